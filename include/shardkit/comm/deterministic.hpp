//! \file comm/deterministic.hpp
//! The schedule of deterministic reductions over point-to-point transfers, for transports whose
//! own reductions do not sum in rank order (NCCL's rings and trees, MPI's reduction algorithms):
//!
//!   reduce_scatter(count c): every rank sends block q of its input to rank q and receives block
//!     r of every rank's input (an all-to-all), then sums the N received blocks in rank order
//!     0..N-1 with fp32 accumulation (the rank-ordered reduction kernel);
//!   all_reduce(n): the same over near-equal chunks (chunk r of n elements owned by rank r, as
//!     comm/volume.hpp cuts them), then an all-gather of the reduced chunks.
//!
//! Results are bit-identical to the thread communicator's, whatever the transport. The
//! all-to-all is staged through a receive buffer of N pieces; when N·count elements would exceed
//! a byte limit, the block is processed in rounds of smaller pieces. Every rank must use the same
//! limit (the piece boundaries must agree between sender and receiver).
#pragma once

#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>

SHARDKIT_NAMESPACE_BEGIN
namespace detail {

//! Elements per piece when a block of `count` elements from each of `ranks` sources is staged
//! in at most `limit_bytes` (at least one element; a multiple of 16 bytes when shorter than the
//! block, so pieces stay vector-aligned).
constexpr std::size_t staging_piece(std::size_t count, std::size_t ranks, std::size_t elem_bytes,
                                    std::size_t limit_bytes) noexcept {
  if (count == 0 || ranks == 0 || elem_bytes == 0) return count;
  const std::size_t fit = limit_bytes / (ranks * elem_bytes);
  if (fit >= count) return count;
  const std::size_t vec = elem_bytes >= 16 ? 1 : 16 / elem_bytes;
  const std::size_t aligned = fit / vec * vec;
  return aligned != 0 ? aligned : std::max<std::size_t>(fit, 1);
}

//! Pieces of length p that cover n elements.
constexpr std::size_t piece_count(std::size_t n, std::size_t p) noexcept {
  return p == 0 ? 0 : (n + p - 1) / p;
}

//! Elements of piece i (0 when the block has no piece i).
constexpr std::size_t piece_length(std::size_t n, std::size_t p, std::size_t i) noexcept {
  const std::size_t b = i * p;
  return b >= n ? 0 : std::min(p, n - b);
}

//! The message of a failed NCCL call: "<what> on rank <r> of <n> (device <d>): <result>
//! (<code>)[; NCCL: <last error>]".
inline std::string format_nccl_error(std::string_view what, int rank, int size, int device,
                                     int code, const char* result, const char* last_error) {
  std::string s = concat(what, " on rank ", rank, " of ", size, " (device ", device,
                         "): ", result != nullptr ? result : "unknown NCCL error", " (", code, ")");
  if (last_error != nullptr && *last_error != '\0') s += concat("; NCCL: ", last_error);
  return s;
}

//! The message of a collective that did not complete in time.
inline std::string format_nccl_timeout(std::string_view what, int rank, int size, int device,
                                       long long timeout_ms) {
  return concat(what, " on rank ", rank, " of ", size, " (device ", device,
                ") did not complete within ", timeout_ms,
                " ms; the NCCL communicator was aborted (a rank died, hangs, or issued a different "
                "sequence of collectives)");
}

}  // namespace detail
SHARDKIT_NAMESPACE_END
