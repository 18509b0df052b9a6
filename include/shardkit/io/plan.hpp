//! \file io/plan.hpp
//! Who writes what, and how the ranks agree. Shared by checkpoints (io/checkpoint.hpp) and
//! safetensors exports (io/export.hpp).
//!
//! Every element of the model is saved exactly once, by one rank:
//!  - stages 1-3: the ranks of the first replica (world ranks 0 .. G-1, G the shard group) save
//!    the pieces of their shard (layout.pieces(shard index)); the other replicas hold the same
//!    values and save nothing;
//!  - stage 0: every rank holds everything; rank r saves the parameters' elements that fall in
//!    chunk r of the flat model (comm/volume.hpp's chunks), so the N ranks share the writing.
//! A rank's file holds its pieces kind by kind (the fp32 values, then each optimizer state), in
//! shard order, unpadded; every rank can compute every other rank's pieces from the layout, so
//! rank 0 writes the manifest's ranges without gathering them.
#pragma once

#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/layout.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace io {

//! The pieces world rank `rank` saves (see the file comment). `layout` is the saving engine's:
//! a 1-way layout for stage 0, else sharded over the shard group of `shard_group` ranks.
inline std::vector<flat_layout::piece> saved_pieces(const flat_layout& layout, int stage,
                                                    std::size_t world, std::size_t shard_group,
                                                    std::size_t rank) {
  if (stage != 0) {
    if (rank >= shard_group) return {};  // another replica saves these
    return layout.pieces(rank);
  }
  const std::size_t n = layout.numel();
  const std::size_t lo = chunk_begin(n, world, rank), hi = lo + chunk_size(n, world, rank);
  std::vector<flat_layout::piece> out;
  for (const auto& pc : layout.pieces(0)) {  // stage 0: full offsets are flat indices
    const std::size_t b = std::max(lo, pc.full_offset);
    const std::size_t e = std::min(hi, pc.full_offset + pc.count);
    if (b >= e) continue;
    flat_layout::piece x = pc;
    x.rank = static_cast<int>(rank);
    x.param_offset += b - pc.full_offset;
    x.shard_offset += b - pc.full_offset;
    x.full_offset = b;
    x.count = e - b;
    out.push_back(x);
  }
  return out;
}

//! Elements of all pieces.
inline std::uint64_t elements_of(const std::vector<flat_layout::piece>& pieces) {
  std::uint64_t n = 0;
  for (const auto& p : pieces) n += p.count;
  return n;
}

namespace detail {
inline constexpr std::size_t agreement_bytes = 512;

//! What each rank says in an agreement: 0 (ok) or 1, a message, and up to three numbers.
struct agreement {
  std::uint64_t failed = 0;
  std::uint64_t values[3] = {0, 0, 0};
  std::string message;
};

//! Collective over `comm` through `ops` (any memory space): every rank learns every rank's
//! agreement. Returns them in rank order.
template <class Comm, class Ops>
std::vector<agreement> agree(Comm& comm, const Ops& ops, const agreement& mine) {
  const std::size_t N = static_cast<std::size_t>(comm.size());
  std::vector<std::uint8_t> in(agreement_bytes, 0), all(agreement_bytes * N, 0);
  std::memcpy(in.data(), &mine.failed, 8);
  std::memcpy(in.data() + 8, mine.values, 24);
  const std::size_t len = std::min(mine.message.size(), agreement_bytes - 33);
  std::memcpy(in.data() + 32, mine.message.data(), len);
  ops.all_gather_host(comm, in.data(), all.data(), agreement_bytes);
  std::vector<agreement> out(N);
  for (std::size_t q = 0; q < N; ++q) {
    const std::uint8_t* p = all.data() + q * agreement_bytes;
    std::memcpy(&out[q].failed, p, 8);
    std::memcpy(out[q].values, p + 8, 24);
    out[q].message = reinterpret_cast<const char*>(p + 32);
  }
  return out;
}

//! "rank 2: <message>; rank 3: <message>" for the ranks that failed ("" when none did).
inline std::string failures(const std::vector<agreement>& all) {
  std::string s;
  for (std::size_t q = 0; q < all.size(); ++q) {
    if (all[q].failed == 0) continue;
    s += shardkit::detail::concat(s.empty() ? "" : "; ", "rank ", q, ": ", all[q].message);
  }
  return s;
}
}  // namespace detail

}  // namespace io
SHARDKIT_NAMESPACE_END
