//! \file plan/offload.hpp
//! Bytes one rank holds with the optimizer offloaded to host memory (OffloadOptimizer,
//! zero/offload_optimizer.hpp; stages 1-3), on the device and on the host, and whether offload
//! is what makes a model fit. docs/accounting.md ("Offloading the optimizer") states the rules;
//! tests/plan checks them against the offloaded engine's two ledgers.
//!
//!   device: memory_per_rank() (plan/memory.hpp) without master_params and optimizer_moments
//!   host:   m·S master + k·S state + (g + w)·S staging      (accounting::offloaded_host_bytes)
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/plan/memory.hpp>
#include <shardkit/plan/model.hpp>
#include <shardkit/zero/accounting.hpp>

#include <cstdint>
#include <span>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

//! One rank's bytes with the optimizer offloaded.
struct offload_memory {
  memory_bytes device;                  //!< the engine's ledger (its memory space)
  accounting::offload_host_bytes host;  //!< the optimizer's ledger (host memory)
  friend constexpr bool operator==(const offload_memory&, const offload_memory&) = default;
};

//! Bytes one rank holds for the layout `l` of setup `s` (stage 1-3) with offload.
constexpr offload_memory offloaded_memory_per_rank(const setup& s, const layout_summary& l) {
  offload_memory m;
  m.device = memory_per_rank(s, l);
  m.device.master_params = 0;
  m.device.optimizer_moments = 0;
  m.host = accounting::offloaded_host_bytes(l.shard, s.bytes);
  return m;
}
constexpr offload_memory offloaded_memory_per_rank(const setup& s, std::span<const unit> units) {
  return offloaded_memory_per_rank(s, summarize(s, units));
}

//! What offload does for a device budget of `usable` bytes per rank and `host_usable` host bytes
//! per rank: whether the stage fits without it, with it, and so whether offload is what makes
//! it fit.
struct offload_verdict {
  bool fits_device = false;   //!< without offload
  bool fits_offload = false;  //!< with offload: device and host budgets both hold
  constexpr bool offload_makes_it_fit() const noexcept { return fits_offload && !fits_device; }
};
constexpr offload_verdict offload_fit(const setup& s, const layout_summary& l, std::uint64_t usable,
                                      std::uint64_t host_usable) {
  const offload_memory o = offloaded_memory_per_rank(s, l);
  return {memory_per_rank(s, l).total() <= usable,
          o.device.total() <= usable && o.host.total() <= host_usable};
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
