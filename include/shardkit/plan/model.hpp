//! \file plan/model.hpp
//! What the planner is told: the model (a list of units or buckets), the training precision and
//! optimizer, and the set-up of a ZeRO stage (ranks, hybrid shard group, alignment, staging
//! buffers, micro-batches, ZeRO-3 prefetch and persistence). From these, `summarize()` derives
//! the flat layout's sizes exactly as core/layout.hpp builds them:
//!
//!     S_g = round_up(ceil(Ψ_g / G), alignment),   S = Σ_g S_g,   full buffer = G·S elements
//!
//! where G is the number of ranks a group is sharded over: N, or the shard group of hybrid
//! sharding. Which groups a stage uses follows the engine (docs/accounting.md):
//!  - stage 0: one group, unsharded and unpadded (S = Ψ);
//!  - stage 1: one group of all Ψ elements;
//!  - stage 2: the model's units as gradient buckets (see `buckets()` for size-based buckets);
//!  - stage 3: the model's units (gathered and freed one at a time).
//!
//! Everything here is constexpr; a model is a `std::span<const unit>` (a constexpr array works).
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/plan/formulas.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

//! One group of the flat layout: a ZeRO-3 unit (one layer or block) or a ZeRO-2 bucket.
struct unit {
  std::uint64_t numel = 0;  //!< Ψ_u: true elements (parameters) of the unit
  //! ZeRO-3: free the gathered parameters after the unit's forward and gather them again for
  //! its backward (true), or keep them gathered from forward to backward (false).
  bool reshard_after_forward = true;
  friend constexpr bool operator==(const unit&, const unit&) = default;
};

//! The optimizers shardkit ships, by the number of fp32 state values they keep per element.
enum class optimizer_kind : std::uint8_t {
  adamw,         //!< AdamW: m and v (2 states)
  adam,          //!< Adam with L2 weight decay: m and v (2 states)
  sgd_momentum,  //!< SGD with heavy-ball momentum: one state
};

//! fp32 state values per parameter element (as `Optimizer::state_count` in kernels/math.hpp).
constexpr std::uint64_t state_count(optimizer_kind o) noexcept {
  return o == optimizer_kind::sgd_momentum ? 1 : 2;
}

//! The optimizer's name as the engine's policies spell it ("adamw", "adam", "sgd_momentum").
constexpr const char* name(optimizer_kind o) noexcept {
  switch (o) {
    case optimizer_kind::adamw:
      return "adamw";
    case optimizer_kind::adam:
      return "adam";
    case optimizer_kind::sgd_momentum:
      return "sgd_momentum";
  }
  return "unknown";
}

//! Bytes per element for training with `working` parameters and gradients of their own type
//! `grad` (each fp32, bf16 or fp16) and an optimizer of `states` fp32 states: 16-bit working
//! parameters keep a 4-byte fp32 master copy, fp32 ones do not (the working copy is the master),
//! whatever the gradient type. Same as engine<Comm, Policies, Working, Optimizer, Grad>::
//! precision(); bf16 working parameters with fp32 gradients are {2, 4, 4, 4·states}.
constexpr precision precision_of(dtype working, dtype grad, std::uint64_t states) noexcept {
  return {size_of(working), size_of(grad), working == dtype::f32 ? 0u : 4u, 4 * states};
}

//! As above, with the optimizer named.
constexpr precision precision_of(dtype working, dtype grad, optimizer_kind o) noexcept {
  return precision_of(working, grad, state_count(o));
}

//! Gradients of the working type (the engine's default).
constexpr precision precision_of(dtype working, std::uint64_t states) noexcept {
  return precision_of(working, working, states);
}

//! As above, with the optimizer named.
constexpr precision precision_of(dtype working, optimizer_kind o) noexcept {
  return precision_of(working, working, state_count(o));
}

//! How one ZeRO stage is run. Sizes are in elements unless the name says bytes.
struct setup {
  //! ZeRO stage, 0-3.
  int stage = 0;
  //! N: data-parallel ranks.
  std::uint64_t ranks = 1;
  //! Hybrid sharding (stages 1-3): G ranks per shard group, the model replicated over N/G
  //! groups. 0 (or N) = plain ZeRO over all N ranks.
  std::uint64_t shard_ranks = 0;
  //! Each rank's slice of a group is rounded up to a multiple of this many elements.
  std::uint64_t alignment = 1;
  //! Bytes per element of each kind of state (precision_of(dtype, optimizer)).
  precision bytes = precision::mixed();
  //! Stages 2-3: full-size gradient staging buffers (engine_options::grad_buffers).
  std::uint64_t grad_buffers = 1;
  //! k: forward/backward passes (micro-batches) per optimizer step.
  std::uint64_t micro_batches = 1;
  //! ZeRO-3: D, units gathered ahead of the one in use.
  std::uint64_t prefetch = 1;
  //! ZeRO-3: units with Ψ_u < persist_below elements stay gathered for the whole step.
  std::uint64_t persist_below = 0;
  //! ZeRO-3: limit on the elements gathered at once (0 = none).
  std::uint64_t max_live_elems = 0;
  //! Activation bytes per rank, as the user estimates them (not modelled by shardkit).
  std::uint64_t activation_bytes = 0;

  //! G: ranks one group is sharded over (N unless hybrid; 1 for stage 0, which shards nothing).
  constexpr std::uint64_t shard_group() const noexcept {
    if (stage == 0) return 1;
    return shard_ranks == 0 ? ranks : shard_ranks;
  }
  //! R: replicas of each shard (N/G for hybrid sharding, else 1; stage 0: N full replicas, but
  //! its gradients are all-reduced over all N ranks at once, see comm.hpp).
  constexpr std::uint64_t replicas() const noexcept {
    const std::uint64_t g = shard_group();
    return stage == 0 || g == 0 ? 1 : ranks / g;
  }
  //! True when stages 1-3 shard over fewer ranks than N (HSDP / ZeRO++ hpZ).
  constexpr bool hybrid() const noexcept { return stage != 0 && replicas() > 1; }
};

//! Why `s` cannot be planned, or nullptr when it can. constexpr (usable in static_assert).
constexpr const char* invalid_reason(const setup& s) noexcept {
  if (s.stage < 0 || s.stage > 3) return "stage must be 0, 1, 2 or 3";
  if (s.ranks == 0) return "ranks must be at least 1";
  if (s.shard_ranks != 0 && s.ranks % s.shard_ranks != 0) {
    return "the hybrid shard group (shard_ranks) must divide the number of ranks";
  }
  if (s.alignment == 0) return "alignment must be at least 1 element";
  if (s.grad_buffers == 0) return "grad_buffers must be at least 1";
  if (s.micro_batches == 0) return "micro_batches must be at least 1";
  return nullptr;
}

//! Raises shardkit::invalid_argument naming what is wrong with `s` and the value given.
inline void validate(const setup& s) {
  if (const char* why = invalid_reason(s)) {
    detail::raise("plan::setup: ", why, " (stage ", s.stage, ", ranks ", s.ranks, ", shard_ranks ",
                  s.shard_ranks, ", alignment ", s.alignment, ", grad_buffers ", s.grad_buffers,
                  ", micro_batches ", s.micro_batches, ")");
  }
}

//! The sizes of the flat layout one stage builds for a model (elements, per rank of a shard
//! group of G ranks). ZeRO-3 fields are filled for every stage; only stage 3 uses them.
struct layout_summary {
  std::uint64_t psi = 0;              //!< Ψ: true elements of the model
  std::uint64_t groups = 0;           //!< groups (buckets or units) of the stage
  std::uint64_t nonempty_groups = 0;  //!< groups with Ψ_g > 0 (the ones collectives touch)
  std::uint64_t ranks = 1;            //!< G: ranks each group is sharded over
  std::uint64_t shard = 0;            //!< S = Σ_g S_g (stage 0: Ψ)
  std::uint64_t largest_shard = 0;    //!< max_g S_g
  // ZeRO-3 (persistent: Ψ_u < persist_below)
  std::uint64_t persistent_units = 0;         //!< units that stay gathered all step
  std::uint64_t persistent_shard = 0;         //!< Σ S_u over persistent units
  std::uint64_t transient_units = 0;          //!< non-persistent units
  std::uint64_t largest_transient_shard = 0;  //!< max S_u over non-persistent units
  std::uint64_t kept_shard = 0;  //!< Σ S_u over non-persistent units without resharding

  //! Elements of the full (padded) buffer: G·S.
  constexpr std::uint64_t padded() const noexcept { return ranks * shard; }
  //! Padding elements: G·S − Ψ.
  constexpr std::uint64_t padding() const noexcept { return padded() - psi; }
};

//! S_g = round_up(ceil(Ψ_g / G), alignment) for one group (G ≥ 1, alignment ≥ 1).
constexpr std::uint64_t group_shard(std::uint64_t psi_g, std::uint64_t g,
                                    std::uint64_t alignment) noexcept {
  return shard_elems(psi_g, g, alignment);
}

//! The layout stage `s.stage` builds for `units` (preconditions: invalid_reason(s) == nullptr).
constexpr layout_summary summarize(const setup& s, std::span<const unit> units) noexcept {
  layout_summary l;
  l.ranks = s.shard_group();
  std::uint64_t psi = 0;
  for (const auto& u : units) psi += u.numel;
  l.psi = psi;
  if (s.stage <= 1) {  // one group for the whole model
    l.groups = 1;
    l.nonempty_groups = psi != 0 ? 1 : 0;
    l.shard = s.stage == 0 ? psi : group_shard(psi, l.ranks, s.alignment);
    l.largest_shard = l.shard;
    return l;
  }
  for (const auto& u : units) {
    const std::uint64_t su = group_shard(u.numel, l.ranks, s.alignment);
    ++l.groups;
    if (u.numel != 0) ++l.nonempty_groups;
    l.shard += su;
    l.largest_shard = std::max(l.largest_shard, su);
    if (u.numel < s.persist_below) {
      ++l.persistent_units;
      l.persistent_shard += su;
    } else {
      ++l.transient_units;
      l.largest_transient_shard = std::max(l.largest_transient_shard, su);
      if (!u.reshard_after_forward) l.kept_shard += su;
    }
  }
  return l;
}

//! Gradient buckets as the engine closes them for `engine_options::bucket_elems` (stage 2):
//! greedily from the last parameter backwards, a bucket closing once it holds at least
//! `bucket_elems` elements; the first bucket takes what is left. bucket_elems = 0: one bucket.
//! `param_numels` are the parameters' sizes in registration order.
constexpr std::vector<unit> buckets(std::span<const std::uint64_t> param_numels,
                                    std::uint64_t bucket_elems) {
  std::vector<unit> rev;
  std::uint64_t acc = 0;
  for (std::size_t i = param_numels.size(); i-- > 0;) {
    acc += param_numels[i];
    if (bucket_elems != 0 && acc >= bucket_elems && i != 0) {
      rev.push_back(unit{acc});
      acc = 0;
    }
  }
  rev.push_back(unit{acc});
  return {rev.rbegin(), rev.rend()};
}

//! A model of Ψ elements cut into units of `largest` elements and one last unit of the rest
//! (what a user knows before the model exists: its size and its largest block). largest = 0 or
//! ≥ Ψ: one unit.
constexpr std::vector<unit> uniform_units(std::uint64_t psi, std::uint64_t largest) {
  std::vector<unit> u;
  if (largest == 0 || largest >= psi) {
    u.push_back(unit{psi});
    return u;
  }
  u.assign(psi / largest, unit{largest});
  if (psi % largest != 0) u.push_back(unit{psi % largest});
  return u;
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
