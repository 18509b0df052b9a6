//! \file comm/volume.hpp
//! Bytes a rank sends in each collective under the ring algorithms (the convention of
//! docs/accounting.md and of nccl-tests). Every communicator records these numbers in its traffic
//! ledger, whatever transport it uses, so the ledger of a step can be checked against closed-form
//! formulas.
//!
//! For N ranks, element size e and the collectives' NCCL-style counts:
//!   reduce_scatter(count per rank c): (N-1)·c·e
//!   all_gather(count per rank c):     (N-1)·c·e
//!   all_reduce(count n), n cut into chunks n_q = floor((q+1)n/N) - floor(qn/N), rank r owning
//!     chunk r: reduce-scatter phase sends every chunk but n_r, all-gather phase every chunk but
//!     n_{r+1}: 2n - n_r - n_{(r+1) mod N}  (= 2(N-1)/N·n when N divides n)
//!   broadcast(count n): a pipelined chain from the root; every rank but the last of the chain
//!     ((root + N - 1) mod N) sends n·e
//!   all_to_all(count per peer c): (N-1)·c·e
//!   barrier: 0
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/ledger.hpp>

#include <cstddef>
#include <cstdint>

SHARDKIT_NAMESPACE_BEGIN

//! Start of chunk q when n elements are cut into `ranks` near-equal chunks.
constexpr std::size_t chunk_begin(std::size_t n, std::size_t ranks, std::size_t q) noexcept {
  // floor(q·n/N) without overflow: q·floor(n/N) + floor(q·(n mod N)/N)
  return q * (n / ranks) + q * (n % ranks) / ranks;
}

//! Length of chunk q when n elements are cut into `ranks` near-equal chunks.
constexpr std::size_t chunk_size(std::size_t n, std::size_t ranks, std::size_t q) noexcept {
  return chunk_begin(n, ranks, q + 1) - chunk_begin(n, ranks, q);
}

//! Bytes rank `rank` of `ranks` sends in one collective (ring algorithms).
//! `count` follows NCCL: per-rank count for reduce_scatter/all_gather/all_to_all (per peer),
//! total count for all_reduce/broadcast.
constexpr std::uint64_t ring_bytes_sent(collective c, std::size_t count, std::size_t elem_bytes,
                                        std::size_t ranks, std::size_t rank,
                                        std::size_t root = 0) noexcept {
  if (ranks <= 1) return 0;
  const std::uint64_t e = elem_bytes;
  switch (c) {
    case collective::reduce_scatter:
    case collective::all_gather:
    case collective::all_to_all:
      return static_cast<std::uint64_t>(ranks - 1) * count * e;
    case collective::all_reduce:
      return (2 * static_cast<std::uint64_t>(count) - chunk_size(count, ranks, rank) -
              chunk_size(count, ranks, (rank + 1) % ranks)) *
             e;
    case collective::broadcast:
      return rank == (root + ranks - 1) % ranks ? 0 : static_cast<std::uint64_t>(count) * e;
    case collective::barrier:
      return 0;
  }
  return 0;
}

SHARDKIT_NAMESPACE_END
