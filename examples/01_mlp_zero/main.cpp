// shardkit example 01: train an MLP with ZeRO on N ranks: in-process threads by default, or the
// processes of an MPI job when started by mpiexec/mpirun.
//
// The "framework" (examples/common/mlp.hpp) owns the model math; shardkit owns the parameter,
// gradient and optimizer buffers, the collectives and the optimizer step. The example prints
// the loss per step, the bytes each rank holds next to the closed-form formula, the bytes each
// rank sends per step next to its formula, and how far the final parameters are from an
// unsharded reference: the same MLP and global batch trained on one thread with a plain AdamW
// in double precision, without shardkit.
//
// --batch is the global batch: the samples of one step over all ranks together (a multiple of
// the number of ranks; each rank takes an equal, contiguous share).
//
//   shardkit_example_01_mlp_zero --stage 2 --ranks 4 --steps 20 --layers 64,256,10 --dtype bf16
//   shardkit_example_01_mlp_zero --dtype fp16    (fp16 working params: dynamic loss scaling)
//   shardkit_example_01_mlp_zero --stage 3 --prefetch 1      (one ZeRO-3 unit per layer)
//   shardkit_example_01_mlp_zero --json          (one JSON object instead of the tables)
//   shardkit_example_01_mlp_zero --check         (exit 1 unless loss falls, bytes match and the
//                                                 parameters are within bound of the reference)
//   mpiexec -np 4 shardkit_example_01_mlp_zero   (one rank per MPI process; rank 0 prints)
//   shardkit_example_01_mlp_zero --steps 10 --save ckpt      (a sharded checkpoint at the end)
//   shardkit_example_01_mlp_zero --resume ckpt --steps 10    (10 more steps; any --ranks/--stage)
//   shardkit_example_01_mlp_zero --export model.safetensors  (the weights, one standard file)
//
// The same binary does both: it initialises MPI only when an MPI launcher started it
// (shardkit::launched_by_mpi()), and it is built without MPI where shardkit::mpi is missing.
#include <shardkit/core/hash.hpp>
#include <shardkit/shardkit.hpp>
#if defined(SHARDKIT_EXAMPLE_IO)
#include <shardkit/io/checkpoint.hpp>
#include <shardkit/io/export.hpp>
#endif

#include "../common/args.hpp"
#include "../common/format.hpp"
#if defined(SHARDKIT_EXAMPLE_MPI)
#include <shardkit/comm/mpi.hpp>
#endif

#include "../common/mlp.hpp"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct config {
  int stage = 2;
  int ranks = 4;
  bool ranks_given = false;
  int steps = 20;
  std::vector<std::size_t> layers{64, 256, 10};
  std::string dtype = "bf16";
  std::size_t batch = 128;  // global batch: samples per step over all ranks
  float lr = 3e-3f;
  float weight_decay = 0.01f;
  std::uint64_t seed = 42;
  std::size_t bucket = 0;    // ZeRO-2 bucket elements; 0 = one bucket per layer
  std::size_t prefetch = 1;  // ZeRO-3 units gathered ahead
  std::size_t hybrid = 0;    // shard within groups of this many ranks (0: all)
  bool json = false;
  bool check = false;
  std::string save;         // checkpoint directory to save to at the end
  std::string resume;       // checkpoint directory to resume from
  std::string export_path;  // safetensors file to export to at the end
  int first_step = 0;       // steps already taken (the resumed checkpoint's)
  float init_scale = 0;     // the first loss scale (0: the engine's default, 65536)
  bool help = false;
};

// A command line that cannot be used: main prints it (once, under MPI) and exits with 2.
struct usage_exit {
  std::string why;
};

[[noreturn]] void usage(const std::string& why) {
  throw usage_exit{why};
}

constexpr const char* usage_text =
    "usage: shardkit_example_01_mlp_zero [--stage 0|1|2|3] [--ranks N] [--steps K]\n"
    "         [--layers a,b,c,...] [--dtype fp32|bf16|fp16] [--batch GLOBAL_BATCH] [--lr X]\n"
    "         [--bucket ELEMS] [--prefetch D] [--hybrid G] [--seed S] [--json] [--check]\n"
    "         [--save DIR] [--resume DIR] [--export FILE.safetensors] [--init-scale X]\n"
    "         [--help]\n"
    "       mpiexec -np N shardkit_example_01_mlp_zero [same options; --ranks N or none]\n"
    "  --batch is the global batch (default 128), a multiple of the ranks; fp16 turns on\n"
    "  dynamic loss scaling (--init-scale 1e6: watch the first steps overflow, be skipped and\n"
    "  the scale back off); --check exits 1 unless the loss falls, the bytes equal their\n"
    "  formulas and the parameters are within the stated bound of the unsharded reference\n";

void print_usage(const std::string& why) {
  std::cerr << "error: " << why << "\n" << usage_text;
}

long parse_int(const std::string& flag, const char* v, long lo, long hi) {
  return examples::parse_int(flag, v, lo, hi, usage);
}

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--stage")
      c.stage = static_cast<int>(parse_int(a, value(), 0, 3));
    else if (a == "--prefetch")
      c.prefetch = static_cast<std::size_t>(parse_int(a, value(), 0, 64));
    else if (a == "--hybrid")
      c.hybrid = static_cast<std::size_t>(parse_int(a, value(), 0, 64));
    else if (a == "--ranks") {
      c.ranks = static_cast<int>(parse_int(a, value(), 1, 64));
      c.ranks_given = true;
    } else if (a == "--steps")
      c.steps = static_cast<int>(parse_int(a, value(), 1, 100000));
    else if (a == "--batch")
      c.batch = static_cast<std::size_t>(parse_int(a, value(), 1, 1 << 20));
    else if (a == "--bucket")
      c.bucket = static_cast<std::size_t>(parse_int(a, value(), 0, 1L << 40));
    else if (a == "--seed")
      c.seed = static_cast<std::uint64_t>(parse_int(a, value(), 0, 1L << 62));
    else if (a == "--init-scale")
      c.init_scale = examples::parse_nonnegative(a, value(), usage);
    else if (a == "--lr")
      c.lr = examples::parse_nonnegative(a, value(), usage);
    else if (a == "--dtype") {
      c.dtype = value();
      if (c.dtype != "fp32" && c.dtype != "bf16" && c.dtype != "fp16")
        usage("--dtype must be fp32, bf16 or fp16");
    } else if (a == "--layers") {
      c.layers.clear();
      std::stringstream ss(value());
      std::string tok;
      while (std::getline(ss, tok, ',')) {
        c.layers.push_back(
            static_cast<std::size_t>(parse_int("--layers", tok.c_str(), 1, 1 << 16)));
      }
      if (c.layers.size() < 2) usage("--layers needs at least two widths, e.g. 64,256,10");
    } else if (a == "--json")
      c.json = true;
    else if (a == "--check")
      c.check = true;
    else if (a == "--save")
      c.save = value();
    else if (a == "--resume")
      c.resume = value();
    else if (a == "--export")
      c.export_path = value();
    else if (a == "--help" || a == "-h") {
      c.help = true;
      return c;
    } else
      usage("unknown argument '" + a + "'");
  }
  return c;
}

// The global batch is split evenly over the ranks.
void check_batch(const config& c) {
  if (c.batch % static_cast<std::size_t>(c.ranks) != 0) {
    usage("--batch " + std::to_string(c.batch) + " must be a multiple of the " +
          std::to_string(c.ranks) +
          " ranks (it is the global batch; every rank gets an equal share)");
  }
}

struct run_result {
  std::vector<double> losses;            // mean loss over the global batch, per step
  std::vector<float> params;             // final working parameters, flattened (rank 0)
  shardkit::plan::state_bytes measured;  // rank 0's ledger
  shardkit::plan::state_bytes formula;   // closed form for the same configuration
  std::size_t grad_bucket_peak = 0;      // ZeRO-2 staging peak
  std::uint64_t sent_per_step = 0;       // rank 0, last step
  std::uint64_t sent_formula = 0;
  std::size_t shard_elems = 0;
  std::size_t padded_elems = 0;
  std::size_t gathered_peak = 0;  // ZeRO-3
  std::uint64_t gathered_bound = 0;
  std::uint64_t params_hash = 0;   // of the final working parameters' bits
  std::vector<float> loss_scales;  // the loss scale each step used (1: no loss scaling)
  std::size_t skipped_steps = 0;   // steps skipped for an inf/NaN gradient (loss scaling)
  std::vector<bool> skipped;       // per step: skipped on every rank
};

// One rank's training, written once for any communicator.
template <class Policies, class W, class Comm>
run_result train_rank(const config& c, Comm& comm, std::size_t batch) {
  using engine_t = shardkit::engine<Comm, Policies, W, shardkit::adamw>;
  const mlp::shape shape{c.layers};
  const mlp::dataset data{shape, c.seed};
  const int ranks = comm.size();
  auto init = mlp::init_params(shape, c.seed);
  shardkit::model_spec model;
  for (std::size_t l = 0; l < shape.layers(); ++l) {
    model.begin_unit("layer" + std::to_string(l));
    model.add("layer" + std::to_string(l) + ".weight", init[2 * l]);
    model.add("layer" + std::to_string(l) + ".bias", init[2 * l + 1]);
  }
  shardkit::engine_options eo;
  eo.bucket_elems = c.bucket;
  eo.prefetch = c.prefetch;
  eo.shard_group_size = c.hybrid;
  if (c.init_scale > 0) eo.loss_scale = shardkit::loss_scale_options{.init_scale = c.init_scale};
  engine_t eng(comm, model, {.lr = c.lr, .weight_decay = c.weight_decay}, eo);
#if defined(SHARDKIT_EXAMPLE_IO)
  if (!c.resume.empty()) shardkit::io::load(eng, c.resume);  // any world size and stage
#endif

  run_result r;
  mlp::batch b;
  std::vector<float> gW, gb;
  for (int step = c.first_step; step < c.first_step + c.steps; ++step) {
    const std::uint64_t first = static_cast<std::uint64_t>(step) * batch * ranks +
                                static_cast<std::uint64_t>(comm.rank()) * batch;
    mlp::load(shape, data, first, batch, b);
    // Forward, layer by layer. The unit hooks gather a layer's parameters under ZeRO-3 (and
    // prefetch the next layer's); in stages 0-2 they do nothing.
    for (std::size_t l = 0; l < shape.layers(); ++l) {
      eng.pre_forward(l);
      mlp::forward_layer<W>(shape, l, eng.param(2 * l), eng.param(2 * l + 1), b);
      eng.post_forward(l);
    }
    double loss = mlp::loss_and_delta(shape, data, b);
    // Loss scaling (on by default for fp16): the gradient of scale x loss goes to the engine,
    // whose fused step unscales it, or skips the step on every rank if any rank overflowed.
    const float scale = eng.loss_scale();
    if (scale != 1.0f)
      for (auto& d : b.delta) d *= scale;
    r.loss_scales.push_back(scale);
    // Backward, last layer first; each gradient goes to shardkit as soon as it exists.
    for (std::size_t l = shape.layers(); l-- > 0;) {
      eng.pre_backward(l);
      mlp::backward_layer<W>(shape, l, eng.param(2 * l), b, gW, gb);
      eng.grad_ready(2 * l + 1, gb);
      eng.grad_ready(2 * l, gW);
      eng.post_backward(l);
    }
    const auto rep = eng.step();
    comm.all_reduce(&loss, &loss, 1, shardkit::reduce_op::sum);
    r.losses.push_back(loss / static_cast<double>(batch * static_cast<std::size_t>(ranks)));
    r.sent_per_step = rep.bytes_sent;
    if (rep.skipped) ++r.skipped_steps;
    r.skipped.push_back(rep.skipped);
  }
#if defined(SHARDKIT_EXAMPLE_IO)
  if (!c.save.empty()) shardkit::io::save(eng, c.save);
  if (!c.export_path.empty()) shardkit::io::export_safetensors(eng, c.export_path);
#endif
  shardkit::stable_hash h;
  for (std::size_t l = 0; l < shape.layers(); ++l) {
    eng.pre_forward(l);
    for (std::size_t i = 2 * l; i < 2 * l + 2; ++i) {
      for (auto v : eng.param(i)) {
        r.params.push_back(static_cast<float>(v));
        if constexpr (std::is_same_v<W, float>)
          h.f32(v);
        else
          h.u64(v.bits);
      }
    }
    eng.post_forward(l);
  }
  r.params_hash = h.value();
  r.measured = eng.measured_state_bytes();
  r.formula = eng.expected_state_bytes();
  r.grad_bucket_peak = eng.memory().peak(shardkit::memory_category::grad_buckets);
  r.sent_formula = eng.expected_step_bytes_sent();
  r.shard_elems = eng.layout().shard_numel();
  r.padded_elems = eng.layout().padded_numel();
  r.gathered_peak = eng.memory().peak(shardkit::memory_category::gathered_params);
  r.gathered_bound = eng.gathered_bytes_bound();
  return r;
}

// Ranks as threads of this process; returns rank 0's result.
struct thread_launch {
  int ranks;
  template <class Policies, class W>
  run_result run(const config& c, std::size_t batch) const {
    return shardkit::run_ranks(
               ranks,
               [&](shardkit::thread_comm& comm) { return train_rank<Policies, W>(c, comm, batch); })
        .front();
  }
};

#if defined(SHARDKIT_EXAMPLE_MPI)
// This process is one rank of an MPI job; returns this rank's result.
struct mpi_launch {
  shardkit::mpi_comm& comm;
  template <class Policies, class W>
  run_result run(const config& c, std::size_t batch) const {
    return train_rank<Policies, W>(c, comm, batch);
  }
};
#endif

template <class W, class Launch>
run_result train_stage(const config& c, int stage, std::size_t batch, const Launch& launch) {
  switch (stage) {
    case 0:
      return launch.template run<shardkit::zero0, W>(c, batch);
    case 1:
      return launch.template run<shardkit::zero1, W>(c, batch);
    case 2:
      return launch.template run<shardkit::zero2, W>(c, batch);
    default:
      return launch.template run<shardkit::zero3, W>(c, batch);
  }
}

template <class Launch>
run_result train_any(const config& c, int stage, std::size_t batch, const Launch& launch) {
  if (c.dtype == "fp32") return train_stage<float>(c, stage, batch, launch);
  if (c.dtype == "fp16") return train_stage<shardkit::fp16>(c, stage, batch, launch);
  return train_stage<shardkit::bf16>(c, stage, batch, launch);
}

// The unsharded reference, independent of shardkit's engine, communicators and kernels: the
// same MLP, initial values and global batches on one thread, the gradient of the mean loss over
// the global batch, and AdamW (decoupled weight decay, bias-corrected moments) in double
// precision. A step the run skipped (an fp16 overflow of the scaled gradient, found by loss
// scaling) updates nothing here either, and Adam's step count t counts the updates taken.
// Returns the final parameters, flattened in registration order.
std::vector<float> reference_params(const config& c, const std::vector<bool>& skipped) {
  const mlp::shape shape{c.layers};
  const mlp::dataset data{shape, c.seed};
  const auto init = mlp::init_params(shape, c.seed);
  const double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  std::vector<std::vector<double>> master, m, v;
  std::vector<std::vector<float>> p = init;  // what forward and backward read
  for (const auto& t : init) {
    master.emplace_back(t.begin(), t.end());
    m.emplace_back(t.size(), 0.0);
    v.emplace_back(t.size(), 0.0);
  }
  auto view = [](const std::vector<float>& t) {
    return shardkit::tensor_view<const float>(t.data(), t.size());
  };
  mlp::batch b;
  std::vector<std::vector<float>> g(init.size());
  const int steps = c.first_step + c.steps;
  int taken = 0;
  for (int step = 0; step < steps; ++step) {
    if (step >= c.first_step && skipped[static_cast<std::size_t>(step - c.first_step)]) continue;
    mlp::load(shape, data, static_cast<std::uint64_t>(step) * c.batch, c.batch, b);
    for (std::size_t l = 0; l < shape.layers(); ++l)
      mlp::forward_layer<float>(shape, l, view(p[2 * l]), view(p[2 * l + 1]), b);
    mlp::loss_and_delta(shape, data, b);
    for (std::size_t l = shape.layers(); l-- > 0;)
      mlp::backward_layer<float>(shape, l, view(p[2 * l]), b, g[2 * l], g[2 * l + 1]);
    const double t = ++taken;
    const double c1 = 1.0 - std::pow(beta1, t), c2 = 1.0 - std::pow(beta2, t);
    for (std::size_t i = 0; i < p.size(); ++i) {
      for (std::size_t k = 0; k < p[i].size(); ++k) {
        const double gk = g[i][k];
        m[i][k] = beta1 * m[i][k] + (1.0 - beta1) * gk;
        v[i][k] = beta2 * v[i][k] + (1.0 - beta2) * gk * gk;
        const double update = (m[i][k] / c1) / (std::sqrt(v[i][k] / c2) + eps);
        master[i][k] -= static_cast<double>(c.lr) *
                        (update + static_cast<double>(c.weight_decay) * master[i][k]);
        p[i][k] = static_cast<float>(master[i][k]);
      }
    }
  }
  std::vector<float> flat;
  for (const auto& t : p) flat.insert(flat.end(), t.begin(), t.end());
  return flat;
}

// How far the final parameters may be from the reference (default model and lr 3e-3). fp32
// differs by rounding only: the ranks' partial gradients are summed in another order than the
// full batch's, and the engine's AdamW runs in float against the reference's double; Adam
// divides by sqrt(v), which makes an element whose gradient is near zero sensitive to the last
// bits of it (measured: 3e-8 after 8 steps, 1.1e-7 after 20, 9.4e-5 after 60, over seeds 1-5 and
// 1-8 ranks). 16-bit working parameters differ by their own rounding (2^-9 relative for bf16,
// 2^-12 for fp16), which the trajectory carries along (measured after 20 steps: bf16 0.022,
// fp16 0.015). A wrong or missing gradient moves a parameter by about lr per step.
double max_diff_bound(const std::string& dtype) {
  if (dtype == "fp32") return 2e-4;
  if (dtype == "fp16") return 3e-2;
  return 4e-2;
}

using examples::with_commas;

// The closed form of the bytes rank 0 sends per step, as text with its value (docs/accounting.md,
// "Bytes sent per rank per step"; gradients and parameters travel in the working type, e bytes).
std::string sent_formula_text(const config& c, const run_result& r, std::uint64_t psi) {
  const std::uint64_t N = static_cast<std::uint64_t>(c.ranks);
  const bool hybrid = c.stage > 0 && c.hybrid != 0 && c.hybrid != N;
  const std::uint64_t P = hybrid ? c.hybrid : N;  // ranks of the shard group
  const std::uint64_t e = c.dtype == "fp32" ? 4 : 2, S = r.shard_elems;
  const std::string n = hybrid ? "G" : "N", eb = std::to_string(e) + "B";
  if (c.stage == 0) {
    // All-reduce of psi cut into N chunks n_q = floor((q+1)psi/N) - floor(q psi/N); rank 0
    // sends everything but chunks 0 and 1: 2(N-1)/N x psi x e when N divides psi.
    const std::uint64_t n0 = psi / N, n1 = N > 1 ? 2 * psi / N - n0 : 0;
    const std::uint64_t v = N > 1 ? (2 * psi - n0 - n1) * e : 0;
    return "2(N-1)/N x psi x " + eb + " = " + with_commas(v);
  }
  const std::uint64_t k = c.stage == 3 ? 3 : 2;
  const std::uint64_t inner = k * (P - 1) * S * e;
  std::string t = std::to_string(k) + "(" + n + "-1) x S x " + eb;
  if (!hybrid) return t + " = " + with_commas(inner);
  // Plus the all-reduce of the S-element gradient shard over the R replicas, chunked as above.
  const std::uint64_t R = N / P, s0 = S / R, s1 = R > 1 ? 2 * S / R - s0 : 0;
  const std::uint64_t outer = R > 1 ? (2 * S - s0 - s1) * e : 0;
  return t + " + all-reduce of S over " + std::to_string(R) + " replicas = " + with_commas(inner) +
         " + " + with_commas(outer);
}

// Prints the run (tables or JSON) and returns the exit status. `ref` holds the final parameters
// of the independent unsharded reference; `where` says what the ranks were.
int report(const config& c, const run_result& r, const std::vector<float>& ref,
           const char* comm_name, const char* where) {
  const mlp::shape shape{c.layers};
  double max_diff = 0.0;
  for (std::size_t i = 0; i < r.params.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(r.params[i]) - ref[i]));
  }
  const double bound = max_diff_bound(c.dtype);

  const std::uint64_t psi = shape.num_params();
  const int N = c.ranks;
  const bool hybrid = c.stage > 0 && c.hybrid != 0 && c.hybrid != static_cast<std::size_t>(N);

  const bool loss_fell = r.losses.back() < r.losses.front();
  const bool bytes_match = r.measured == r.formula && r.sent_per_step == r.sent_formula &&
                           r.gathered_peak <= r.gathered_bound;
  const bool close = max_diff <= bound;

  if (c.json) {
    std::printf(
        "{\"stage\": %d, \"ranks\": %d, \"comm\": \"%s\", \"dtype\": \"%s\", "
        "\"params\": %" PRIu64 ", \"shard_elems\": %zu, \"padded_elems\": %zu,\n",
        c.stage, N, comm_name, c.dtype.c_str(), psi, r.shard_elems, r.padded_elems);
    auto obj = [](const shardkit::plan::state_bytes& b) {
      std::printf("{\"working_params\": %" PRIu64 ", \"grads\": %" PRIu64
                  ", \"master_params\": %" PRIu64 ", \"optimizer_moments\": %" PRIu64
                  ", \"total\": %" PRIu64 "}",
                  b.working_params, b.grads, b.master_params, b.optimizer_moments, b.total());
    };
    std::printf(" \"bytes_per_rank\": ");
    obj(r.measured);
    std::printf(",\n \"formula_bytes_per_rank\": ");
    obj(r.formula);
    std::printf(
        ",\n \"grad_bucket_peak_bytes\": %zu, \"gathered_peak_bytes\": %zu, "
        "\"gathered_bound_bytes\": %" PRIu64 ",\n",
        r.grad_bucket_peak, r.gathered_peak, r.gathered_bound);
    std::printf(" \"comm_bytes_per_rank_per_step\": %" PRIu64
                ", \"formula_comm_bytes_per_rank_per_step\": %" PRIu64 ",\n",
                r.sent_per_step, r.sent_formula);
    std::printf(" \"losses\": [");
    for (std::size_t i = 0; i < r.losses.size(); ++i) {
      std::printf("%s%.6f", i ? ", " : "", r.losses[i]);
    }
    std::printf("],\n \"first_step\": %d, \"params_hash\": \"%016" PRIx64 "\",\n", c.first_step + 1,
                r.params_hash);
    std::printf(" \"loss_scales\": [");
    for (std::size_t i = 0; i < r.loss_scales.size(); ++i) {
      std::printf("%s%g", i ? ", " : "", static_cast<double>(r.loss_scales[i]));
    }
    std::printf("], \"skipped_steps\": %zu,\n", r.skipped_steps);
    std::printf(" \"max_abs_diff_vs_unsharded\": %.6g, \"max_abs_diff_bound\": %g}\n", max_diff,
                bound);
  } else {
    std::printf("shardkit %s example 01: MLP ", SHARDKIT_VERSION_STRING);
    for (std::size_t i = 0; i < c.layers.size(); ++i)
      std::printf("%s%zu", i ? "-" : "", c.layers[i]);
    std::printf(
        " (%s parameters), ZeRO stage %d on %d %s, %s working params%s, "
        "AdamW lr %g\n\n",
        with_commas(psi).c_str(), c.stage, N, where, c.dtype.c_str(),
        c.dtype != "fp32" ? " + fp32 master" : "", static_cast<double>(c.lr));
    if (hybrid) {
      std::printf(
          "hybrid sharding: shard groups of %zu ranks, %zu replicas (the formula adds "
          "the replicas' all-reduce of the gradient shard)\n\n",
          c.hybrid, static_cast<std::size_t>(N) / c.hybrid);
    }
    if (!c.resume.empty()) {
      std::printf("resumed from %s at step %d\n\n", c.resume.c_str(), c.first_step);
    }
    const bool scaled = c.dtype == "fp16";
    std::printf("step   loss (global batch of %zu)%s\n", c.batch, scaled ? "   loss scale" : "");
    for (std::size_t i = 0; i < r.losses.size(); ++i) {
      std::printf("%4zu   %.4f", static_cast<std::size_t>(c.first_step) + i + 1, r.losses[i]);
      if (scaled) {
        std::printf("%28.0f%s", static_cast<double>(r.loss_scales[i]),
                    r.skipped[i] ? "   skipped: inf/NaN gradient" : "");
      }
      std::printf("\n");
    }
    if (scaled) {
      std::printf(
          "fp16 dynamic loss scaling: the loss gradient is multiplied by the scale and the fused\n"
          "step unscales; %zu step(s) skipped on every rank for an inf/NaN gradient (each halves\n"
          "the scale; it doubles after 2000 good steps)\n",
          r.skipped_steps);
    }
    if (c.stage == 0) {
      std::printf(
          "\nbytes held per rank (rank 0)  measured      formula   "
          "(stage 0 shards nothing: psi = %s elements on every rank)\n",
          with_commas(psi).c_str());
    } else if (hybrid) {
      std::printf(
          "\nbytes held per rank (rank 0)  measured      formula   "
          "(S = %s elements per rank, G*S = %s in each shard group of G = %zu)\n",
          with_commas(r.shard_elems).c_str(), with_commas(r.padded_elems).c_str(), c.hybrid);
    } else {
      std::printf(
          "\nbytes held per rank (rank 0)  measured      formula   "
          "(S = %s elements per rank, N*S = %s)\n",
          with_commas(r.shard_elems).c_str(), with_commas(r.padded_elems).c_str());
    }
    auto row = [](const char* name, std::uint64_t m, std::uint64_t f) {
      std::printf("  %-26s %10s   %10s  %s\n", name, with_commas(m).c_str(), with_commas(f).c_str(),
                  m == f ? "" : "MISMATCH");
    };
    row("working params", r.measured.working_params, r.formula.working_params);
    row("grads", r.measured.grads, r.formula.grads);
    row("master params (fp32)", r.measured.master_params, r.formula.master_params);
    row("optimizer moments (m, v)", r.measured.optimizer_moments, r.formula.optimizer_moments);
    row("total", r.measured.total(), r.formula.total());
    if (c.stage >= 2) {
      std::printf("  %-26s %10s   (peak, transient: one bucket of full gradients)\n",
                  "grad staging bucket", with_commas(r.grad_bucket_peak).c_str());
    }
    if (c.stage == 3) {
      std::printf("  %-26s %10s   (peak, transient; bound (1 + prefetch) x largest unit = %s)\n",
                  "gathered layer params", with_commas(r.gathered_peak).c_str(),
                  with_commas(r.gathered_bound).c_str());
    }
    std::printf("\nbytes sent per rank per step  %10s   %10s  %s(%s)\n",
                with_commas(r.sent_per_step).c_str(), with_commas(r.sent_formula).c_str(),
                r.sent_per_step == r.sent_formula ? "" : "MISMATCH ",
                sent_formula_text(c, r, psi).c_str());
    std::printf(
        "\nmax |param - unsharded reference| = %.3g   (expected below %g for %s; the "
        "reference:\n  one thread, same global batches, plain AdamW in double, no shardkit)\n",
        max_diff, bound, c.dtype.c_str());
  }
  if (c.check && !(loss_fell && bytes_match && close)) {
    std::fprintf(stderr, "check failed: %s%s%s\n", loss_fell ? "" : "loss did not fall; ",
                 bytes_match ? "" : "ledger differs from the formula; ",
                 close ? "" : "parameters farther from the reference than the bound");
    return 1;
  }
  return 0;
}

// The options that need checkpoints, and the step a resumed run starts at.
void prepare_io(config& c) {
#if defined(SHARDKIT_EXAMPLE_IO)
  if (!c.resume.empty())
    c.first_step = static_cast<int>(shardkit::io::read_manifest(c.resume).step);
#else
  if (!c.save.empty() || !c.resume.empty() || !c.export_path.empty()) {
    throw std::runtime_error(
        "this build has no checkpoints (shardkit::io needs nlohmann-json and "
        "xxHash: scripts/install-deps installs them)");
  }
#endif
}

// Ranks as threads of this process (the default).
int main_threads(int argc, char** argv) try {
  config c;
  try {
    c = parse(argc, argv);
    if (c.help) {
      std::fputs(usage_text, stdout);
      return 0;
    }
    check_batch(c);
  } catch (const usage_exit& u) {
    print_usage(u.why);
    return 2;
  }
  prepare_io(c);
  const run_result r =
      train_any(c, c.stage, c.batch / static_cast<std::size_t>(c.ranks), thread_launch{c.ranks});
  return report(c, r, reference_params(c, r.skipped), "thread", "in-process ranks");
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

#if defined(SHARDKIT_EXAMPLE_MPI)
// One rank per MPI process. Every rank trains its part; rank 0 also runs the independent
// unsharded reference in-process and prints. A rank that fails ends the job (mpi_main).
int main_mpi(int& argc, char**& argv) {
  return shardkit::mpi_main(argc, argv, [&](shardkit::mpi_comm& comm) -> int {
    const bool printer = comm.rank() == 0;
    config c;
    try {
      c = parse(argc, argv);
      if (c.help) {
        if (printer) std::fputs(usage_text, stdout);
        return 0;
      }
      if (c.ranks_given && c.ranks != comm.size()) {
        usage("--ranks " + std::to_string(c.ranks) + " does not match the " +
              std::to_string(comm.size()) +
              " processes of this MPI job; under mpiexec the ranks "
              "are the processes: omit --ranks or pass --ranks " +
              std::to_string(comm.size()));
      }
      c.ranks = comm.size();
      check_batch(c);
    } catch (const usage_exit& u) {  // every rank parses the same arguments: all exit with 2
      if (printer) print_usage(u.why);
      return 2;
    }
    c.ranks = comm.size();
    prepare_io(c);
    const run_result r =
        train_any(c, c.stage, c.batch / static_cast<std::size_t>(c.ranks), mpi_launch{comm});
    int status = 0;
    if (printer) {
      status = report(c, r, reference_params(c, r.skipped), "mpi", "MPI processes");
      std::fflush(stdout);
    }
    comm.broadcast(&status, 1, 0);  // the job's exit status is rank 0's
    return status;
  });
}
#endif

}  // namespace

int main(int argc, char** argv) {
#if defined(SHARDKIT_EXAMPLE_MPI)
  if (shardkit::launched_by_mpi()) return main_mpi(argc, argv);
#endif
  return main_threads(argc, argv);
}
