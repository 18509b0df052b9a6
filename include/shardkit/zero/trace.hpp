//! \file zero/trace.hpp
//! The ZeRO-3 timeline: when each unit's all-gather was issued and completed, when its compute
//! started and ended, when its gradients' reduce-scatter was issued and when its gathered
//! parameters were released. Recorded by shard_params (engine_options::trace) and read with
//! engine::trace(), to check that prefetching overlaps compute.
#pragma once

#include <shardkit/config.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! One entry of the ZeRO-3 timeline (engine_options::trace).
struct trace_event {
  enum class kind : std::uint8_t {
    gather_issued,     //!< all-gather of the unit started (on demand or as a prefetch)
    gather_completed,  //!< the all-gather finished (communicator's completion time)
    compute_started,   //!< pre_forward/pre_backward returned: the unit's parameters are usable
    compute_ended,     //!< post_forward/post_backward called
    grads_reduced,     //!< the unit's gradient reduce-scatter was issued
    released,          //!< the gathered parameters were freed
  };
  kind what;
  std::size_t unit;
  bool backward;  //!< in the backward phase
  std::chrono::steady_clock::time_point time;
};

//! A timeline that records only when enabled.
class trace_log {
 public:
  explicit trace_log(bool enabled = false) noexcept : enabled_(enabled) {}

  bool enabled() const noexcept { return enabled_; }
  void note(trace_event::kind k, std::size_t unit, bool backward,
            std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now()) {
    if (enabled_) events_.push_back(trace_event{k, unit, backward, t});
  }
  const std::vector<trace_event>& events() const noexcept { return events_; }
  void clear() noexcept { events_.clear(); }

 private:
  bool enabled_ = false;
  std::vector<trace_event> events_;
};

SHARDKIT_NAMESPACE_END
