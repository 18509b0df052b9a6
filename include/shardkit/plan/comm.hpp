//! \file plan/comm.hpp
//! The collectives one rank issues in one optimizer step, and the bytes it sends in them: the
//! ring volumes of comm/volume.hpp, the numbers the engine's traffic ledger records.
//!
//! One list of collectives (`for_each_collective`) is the single source of both the byte counts
//! here and the time model of plan/time.hpp. Per step, with k micro-batches, G the shard group
//! (N unless hybrid), R = N/G replicas, S_g per-rank slices and S = Σ_g S_g; groups with Ψ_g = 0
//! and groups of one rank issue nothing:
//!
//!   | stage | collectives (group)                                                          |
//!   |-------|------------------------------------------------------------------------------|
//!   | 0     | all-reduce of Ψ (all N ranks), once (micro-batches accumulate locally)       |
//!   | 1     | per group: reduce-scatter S_g (shard) + all-gather S_g (shard), once          |
//!   | 2     | per group: reduce-scatter S_g × k (each micro-batch) + all-gather S_g, once   |
//!   | 3     | per unit, non-persistent: all-gather S_u × 2k (forward and backward; × k when |
//!   |       | reshard_after_forward = false) + reduce-scatter S_u × k; persistent: one      |
//!   |       | all-gather S_u per step (after the optimizer) + reduce-scatter S_u × k        |
//!   | 1-3, hybrid | in addition one all-reduce of the S-element gradient shard across the R   |
//!   |       | replicas (replica group), once per step                                       |
//!
//! Bytes sent by a rank (e = gradient bytes for reduce-scatter and all-reduce, working bytes for
//! all-gather): reduce-scatter and all-gather (P−1)·c·e over P ranks; all-reduce of n elements
//! (2n − n_r − n_{r+1})·e with the near-equal chunks n_q of comm/volume.hpp, r the rank's
//! position in the group. Rank placement: rank = replica·G + index in its shard group, so the
//! shard groups are G consecutive ranks and a replica group is every G-th rank.
//!
//! Stage 0 sends 2(N−1)/N·e·Ψ (N | Ψ), stages 1-2 2(N−1)·e·S, stage 3 without persistent units
//! 3(N−1)·e·S: the 1 : 1 : 1.5 of docs/accounting.md.
#pragma once

#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/plan/model.hpp>
#include <shardkit/zero/accounting.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

using accounting::collective_call;
using accounting::comm_group;
using accounting::name;

//! The step shape of setup `s` for a layout summarised as `l` (zero/accounting.hpp).
constexpr accounting::step_shape step_shape_of(const setup& s, const layout_summary& l) {
  accounting::step_shape sh;
  sh.stage = s.stage;
  sh.ranks = s.ranks;
  sh.shard_ranks = s.shard_group();
  sh.psi = l.psi;
  sh.shard = l.shard;
  sh.grad_bytes = s.bytes.grad_bytes;
  sh.working_bytes = s.bytes.working_bytes;
  sh.micro_batches = s.micro_batches;
  return sh;
}

//! Ranks in group `g` of setup `s`.
constexpr std::uint64_t group_size(const setup& s, comm_group g) noexcept {
  return accounting::group_size(step_shape_of(s, {}), g);
}

//! Position of `rank` within its group `g` (ring order: rank = replica·G + index in its shard
//! group).
constexpr std::uint64_t group_rank(const setup& s, comm_group g, std::uint64_t rank) noexcept {
  return accounting::group_rank(step_shape_of(s, {}), g, rank);
}

//! Calls f(collective_call) for every collective a rank issues in one optimizer step of stage
//! `s.stage` (see the file comment): zero/accounting.hpp's list, the one the engine reports.
template <class F>
constexpr void for_each_collective(const setup& s, std::span<const unit> units, F&& f) {
  const layout_summary l = summarize(s, units);
  const std::uint64_t G = l.ranks;
  auto group = [&](std::size_t i) {
    const unit& u = units[i];
    return accounting::group_shape{u.numel, group_shard(u.numel, G, s.alignment),
                                   u.numel < s.persist_below, u.reshard_after_forward};
  };
  accounting::for_each_step_collective(step_shape_of(s, l), units.size(), group, f);
}

//! Bytes one rank sends per optimizer step, and the collectives it issues, per kind.
struct comm_bytes {
  std::uint64_t all_reduce = 0;      //!< bytes sent in all-reduces
  std::uint64_t reduce_scatter = 0;  //!< bytes sent in reduce-scatters
  std::uint64_t all_gather = 0;      //!< bytes sent in all-gathers
  std::uint64_t all_reduce_calls = 0;
  std::uint64_t reduce_scatter_calls = 0;
  std::uint64_t all_gather_calls = 0;

  //! Bytes sent per step, all collectives (what engine::step() reports as bytes_sent).
  constexpr std::uint64_t total() const noexcept {
    return all_reduce + reduce_scatter + all_gather;
  }
  //! Collectives issued per step.
  constexpr std::uint64_t calls() const noexcept {
    return all_reduce_calls + reduce_scatter_calls + all_gather_calls;
  }
  //! Bytes of collective `c` (0 for the ones ZeRO does not use).
  constexpr std::uint64_t bytes(collective c) const noexcept {
    return c == collective::all_reduce       ? all_reduce
           : c == collective::reduce_scatter ? reduce_scatter
           : c == collective::all_gather     ? all_gather
                                             : 0;
  }
  //! Calls of collective `c`.
  constexpr std::uint64_t calls(collective c) const noexcept {
    return c == collective::all_reduce       ? all_reduce_calls
           : c == collective::reduce_scatter ? reduce_scatter_calls
           : c == collective::all_gather     ? all_gather_calls
                                             : 0;
  }
  friend constexpr bool operator==(const comm_bytes&, const comm_bytes&) = default;
};

//! Bytes rank `rank` sends in one optimizer step (preconditions: invalid_reason(s) == nullptr,
//! rank < s.ranks). Ranks differ only in all-reduces whose length their group size does not
//! divide.
constexpr comm_bytes bytes_sent_per_step(const setup& s, std::span<const unit> units,
                                         std::uint64_t rank = 0) {
  comm_bytes b;
  for_each_collective(s, units, [&](const collective_call& c) {
    const std::uint64_t p = group_size(s, c.group);
    const std::uint64_t once =
        ring_bytes_sent(c.op, c.count, c.elem_bytes, p, group_rank(s, c.group, rank));
    switch (c.op) {
      case collective::all_reduce:
        b.all_reduce += c.repeat * once;
        b.all_reduce_calls += c.repeat;
        break;
      case collective::reduce_scatter:
        b.reduce_scatter += c.repeat * once;
        b.reduce_scatter_calls += c.repeat;
        break;
      default:
        b.all_gather += c.repeat * once;
        b.all_gather_calls += c.repeat;
        break;
    }
  });
  return b;
}

//! As above, for a model of `psi` elements in one unit.
constexpr comm_bytes bytes_sent_per_step(const setup& s, std::uint64_t psi,
                                         std::uint64_t rank = 0) {
  const unit one[1] = {unit{psi}};
  return bytes_sent_per_step(s, std::span<const unit>(one), rank);
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
