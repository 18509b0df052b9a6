// shardkit example 01: train an MLP with ZeRO on N ranks: in-process threads by default, or the
// processes of an MPI job when started by mpiexec/mpirun.
//
// The "framework" (examples/common/mlp.hpp) owns the model math; shardkit owns the parameter,
// gradient and optimizer buffers, the collectives and the optimizer step. The example prints
// the loss per step, the bytes each rank holds next to the closed-form formula, the bytes each
// rank sends per step next to its formula, and how far the final parameters are from a
// single-rank, unsharded run of the same global batch.
//
//   shardkit_example_01_mlp_zero --stage 2 --ranks 4 --steps 20 --layers 64,256,10 --dtype bf16
//   shardkit_example_01_mlp_zero --stage 3 --prefetch 1      (one ZeRO-3 unit per layer)
//   shardkit_example_01_mlp_zero --json          (one JSON object instead of the tables)
//   shardkit_example_01_mlp_zero --check         (exit 1 unless loss falls and bytes match)
//   mpiexec -np 4 shardkit_example_01_mlp_zero   (one rank per MPI process; rank 0 prints)
//   shardkit_example_01_mlp_zero --steps 10 --save ckpt      (a sharded checkpoint at the end)
//   shardkit_example_01_mlp_zero --resume ckpt --steps 10    (10 more steps; any --ranks/--stage)
//   shardkit_example_01_mlp_zero --export model.safetensors  (the weights, one standard file)
//
// The same binary does both: it initialises MPI only when an MPI launcher started it
// (shardkit::launched_by_mpi()), and it is built without MPI where shardkit::mpi is missing.
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
  std::size_t batch = 32;  // samples per rank per step
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
};

// A command line that cannot be used: main prints it (once, under MPI) and exits with 2.
struct usage_exit {
  std::string why;
};

[[noreturn]] void usage(const std::string& why) {
  throw usage_exit{why};
}

void print_usage(const std::string& why) {
  std::cerr << "error: " << why << "\n"
            << "usage: shardkit_example_01_mlp_zero [--stage 0|1|2|3] [--ranks N] [--steps K]\n"
               "         [--layers a,b,c,...] [--dtype fp32|bf16] [--batch B] [--lr X]\n"
               "         [--bucket ELEMS] [--prefetch D] [--hybrid G] [--seed S] [--json] "
               "[--check]\n"
               "         [--save DIR] [--resume DIR] [--export FILE.safetensors]\n"
               "       mpiexec -np N shardkit_example_01_mlp_zero [same options; --ranks N or "
               "none]\n";
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
    else if (a == "--lr")
      c.lr = examples::parse_nonnegative(a, value(), usage);
    else if (a == "--dtype") {
      c.dtype = value();
      if (c.dtype != "fp32" && c.dtype != "bf16") usage("--dtype must be fp32 or bf16");
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
    else if (a == "--help" || a == "-h")
      usage("help requested");
    else
      usage("unknown argument '" + a + "'");
  }
  return c;
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
  std::uint64_t params_hash = 0;  // of the final working parameters' bits
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
  return c.dtype == "fp32" ? train_stage<float>(c, stage, batch, launch)
                           : train_stage<shardkit::bf16>(c, stage, batch, launch);
}

using examples::with_commas;

// Prints the run (tables or JSON) and returns the exit status. `ref` is the single-rank,
// unsharded run of the same global batch; `where` says what the ranks were.
int report(const config& c, const run_result& r, const run_result& ref, const char* comm_name,
           const char* where) {
  const mlp::shape shape{c.layers};
  double max_diff = 0.0;
  for (std::size_t i = 0; i < r.params.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(r.params[i]) - ref.params[i]));
  }

  const std::uint64_t psi = shape.num_params();
  const int N = c.ranks;
  // FACTS.md's textbook communication volume, 2(N-1)/N · 2Ψ (3(N-1)/N · 2Ψ for ZeRO-3; Ψ
  // replaced by the padded N·S for the sharded stages), next to the exact per-rank formula.
  const std::size_t elem = c.dtype == "fp32" ? 4 : 2;
  const double textbook = (c.stage == 3 ? 3.0 : 2.0) * (N - 1) / N * static_cast<double>(elem) *
                          static_cast<double>(c.stage == 0 ? psi : r.padded_elems);

  const bool loss_fell = r.losses.back() < r.losses.front();
  const bool bytes_match = r.measured == r.formula && r.sent_per_step == r.sent_formula &&
                           r.gathered_peak <= r.gathered_bound;

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
    std::printf(" \"max_abs_diff_vs_unsharded\": %.6g}\n", max_diff);
  } else {
    std::printf("shardkit %s example 01: MLP ", SHARDKIT_VERSION_STRING);
    for (std::size_t i = 0; i < c.layers.size(); ++i)
      std::printf("%s%zu", i ? "-" : "", c.layers[i]);
    std::printf(
        " (%s parameters), ZeRO stage %d on %d %s, %s working params%s, "
        "AdamW lr %g\n\n",
        with_commas(psi).c_str(), c.stage, N, where, c.dtype.c_str(),
        c.dtype == "bf16" ? " + fp32 master" : "", static_cast<double>(c.lr));
    if (c.hybrid != 0 && c.hybrid != static_cast<std::size_t>(N)) {
      std::printf(
          "hybrid sharding: shard groups of %zu ranks, %zu replicas (the formula adds "
          "the replicas' all-reduce of the gradient shard)\n\n",
          c.hybrid, static_cast<std::size_t>(N) / c.hybrid);
    }
    if (!c.resume.empty()) {
      std::printf("resumed from %s at step %d\n\n", c.resume.c_str(), c.first_step);
    }
    std::printf("step   loss (global batch of %zu)\n", c.batch * static_cast<std::size_t>(N));
    for (std::size_t i = 0; i < r.losses.size(); ++i)
      std::printf("%4zu   %.4f\n", static_cast<std::size_t>(c.first_step) + i + 1, r.losses[i]);
    std::printf(
        "\nbytes held per rank (rank 0)  measured      formula   "
        "(S = %zu elements per rank, N*S = %zu)\n",
        r.shard_elems, r.padded_elems);
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
    std::printf("\nbytes sent per rank per step  %10s   %10s  %s (%d(N-1)/N x %zuB x %s = %.1f)\n",
                with_commas(r.sent_per_step).c_str(), with_commas(r.sent_formula).c_str(),
                r.sent_per_step == r.sent_formula ? "" : "MISMATCH", c.stage == 3 ? 3 : 2, elem,
                c.stage == 0 ? "psi" : "N*S", textbook);
    std::printf("\nmax |param - unsharded single-rank run of the same global batch| = %.3g\n",
                max_diff);
  }
  if (c.check && !(loss_fell && bytes_match)) {
    std::fprintf(stderr, "check failed: %s%s\n", loss_fell ? "" : "loss did not fall; ",
                 bytes_match ? "" : "ledger differs from the formula");
    return 1;
  }
  return 0;
}

// The same global batch on one in-process rank without sharding, from the start (all the
// steps a resumed run has taken too), saving and exporting nothing: the reference.
run_result reference(const config& c) {
  config single = c;
  single.hybrid = 0;
  single.steps = c.first_step + c.steps;
  single.first_step = 0;
  single.save.clear();
  single.resume.clear();
  single.export_path.clear();
  return train_any(single, 0, c.batch * static_cast<std::size_t>(c.ranks), thread_launch{1});
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
  } catch (const usage_exit& u) {
    print_usage(u.why);
    return 2;
  }
  prepare_io(c);
  const run_result r = train_any(c, c.stage, c.batch, thread_launch{c.ranks});
  const run_result ref = reference(c);
  return report(c, r, ref, "thread", "in-process ranks");
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

#if defined(SHARDKIT_EXAMPLE_MPI)
// One rank per MPI process. Every rank trains its part; rank 0 also runs the unsharded
// single-rank reference in-process and prints. A rank that fails ends the job (mpi_main).
int main_mpi(int& argc, char**& argv) {
  return shardkit::mpi_main(argc, argv, [&](shardkit::mpi_comm& comm) -> int {
    const bool printer = comm.rank() == 0;
    config c;
    try {
      c = parse(argc, argv);
      if (c.ranks_given && c.ranks != comm.size()) {
        usage("--ranks " + std::to_string(c.ranks) + " does not match the " +
              std::to_string(comm.size()) +
              " processes of this MPI job; under mpiexec the ranks "
              "are the processes: omit --ranks or pass --ranks " +
              std::to_string(comm.size()));
      }
    } catch (const usage_exit& u) {  // every rank parses the same arguments: all exit with 2
      if (printer) print_usage(u.why);
      return 2;
    }
    c.ranks = comm.size();
    prepare_io(c);
    const run_result r = train_any(c, c.stage, c.batch, mpi_launch{comm});
    int status = 0;
    if (printer) {
      const run_result ref = reference(c);
      status = report(c, r, ref, "mpi", "MPI processes");
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
