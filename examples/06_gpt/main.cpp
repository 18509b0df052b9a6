// shardkit example 06: a GPT-2-style transformer (LibTorch, byte-level, tied embedding and output
// projection) trained with ZeRO stages 0-3 on thread ranks or MPI processes, on the Python
// standard library's source as text, with gradient accumulation, clipping, a warm-up + cosine
// schedule, weight decay on matrices only, activation recomputation, asynchronous checkpoints,
// resumption at any number of ranks or stage, and a safetensors export that plain LibTorch
// evaluates. README.md in this directory has the results and the commands behind them.
//
//   shardkit_example_06_gpt --stage 3 --ranks 4 --steps 40
//   mpiexec -np 2 shardkit_example_06_gpt --stage 2 --steps 40 --save ckpt --save-every 10
//   shardkit_example_06_gpt --resume ckpt --ranks 4 --stage 3 --steps 60
//   shardkit_example_06_gpt --steps 40 --export gpt.safetensors
//   shardkit_example_06_gpt --eval gpt.safetensors
//   shardkit_example_06_gpt --torch-only --threads 2      (the unsharded LibTorch baseline)
#include "config.hpp"
#include "corpus.hpp"
#include "gpt.hpp"
#include "reference.hpp"
#include "train.hpp"

#if defined(SHARDKIT_EXAMPLE_MPI)
#include <shardkit/comm/mpi.hpp>
#endif

#include <CLI/CLI.hpp>
#include <cinttypes>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace {

using gpt::config;
using gpt::run_result;

//! Parses the command line into `c`; returns an exit status when the program should stop
//! (--help: 0; a bad argument: 2, with the reason on stderr), or -1 to go on.
int parse(int argc, char** argv, config& c, bool printer) {
  CLI::App app{"shardkit example 06: a GPT trained with ZeRO (LibTorch)"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // last one wins
  app.add_option("--stage", c.stage, "ZeRO stage")->check(CLI::Range(0, 3));
  app.add_option("--ranks", c.ranks, "thread ranks (under mpiexec: the processes)")
      ->check(CLI::Range(1, 64));
  app.add_option("--steps", c.steps, "the run ends at this step (the schedule's length)")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--stop-after", c.stop_after, "stop after this step (to resume later)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--dtype", c.dtype, "working parameters (fp32 master either way)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--layers", c.model.layers, "transformer blocks")->check(CLI::Range(1, 96));
  app.add_option("--width", c.model.width, "model width")->check(CLI::Range(8, 8192));
  app.add_option("--heads", c.model.heads, "attention heads")->check(CLI::Range(1, 128));
  app.add_option("--context", c.model.context, "tokens per sequence")->check(CLI::Range(2, 8192));
  app.add_flag("--recompute", c.model.recompute, "recompute each block's forward in backward");
  app.add_option("--batch", c.batch, "global batch: sequences per step over all ranks")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--micro", c.micro, "micro-batches per step (gradient accumulation)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--lr", c.lr, "peak learning rate")->check(CLI::PositiveNumber);
  app.add_option("--min-lr", c.min_lr, "learning rate at the end of the cosine")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", c.warmup, "linear warm-up steps")->check(CLI::NonNegativeNumber);
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay of matrices")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--clip", c.clip, "global gradient-norm clip (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", c.seed, "initial values and batches");
  app.add_option("--prefetch", c.prefetch, "ZeRO-3: units gathered ahead")
      ->check(CLI::Range(0, 64));
  app.add_option("--grad-buffers", c.grad_buffers, "ZeRO-2/3: gradient staging buffers")
      ->check(CLI::Range(1, 16));
  app.add_option("--progress", c.progress,
                 "MPI: asynchronous collectives move on inside shardkit's calls (on_call) or in "
                 "a progress thread (thread)")
      ->check(CLI::IsMember({"on_call", "thread"}));
  app.add_option("--log-every", c.log_every, "a progress line every K steps")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--eval-every", c.eval_every, "validation loss every E steps")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--val-seqs", c.val_seqs, "validation sequences")->check(CLI::Range(1, 1 << 16));
  app.add_option("--data", c.data, "directory of .py files (default: Python's standard library)");
  app.add_option("--max-bytes", c.max_bytes, "bytes of the corpus to read")
      ->check(CLI::Range(std::size_t{1024}, std::size_t{1} << 34));
  app.add_option("--save", c.save, "checkpoint directory (replaced at each save)");
  app.add_option("--save-every", c.save_every,
                 "save every K steps, asynchronously (and at the end)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--resume", c.resume, "resume from this checkpoint (any number of ranks, stage)");
  app.add_option("--export", c.export_path, "write the final weights to this safetensors file");
  app.add_option("--eval", c.eval_path, "print the validation loss of a safetensors file and exit");
  app.add_flag("--compare", c.compare, "also train the unsharded torch reference and compare");
  app.add_flag("--torch-only", c.torch_only, "train only the unsharded torch reference");
  app.add_option("--threads", c.threads, "intra-op threads of --torch-only")
      ->check(CLI::Range(1, 256));
  app.add_flag("--json", c.json, "print the results as JSON");
  app.add_flag("--quiet", c.quiet, "no progress lines");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (!printer) return e.get_exit_code() == 0 ? 0 : 2;
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  return -1;
}

//! A setting that cannot work with the number of ranks: the reason, exit status 2.
std::string check_shape(const config& c, int ranks) {
  if (c.batch % (ranks * c.micro) != 0) {
    return "--batch " + std::to_string(c.batch) +
           " must be a multiple of ranks x --micro = " + std::to_string(ranks) + " x " +
           std::to_string(c.micro) + " (every rank gets an equal share of each micro-batch)";
  }
  if (c.model.width % c.model.heads != 0) {
    return "--width " + std::to_string(c.model.width) + " must be a multiple of --heads " +
           std::to_string(c.model.heads);
  }
  return {};
}

template <class Comm, class W>
run_result train_stage(Comm& comm, const config& c, const gpt::corpus& data, gpt::GPT& net) {
  switch (c.stage) {
    case 0:
      return gpt::train_rank<Comm, shardkit::zero0, W>(comm, c, data, net);
    case 1:
      return gpt::train_rank<Comm, shardkit::zero1, W>(comm, c, data, net);
    case 2:
      return gpt::train_rank<Comm, shardkit::zero2, W>(comm, c, data, net);
    default:
      return gpt::train_rank<Comm, shardkit::zero3, W>(comm, c, data, net);
  }
}

template <class Comm>
run_result train_any(Comm& comm, const config& c, const gpt::corpus& data, gpt::GPT& net) {
  return c.dtype == "bf16" ? train_stage<Comm, shardkit::bf16>(comm, c, data, net)
                           : train_stage<Comm, float>(comm, c, data, net);
}

gpt::GPT fresh_model(const config& c) {
  torch::manual_seed(c.seed);  // the same initial values on every rank, at every N
  return gpt::GPT(c.model);
}

double mean_tokens_per_s(const run_result& r) {
  // The first step of a run pays for first touches and allocations: left out when there are more.
  double tokens = 0, seconds = 0;
  for (std::size_t i = r.records.size() > 1 ? 1 : 0; i < r.records.size(); ++i) {
    tokens += r.records[i].tokens_per_s * r.records[i].seconds;
    seconds += r.records[i].seconds;
  }
  return seconds > 0 ? tokens / seconds : 0.0;
}

nlohmann::json records_json(const run_result& r) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& s : r.records) {
    nlohmann::json j{{"step", s.step},
                     {"loss", s.loss},
                     {"seconds", s.seconds},
                     {"compute_s", s.compute},
                     {"comm_s", s.comm},
                     {"optimizer_s", s.optimizer},
                     {"lr", s.lr},
                     {"grad_norm", s.grad_norm},
                     {"loss_scale", s.loss_scale},
                     {"tokens_per_s", s.tokens_per_s}};
    if (!std::isnan(s.val_loss)) j["val_loss"] = s.val_loss;
    a.push_back(j);
  }
  return a;
}

int report(const config& c, int ranks, const char* how, const run_result& r,
           const run_result* ref) {
  double max_loss_diff = 0, max_param_diff = 0;
  if (ref != nullptr) {
    for (std::size_t i = 0; i < r.records.size() && i < ref->records.size(); ++i) {
      max_loss_diff = std::max(max_loss_diff, std::fabs(r.records[i].loss - ref->records[i].loss));
    }
    for (std::size_t i = 0; i < r.final_params.size() && i < ref->final_params.size(); ++i) {
      max_param_diff = std::max(
          max_param_diff, std::fabs(static_cast<double>(r.final_params[i]) - ref->final_params[i]));
    }
  }
  if (c.json) {
    nlohmann::json j{{"stage", c.stage},
                     {"ranks", ranks},
                     {"launch", how},
                     {"dtype", c.dtype},
                     {"params", r.params},
                     {"first_step", c.first_step},
                     {"last_step", c.last_step()},
                     {"recompute", c.model.recompute},
                     {"micro_batches", c.micro},
                     {"final_val_loss", r.final_val_loss},
                     {"params_hash", shardkit::detail::concat(std::hex, r.params_hash)},
                     {"tokens_per_s", mean_tokens_per_s(r)},
                     {"train_seconds", r.train_seconds},
                     {"steps", records_json(r)}};
    nlohmann::json led = nlohmann::json::object(), plan = nlohmann::json::object();
    for (const auto& [k, v] : r.ledger) led[k] = v;
    for (const auto& [k, v] : r.planned) plan[k] = v;
    j["ledger_bytes"] = led;
    j["planned_bytes"] = plan;
    j["gathered_peak_bytes"] = r.gathered_peak;
    j["gathered_bound_bytes"] = r.gathered_bound;
    j["gathers_forward"] = r.gathers_forward;
    j["gathers_backward"] = r.gathers_backward;
    if (ref != nullptr) {
      j["reference"] = {{"final_val_loss", ref->final_val_loss},
                        {"tokens_per_s", mean_tokens_per_s(*ref)},
                        {"losses", records_json(*ref)},
                        {"max_abs_loss_diff", max_loss_diff},
                        {"max_abs_param_diff", max_param_diff}};
    }
    std::printf("%s\n", j.dump(1).c_str());
    return 0;
  }
  std::printf(
      "\nGPT: %d blocks, width %d, %d heads, context %d, %zu parameters (tied "
      "embedding/output), ZeRO stage %d on %d %s, %s working parameters\n",
      c.model.layers, c.model.width, c.model.heads, c.model.context, r.params, c.stage, ranks, how,
      c.dtype.c_str());
  std::printf("steps %d-%d: %.0f tokens/s (steps after the first), final validation loss %.6f\n",
              c.first_step + 1, c.last_step(), mean_tokens_per_s(r), r.final_val_loss);
  std::printf("\nbytes held by rank 0       ledger     planner\n");
  for (std::size_t i = 0; i < r.ledger.size(); ++i) {
    std::printf("  %-24s %10" PRIu64 "  %10" PRIu64 "%s\n", r.ledger[i].first.c_str(),
                r.ledger[i].second, r.planned[i].second,
                i == 4 && c.stage == 3 ? "  (planner: the bound)" : "");
  }
  std::string units;
  for (const auto n : r.unit_numels) units += (units.empty() ? "" : ",") + std::to_string(n);
  std::printf(
      "  (the planner: shardkit-plan --units %s --ranks %d --dtype %s --gpu-mem 80GB "
      "--exact%s%s%s)\n",
      units.c_str(), ranks, c.dtype.c_str(), c.micro > 1 ? " --micro-batches " : "",
      c.micro > 1 ? std::to_string(c.micro).c_str() : "",
      c.stage == 3 ? "; at stage 3 the root unit is kept from forward to backward" : "");
  if (c.stage == 3) {
    std::printf("ZeRO-3 all-gathers per unit in the last step (forward/backward):");
    for (std::size_t u = 0; u < r.gathers_forward.size(); ++u) {
      std::printf(" %s%zu/%zu", u == 0 ? "root " : "", r.gathers_forward[u], r.gathers_backward[u]);
    }
    std::printf("\n");
  }
  if (ref != nullptr) {
    std::printf(
        "\nunsharded torch::optim::AdamW reference: final validation loss %.6f, %.0f "
        "tokens/s\nmax |loss - reference loss| = %.3g, max |param - reference param| = "
        "%.3g\n",
        ref->final_val_loss, mean_tokens_per_s(*ref), max_loss_diff, max_param_diff);
  }
  if (!r.saved.empty()) std::printf("checkpoint: %s (step %d)\n", r.saved.c_str(), c.last_step());
  if (!r.exported.empty()) std::printf("exported: %s\n", r.exported.c_str());
  std::printf("parameters hash: %016" PRIx64 "\n", r.params_hash);
  return 0;
}

// Shared by both launchers: settings every rank needs before training.
void prepare(config& c) {
  if (!c.resume.empty())
    c.first_step = static_cast<int>(shardkit::io::read_manifest(c.resume).step);
  if (c.first_step >= c.last_step()) {
    throw std::runtime_error("the checkpoint is at step " + std::to_string(c.first_step) +
                             "; --steps (or --stop-after) " + std::to_string(c.last_step()) +
                             " leaves nothing to train");
  }
}

gpt::corpus load(const config& c) {
  return gpt::load_corpus(c.data.empty() ? gpt::default_corpus_dir() : c.data, c.max_bytes, 0.1,
                          c.model.context);
}

int main_threads(int argc, char** argv) {
  config c;
  if (const int s = parse(argc, argv, c, true); s >= 0) return s;
  torch::set_num_threads(c.torch_only ? c.threads : 1);  // ranks are threads already
  const gpt::corpus data = load(c);
  if (!c.eval_path.empty()) {
    const double v = gpt::evaluate_safetensors(c, data, c.eval_path);
    if (c.json)
      std::printf("{\"val_loss\": %.17g}\n", v);
    else
      std::printf("validation loss of %s: %.6f\n", c.eval_path.c_str(), v);
    return 0;
  }
  if (const std::string why = check_shape(c, c.torch_only ? 1 : c.ranks); !why.empty()) {
    std::fprintf(stderr, "error: %s\n", why.c_str());
    return 2;
  }
  if (c.torch_only) {
    gpt::GPT net = fresh_model(c);
    const run_result r = gpt::train_torch(c, data, net);
    std::printf(c.json ? "{\"tokens_per_s\": %.1f, \"final_val_loss\": %.17g, \"threads\": %d}\n"
                       : "unsharded LibTorch: %.0f tokens/s, final validation loss %.6f, %d "
                         "thread(s)\n",
                mean_tokens_per_s(r), r.final_val_loss, c.threads);
    return 0;
  }
  prepare(c);
  std::vector<gpt::GPT> nets;  // built here, not in the rank threads: torch's RNG is global
  for (int r = 0; r < c.ranks; ++r) nets.push_back(fresh_model(c));
  auto per_rank = shardkit::run_ranks(c.ranks, [&](shardkit::thread_comm& comm) {
    return train_any(comm, c, data, nets[static_cast<std::size_t>(comm.rank())]);
  });
  std::optional<run_result> ref;
  if (c.compare) {
    gpt::GPT net = fresh_model(c);
    ref = gpt::train_torch(c, data, net);
  }
  return report(c, c.ranks, "thread ranks", per_rank.front(), ref ? &*ref : nullptr);
}

#if defined(SHARDKIT_EXAMPLE_MPI)
// --progress thread, read before MPI starts (the communicator's options are fixed then).
shardkit::mpi_comm_options mpi_options(int argc, char** argv) {
  shardkit::mpi_comm_options o;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--progress" && std::string(argv[i + 1]) == "thread") {
      o.progress = shardkit::mpi_progress::thread;
    }
  }
  return o;
}

int main_mpi(int& argc, char**& argv) {
  return shardkit::mpi_main(
      argc, argv,
      [&](shardkit::mpi_comm& comm) -> int {
        const bool printer = comm.rank() == 0;
        config c;
        if (const int s = parse(argc, argv, c, printer); s >= 0) return s;
        if (!c.eval_path.empty() || c.torch_only) {
          if (printer) std::fprintf(stderr, "error: --eval and --torch-only run without mpiexec\n");
          return 2;
        }
        c.ranks = comm.size();
        if (const std::string why = check_shape(c, c.ranks); !why.empty()) {
          if (printer) std::fprintf(stderr, "error: %s\n", why.c_str());
          return 2;
        }
        torch::set_num_threads(1);
        const gpt::corpus data = load(c);
        prepare(c);
        gpt::GPT net = fresh_model(c);
        const run_result r = train_any(comm, c, data, net);
        int status = 0;
        if (printer) {
          std::optional<run_result> ref;
          if (c.compare) {
            gpt::GPT ref_net = fresh_model(c);
            ref = gpt::train_torch(c, data, ref_net);
          }
          status = report(c, c.ranks, "MPI processes", r, ref ? &*ref : nullptr);
          std::fflush(stdout);
        }
        comm.broadcast(&status, 1, 0);  // the job's exit status is rank 0's
        return status;
      },
      mpi_options(argc, argv));
}
#endif

}  // namespace

int main(int argc, char** argv) try {
#if defined(SHARDKIT_EXAMPLE_MPI)
  if (shardkit::launched_by_mpi()) return main_mpi(argc, argv);
#endif
  return main_threads(argc, argv);
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
