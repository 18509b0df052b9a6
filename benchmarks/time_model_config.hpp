// The time-model bench's configuration (benchmarks/time_model.cpp has the overview): the model
// the planner is given, its command line, and the line printed before the results.
#pragma once

#include <shardkit/plan/calibrate.hpp>
#include <shardkit/plan/model.hpp>

#include "engine_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench::time_model {

namespace plan = shardkit::plan;

//! What one run of the bench does (the command line's values).
struct config {
  model_shape shape{1024, 8};
  std::vector<int> ranks{2, 4};
  int reps = 7;
  // Calibrate-then-measure rounds; ratios are reported per round and as medians, each median
  // with its 95% interval over the rounds. On the 2-core machines one round's ratio moves by
  // 0.5-2x from the next: with 15 rounds most stages' intervals straddle a 15% bound, with 45
  // (about 12 minutes at N = 2 and 4 on the Intel Xeon, 3 minutes over MPI at N = 2) most decide
  // (benchmarks/README.md).
  int rounds = 45;
  bool samples = false;  // --samples 1: print every calibration sample's median and range
  bool age = true;       // --age 0: no optimizer_bytes (in-place all-gathers timed in cache)
  // --age-runs 0: every in-place all-gather aged by a whole optimizer pass, not a run of them
  // after one pass as the step's (sweep_options::gathered_bytes).
  bool age_runs = true;
  // The step's gradients and parameters are written just before they are reduced or gathered
  // and, at this model's size, still in cache; the step issues them asynchronously, some in
  // place: the sweep times its collectives the same way (see time_model.cpp's file comment). Sizes
  // x2 apart: the step's 1-2 MiB calls lie where the cost per byte changes with the caches. Single
  // calls are noisier than back-to-back ones: more repetitions per size.
  plan::sweep_options sweep{.growth = 2,
                            .reps = 11,
                            .warmup = 2,
                            .cold_bytes = 0,
                            .fresh_input = true,
                            .out_of_place = true,
                            .in_place = true,
                            .asynchronous = true,
                            .gather_outputs = 2,
                            .zero_reduce_outputs = true,
                            .after_last_arrival = true,
                            .element = shardkit::dtype::bf16};
};

//! A distribution-free 95% confidence interval for the median of `v` (the per-round ratios):
//! the order statistics x_(k) and x_(n+1-k), k the largest rank with P(Binomial(n, 1/2) < k) <=
//! 2.5%, so that the true median lies between them with at least 95% probability whatever the
//! distribution. Fewer than 6 values cannot give one: `exists` is false and the bounds are the
//! extremes.
struct median_interval {
  double lo = 0, hi = 0;
  bool exists = false;
};
inline median_interval median_ci95(std::vector<double> v) {
  median_interval r;
  if (v.empty()) return r;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  // P(B <= j) for B ~ Binomial(n, 1/2), accumulated from j = 0.
  double term = std::pow(0.5, static_cast<double>(n)), below = 0;  // term = P(B = j)
  std::size_t k = 0;                                               // P(B < k) <= 2.5%
  for (std::size_t j = 0; j < n; ++j) {
    if (below + term > 0.025) break;
    below += term;
    k = j + 1;
    term *= static_cast<double>(n - j) / static_cast<double>(j + 1);
  }
  r.exists = k >= 1;
  r.lo = v[r.exists ? k - 1 : 0];
  r.hi = v[r.exists ? n - k : n - 1];
  return r;
}

//! Where a stage's ratio stands against the target (within 15%), judged by the interval of its
//! median: "met" when the whole interval lies within 0.85-1.15, "missed" when none of it does,
//! "open" when the interval straddles a bound (more rounds, or a quieter machine, would tell).
inline const char* verdict_15(const median_interval& ci) {
  if (!ci.exists) return "open";
  if (ci.lo >= 0.85 && ci.hi <= 1.15) return "met";
  if (ci.hi < 0.85 || ci.lo > 1.15) return "missed";
  return "open";
}

//! The benchmark's units as the planner counts them: one per layer, a d x d weight and a d bias.
inline std::vector<plan::unit> units_of(const model_shape& m) {
  return std::vector<plan::unit>(m.layers, plan::unit{m.d * m.d + m.d});
}

//! The planner's description of the benchmark's engine: stage `st` on N ranks, bf16, AdamW.
inline plan::setup setup_of(int st, int N) {
  plan::setup s;
  s.stage = st;
  s.ranks = static_cast<std::uint64_t>(N);
  s.bytes =
      plan::precision_of(shardkit::dtype::bf16, shardkit::dtype::bf16, plan::optimizer_kind::adamw);
  return s;
}

//! Throws std::invalid_argument with `why` and the usage line.
[[noreturn]] inline void usage(const std::string& why) {
  throw std::invalid_argument(
      why +
      "\nusage: shardkit_bench_time_model [--size=tiny|full] "
      "[--ranks 2,4] [--reps K] [--rounds R] [--min-bytes B] "
      "[--max-bytes B] [--growth G] [--cold-bytes B] [--async 0|1] "
      "[--age 0|1] [--age-runs 0|1] [--gather-outputs K] [--zero-outputs 0|1] [--arrival 0|1] "
      "[--samples 0|1]");
}

inline config parse(int argc, char** argv) {
  config c;
  bool max_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--size=tiny") {
      c.shape = {64, 2};
      c.reps = 3;
      c.sweep.max_bytes = 1 << 20;  // smaller sizes alone are noise on a busy machine
      max_given = true;
      c.sweep.reps = 3;
      c.sweep.cold_bytes = 0;
      // Three rounds: on a machine busy with other tests, one tiny sweep in 7-15 cannot be
      // fitted (its times do not grow with size), and a run fails only if every round is.
      c.rounds = 3;
      continue;
    }
    if (a == "--size=full") continue;
    if (i + 1 >= argc) usage("unknown or incomplete argument '" + a + "'");
    const std::string v = argv[++i];
    if (a == "--ranks") {
      c.ranks.clear();
      for (std::size_t p = 0; p < v.size();) {
        const std::size_t q = std::min(v.find(',', p), v.size());
        const int n = std::atoi(v.substr(p, q - p).c_str());
        if (n < 2 || n > 64) usage("--ranks: '" + v + "': every N must be 2..64");
        c.ranks.push_back(n);
        p = q + 1;
      }
    } else if (a == "--reps") {
      c.reps = std::atoi(v.c_str());
      if (c.reps < 1) usage("--reps: '" + v + "' must be at least 1");
    } else if (a == "--max-bytes") {
      c.sweep.max_bytes = static_cast<std::size_t>(std::strtoull(v.c_str(), nullptr, 10));
      max_given = true;
      if (c.sweep.max_bytes < 4 * c.sweep.min_bytes) usage("--max-bytes: expected at least 16384");
    } else if (a == "--growth") {
      c.sweep.growth = static_cast<std::size_t>(std::strtoull(v.c_str(), nullptr, 10));
      if (c.sweep.growth < 2) usage("--growth: '" + v + "' must be at least 2");
    } else if (a == "--rounds") {
      c.rounds = std::atoi(v.c_str());
      if (c.rounds < 1 || c.rounds > 100) usage("--rounds: '" + v + "' must be 1..100");
    } else if (a == "--min-bytes") {
      c.sweep.min_bytes = static_cast<std::size_t>(std::strtoull(v.c_str(), nullptr, 10));
      if (c.sweep.min_bytes < 4) usage("--min-bytes: expected at least 4");
    } else if (a == "--async") {
      if (v != "0" && v != "1") usage("--async: '" + v + "': expected 0 or 1");
      c.sweep.asynchronous = v == "1";
    } else if (a == "--gather-outputs") {
      c.sweep.gather_outputs = static_cast<std::size_t>(std::strtoull(v.c_str(), nullptr, 10));
      if (c.sweep.gather_outputs > 16) usage("--gather-outputs: '" + v + "' must be 0..16");
    } else if (a == "--arrival") {
      if (v != "0" && v != "1") usage("--arrival: '" + v + "': expected 0 or 1");
      c.sweep.after_last_arrival = v == "1";
    } else if (a == "--zero-outputs") {
      if (v != "0" && v != "1") usage("--zero-outputs: '" + v + "': expected 0 or 1");
      c.sweep.zero_reduce_outputs = v == "1";
    } else if (a == "--age") {
      if (v != "0" && v != "1") usage("--age: '" + v + "': expected 0 or 1");
      c.age = v == "1";
    } else if (a == "--age-runs") {
      if (v != "0" && v != "1") usage("--age-runs: '" + v + "': expected 0 or 1");
      c.age_runs = v == "1";
    } else if (a == "--samples") {
      if (v != "0" && v != "1") usage("--samples: '" + v + "': expected 0 or 1");
      c.samples = v == "1";
    } else if (a == "--cold-bytes") {
      c.sweep.cold_bytes = static_cast<std::size_t>(std::strtoull(v.c_str(), nullptr, 10));
    } else {
      usage("unknown argument '" + a + "'");
    }
  }
  // The sweep reaches the step's largest call (stage 0's all-reduce of every bf16 gradient), so
  // that no call of the step is predicted beyond the samples.
  if (!max_given) {
    while (c.sweep.max_bytes < 2 * c.shape.params()) c.sweep.max_bytes *= c.sweep.growth;
  }
  return c;
}

//! The line printed before the results: the model, the steps and how the sweep ran.
inline void header(const config& c) {
  std::printf(
      "time model vs measurement: %zu units of %zu x %zu + %zu (bf16, AdamW), %d steps "
      "per stage (median), calibration %zu B - %zu B (%s inputs, %s, %s, %s, %s)\n",
      c.shape.layers, c.shape.d, c.shape.d, c.shape.d, c.reps, c.sweep.min_bytes, c.sweep.max_bytes,
      c.sweep.fresh_input ? "fresh" : "reused",
      c.sweep.cold_bytes != 0 ? "cold walk" : "reused buffers",
      c.sweep.asynchronous ? "asynchronous" : "synchronous",
      !c.age       ? "no optimizer bytes"
      : c.age_runs ? "optimizer's bytes streamed once before each run of in-place all-gathers"
                   : "optimizer's bytes streamed before each in-place all-gather",
      c.sweep.gather_outputs != 0 ? "out-of-place all-gathers on their own outputs"
                                  : "outputs walked");
  std::printf(
      "one / pred = plan::comm_time_per_step with one calibrated link / one link per collective "
      "and placement; own = each collective from the last rank's arrival to the first rank's "
      "exit, summed, collectives serialized (the model's assumption; own_last: to the last "
      "rank's exit); ovl_* = as the engine runs: own, seconds inside collectives (timed_comm), "
      "wall - optimizer seconds\n");
}

}  // namespace bench::time_model
