//! \file plan/sampled.hpp
//! The time model read off a calibration's own samples, where a call's size lies among them.
//!
//! plan/calibrate.hpp fits one α-β line per collective and placement to a sweep of 4 KiB to tens
//! of MiB. A host communicator's cost per byte is not one number over that range: it changes
//! where the buffers stop fitting in the caches, and a line fitted over four decades can lie 15%
//! or more above or below the sweep's own time at a given size (benchmarks/README.md, "The
//! planner's time model"). sampled_times keeps the samples and answers with the measured curve:
//! log-log interpolation in bytes between the two samples around a call (sizes ×2 or ×4 apart
//! give the sweep's own times to within the curvature between them). Outside the sampled sizes,
//! or for a collective, placement or group size it has no samples of, comm_time_per_step falls
//! back to the cluster's links (the fitted lines, or the flags a user gave).
//!
//! The samples describe one communicator on one machine and group size, as a calibration does;
//! they stand for links inside a node, so calls whose group spans nodes use the cluster's links.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/plan/fit.hpp>
#include <shardkit/plan/planner.hpp>
#include <shardkit/plan/time.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

//! A sweep's samples read as one measured curve per collective, placement and rank count.
class sampled_times {
  using key_type = std::tuple<int, bool, std::uint64_t, std::uint64_t>;
  static key_type key(const calibration_sample& x) {
    return {static_cast<int>(x.op), x.in_place, x.ranks, x.count * x.elem_bytes};
  }

 public:
  sampled_times() = default;

  //! Keeps `samples` (e.g. calibration::samples). Samples of the same collective, placement,
  //! rank count and bytes (several rounds of a sweep) are merged into their geometric mean.
  //! Throws calibration_error naming the sample when one cannot be a measured time: fewer than
  //! 2 ranks, no elements, a collective other than all-reduce, reduce-scatter and all-gather, or
  //! a time that is not positive and finite.
  explicit sampled_times(std::vector<calibration_sample> samples) {
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const auto& x = samples[i];
      const char* why = nullptr;
      if (x.ranks < 2) {
        why = "fewer than 2 ranks; expected a collective over at least 2";
      } else if (x.count == 0 || x.elem_bytes == 0) {
        why = "no bytes; expected count and elem_bytes of at least 1";
      } else if (x.op != collective::all_reduce && x.op != collective::reduce_scatter &&
                 x.op != collective::all_gather) {
        why =
            "a collective the sweep does not time; expected all-reduce, reduce-scatter or "
            "all-gather";
      } else if (!(x.seconds > 0) || !std::isfinite(x.seconds)) {
        why = "a time that is not positive and finite";
      }
      if (why != nullptr) {
        shardkit::detail::raise<calibration_error>("sampled_times: ", detail::describe_sample(i, x),
                                                   " has ", why);
      }
    }
    std::sort(samples.begin(), samples.end(),
              [](const auto& a, const auto& b) { return key(a) < key(b); });
    // Merge equal keys: the geometric mean, which log-log interpolation treats as one point.
    for (std::size_t i = 0; i < samples.size();) {
      std::size_t j = i;
      double log_sum = 0.0;
      for (; j < samples.size() && key(samples[j]) == key(samples[i]); ++j) {
        log_sum += std::log(samples[j].seconds);
      }
      calibration_sample merged = samples[i];
      if (j - i > 1) merged.seconds = std::exp(log_sum / static_cast<double>(j - i));
      samples_.push_back(merged);
      i = j;
    }
  }

  //! Seconds one call of `count` elements of `elem_bytes` bytes (count as calibration_sample
  //! counts it) of collective `op` over `ranks` ranks takes, in place or not: log-log
  //! interpolation in bytes between the samples of that collective, placement and rank count
  //! just below and just above it (the sample itself at a sampled size). nullopt where the
  //! samples do not reach that size on both sides, or there are none of it.
  std::optional<double> at(collective op, std::uint64_t count, std::uint64_t elem_bytes,
                           std::uint64_t ranks, bool in_place) const {
    const std::uint64_t bytes = count * elem_bytes;
    const calibration_sample* lo = nullptr;
    const calibration_sample* hi = nullptr;
    for (const auto& x : samples_) {
      if (x.op != op || x.in_place != in_place || x.ranks != ranks) continue;
      const std::uint64_t b = x.count * x.elem_bytes;
      if (b <= bytes) lo = &x;  // sorted by bytes: the last one at or below
      if (b >= bytes && hi == nullptr) hi = &x;
    }
    if (lo == nullptr || hi == nullptr) return std::nullopt;
    const double b_lo = static_cast<double>(lo->count * lo->elem_bytes);
    const double b_hi = static_cast<double>(hi->count * hi->elem_bytes);
    if (lo == hi || b_lo == b_hi) return lo->seconds;
    const double f = std::log(static_cast<double>(bytes) / b_lo) / std::log(b_hi / b_lo);
    return std::exp(std::log(lo->seconds) + f * (std::log(hi->seconds) - std::log(lo->seconds)));
  }

  //! Whether any sample is of collective `op` over `ranks` ranks, in place or not.
  bool has(collective op, std::uint64_t ranks, bool in_place) const {
    return std::any_of(samples_.begin(), samples_.end(), [&](const calibration_sample& x) {
      return x.op == op && x.ranks == ranks && x.in_place == in_place;
    });
  }

  //! The samples kept, sorted by collective, placement, rank count and bytes, equal ones merged.
  std::span<const calibration_sample> samples() const noexcept { return samples_; }
  bool empty() const noexcept { return samples_.empty(); }

 private:
  std::vector<calibration_sample> samples_;
};

//! Seconds of communication per optimizer step, as comm_time_per_step(s, units, c, a), with each
//! call whose group lies within one node and whose size lies among `measured`'s samples of its
//! collective, placement and group size taken from them (sampled_times::at); every other call
//! from the cluster's links. A call in place where no in-place samples of its collective and
//! group size were taken reads the out-of-place ones, as the links fall back to the
//! collective's out-of-place link (intra_link). Preconditions as comm_time_per_step.
inline double comm_time_per_step(const setup& s, std::span<const unit> units, const cluster& c,
                                 const sampled_times& measured, algorithm a = algorithm::ring) {
  double t = 0.0;
  for_each_collective(s, units, [&](const collective_call& call) {
    const placement where = place(s, call.group, c);
    std::optional<double> one;
    if (where.nodes() <= 1) {
      const bool in_place = call.in_place && measured.has(call.op, where.size, true);
      one = measured.at(call.op, call.count, call.elem_bytes, where.size, in_place);
    }
    if (!one) {
      one = collective_time(call.op, call.count, call.elem_bytes, where, c, a, call.in_place);
    }
    t += static_cast<double>(call.repeat) * *one;
  });
  return t;
}

//! plan_all(base, units, c, budget, rank), each stage's communication times from `measured`
//! where its samples reach (comm_time_per_step above) and from the cluster's links elsewhere.
inline plan_report plan_all(const setup& base, std::span<const unit> units, const cluster& c,
                            const sampled_times& measured, const gpu_budget& budget,
                            std::uint64_t rank = 0) {
  plan_report r = plan_all(base, units, c, budget, rank);
  for (stage_plan& p : r.stages) {
    p.ring_time_s = comm_time_per_step(p.config, units, c, measured, algorithm::ring);
    p.hierarchical_time_s =
        comm_time_per_step(p.config, units, c, measured, algorithm::hierarchical);
  }
  return r;
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
