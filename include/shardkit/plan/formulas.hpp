//! \file plan/formulas.hpp
//! Closed-form memory and communication of ZeRO stages, with shardkit's exact padding
//! (core/layout.hpp). These are FACTS.md's formulas with Ψ/N replaced by the padded shard S and
//! the gathered full buffers counted at their padded size N·S; the engine's ledger is tested
//! against them byte for byte.
//!
//! Per rank, with w/g bytes per working parameter/gradient element, m = 4 bytes of fp32 master
//! weights (0 when training in fp32, where the working copy is the master) and k = 4·states
//! bytes of optimizer state per element:
//!
//!   | stage | working params | grads   | master | optimizer state |
//!   |-------|----------------|---------|--------|-----------------|
//!   | 0     | w·Ψ            | g·Ψ     | m·Ψ    | k·Ψ             |
//!   | 1     | w·N·S          | g·N·S   | m·S    | k·S             |
//!   | 2     | w·N·S          | g·S     | m·S    | k·S             |
//!   | 3     | w·S            | g·S     | m·S    | k·S             |
//!
//! ZeRO-2 adds its gradient staging buckets and ZeRO-3 its gathered units (transient, reported
//! separately). Bytes sent per rank per step (16-bit transfers: e = 2):
//!   stage 0: all-reduce of Ψ elements (comm/volume.hpp; 2(N-1)/N·eΨ when N divides Ψ)
//!   stage 1, 2: reduce-scatter + all-gather: 2·(N-1)·S·e
//!   stage 3: two all-gathers + one reduce-scatter: 3·(N-1)·S·e
//!
//! These are the single-group closed forms the engine reports (engine::expected_state_bytes()).
//! The planner generalises them to several units or buckets, staging buffers, micro-batches,
//! ZeRO-3 prefetch and persistence, hybrid sharding and a time model: plan/planner.hpp (with
//! plan/model.hpp, memory.hpp, comm.hpp, time.hpp); on one group it gives the same numbers.
#pragma once

#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/ledger.hpp>

#include <cstddef>
#include <cstdint>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

//! Bytes per element of each kind of model state.
struct precision {
  std::uint64_t working_bytes = 2;  //!< working parameters (bf16/fp16: 2, fp32: 4)
  std::uint64_t grad_bytes = 2;     //!< gradients
  std::uint64_t master_bytes = 4;   //!< fp32 master copy (0 when the working copy is fp32)
  std::uint64_t state_bytes = 8;    //!< optimizer state (Adam: 8, SGD momentum: 4)

  //! Mixed precision (16-bit working copy, fp32 master) with `states` fp32 optimizer states.
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
  constexpr std::uint64_t total() const noexcept {
    return working_params + grads + master_params + optimizer_moments;
  }
  friend constexpr bool operator==(const state_bytes&, const state_bytes&) = default;
};

//! S = round_up(ceil(Ψ/N), alignment): one group's per-rank shard.
constexpr std::uint64_t shard_elems(std::uint64_t psi, std::uint64_t ranks,
                                    std::uint64_t alignment = 1) noexcept {
  const std::uint64_t s = (psi + ranks - 1) / ranks;
  return (s + alignment - 1) / alignment * alignment;
}

//! Bytes per rank for `stage` with Ψ true elements, N ranks and a total per-rank shard of S
//! elements (Σ over groups; shard_elems(Ψ, N) for a single group).
constexpr state_bytes model_state_bytes(int stage, std::uint64_t psi, std::uint64_t ranks,
                                        std::uint64_t shard, precision p) noexcept {
  const std::uint64_t full = ranks * shard;
  switch (stage) {
    case 0:
      return {p.working_bytes * psi, p.grad_bytes * psi, p.master_bytes * psi, p.state_bytes * psi};
    case 1:
      return {p.working_bytes * full, p.grad_bytes * full, p.master_bytes * shard,
              p.state_bytes * shard};
    case 2:
      return {p.working_bytes * full, p.grad_bytes * shard, p.master_bytes * shard,
              p.state_bytes * shard};
    default:
      return {p.working_bytes * shard, p.grad_bytes * shard, p.master_bytes * shard,
              p.state_bytes * shard};
  }
}

//! Bytes rank `rank` sends in one optimizer step (one micro-batch per step).
constexpr std::uint64_t step_bytes_sent(int stage, std::uint64_t psi, std::uint64_t ranks,
                                        std::uint64_t shard, std::uint64_t elem_bytes,
                                        std::uint64_t rank = 0) noexcept {
  if (ranks <= 1) return 0;
  switch (stage) {
    case 0:
      return ring_bytes_sent(collective::all_reduce, psi, elem_bytes, ranks, rank);
    case 1:
    case 2:
      return 2 * (ranks - 1) * shard * elem_bytes;
    default:
      return 3 * (ranks - 1) * shard * elem_bytes;
  }
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
