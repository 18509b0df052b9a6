// The example's settings (parsed by CLI11 in main.cpp) and what a run reports.
#pragma once

#include "gpt.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

struct config {
  options model;
  int stage = 2;
  int ranks = 2;               // thread ranks (under mpiexec: the processes)
  int steps = 40;              // the run ends at this step (the schedule's length)
  int stop_after = 0;          // stop after this step (0: run to --steps); for resumption
  std::string dtype = "fp32";  // working parameters (fp32 master either way)
  int batch = 16;              // global batch: sequences per step, all ranks together
  int micro = 1;               // micro-batches per step (gradient accumulation)
  float lr = 1e-3f;            // peak learning rate
  float min_lr = 1e-4f;        // the cosine decays to this
  int warmup = 5;              // linear warm-up steps
  float weight_decay = 0.1f;   // on matrices only
  float clip = 1.0f;           // global gradient-norm clip (0: none)
  std::uint64_t seed = 1;
  std::size_t prefetch = 1;          // ZeRO-3: units gathered ahead
  std::size_t grad_buffers = 1;      // ZeRO-2/3: gradient staging buffers
  std::string progress = "on_call";  // MPI: who moves asynchronous collectives forward
  int log_every = 5;                 // a progress line every this many steps
  int eval_every = 20;               // validation loss every this many steps (and at the end)
  int val_seqs = 16;                 // validation sequences
  std::string data;                  // corpus directory (default: the Python standard library)
  std::size_t max_bytes = 4u << 20;  // bytes of the corpus read
  std::string save;                  // checkpoint directory
  int save_every = 0;                // save every this many steps (asynchronously; 0: at the end)
  std::string resume;                // checkpoint to resume from
  std::string export_path;           // safetensors file of the final weights
  std::string eval_path;             // evaluate this safetensors file with plain LibTorch and exit
  bool compare = false;              // also train the unsharded torch reference and compare
  bool torch_only = false;           // train only the unsharded torch reference (throughput)
  int threads = 1;                   // intra-op threads of the torch-only reference
  bool json = false;
  bool quiet = false;  // no progress lines

  int first_step = 0;  // steps already taken (a resumed checkpoint's)
  int last_step() const { return stop_after > 0 && stop_after < steps ? stop_after : steps; }

  //! Warm-up, then a cosine from lr down to min_lr at `steps`: the factor of step t (1-based).
  float lr_factor(std::uint64_t t) const {
    if (warmup > 0 && t <= static_cast<std::uint64_t>(warmup)) {
      return static_cast<float>(t) / static_cast<float>(warmup);
    }
    const double span = std::max(1, steps - warmup);
    const double p =
        std::min(1.0, static_cast<double>(t - static_cast<std::uint64_t>(warmup)) / span);
    const double lo = static_cast<double>(min_lr) / static_cast<double>(lr);
    return static_cast<float>(lo + (1.0 - lo) * 0.5 * (1.0 + std::cos(3.14159265358979323846 * p)));
  }
};

//! One progress record (one step).
struct step_record {
  int step = 0;
  double loss = 0.0;      // mean over the global batch
  double val_loss = NAN;  // when evaluated at this step
  double seconds = 0.0;   // the step's wall time (rank 0)
  double compute = 0.0;   // forward + backward outside the engine's hooks
  double comm = 0.0;      // inside the hooks and in step() outside the optimizer
  double optimizer = 0.0;
  double lr = 0.0, grad_norm = 0.0, loss_scale = 1.0;
  double tokens_per_s = 0.0;
};

//! What a run reports.
struct run_result {
  std::vector<step_record> records;
  double final_val_loss = NAN;
  std::uint64_t params_hash = 0;  // of the final parameters' fp32 bits, in registration order
  std::size_t params = 0;
  std::vector<float> final_params;  // rank 0, when comparing
  double seconds = 0.0, train_seconds = 0.0;
  std::uint64_t tokens = 0;
  // rank 0's ledger by category: current (model state) and peak (transient buffers)
  std::vector<std::pair<std::string, std::uint64_t>> ledger, planned;
  std::uint64_t gathered_peak = 0, gathered_bound = 0;
  std::vector<std::uint64_t> unit_numels;  // the root unit, then each block
  // ZeRO-3: all-gathers issued per unit in the last step, forward and backward
  std::vector<std::size_t> gathers_forward, gathers_backward;
  std::string saved, exported;
};

}  // namespace gpt
