// shardkit example 03: train a LibTorch model with ZeRO stages 0-3 on N in-process ranks, and
// the same model with torch's own AdamW on the full batch, then compare.
//
// The model is torch::nn code: blocks of Linear + LayerNorm + GELU, then a Linear head, trained
// on a synthetic regression task (fixed seed). Every block, and the head, is one shardkit unit.
// shardkit owns the parameters: the torch modules' parameters are tensors over the engine's
// working parameters (shardkit/adapters/torch.hpp, torch_bind), so no parameter is ever copied
// between torch and shardkit. The engine's unit hooks are driven by shardkit::torch_hooks: from
// the model's forward around each block, and from autograd in backward (a hook on each block's
// output gradient gathers the block before its backward runs; a hook on each parameter hands its
// gradient to the engine; the block's last gradient ends its backward).
//
// The reference is the unsharded model trained by torch::optim::AdamW on the full global batch
// (same initial values, same data, fp32). With fp32 working parameters the two differ only by
// floating-point rounding (summation order across ranks and inside the kernels; shardkit's AdamW
// subtracts lr*wd*p inside the update, torch's multiplies p by 1 - lr*wd first).
//
//   shardkit_example_03_libtorch --stage 3 --ranks 4 --steps 20
//   shardkit_example_03_libtorch --stage 2 --dtype bf16 --json
//   shardkit_example_03_libtorch --steps 10 --save ckpt          (a sharded checkpoint)
//   shardkit_example_03_libtorch --resume ckpt --steps 10 --json  (10 more steps)
//   shardkit_example_03_libtorch --export model.safetensors       (the weights, one file)
#include <shardkit/adapters/torch.hpp>
#include <shardkit/core/hash.hpp>
#include <shardkit/shardkit.hpp>
#if defined(SHARDKIT_EXAMPLE_IO)
#include <shardkit/io/checkpoint.hpp>
#include <shardkit/io/export.hpp>
#endif

#include "../common/args.hpp"

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <torch/torch.h>
#include <vector>

namespace {

struct config {
  int stage = 3;
  int ranks = 4;
  int steps = 20;
  std::string dtype = "fp32";
  int blocks = 3;   // Linear + LayerNorm + GELU blocks before the head
  int width = 64;   // hidden width
  int inputs = 16;  // features per sample
  int outputs = 4;  // regression targets per sample
  int batch = 64;   // global batch (all ranks together) per step
  float lr = 3e-3f;
  float weight_decay = 0.01f;
  std::uint64_t seed = 1;
  std::size_t prefetch = 1;  // ZeRO-3: units gathered ahead
  bool json = false;
  std::string save, resume, export_path;  // checkpoint to save to / resume from; safetensors
  int first_step = 0;                     // steps already taken (the resumed checkpoint's)
};

constexpr const char* usage_text =
    "usage: shardkit_example_03_libtorch [--stage 0|1|2|3] [--ranks N] [--steps K]\n"
    "         [--dtype fp32|bf16] [--blocks B] [--width W] [--batch GLOBAL_BATCH]\n"
    "         [--lr X] [--seed S] [--prefetch D] [--json]\n"
    "         [--save DIR] [--resume DIR] [--export FILE.safetensors]\n"
    "  --batch is the global batch: the samples of one step over all ranks (a multiple of\n"
    "  --ranks, split evenly)\n";

//! A command line that cannot be used: the reason and the usage on stderr, exit status 2.
[[noreturn]] void usage(const std::string& why) {
  std::cerr << "error: " << why << "\n" << usage_text;
  std::exit(2);
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
    else if (a == "--ranks")
      c.ranks = static_cast<int>(parse_int(a, value(), 1, 64));
    else if (a == "--steps")
      c.steps = static_cast<int>(parse_int(a, value(), 1, 100000));
    else if (a == "--blocks")
      c.blocks = static_cast<int>(parse_int(a, value(), 1, 64));
    else if (a == "--width")
      c.width = static_cast<int>(parse_int(a, value(), 1, 1 << 14));
    else if (a == "--batch")
      c.batch = static_cast<int>(parse_int(a, value(), 1, 1 << 20));
    else if (a == "--seed")
      c.seed = static_cast<std::uint64_t>(parse_int(a, value(), 0, 1L << 62));
    else if (a == "--prefetch")
      c.prefetch = static_cast<std::size_t>(parse_int(a, value(), 0, 64));
    else if (a == "--lr")
      c.lr = examples::parse_nonnegative(a, value(), usage);
    else if (a == "--dtype") {
      c.dtype = value();
      if (c.dtype != "fp32" && c.dtype != "bf16") usage("--dtype must be fp32 or bf16");
    } else if (a == "--json")
      c.json = true;
    else if (a == "--save")
      c.save = value();
    else if (a == "--resume")
      c.resume = value();
    else if (a == "--export")
      c.export_path = value();
    else if (a == "--help" || a == "-h") {
      std::fputs(usage_text, stdout);  // asked for: the usage on stdout, exit status 0
      std::exit(0);
    } else
      usage("unknown argument '" + a + "'");
  }
  if (c.batch % c.ranks != 0) {
    usage("--batch " + std::to_string(c.batch) + " must be a multiple of --ranks " +
          std::to_string(c.ranks) + " (every rank gets an equal share of the global batch)");
  }
  return c;
}

// ---- the model: plain torch::nn code --------------------------------------------------------

struct BlockImpl : torch::nn::Module {
  BlockImpl(int in, int out)
      : fc(register_module("fc", torch::nn::Linear(in, out))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({out})))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::gelu(norm(fc(x))); }
  torch::nn::Linear fc;
  torch::nn::LayerNorm norm;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(const config& c) {
    for (int b = 0; b < c.blocks; ++b) {
      blocks.push_back(register_module("block" + std::to_string(b),
                                       Block(b == 0 ? c.inputs : c.width, c.width)));
    }
    head = register_module("head", torch::nn::Linear(c.width, c.outputs));
  }
  // The units shardkit gathers and releases: each block, then the head.
  std::size_t num_units() const { return blocks.size() + 1; }
  std::string unit_name(std::size_t u) const {
    return u < blocks.size() ? "block" + std::to_string(u) : "head";
  }
  std::shared_ptr<torch::nn::Module> unit(std::size_t u) {
    if (u < blocks.size()) return blocks[u].ptr();
    return head.ptr();
  }
  torch::Tensor unit_forward(std::size_t u, const torch::Tensor& x) {
    return u < blocks.size() ? blocks[u]->forward(x) : head->forward(x);
  }
  // The model's forward. `around`, when set, wraps each unit's forward: the training framework's
  // place for per-block hooks (here: shardkit's ZeRO hooks; unset for the plain torch run).
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t u = 0; u < num_units(); ++u) {
      x = around ? around(u, [&] { return unit_forward(u, x); }) : unit_forward(u, x);
    }
    return x;
  }
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
  std::function<torch::Tensor(std::size_t, const std::function<torch::Tensor()>&)> around;
};
TORCH_MODULE(Net);

// ---- the problem: data and initial values, the same for every run --------------------------

struct problem {
  torch::Tensor x, y;                // (first_step + steps) * batch samples
  std::vector<torch::Tensor> init;   // initial parameter values (fp32), in unit order
  std::vector<std::string> names;    // their names
  std::vector<std::size_t> unit_of;  // and units
};

problem make_problem(const config& c) {
  problem p;
  // A fixed random teacher, y = tanh(x A) B + noise, and each step's batch from a seed of its
  // own: the data of step t is the same whatever the number of steps, so a resumed run sees
  // the batches the uninterrupted one did.
  torch::manual_seed(static_cast<std::uint64_t>(c.seed));
  const auto A = torch::randn({c.inputs, 32}) / std::sqrt(static_cast<double>(c.inputs));
  const auto B = torch::randn({32, c.outputs}) / std::sqrt(32.0);
  std::vector<torch::Tensor> xs, ys;
  for (int t = 0; t < c.first_step + c.steps; ++t) {
    torch::manual_seed(static_cast<std::uint64_t>(c.seed) * 1'000'003 +
                       static_cast<std::uint64_t>(t) + 1);
    xs.push_back(torch::randn({c.batch, c.inputs}));
    ys.push_back(torch::tanh(xs.back().matmul(A)).matmul(B) +
                 0.05 * torch::randn({c.batch, c.outputs}));
  }
  p.x = torch::cat(xs);
  p.y = torch::cat(ys);
  torch::manual_seed(static_cast<std::uint64_t>(c.seed));
  Net net(c);  // torch's default initialisation, from the seed
  for (std::size_t u = 0; u < net->num_units(); ++u) {
    for (const auto& kv : net->unit(u)->named_parameters()) {
      p.init.push_back(kv.value().detach().clone());
      p.names.push_back(net->unit_name(u) + "." + kv.key());
      p.unit_of.push_back(u);
    }
  }
  return p;
}

struct run_result {
  std::vector<double> losses;  // mean loss over the global batch, per step
  std::vector<float> params;   // final parameters, in unit order
  double seconds = 0.0;
  std::uint64_t params_hash = 0;                  // of the final parameters' bits
  shardkit::plan::state_bytes measured, formula;  // rank 0's ledger and the closed form
  std::size_t gathered_peak = 0;                  // ZeRO-3: gathered parameter bytes, peak
  std::uint64_t gathered_bound = 0;
  std::size_t torch_owned_param_bytes = 0;  // parameter bytes torch allocated itself (rank 0)
  std::size_t alias_mismatches = 0;  // forward passes that saw a parameter not over the engine's
};

// ---- shardkit: N ranks, each with its own torch model whose parameters alias the engine --------

template <class Policies, class W>
run_result train_shardkit(const config& c, const problem& pb) {
  using engine_t = shardkit::engine<shardkit::thread_comm, Policies, W, shardkit::adamw>;
  std::vector<Net> nets;  // built here, not in the rank threads: torch's RNG is process-wide
  for (int r = 0; r < c.ranks; ++r) nets.emplace_back(c);
  const std::int64_t local = c.batch / c.ranks;
  const auto start = std::chrono::steady_clock::now();
  auto per_rank = shardkit::run_ranks(c.ranks, [&](shardkit::thread_comm& comm) {
    Net& net = nets[static_cast<std::size_t>(comm.rank())];
    // 1. Register the parameters unit by unit, with their initial values (torch tensors).
    shardkit::model_spec model;
    for (std::size_t i = 0; i < pb.init.size(); ++i) {
      if (i == 0 || pb.unit_of[i] != pb.unit_of[i - 1])
        model.begin_unit(net->unit_name(pb.unit_of[i]));
      model.add(pb.names[i], pb.init[i]);
    }
    shardkit::engine_options eo;
    eo.prefetch = c.prefetch;
    engine_t eng(
        comm, model,
        {.lr = c.lr, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = c.weight_decay},
        eo);
    // 2. Hand the torch parameters to the engine: from here on they alias its memory, and
    //    autograd's hooks drive the unit hooks and hand over the gradients.
    std::vector<std::vector<torch::Tensor>> unit_params;
    for (std::size_t u = 0; u < net->num_units(); ++u)
      unit_params.push_back(net->unit(u)->parameters());
#if defined(SHARDKIT_EXAMPLE_IO)
    if (!c.resume.empty()) shardkit::io::load(eng, c.resume);  // the torch tensors see it
#endif
    shardkit::torch_hooks<engine_t> hooks(eng, unit_params);
    run_result r;
    net->around = [&](std::size_t u, const std::function<torch::Tensor()>& unit_forward) {
      return hooks.forward(u, [&] {
        // Inside the hooks every parameter of the unit is a view of the engine's memory (under
        // ZeRO-3: of the buffer the unit was just gathered into), never a copy.
        for (std::size_t k = 0; k < unit_params[u].size(); ++k) {
          const std::size_t i = hooks.param_index(u, k);
          if (unit_params[u][k].data_ptr() != static_cast<void*>(eng.param(i).data())) {
            ++r.alias_mismatches;
          }
        }
        return unit_forward();
      });
    };

    for (int step = c.first_step; step < c.first_step + c.steps; ++step) {
      const std::int64_t first = static_cast<std::int64_t>(step) * c.batch + comm.rank() * local;
      const torch::Tensor x = pb.x.narrow(0, first, local);
      const torch::Tensor y = pb.y.narrow(0, first, local);
      // 3. The model's own forward; each block runs inside the hooks (ZeRO-3 gathers the block,
      //    binds its parameters, runs it, frees the gathered buffer).
      const torch::Tensor out = net->forward(x.to(shardkit::torch_scalar_type_of<W>));
      torch::Tensor loss = torch::mse_loss(out.to(torch::kFloat32), y);
      // 4. Backward: autograd calls the hooks (pre_backward, grad_ready, post_backward).
      loss.backward();
      hooks.finish_backward();
      // 5. The optimizer step on this rank's shard; the torch parameters see the new values.
      eng.step();
      double l = loss.item<double>();
      comm.all_reduce(&l, &l, 1, shardkit::reduce_op::sum);
      r.losses.push_back(l / c.ranks);
    }
#if defined(SHARDKIT_EXAMPLE_IO)
    if (!c.save.empty()) shardkit::io::save(eng, c.save);
    if (!c.export_path.empty()) shardkit::io::export_safetensors(eng, c.export_path);
#endif
    // Final parameters (ZeRO-3: gathered unit by unit; every rank takes part).
    shardkit::stable_hash h;
    for (std::size_t u = 0; u < eng.num_units(); ++u) {
      eng.pre_forward(u);
      for (std::size_t i = 0; i < eng.num_params(); ++i) {
        if (eng.unit_of(i) != u) continue;
        for (auto v : eng.param(i)) {
          r.params.push_back(static_cast<float>(v));
          h.f32(static_cast<float>(v));
        }
      }
      eng.post_forward(u);
    }
    r.params_hash = h.value();
    net->around = nullptr;  // it refers to `hooks` and `eng`, which end with this rank
    for (const auto& p : net->parameters()) {
      if (!shardkit::torch_is_bound(p)) r.torch_owned_param_bytes += p.nbytes();
    }
    r.measured = eng.measured_state_bytes();
    r.formula = eng.expected_state_bytes();
    r.gathered_peak = eng.memory().peak(shardkit::memory_category::gathered_params);
    r.gathered_bound = eng.gathered_bytes_bound();
    return r;
  });
  run_result r = per_rank.front();
  for (std::size_t k = 1; k < per_rank.size(); ++k)
    r.alias_mismatches += per_rank[k].alias_mismatches;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

template <class W>
run_result train_stage(const config& c, const problem& pb) {
  switch (c.stage) {
    case 0:
      return train_shardkit<shardkit::zero0, W>(c, pb);
    case 1:
      return train_shardkit<shardkit::zero1, W>(c, pb);
    case 2:
      return train_shardkit<shardkit::zero2, W>(c, pb);
    default:
      return train_shardkit<shardkit::zero3, W>(c, pb);
  }
}

// ---- the reference: one unsharded model, torch's AdamW, the full global batch, fp32 ---------

run_result train_torch(const config& c, const problem& pb) {
  Net net(c);
  {
    torch::NoGradGuard no_grad;
    auto params = net->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) params[i].copy_(pb.init[i]);
  }
  torch::optim::AdamW opt(
      net->parameters(),
      torch::optim::AdamWOptions(c.lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(c.weight_decay));
  run_result r;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < c.first_step + c.steps; ++step) {  // from the start
    const std::int64_t first = static_cast<std::int64_t>(step) * c.batch;
    opt.zero_grad();
    torch::Tensor loss = torch::mse_loss(net->forward(pb.x.narrow(0, first, c.batch)),
                                         pb.y.narrow(0, first, c.batch));
    loss.backward();
    opt.step();
    if (step >= c.first_step) r.losses.push_back(loss.item<double>());
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const auto& p : net->parameters()) {
    const auto flat = p.detach().reshape({-1}).contiguous();
    r.params.insert(r.params.end(), flat.data_ptr<float>(), flat.data_ptr<float>() + flat.numel());
  }
  return r;
}

void print_array(const char* key, const std::vector<double>& v) {
  std::printf(" \"%s\": [", key);
  for (std::size_t i = 0; i < v.size(); ++i) std::printf("%s%.7g", i ? ", " : "", v[i]);
  std::printf("]");
}

}  // namespace

int main(int argc, char** argv) try {
  config c = parse(argc, argv);
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
  // One intra-op thread: the ranks are threads already, and results stay deterministic.
  torch::set_num_threads(1);
  const problem pb = make_problem(c);
  const run_result sk =
      c.dtype == "bf16" ? train_stage<shardkit::bf16>(c, pb) : train_stage<float>(c, pb);
  const run_result ref = train_torch(c, pb);

  double max_param_diff = 0.0, max_loss_diff = 0.0;
  for (std::size_t i = 0; i < sk.params.size(); ++i) {
    max_param_diff =
        std::max(max_param_diff, std::fabs(static_cast<double>(sk.params[i]) - ref.params[i]));
  }
  for (std::size_t i = 0; i < sk.losses.size(); ++i) {
    max_loss_diff = std::max(max_loss_diff, std::fabs(sk.losses[i] - ref.losses[i]));
  }
  // What the comparison should show (see the file comment and README).
  const double expected = c.dtype == "fp32" ? 2e-5 : 3e-2;

  if (c.json) {
    std::printf(
        "{\"stage\": %d, \"ranks\": %d, \"dtype\": \"%s\", \"steps\": %d, \"params\": %zu,\n",
        c.stage, c.ranks, c.dtype.c_str(), c.steps, sk.params.size());
    print_array("losses_shardkit", sk.losses);
    std::printf(",\n");
    print_array("losses_torch", ref.losses);
    std::printf(",\n \"max_abs_param_diff\": %.6g, \"max_abs_loss_diff\": %.6g,", max_param_diff,
                max_loss_diff);
    std::printf(" \"expected_max_abs_param_diff\": %g,\n", expected);
    std::printf(" \"bytes_per_rank\": %" PRIu64 ", \"formula_bytes_per_rank\": %" PRIu64
                ", \"gathered_peak_bytes\": %zu, \"gathered_bound_bytes\": %" PRIu64
                ", \"torch_owned_param_bytes\": %zu, \"alias_mismatches\": %zu,\n",
                sk.measured.total(), sk.formula.total(), sk.gathered_peak, sk.gathered_bound,
                sk.torch_owned_param_bytes, sk.alias_mismatches);
    std::printf(" \"first_step\": %d, \"params_hash\": \"%016" PRIx64 "\",\n", c.first_step + 1,
                sk.params_hash);
    std::printf(" \"seconds_shardkit\": %.3f, \"seconds_torch\": %.3f}\n", sk.seconds, ref.seconds);
  } else {
    std::printf(
        "shardkit %s example 03: LibTorch model (%d x Linear+LayerNorm+GELU, width %d, + head; "
        "%zu parameters)\nZeRO stage %d on %d in-process ranks, %s working parameters, AdamW lr "
        "%g, weight decay %g; reference: torch::optim::AdamW, unsharded, full batch, fp32\n\n",
        SHARDKIT_VERSION_STRING, c.blocks, c.width, sk.params.size(), c.stage, c.ranks,
        c.dtype.c_str(), static_cast<double>(c.lr), static_cast<double>(c.weight_decay));
    std::printf("step   loss shardkit   loss torch   (global batch of %d)\n", c.batch);
    for (std::size_t i = 0; i < sk.losses.size(); ++i) {
      std::printf("%4zu   %12.6f   %10.6f\n", static_cast<std::size_t>(c.first_step) + i + 1,
                  sk.losses[i], ref.losses[i]);
    }
    std::printf("\nmax |param shardkit - param torch| = %.3g   (expected below %g for %s)\n",
                max_param_diff, expected, c.dtype.c_str());
    std::printf("max |loss shardkit - loss torch|   = %.3g\n", max_loss_diff);
    std::printf("bytes held per rank (rank 0): %" PRIu64 " measured, %" PRIu64 " formula\n",
                sk.measured.total(), sk.formula.total());
    if (c.stage == 3) {
      std::printf("gathered parameters (peak): %zu bytes, bound %" PRIu64 "\n", sk.gathered_peak,
                  sk.gathered_bound);
    }
    std::printf(
        "parameter bytes torch allocated itself: %zu; forward passes that found a "
        "parameter not over shardkit's memory: %zu\n",
        sk.torch_owned_param_bytes, sk.alias_mismatches);
    // Wall times of the two runs, not a speed comparison: the shardkit run is N rank threads
    // sharing this machine's cores, with a unit hook and a collective per block; the reference
    // is one unsharded torch model on one thread.
    std::printf(
        "wall time of each run (not a speed comparison: %d rank threads on this machine's cores "
        "vs one unsharded torch model): shardkit %.2f s, torch %.2f s\n",
        c.ranks, sk.seconds, ref.seconds);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
