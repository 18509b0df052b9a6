//! \file kernels/cuda/launch.hpp
//! The host-side decisions of shardkit's CUDA kernels, as plain C++ that the CPU tests check:
//! launch parameters (constexpr data), grid sizes, when 16-byte vector accesses are possible and
//! where they start, and how many runs of elements (optimizer runs, tensors to flatten) are cut
//! into the chunks that one launch works through. No CUDA headers are needed.
//!
//! Vector accesses: a kernel touches arrays of different element sizes (bf16 gradients, fp32
//! parameters) in *packs* of E elements, E = 16 / (smallest element size), so that the pack of
//! every array is a whole number of 16-byte vectors. A run of n elements is split into a scalar
//! head of h < E elements (so that every array's pack starts 16-byte aligned), a body of whole
//! packs, and a scalar tail. When no such h exists (arrays misaligned against each other) the
//! whole run is scalar. Every element goes through the same per-element function either way,
//! so the split changes the speed, never the result.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace gpu {

//! Launch parameters of one family of kernels.
struct launch_policy {
  int threads;        //!< threads per block
  int blocks_per_sm;  //!< blocks per multiprocessor of a grid-stride launch; also the kernels'
                      //!< __launch_bounds__ minimum, which caps registers at 64K/(threads·this)
  int vector_bytes;   //!< bytes per vector access (16: one 128-bit load or store)
  int unroll;         //!< whole packs per thread per iteration, their loads issued together
};

// Every policy keeps 1024 threads resident per multiprocessor with at most 64 registers each.
// Little's law on an H200 (4.3 TB/s, about 0.7 us to memory) wants about 3 MB in flight over
// 132 SMs, 23 KB per SM, 23 bytes per thread: one 16-byte load per thread is not enough, so the
// copy-like kernels issue 4 packs' loads together, and the fused step has 7 loads per pack.

//! The fused optimizer step: 7 independent 16-byte loads per pack (bf16 gradients, Adam), about
//! 60 registers.
inline constexpr launch_policy fused_step_policy{256, 4, 16, 1};
//! Conversions, accumulation, flatten/unflatten: copies with arithmetic.
inline constexpr launch_policy copy_policy{256, 4, 16, 4};
//! The rank-ordered reduction: k loads per pack already.
inline constexpr launch_policy reduce_policy{256, 4, 16, 1};
//! Gradient statistics: each block keeps 257 bins in shared memory and flushes them once, so
//! fewer, fuller blocks; the bins, not the loads, bound it.
inline constexpr launch_policy grad_stats_policy{512, 2, 16, 2};

//! Elements per chunk of a multi-run launch: big enough that a block streams for a while,
//! small enough that the runs of a few large tensors still spread over every multiprocessor.
inline constexpr std::size_t chunk_elems = std::size_t{1} << 16;
//! Elements per chunk (and block) of a batched copy: flatten of 1,024 bf16 tensors, 256Mi
//! elements, on an H200 (benchmarks/bench_cuda.cu) ran at 0.96x a device-to-device copy with
//! 16Ki, 0.89x with 64Ki and 0.81x with 256Ki: the short blocks keep every multiprocessor
//! streaming to the end.
inline constexpr std::size_t copy_chunk_elems = std::size_t{1} << 14;
//! Blocks of a launch over a table of chunks (batched_copy, fused_step_table): one block per
//! chunk when `max_blocks` is 0, so the block scheduler overlaps one block's table reads and
//! start with the others' streaming; else a grid of at most `max_blocks` blocks that loop over
//! the chunks. (A grid dimension holds at most 2^31 - 1 blocks.)
constexpr std::size_t table_grid(std::size_t chunks, std::size_t max_blocks) {
  const std::size_t most = max_blocks == 0 ? std::size_t{0x7fffffff} : max_blocks;
  return chunks < most ? chunks : most;
}
//! Optimizer constants (one per parameter group) passed in one launch's parameters; a table
//! with more groups takes one launch per this many groups.
inline constexpr std::size_t max_groups_per_launch = 16;
//! Source pointers of the rank-ordered reduction passed in the launch parameters; more sources
//! go through a table in device memory.
inline constexpr std::size_t max_inline_sources = 64;

//! Elements per pack for arrays whose smallest element has `min_elem_bytes` bytes.
constexpr std::size_t pack_elems(std::size_t min_elem_bytes, std::size_t vector_bytes = 16) {
  return min_elem_bytes == 0 || min_elem_bytes > vector_bytes ? 1 : vector_bytes / min_elem_bytes;
}

//! Blocks of a grid-stride launch over `items` work items (one per thread per iteration):
//! enough to cover them, at most blocks_per_sm per multiprocessor, at least 1.
constexpr std::size_t grid_blocks(std::size_t items, const launch_policy& p, int sm_count) {
  const std::size_t threads = static_cast<std::size_t>(p.threads);
  const std::size_t want = (items + threads - 1) / threads;
  const std::size_t cap = static_cast<std::size_t>(sm_count > 0 ? sm_count : 1) *
                          static_cast<std::size_t>(p.blocks_per_sm);
  return std::max<std::size_t>(1, std::min(want, cap));
}

//! How a run is split for vector access (see the file comment).
struct vector_split {
  std::size_t head = 0;   //!< scalar elements before the first pack
  std::size_t packs = 0;  //!< whole packs of `pack` elements
  std::size_t pack = 1;   //!< elements per pack
  bool vectorised = false;
  SHARDKIT_HOST_DEVICE constexpr std::size_t body_end() const noexcept {
    return head + packs * pack;
  }
  friend constexpr bool operator==(const vector_split&, const vector_split&) = default;
};

//! One array a kernel touches: its address and element size.
struct array_ref {
  std::uintptr_t address;
  std::size_t elem_bytes;
};

//! The split of n elements of the given arrays (element i of array j at
//! address_j + i·elem_bytes_j) into a scalar head, whole packs whose every array access is
//! `vector_bytes`-aligned, and a scalar tail.
inline vector_split plan_vector_split(std::span<const array_ref> arrays, std::size_t n,
                                      std::size_t vector_bytes = 16) {
  vector_split s;
  if (arrays.empty() || n == 0) return s;
  std::size_t min_size = arrays[0].elem_bytes;
  for (const auto& a : arrays) min_size = std::min(min_size, a.elem_bytes);
  s.pack = pack_elems(min_size, vector_bytes);
  if (s.pack <= 1) return s;
  for (std::size_t h = 0; h < s.pack; ++h) {
    bool ok = true;
    for (const auto& a : arrays) {
      ok = ok && (a.address + h * a.elem_bytes) % vector_bytes == 0;
    }
    if (!ok) continue;
    if (h >= n) return s;  // too short for one pack
    s.head = h;
    s.packs = (n - h) / s.pack;
    s.vectorised = s.packs != 0;
    if (!s.vectorised) s.head = 0;
    return s;
  }
  return s;
}

//! plan_vector_split for pointers given directly.
inline vector_split plan_vector_split(std::initializer_list<array_ref> arrays, std::size_t n,
                                      std::size_t vector_bytes = 16) {
  return plan_vector_split(std::span<const array_ref>(arrays.begin(), arrays.size()), n,
                           vector_bytes);
}

//! A same-type copy whose source and destination cannot be aligned together (their addresses
//! differ by a number of bytes that is not a multiple of 16: the common case of flattening
//! tensors into a buffer at arbitrary element offsets). The destination is written in aligned
//! 16-byte packs; each pack's bytes are taken from two aligned 16-byte loads of the source,
//! starting `shift` bytes into the first (shifted_pack). `split` describes the destination's
//! packs as for plan_vector_split (head, packs, pack), so chunk plans and split_range apply.
//! Both loads of every pack lie inside the source array: packs whose second load would reach
//! past its end, or whose first would start before it, are left to the scalar head and tail.
struct shifted_copy_split {
  vector_split split;
  unsigned shift = 0;  //!< (source address of the first pack) mod 16, bytes; 0: not shifted
  friend constexpr bool operator==(const shifted_copy_split&, const shifted_copy_split&) = default;
};

//! Plans a shifted copy of n elements of `elem_bytes` bytes (2 or 4) from `src` to `dst`. The
//! result is not vectorised when the arrays can be aligned together (use plan_vector_split), when
//! either address is not aligned to its element size, or when n is too short for one pack.
inline shifted_copy_split plan_shifted_copy(std::uintptr_t src, std::uintptr_t dst, std::size_t n,
                                            std::size_t elem_bytes, std::size_t vector_bytes = 16) {
  shifted_copy_split s;
  if (n == 0 || elem_bytes == 0 || vector_bytes % elem_bytes != 0 || elem_bytes > 4) return s;
  if (src % elem_bytes != 0 || dst % elem_bytes != 0) return s;
  const std::size_t pack = vector_bytes / elem_bytes;
  if ((src - dst) % vector_bytes == 0) return s;  // alignable together: not a shifted copy
  // first element whose destination is vector-aligned
  std::size_t head = (vector_bytes - dst % vector_bytes) % vector_bytes / elem_bytes;
  const unsigned shift = static_cast<unsigned>((src + head * elem_bytes) % vector_bytes);
  // the first pack's first load starts `shift` bytes before its source: not before the array
  if (head * elem_bytes < shift) head += pack;
  // pack p (element i = head + p·pack) loads bytes [src + i·e - shift, src + i·e - shift + 32)
  const std::size_t total = n * elem_bytes;
  const std::size_t first = head * elem_bytes - shift;  // offset of the first load
  if (first + 2 * vector_bytes > total) return s;
  const std::size_t packs = (total - first - 2 * vector_bytes) / vector_bytes + 1;
  s.split.head = head;
  s.split.pack = pack;
  s.split.packs = packs;
  s.split.vectorised = true;
  s.shift = shift;
  return s;
}

//! Four 32-bit words (one 16-byte vector) in memory order.
struct words4 {
  std::uint32_t w[4];
  friend constexpr bool operator==(const words4&, const words4&) = default;
};

//! (hi:lo) >> s, low 32 bits, s < 32 (a funnel shift).
SHARDKIT_HOST_DEVICE constexpr std::uint32_t funnel_shift_right(std::uint32_t lo, std::uint32_t hi,
                                                                unsigned s) {
  return s == 0 ? lo : (lo >> s) | (hi << (32u - s));
}

//! Bytes [4·Q + s/8, 4·Q + s/8 + 16) of the 32 bytes a (then b), on a little-endian machine: the
//! pack of a shifted copy whose shift is 4·Q + s/8 bytes. Q in [0, 3], s in {0, 8, 16, 24}.
template <int Q>
SHARDKIT_HOST_DEVICE constexpr words4 shifted_pack(const words4& a, const words4& b, unsigned s) {
  static_assert(Q >= 0 && Q <= 3, "the word shift of a 16-byte pack is 0..3");
  const std::uint32_t c[8] = {a.w[0], a.w[1], a.w[2], a.w[3], b.w[0], b.w[1], b.w[2], b.w[3]};
  return {{funnel_shift_right(c[Q], c[Q + 1], s), funnel_shift_right(c[Q + 1], c[Q + 2], s),
           funnel_shift_right(c[Q + 2], c[Q + 3], s), funnel_shift_right(c[Q + 3], c[Q + 4], s)}};
}

//! An array_ref for a typed pointer.
template <class T>
array_ref ref(const T* p) noexcept {
  return {reinterpret_cast<std::uintptr_t>(p), sizeof(T)};
}

//! The part of a vector split that falls into elements [begin, end): scalar elements before
//! `vec_begin`, whole packs in [vec_begin, vec_end), scalar elements after. vec_begin == vec_end
//! when no whole pack lies inside.
struct range_split {
  std::size_t vec_begin;
  std::size_t vec_end;
};
SHARDKIT_HOST_DEVICE constexpr range_split split_range(const vector_split& s, std::size_t begin,
                                                       std::size_t end) {
  if (!s.vectorised) return {end, end};
  const std::size_t lo = begin > s.head ? begin : s.head;
  const std::size_t body = s.body_end();
  const std::size_t hi = end < body ? end : body;
  if (lo >= hi) return {end, end};
  const std::size_t vb = s.head + (lo - s.head + s.pack - 1) / s.pack * s.pack;
  const std::size_t ve = s.head + (hi - s.head) / s.pack * s.pack;
  if (vb >= ve) return {end, end};
  return {vb, ve};
}

//! A piece of one run that one block of a multi-run launch processes.
struct work_chunk {
  std::uint32_t run;    //!< index into the launch's run table
  std::uint32_t group;  //!< parameter group (optimizer constants) of the run
  std::uint64_t begin;  //!< first element, relative to the run
  std::uint64_t end;    //!< one past the last element
  friend constexpr bool operator==(const work_chunk&, const work_chunk&) = default;
};

//! What plan_chunks needs to know of a run.
struct run_extent {
  std::size_t count;  //!< elements
  vector_split split;
  std::size_t group = 0;
};

//! The chunks of a multi-run launch, ordered by group (runs in their order within a group), and
//! for each group g its chunks [group_begin[g], group_begin[g+1]).
struct chunk_plan {
  std::vector<work_chunk> chunks;
  std::vector<std::size_t> group_begin;
};

//! Cuts runs into chunks of about `chunk` elements whose boundaries after a run's scalar head fall
//! on its pack boundaries (so no pack straddles two chunks). Empty runs get no chunk. Raises
//! invalid_argument for a group index >= groups or more than 2^32 runs.
inline chunk_plan plan_chunks(std::span<const run_extent> runs, std::size_t groups,
                              std::size_t chunk = chunk_elems) {
  if (runs.size() > 0xffffffffu) {
    ::shardkit::detail::raise("plan_chunks: ", runs.size(), " runs exceed the 2^32 a table holds");
  }
  for (std::size_t r = 0; r < runs.size(); ++r) {
    if (runs[r].group >= groups) {
      ::shardkit::detail::raise("plan_chunks: run ", r, " belongs to group ", runs[r].group,
                                " but there are ", groups, " group(s)");
    }
  }
  chunk_plan plan;
  plan.group_begin.assign(groups + 1, 0);
  const std::size_t step = std::max<std::size_t>(chunk, 1);
  for (std::size_t g = 0; g < groups; ++g) {
    plan.group_begin[g] = plan.chunks.size();
    for (std::size_t r = 0; r < runs.size(); ++r) {
      const run_extent& e = runs[r];
      if (e.group != g || e.count == 0) continue;
      const std::size_t pack = e.split.vectorised ? e.split.pack : 1;
      const std::size_t len = (step + pack - 1) / pack * pack;  // a whole number of packs
      std::size_t b = 0;
      std::size_t next = e.split.vectorised ? e.split.head + len : len;
      while (b < e.count) {
        const std::size_t end = std::min(next, e.count);
        plan.chunks.push_back(
            {static_cast<std::uint32_t>(r), static_cast<std::uint32_t>(g), b, end});
        b = end;
        next = end + len;
      }
    }
  }
  plan.group_begin[groups] = plan.chunks.size();
  return plan;
}

}  // namespace gpu
SHARDKIT_NAMESPACE_END
