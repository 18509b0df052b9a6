//! \file zero/policies.hpp
//! The ZeRO policies and their composition. A stage is a set of policies chosen at compile time:
//!
//!   | stage | policies                                  | sharded                         |
//!   |-------|-------------------------------------------|---------------------------------|
//!   | 0     | policies<>                                | nothing (plain data parallel)   |
//!   | 1     | policies<ShardOptimizer>                  | optimizer state (+ fp32 master) |
//!   | 2     | policies<ShardOptimizer, ShardGrads>      | + gradients                     |
//!   | 3     | policies<ShardOptimizer, ShardGrads,      | + parameters                    |
//!   |       |          ShardParams>                     |                                 |
//!
//! The order of the policies does not matter. Sets that make no sense (gradients sharded while
//! the optimizer that consumes them is not, a policy given twice, a type that is not a policy)
//! stop compilation with a static_assert that says why.
#pragma once

#include <shardkit/config.hpp>

#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN

//! ZeRO-1: each rank keeps the optimizer state (and fp32 master weights) of its shard only.
struct ShardOptimizer {
  static constexpr const char* name = "ShardOptimizer";
};
//! ZeRO-2: gradients are reduce-scattered into a per-rank gradient shard, bucket by bucket.
struct ShardGrads {
  static constexpr const char* name = "ShardGrads";
};
//! ZeRO-3: each rank keeps only its shard of the parameters; units are gathered around use.
struct ShardParams {
  static constexpr const char* name = "ShardParams";
};
//! The sharded optimizer's master and state in host memory, its step on the host
//! (zero/offload_optimizer.hpp). Stages 1-3.
struct OffloadOptimizer {
  static constexpr const char* name = "OffloadOptimizer";
};

template <class P>
inline constexpr bool is_zero_policy =
    std::is_same_v<P, ShardOptimizer> || std::is_same_v<P, ShardGrads> ||
    std::is_same_v<P, ShardParams> || std::is_same_v<P, OffloadOptimizer>;

//! A set of ZeRO policies; see the file comment for the valid sets.
template <class... Ps>
struct policies {
  static_assert((is_zero_policy<Ps> && ...),
                "shardkit::policies<...>: every argument must be one of ShardOptimizer, "
                "ShardGrads, ShardParams, OffloadOptimizer");

  static constexpr int count_optimizer = (0 + ... + std::is_same_v<Ps, ShardOptimizer>);
  static constexpr int count_grads = (0 + ... + std::is_same_v<Ps, ShardGrads>);
  static constexpr int count_params = (0 + ... + std::is_same_v<Ps, ShardParams>);
  static constexpr int count_offload = (0 + ... + std::is_same_v<Ps, OffloadOptimizer>);

  static_assert(count_optimizer <= 1 && count_grads <= 1 && count_params <= 1 && count_offload <= 1,
                "shardkit::policies<...>: a policy is listed twice");

  static constexpr bool shard_optimizer = count_optimizer == 1;
  static constexpr bool shard_grads = count_grads == 1;
  static constexpr bool shard_params = count_params == 1;
  static constexpr bool offload_optimizer = count_offload == 1;

  static_assert(!shard_grads || shard_optimizer,
                "shardkit::policies<...>: ShardGrads needs ShardOptimizer. Sharded gradients "
                "(ZeRO-2) feed a sharded optimizer step (ZeRO-1); an unsharded optimizer would "
                "need the full gradient that ShardGrads no longer keeps");
  static_assert(!shard_params || (shard_optimizer && shard_grads),
                "shardkit::policies<...>: ShardParams needs ShardOptimizer and ShardGrads. "
                "ZeRO-3 shards parameters on top of ZeRO-2 (sharded optimizer state and "
                "gradients): use policies<ShardOptimizer, ShardGrads, ShardParams> (zero3)");

  static_assert(!offload_optimizer || shard_optimizer,
                "shardkit::policies<...>: OffloadOptimizer needs ShardOptimizer. Offload moves "
                "the optimizer's shard to the host (stages 1-3); at stage 0 every rank would "
                "copy and step the whole model: use zero1_offload, zero2_offload or "
                "zero3_offload");

  //! The ZeRO stage this set implements (0-3).
  static constexpr int stage = shard_params ? 3 : shard_grads ? 2 : shard_optimizer ? 1 : 0;
};

template <class T>
inline constexpr bool is_policy_set = false;
template <class... Ps>
inline constexpr bool is_policy_set<policies<Ps...>> = true;

using zero0 = policies<>;
using zero1 = policies<ShardOptimizer>;
using zero2 = policies<ShardOptimizer, ShardGrads>;
using zero3 = policies<ShardOptimizer, ShardGrads, ShardParams>;
//! Stages 1-3 with the optimizer's master, state and step in host memory.
using zero1_offload = policies<ShardOptimizer, OffloadOptimizer>;
using zero2_offload = policies<ShardOptimizer, ShardGrads, OffloadOptimizer>;
using zero3_offload = policies<ShardOptimizer, ShardGrads, ShardParams, OffloadOptimizer>;

namespace detail {
template <int N>
struct stage_policies {
  static_assert(N >= 0 && N <= 3, "shardkit::stage<N>: N must be 0, 1, 2 or 3");
  using type = zero0;
};
template <>
struct stage_policies<1> {
  using type = zero1;
};
template <>
struct stage_policies<2> {
  using type = zero2;
};
template <>
struct stage_policies<3> {
  using type = zero3;
};
}  // namespace detail

//! The policy set of ZeRO stage N.
template <int N>
using stage = typename detail::stage_policies<N>::type;

SHARDKIT_NAMESPACE_END
