//! \file plan/formulas.hpp
//! The closed forms of one ZeRO stage for a model of one group, as the planner names them. They
//! are zero/accounting.hpp's (the one copy the engine's reports also use), re-exported here
//! with the single-group conveniences the planner and its users call:
//!
//!   | stage | working params | grads   | master | optimizer state |
//!   |-------|----------------|---------|--------|-----------------|
//!   | 0     | w·Ψ            | g·Ψ     | m·Ψ    | k·Ψ             |
//!   | 1     | w·N·S          | g·N·S   | m·S    | k·S             |
//!   | 2     | w·N·S          | g·S     | m·S    | k·S             |
//!   | 3     | w·S            | g·S     | m·S    | k·S             |
//!
//! Bytes sent per rank per step (e bytes per element, one group):
//!   stage 0: all-reduce of Ψ elements (comm/volume.hpp; 2(N-1)/N·eΨ when N divides Ψ)
//!   stage 1, 2: reduce-scatter + all-gather: 2·(N-1)·S·e
//!   stage 3: two all-gathers + one reduce-scatter: 3·(N-1)·S·e
//! docs/accounting.md states them with the worked numbers. The planner generalises them to
//! several units or buckets, staging buffers, micro-batches, ZeRO-3 prefetch and persistence,
//! hybrid sharding and a time model: plan/planner.hpp (with plan/model.hpp, memory.hpp,
//! comm.hpp, time.hpp); on one group it gives the same numbers.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/zero/accounting.hpp>

#include <cstdint>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

using accounting::model_state_bytes;
using accounting::precision;
using accounting::shard_elems;
using accounting::state_bytes;

//! Bytes rank `rank` sends in one optimizer step of a model of one group (one micro-batch per
//! step, no hybrid sharding): Ψ elements, N ranks, shard S, e bytes per element on the wire.
constexpr std::uint64_t step_bytes_sent(int stage, std::uint64_t psi, std::uint64_t ranks,
                                        std::uint64_t shard, std::uint64_t elem_bytes,
                                        std::uint64_t rank = 0) {
  accounting::step_shape s;
  s.stage = stage;
  s.ranks = ranks;
  s.shard_ranks = stage == 0 ? 1 : ranks;
  s.psi = psi;
  s.shard = shard;
  s.grad_bytes = s.working_bytes = elem_bytes;
  const accounting::group_shape one{psi, shard, false, true};
  return accounting::step_bytes_sent(
      s, 1, [&](std::size_t) { return one; }, rank);
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
