//! \file plan/memory.hpp
//! Bytes one rank holds, by ledger category (core/ledger.hpp), for ZeRO stages 0-3 and hybrid
//! sharding, with the exact padding of core/layout.hpp. docs/accounting.md states the rules;
//! the tests check them byte for byte against the engine's memory ledger.
//!
//! w, g = bytes per working parameter / gradient element, m = master bytes (4 or 0), k = optimizer
//! state bytes per element; G = ranks a group is sharded over (N, or the hybrid shard group);
//! S = Σ_g S_g; B = grad_buffers; k_mb = micro-batches. Persistent model state:
//!
//!   | stage | working params | grads | master | optimizer state |
//!   |-------|----------------|-------|--------|-----------------|
//!   | 0     | w·Ψ            | g·Ψ   | m·Ψ    | k·Ψ             |
//!   | 1     | w·G·S          | g·G·S | m·S    | k·S             |
//!   | 2     | w·G·S          | g·S   | m·S    | k·S             |
//!   | 3     | w·S            | g·S   | m·S    | k·S             |
//!
//! Transient (their peaks):
//!  - grad_buckets (stages 2, 3): B · g·G·max_g S_g.
//!  - comm_scratch (stages 2, 3, only with k_mb ≥ 2): the reduce-scatter target of later
//!    micro-batches, one slice of g·max_g S_g for each staging buffer that ever receives one.
//!    Buckets are handed over in backward order and take the staging buffers round-robin, so
//!    that is min(B, (k_mb − 1)·U) buffers, U = groups with Ψ_g > 0.
//!  - gathered_params (stage 3): w·G·L elements, L = live_elems() below: the bound on what is
//!    gathered at once.
//!  - activations: as given in setup::activation_bytes.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/plan/formulas.hpp>
#include <shardkit/plan/model.hpp>
#include <shardkit/zero/accounting.hpp>

#include <algorithm>
#include <cstdint>
#include <span>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

//! Bytes one rank holds per ledger category. The first four are the persistent model state
//! (ledger `current`); the others are peaks of transient buffers.
struct memory_bytes {
  std::uint64_t working_params = 0;     //!< memory_category::working_params
  std::uint64_t grads = 0;              //!< memory_category::grads
  std::uint64_t master_params = 0;      //!< memory_category::master_params
  std::uint64_t optimizer_moments = 0;  //!< memory_category::optimizer_moments
  std::uint64_t gathered_params = 0;    //!< memory_category::gathered_params (ZeRO-3 bound)
  std::uint64_t grad_buckets = 0;       //!< memory_category::grad_buckets (peak)
  std::uint64_t comm_scratch = 0;       //!< memory_category::comm_scratch (peak)
  std::uint64_t activations = 0;        //!< given by the user; not in the engine's ledger

  //! The persistent model state (what plan/formulas.hpp's model_state_bytes() returns).
  constexpr state_bytes model_state() const noexcept {
    return {working_params, grads, master_params, optimizer_moments};
  }
  //! Transient buffers of the library (gathered units, staging buckets, scratch).
  constexpr std::uint64_t transient() const {
    constexpr const char* what = "plan: transient bytes";
    return checked_add<std::uint64_t>(checked_add(gathered_params, grad_buckets, what),
                                      comm_scratch, what);
  }
  //! The peak per rank: every category at its peak at once. Exact for stages 0-2 (their
  //! buffers are allocated once and kept); an upper bound for stage 3.
  constexpr std::uint64_t total() const {
    constexpr const char* what = "plan: bytes per rank";
    return checked_add<std::uint64_t>(checked_add(model_state().total(), transient(), what),
                                      activations, what);
  }
  friend constexpr bool operator==(const memory_bytes&, const memory_bytes&) = default;
};

//! ZeRO-3: the most parameter elements gathered on a rank at once, as the engine is specified
//! to bound them (docs/accounting.md):
//!
//!     L = min(1 + D, U_t)·G·max S_u  +  Σ_{persistent} G·S_u  +  Σ_{kept} G·S_u
//!
//! D = prefetch depth; U_t = non-persistent units (at most 1 + D of them are gathered at a
//! time: the current one and D prefetched); persistent units (Ψ_u < persist_below) stay
//! gathered all step; "kept" = non-persistent units with reshard_after_forward = false, which
//! stay gathered from their forward to their backward. A live limit (max_live_elems) caps it:
//! the engine prefetches less rather than exceed the limit. 0 for stages 0-2.
constexpr std::uint64_t live_elems(const setup& s, const layout_summary& l) {
  if (s.stage != 3) return 0;
  constexpr const char* what = "plan: ZeRO-3 live elements";
  return accounting::live_elems_bound(s.prefetch, l.transient_units,
                                      checked_mul(l.ranks, l.largest_transient_shard, what),
                                      checked_mul(l.ranks, l.persistent_shard, what),
                                      checked_mul(l.ranks, l.kept_shard, what), s.max_live_elems);
}

//! As above, for a model.
constexpr std::uint64_t live_elems(const setup& s, std::span<const unit> units) {
  return live_elems(s, summarize(s, units));
}

//! ZeRO-3: true when the live limit (setup::max_live_elems) leaves room for the largest unit
//! next to the persistent and kept ones (always true without a limit and for stages 0-2). The
//! engine refuses a set-up whose largest unit and persistent units do not fit the limit, and a
//! gather that would exceed it while kept units are held.
constexpr bool live_limit_ok(const setup& s, const layout_summary& l) {
  if (s.stage != 3 || s.max_live_elems == 0) return true;
  constexpr const char* what = "plan: ZeRO-3 live elements";
  const std::uint64_t held = checked_add<std::uint64_t>(
      checked_add(l.largest_transient_shard, l.persistent_shard, what), l.kept_shard, what);
  return checked_mul(l.ranks, held, what) <= s.max_live_elems;
}

//! Bytes one rank holds for the layout `l` of setup `s` (see the file comment).
//! Raises size_overflow when a byte count does not fit in 64 bits.
constexpr memory_bytes memory_per_rank(const setup& s, const layout_summary& l) {
  constexpr const char* what = "plan: bytes per rank";
  const auto mul = [](std::uint64_t a, std::uint64_t b) {
    return checked_mul<std::uint64_t>(a, b, what);
  };
  const precision& p = s.bytes;
  const std::uint64_t S = l.shard;
  const state_bytes model = model_state_bytes(s.stage, l.psi, l.ranks, S, p);
  memory_bytes m;
  m.activations = s.activation_bytes;
  m.working_params = model.working_params;
  m.grads = model.grads;
  m.master_params = model.master_params;
  m.optimizer_moments = model.optimizer_moments;
  if (s.stage <= 1) return m;
  if (s.stage == 3) m.gathered_params = mul(p.working_bytes, live_elems(s, l));
  // Stages 2 and 3: staging buckets and micro-batch scratch.
  m.grad_buckets = mul(mul(s.grad_buffers, p.grad_bytes), mul(l.ranks, l.largest_shard));
  if (s.micro_batches > 1) {
    const std::uint64_t later_rounds = mul(s.micro_batches - 1, l.nonempty_groups);
    m.comm_scratch =
        mul(mul(std::min(s.grad_buffers, later_rounds), p.grad_bytes), l.largest_shard);
  }
  return m;
}

//! Bytes one rank holds for `units` under setup `s` (preconditions: invalid_reason(s) == nullptr).
constexpr memory_bytes memory_per_rank(const setup& s, std::span<const unit> units) {
  return memory_per_rank(s, summarize(s, units));
}

//! Bytes one rank holds for a model of `psi` elements in one unit.
constexpr memory_bytes memory_per_rank(const setup& s, std::uint64_t psi) {
  const unit one[1] = {unit{psi}};
  return memory_per_rank(s, std::span<const unit>(one));
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
