//! \file zero/accounting.hpp
//! The closed forms of what a ZeRO stage holds and sends, with shardkit's exact padding
//! (core/layout.hpp). One copy of them: the engine's reports (engine::expected_state_bytes(),
//! expected_step_bytes_sent(), gathered_bytes_bound()) and the planner (plan/) both compute
//! from these functions, and the tests check both against the ledgers and against the
//! specification (docs/accounting.md), written independently in the tests.
//!
//! Per rank, with w/g bytes per working parameter/gradient element, m = 4 bytes of fp32 master
//! weights (0 when training in fp32, where the working copy is the master), k = 4·states bytes
//! of optimizer state per element, G the ranks a group is sharded over (N, or the hybrid shard
//! group) and S = Σ_g S_g the rank's shard:
//!
//!   | stage | working params | grads   | master | optimizer state |
//!   |-------|----------------|---------|--------|-----------------|
//!   | 0     | w·Ψ            | g·Ψ     | m·Ψ    | k·Ψ             |
//!   | 1     | w·G·S          | g·G·S   | m·S    | k·S             |
//!   | 2     | w·G·S          | g·S     | m·S    | k·S             |
//!   | 3     | w·S            | g·S     | m·S    | k·S             |
//!
//! The collectives of one optimizer step (k micro-batches; groups with Ψ_g = 0 and groups of one
//! rank issue nothing; R = N/G replicas):
//!
//!   | stage | collectives                                                                  |
//!   |-------|------------------------------------------------------------------------------|
//!   | 0     | all-reduce of Ψ (all N ranks), once (micro-batches accumulate locally)       |
//!   | 1     | per group: reduce-scatter S_g + all-gather S_g, once                          |
//!   | 2     | per group: reduce-scatter S_g × k (every micro-batch) + all-gather S_g, once  |
//!   | 3     | per unit, transient: all-gather S_u × 2k (× k when kept from forward to       |
//!   |       | backward) + reduce-scatter S_u × k; persistent: one all-gather S_u per step   |
//!   |       | (after the optimizer) + reduce-scatter S_u × k                                |
//!   | 1-3, hybrid | one all-reduce of the S-element gradient shard across the R replicas      |
//!
//! Bytes sent are the ring volumes of comm/volume.hpp (reduce-scatter and all-reduce carry
//! gradients, g bytes; all-gathers carry working parameters, w bytes).
#pragma once

#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/checked.hpp>
#include <shardkit/core/ledger.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

SHARDKIT_NAMESPACE_BEGIN
namespace accounting {

//! Bytes per element of each kind of model state.
struct precision {
  std::uint64_t working_bytes = 2;  //!< working parameters (bf16/fp16: 2, fp32: 4)
  std::uint64_t grad_bytes = 2;     //!< gradients (their own type: may differ from the working)
  std::uint64_t master_bytes = 4;   //!< fp32 master copy (0 when the working copy is fp32)
  std::uint64_t state_bytes = 8;    //!< optimizer state (Adam: 8, SGD momentum: 4)

  //! Mixed precision (16-bit working copy and gradients, fp32 master) with `states` fp32
  //! optimizer states.
  static constexpr precision mixed(std::uint64_t states = 2) noexcept {
    return {2, 2, 4, 4 * states};
  }
  //! All fp32: the working copy is the master.
  static constexpr precision fp32(std::uint64_t states = 2) noexcept {
    return {4, 4, 0, 4 * states};
  }
  friend constexpr bool operator==(const precision&, const precision&) = default;
};

//! Model-state bytes held by one rank, by category.
struct state_bytes {
  std::uint64_t working_params = 0;
  std::uint64_t grads = 0;
  std::uint64_t master_params = 0;
  std::uint64_t optimizer_moments = 0;
  constexpr std::uint64_t total() const {
    constexpr const char* what = "model-state bytes";
    return checked_add<std::uint64_t>(checked_add(working_params, grads, what),
                                      checked_add(master_params, optimizer_moments, what), what);
  }
  friend constexpr bool operator==(const state_bytes&, const state_bytes&) = default;
};

//! S = round_up(ceil(Ψ/N), alignment): one group's per-rank shard.
//! Raises size_overflow when the rounded size does not fit in 64 bits.
constexpr std::uint64_t shard_elems(std::uint64_t psi, std::uint64_t ranks,
                                    std::uint64_t alignment = 1) {
  return checked_round_up<std::uint64_t>(ceil_div<std::uint64_t>(psi, ranks), alignment,
                                         "shard size round_up(ceil(psi / N), alignment)");
}

//! Bytes per rank for `stage` with Ψ true elements, G ranks per shard group and a total
//! per-rank shard of S elements (Σ over groups).
//! Raises size_overflow when a byte count does not fit in 64 bits.
constexpr state_bytes model_state_bytes(int stage, std::uint64_t psi, std::uint64_t ranks,
                                        std::uint64_t shard, precision p) {
  constexpr const char* what = "model-state bytes";
  const auto mul = [](std::uint64_t a, std::uint64_t b) {
    return checked_mul<std::uint64_t>(a, b, what);
  };
  const std::uint64_t full = mul(ranks, shard);
  state_bytes b;
  switch (stage) {
    case 0:
      b = {mul(p.working_bytes, psi), mul(p.grad_bytes, psi), mul(p.master_bytes, psi),
           mul(p.state_bytes, psi)};
      break;
    case 1:
      b = {mul(p.working_bytes, full), mul(p.grad_bytes, full), mul(p.master_bytes, shard),
           mul(p.state_bytes, shard)};
      break;
    case 2:
      b = {mul(p.working_bytes, full), mul(p.grad_bytes, shard), mul(p.master_bytes, shard),
           mul(p.state_bytes, shard)};
      break;
    default:
      b = {mul(p.working_bytes, shard), mul(p.grad_bytes, shard), mul(p.master_bytes, shard),
           mul(p.state_bytes, shard)};
  }
  (void)checked_add<std::uint64_t>(
      checked_add<std::uint64_t>(b.working_params, b.grads, what),
      checked_add<std::uint64_t>(b.master_params, b.optimizer_moments, what), what);
  return b;
}

//! ZeRO-3: the most parameter elements gathered at once,
//!     L = min(1 + D, U_t)·max transient unit + Σ persistent units + Σ kept units
//! each unit at its padded size G·S_u, capped by the live limit (0 = none).
constexpr std::uint64_t live_elems_bound(std::uint64_t prefetch, std::uint64_t transient_units,
                                         std::uint64_t largest_transient_padded,
                                         std::uint64_t persistent_padded, std::uint64_t kept_padded,
                                         std::uint64_t max_live_elems) {
  constexpr const char* what = "ZeRO-3 live-element bound";
  const std::uint64_t window =
      std::min<std::uint64_t>(checked_add<std::uint64_t>(1, prefetch, what), transient_units);
  const std::uint64_t bound = checked_add<std::uint64_t>(
      checked_add<std::uint64_t>(checked_mul(window, largest_transient_padded, what),
                                 persistent_padded, what),
      kept_padded, what);
  return max_live_elems != 0 ? std::min(bound, max_live_elems) : bound;
}

//! Which ranks a collective runs over.
enum class comm_group : std::uint8_t {
  world,    //!< all N ranks
  shard,    //!< the rank's shard group: G consecutive ranks (all N unless hybrid)
  replica,  //!< the ranks holding the same shard in the other replicas: R ranks, stride G
};

constexpr const char* name(comm_group g) noexcept {
  switch (g) {
    case comm_group::world:
      return "world";
    case comm_group::shard:
      return "shard";
    case comm_group::replica:
      return "replica";
  }
  return "unknown";
}

//! One collective of a step, issued `repeat` times.
struct collective_call {
  collective op;             //!< all_reduce, reduce_scatter or all_gather
  std::uint64_t count;       //!< elements, as NCCL counts them: per rank for reduce-scatter and
                             //!< all-gather, the whole array for all-reduce
  std::uint64_t elem_bytes;  //!< bytes per element on the wire
  comm_group group;          //!< the ranks taking part
  std::uint64_t repeat;      //!< times per optimizer step
  //! The engine issues it in place: the all-reduce on one buffer, the reduce-scatter into the
  //! rank's own slice of its input, the all-gather from the rank's own slice of its output.
  //! A host communicator's cost depends on it (an out-of-place output is a second array that
  //! is read before it is written); plan/time.hpp can give each placement its own link.
  bool in_place;
};

//! The shape of one stage's step: what the collectives depend on besides the groups.
struct step_shape {
  int stage = 0;
  std::uint64_t ranks = 1;          //!< N
  std::uint64_t shard_ranks = 1;    //!< G (stage 0: 1; without hybrid sharding: N)
  std::uint64_t psi = 0;            //!< Ψ
  std::uint64_t shard = 0;          //!< S = Σ_g S_g (stage 0: Ψ)
  std::uint64_t grad_bytes = 2;     //!< bytes per gradient element on the wire
  std::uint64_t working_bytes = 2;  //!< bytes per working-parameter element on the wire
  std::uint64_t micro_batches = 1;  //!< k

  constexpr std::uint64_t replicas() const noexcept {
    return stage == 0 || shard_ranks == 0 ? 1 : ranks / shard_ranks;
  }
};

//! One group (bucket or unit) as the step sees it.
struct group_shape {
  std::uint64_t numel = 0;            //!< Ψ_g
  std::uint64_t shard = 0;            //!< S_g
  bool persistent = false;            //!< ZeRO-3: stays gathered all step
  bool reshard_after_forward = true;  //!< ZeRO-3: released after its forward
};

//! Calls f(collective_call) for every collective a rank issues in one optimizer step (see the
//! file comment). The groups are group(0), ..., group(groups - 1), each a group_shape (for
//! stages 0 and 1 they are not read: one group of all Ψ elements and S = shape.shard).
template <class GroupAt, class F>
constexpr void for_each_step_collective(const step_shape& s, std::size_t groups, GroupAt&& group,
                                        F&& f) {
  const std::uint64_t k = s.micro_batches;
  const std::uint64_t eg = s.grad_bytes, ew = s.working_bytes;
  const bool sharded = s.shard_ranks > 1;
  auto each = [&](collective op, std::uint64_t count, std::uint64_t e, comm_group g,
                  std::uint64_t repeat, bool in_place) {
    if (repeat != 0 && count != 0) f(collective_call{op, count, e, g, repeat, in_place});
  };
  // In place: stage 0's all-reduce of the flat gradients, stage 1's reduce-scatter of them into
  // the rank's slice, stages 1-2's all-gather of the working parameters from the rank's slice,
  // the replica all-reduce of the gradient shard. Out of place: stage 2's reduce-scatter of a
  // bucket into the shard, stage 3's gathers into a unit's buffer and its reduce-scatters.
  if (s.stage == 0) {
    if (s.ranks > 1) each(collective::all_reduce, s.psi, eg, comm_group::world, 1, true);
    return;
  }
  auto per_group = [&](auto&& fn) {
    if (s.stage == 1) {
      fn(s.shard);
    } else {
      for (std::size_t i = 0; i < groups; ++i) fn(group_shape(group(i)).shard);
    }
  };
  const std::uint64_t rounds = s.stage == 1 ? 1 : k;  // stage 2 reduces every micro-batch
  if (s.stage <= 2 && sharded) {
    per_group([&](std::uint64_t sg) {
      each(collective::reduce_scatter, sg, eg, comm_group::shard, rounds, s.stage == 1);
    });
  }
  if (s.stage == 3 && sharded) {
    for (std::size_t i = 0; i < groups; ++i) {
      const group_shape g = group(i);
      const std::uint64_t gathers = g.persistent ? 1 : (g.reshard_after_forward ? 2 * k : k);
      each(collective::all_gather, g.shard, ew, comm_group::shard, gathers, false);
      each(collective::reduce_scatter, g.shard, eg, comm_group::shard, k, false);
    }
  }
  if (s.replicas() > 1) each(collective::all_reduce, s.shard, eg, comm_group::replica, 1, true);
  if (s.stage <= 2 && sharded) {
    per_group([&](std::uint64_t sg) {
      each(collective::all_gather, sg, ew, comm_group::shard, 1, true);
    });
  }
}

//! Ranks in group `g`, and the position of world rank `rank` in it (rank = replica·G + index in
//! its shard group).
constexpr std::uint64_t group_size(const step_shape& s, comm_group g) noexcept {
  switch (g) {
    case comm_group::world:
      return s.ranks;
    case comm_group::shard:
      return s.shard_ranks;
    case comm_group::replica:
      return s.replicas();
  }
  return 1;
}
constexpr std::uint64_t group_rank(const step_shape& s, comm_group g, std::uint64_t rank) noexcept {
  const std::uint64_t G = s.shard_ranks;
  switch (g) {
    case comm_group::world:
      return rank;
    case comm_group::shard:
      return G == 0 ? 0 : rank % G;
    case comm_group::replica:
      return G == 0 ? 0 : rank / G;
  }
  return 0;
}

//! Bytes world rank `rank` sends in one collective call of a step.
constexpr std::uint64_t bytes_of(const step_shape& s, const collective_call& c,
                                 std::uint64_t rank) noexcept {
  return ring_bytes_sent(c.op, c.count, c.elem_bytes, group_size(s, c.group),
                         group_rank(s, c.group, rank));
}

//! Bytes world rank `rank` sends in one optimizer step (groups as for_each_step_collective).
template <class GroupAt>
constexpr std::uint64_t step_bytes_sent(const step_shape& s, std::size_t groups, GroupAt&& group,
                                        std::uint64_t rank) noexcept {
  std::uint64_t total = 0;
  for_each_step_collective(s, groups, group, [&](const collective_call& c) {
    total += c.repeat * bytes_of(s, c, rank);
  });
  return total;
}

//! Host bytes one rank holds with the optimizer offloaded (OffloadOptimizer, stages 1-3): the
//! fp32 master m·S, the optimizer state k·S, and the host copies of the gradient and working
//! shards the step moves (g·S + w·S, ledger category offload_staging). The device then holds
//! model_state_bytes() without master and state, plus its usual transient buffers.
struct offload_host_bytes {
  std::uint64_t master_params = 0;
  std::uint64_t optimizer_moments = 0;
  std::uint64_t staging = 0;
  constexpr std::uint64_t total() const {
    constexpr const char* what = "offloaded host bytes";
    return checked_add<std::uint64_t>(checked_add(master_params, optimizer_moments, what), staging,
                                      what);
  }
  friend constexpr bool operator==(const offload_host_bytes&, const offload_host_bytes&) = default;
};

//! As above, for a rank's shard of S elements. Raises size_overflow past 64 bits.
constexpr offload_host_bytes offloaded_host_bytes(std::uint64_t shard, precision p) {
  constexpr const char* what = "offloaded host bytes";
  return {
      checked_mul<std::uint64_t>(p.master_bytes, shard, what),
      checked_mul<std::uint64_t>(p.state_bytes, shard, what),
      checked_mul<std::uint64_t>(checked_add(p.grad_bytes, p.working_bytes, what), shard, what)};
}

}  // namespace accounting
SHARDKIT_NAMESPACE_END
