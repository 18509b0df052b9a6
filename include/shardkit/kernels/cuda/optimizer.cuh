//! \file kernels/cuda/optimizer.cuh
//! The fused optimizer step on the GPU, the device twin of kernels/host/optimizer.hpp: one pass
//! over a flat shard that reads the gradient (fp32, bf16 or fp16) and the fp32 parameter and
//! state, calls the optimizer policy's per-element `update` (kernels/math.hpp, V = float, the
//! function the host loops call), writes parameter and state back and the 16-bit working copy in
//! the same pass. With bf16 gradients and Adam: read 2 + 12, write 12 + 2 = 28 bytes per element,
//! the minimum (docs/accounting.md). The gradient multiplier (unscale × average × clip) is
//! `constants::grad_scale`, applied inside. The overflow skip can stay on the device: the step
//! takes an optional pointer to a non-finite count and changes nothing when it is non-zero.
//!
//!  - gpu::fused_step: one run: cub::DeviceTransform (kernels/cuda/transform.cuh) by default,
//!    the hand-written grid-stride kernel for the device-side skip or when asked for.
//!  - gpu::fused_step_table: many runs (an engine's per-parameter-group runs) in one launch per
//!    16 groups: a device table of runs cut into chunks, built once, launched every step with
//!    that step's constants.
//!
//! Accesses are 16-byte vectors when the arrays can be aligned together (launch.hpp), scalar
//! otherwise. Compiled with -fmad=false, results equal host::fused_step_scalar bit for bit.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/cuda_memory.cuh>
#include <shardkit/core/device.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/cuda/common.cuh>
#include <shardkit/kernels/cuda/launch.hpp>
#include <shardkit/kernels/cuda/transform.cuh>
#include <shardkit/kernels/math.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace gpu {

namespace detail {

//! One run of the fused step, as the kernels see it.
template <class Opt, class G, class W>
struct step_run {
  float* params;
  float* state[Opt::state_count];
  const G* grads;
  W* out;  // nullptr: no working copy
  std::size_t count;
  vector_split split;
};

//! Elements per pack: 16 bytes of the smallest array touched.
template <class G, class W, bool WriteOut>
inline constexpr int step_pack =
    pack_of<std::min({sizeof(float), sizeof(G), WriteOut ? sizeof(W) : sizeof(float)})>;

template <class Opt, class G, class W, bool WriteOut>
vector_split plan_step(const step_run<Opt, G, W>& r) {
  std::vector<array_ref> a;
  a.push_back(ref(r.params));
  for (std::size_t s = 0; s < Opt::state_count; ++s) a.push_back(ref(r.state[s]));
  a.push_back(ref(r.grads));
  if constexpr (WriteOut) a.push_back(ref(r.out));
  vector_split v = plan_vector_split(a, r.count);
  if (v.vectorised && v.pack != static_cast<std::size_t>(step_pack<G, W, WriteOut>)) {
    ::shardkit::detail::raise<error>("fused step: planned packs of ", v.pack,
                                     " elements, kernel built for ", step_pack<G, W, WriteOut>);
  }
  return v;
}

//! Steps elements [begin, end) of run `r`; thread `tid` of `threads`.
template <class Opt, class G, class W, bool WriteOut>
__device__ SHARDKIT_FORCEINLINE void step_range(const step_run<Opt, G, W>& r,
                                                const typename Opt::constants& k, std::size_t begin,
                                                std::size_t end, std::size_t tid,
                                                std::size_t threads) {
  constexpr std::size_t S = Opt::state_count;
  constexpr int E = step_pack<G, W, WriteOut>;
  auto scalar = [&](std::size_t i) {
    float p = r.params[i];
    float s[S];
#pragma unroll
    for (std::size_t j = 0; j < S; ++j) s[j] = r.state[j][i];
    Opt::update(p, s, to_float(r.grads[i]), k);
    r.params[i] = p;
#pragma unroll
    for (std::size_t j = 0; j < S; ++j) r.state[j][i] = s[j];
    if constexpr (WriteOut) r.out[i] = from_float<W>(p);
  };
  auto packed = [&](std::size_t i) {
    float p[E], g[E], st[S][E];
    load_pack<float, E>(r.params + i, p);
#pragma unroll
    for (std::size_t j = 0; j < S; ++j) load_pack<float, E>(r.state[j] + i, st[j]);
    load_pack<G, E>(r.grads + i, g);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      float s[S];
#pragma unroll
      for (std::size_t j = 0; j < S; ++j) s[j] = st[j][e];
      Opt::update(p[e], s, g[e], k);
#pragma unroll
      for (std::size_t j = 0; j < S; ++j) st[j][e] = s[j];
    }
    store_pack<float, E>(r.params + i, p);
#pragma unroll
    for (std::size_t j = 0; j < S; ++j) store_pack<float, E>(r.state[j] + i, st[j]);
    if constexpr (WriteOut) store_pack<W, E>(r.out + i, p);
  };
  for_each_element<E>(r.split, begin, end, tid, threads, scalar, packed);
}

//! True when the step is to be skipped: `skip` points to a non-zero count (device memory).
__device__ SHARDKIT_FORCEINLINE bool skip_step(const unsigned long long* skip) {
  return skip != nullptr && *skip != 0;
}

template <class Opt, class G, class W, bool WriteOut>
__global__ void __launch_bounds__(fused_step_policy.threads, fused_step_policy.blocks_per_sm)
    fused_step_kernel(step_run<Opt, G, W> r, typename Opt::constants k,
                      const unsigned long long* skip) {
  if (skip_step(skip)) return;
  step_range<Opt, G, W, WriteOut>(r, k, 0, r.count, global_thread(), global_threads());
}

//! Launch parameters of one multi-run launch: up to max_groups_per_launch groups' constants.
template <class Opt>
struct step_table_args {
  const work_chunk* chunks;
  const unsigned long long* skip;  // non-zero count here: skip the step; nullptr: never
  std::uint32_t chunk_count;
  std::uint32_t first_group;
  typename Opt::constants k[max_groups_per_launch];
};

template <class Opt, class G, class W, bool WriteOut>
__global__ void __launch_bounds__(fused_step_policy.threads, fused_step_policy.blocks_per_sm)
    fused_step_table_kernel(const step_run<Opt, G, W>* runs,
                            const __grid_constant__ step_table_args<Opt> a) {
  if (skip_step(a.skip)) return;
  for (std::uint32_t c = blockIdx.x; c < a.chunk_count; c += gridDim.x) {
    const work_chunk ch = a.chunks[c];
    const step_run<Opt, G, W> r = runs[ch.run];
    step_range<Opt, G, W, WriteOut>(r, a.k[ch.group - a.first_group], ch.begin, ch.end, threadIdx.x,
                                    blockDim.x);
  }
}

template <class Opt, class G, class W, bool WriteOut>
void launch_step(const step_run<Opt, G, W>& r, const typename Opt::constants& k,
                 cudaStream_t stream, const unsigned long long* skip) {
  const std::size_t items =
      r.split.vectorised ? r.split.packs + r.split.pack : r.count;  // packs, plus head/tail
  launch(&fused_step_kernel<Opt, G, W, WriteOut>, "gpu::fused_step",
         grid_for(items, fused_step_policy), fused_step_policy.threads, stream, r.count, r, k,
         skip);
}

}  // namespace detail

//! One optimizer step over `n` consecutive elements in device memory, enqueued on `stream`:
//!  - `params`: fp32 parameters (the master copy, or the working parameters when training in
//!    fp32), updated in place;
//!  - `state`: a host array of Opt::state_count device pointers to fp32 state, updated in place;
//!  - `grads`: the raw gradients (k.grad_scale is applied inside);
//!  - `working_out`: where to write the rounded 16-bit working copy, or nullptr for none.
//! The same contract as host::fused_step. Raises cuda_error when the launch fails.
//!
//! The overflow skip without a round trip to the host: when `skip_if_nonzero` (device memory)
//! is given and holds a non-zero value when the kernel runs, the step changes nothing. Point it
//! at the count of count_nonfinite (or accumulate_stats' word 256) after summing it over the
//! ranks on the device, and an overflowing step is skipped in stream order.
template <optimizer_policy Opt, float_storage G, float_storage W = bf16>
void fused_step(const typename Opt::constants& k, float* params, float* const* state,
                const G* grads, W* working_out, std::size_t n, device_stream stream,
                const unsigned long long* skip_if_nonzero = nullptr,
                elementwise_path path = default_elementwise_path) {
  static_assert(std::is_trivially_copyable_v<typename Opt::constants>,
                "optimizer constants must be trivially copyable to reach a kernel");
  if (n == 0) return;
  // cub::DeviceTransform by default; the hand-written kernel for the device-side skip (a
  // transform writes every element) or when asked for (kernels/cuda/transform.cuh).
  if (path == elementwise_path::cub_transform && skip_if_nonzero == nullptr) {
    fused_step_transform<Opt, G, W>(k, params, state, grads, working_out, n, stream);
    return;
  }
  detail::step_run<Opt, G, W> r{};
  r.params = params;
  for (std::size_t s = 0; s < Opt::state_count; ++s) r.state[s] = state[s];
  r.grads = grads;
  r.out = working_out;
  r.count = n;
  if (working_out != nullptr) {
    r.split = detail::plan_step<Opt, G, W, true>(r);
    detail::launch_step<Opt, G, W, true>(r, k, stream, skip_if_nonzero);
  } else {
    r.split = detail::plan_step<Opt, G, W, false>(r);
    detail::launch_step<Opt, G, W, false>(r, k, stream, skip_if_nonzero);
  }
}

//! The fused step over many runs (for example an engine's per-parameter-group pieces of a
//! shard), one launch per max_groups_per_launch groups. Build it once (it plans the chunks and
//! copies the table to the device, ordered on the given stream) and launch it every step with
//! that step's constants, one per group. The runs' memory must outlive the table's launches.
//! All runs write a working copy or none do.
template <optimizer_policy Opt, float_storage G, float_storage W = bf16>
class fused_step_table {
 public:
  //! One run: `count` elements of each array, stepped with the constants of group `group`.
  struct run {
    float* params = nullptr;
    std::array<float*, Opt::state_count> state{};
    const G* grads = nullptr;
    W* working_out = nullptr;
    std::size_t count = 0;
    std::size_t group = 0;
  };

  fused_step_table() = default;

  //! Plans and uploads the table of `runs` over `groups` parameter groups. Raises
  //! invalid_argument when runs disagree about writing a working copy or name a group >= groups.
  //! `chunk`: elements per chunk (and block).
  fused_step_table(std::span<const run> runs, std::size_t groups, device_stream stream,
                   std::size_t chunk = chunk_elems)
      : groups_(groups), stream_(stream) {
    if (chunk == 0) ::shardkit::detail::raise("fused_step_table: a chunk of 0 elements");
    if (runs.empty()) {
      group_begin_.assign(groups + 1, 0);
      return;
    }
    write_out_ = runs[0].working_out != nullptr;
    std::vector<run_extent> extents;
    std::vector<std::byte> host_runs;
    if (write_out_)
      plan_runs<true>(runs, extents, host_runs);
    else
      plan_runs<false>(runs, extents, host_runs);
    const chunk_plan plan = plan_chunks(extents, groups, chunk);
    group_begin_ = plan.group_begin;
    chunk_count_ = plan.chunks.size();
    elements_ = 0;
    for (const auto& r : runs) elements_ += r.count;
    const std::size_t runs_bytes = round_up(host_runs.size());
    const std::size_t bytes = runs_bytes + plan.chunks.size() * sizeof(work_chunk);
    device_stream_scope scope(stream);
    table_ = buffer<std::byte, cuda_space>(bytes, nullptr, memory_category::comm_scratch);
    copy_bytes_async(table_.data(), host_runs.data(), host_runs.size(), stream);
    copy_bytes_async(table_.data() + runs_bytes, plan.chunks.data(),
                     plan.chunks.size() * sizeof(work_chunk), stream);
    chunks_ = reinterpret_cast<const work_chunk*>(table_.data() + runs_bytes);
  }

  fused_step_table(fused_step_table&&) noexcept = default;
  //! Frees this table's memory ordered on the stream it was built on (not the caller's
  //! current stream), then takes over `o`'s.
  fused_step_table& operator=(fused_step_table&& o) noexcept {
    if (this != &o) {
      {
        device_stream_scope scope(stream_);
        table_.release();
      }
      groups_ = std::exchange(o.groups_, {});
      stream_ = std::exchange(o.stream_, {});
      write_out_ = std::exchange(o.write_out_, {});
      group_begin_ = std::move(o.group_begin_);
      chunk_count_ = std::exchange(o.chunk_count_, {});
      elements_ = std::exchange(o.elements_, {});
      table_ = std::move(o.table_);
      chunks_ = std::exchange(o.chunks_, {});
    }
    return *this;
  }
  //! Frees the device table ordered on the stream it was built on: launches on other streams
  //! must be complete (or ordered before that point) by then.
  ~fused_step_table() {
    device_stream_scope scope(stream_);
    table_.release();
  }

  //! Enqueues the step of every run on `stream`, group g with constants k[g]; nothing changes
  //! when `skip_if_nonzero` (device memory) holds a non-zero value then (see fused_step).
  //! Raises invalid_argument unless k holds one entry per group.
  //! `max_blocks` caps the grid of each launch (table_grid; 0: one block per chunk).
  void launch(std::span<const typename Opt::constants> k, device_stream stream,
              const unsigned long long* skip_if_nonzero = nullptr,
              std::size_t max_blocks = 0) const {
    if (k.size() != groups_) {
      ::shardkit::detail::raise("fused_step_table::launch: ", k.size(),
                                " constants given for a table of ", groups_, " group(s)");
    }
    if (chunk_count_ == 0) return;
    if (write_out_)
      launch_impl<true>(k, stream, skip_if_nonzero, max_blocks);
    else
      launch_impl<false>(k, stream, skip_if_nonzero, max_blocks);
  }

  std::size_t groups() const noexcept { return groups_; }
  std::size_t chunks() const noexcept { return chunk_count_; }
  std::size_t elements() const noexcept { return elements_; }
  //! Bytes of device memory the table holds.
  std::size_t table_bytes() const noexcept { return table_.bytes(); }

 private:
  static constexpr std::size_t round_up(std::size_t b) { return (b + 255) / 256 * 256; }

  template <bool WriteOut>
  static void plan_runs(std::span<const run> runs, std::vector<run_extent>& extents,
                        std::vector<std::byte>& bytes) {
    std::vector<detail::step_run<Opt, G, W>> dev(runs.size());
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const run& in = runs[i];
      if ((in.working_out != nullptr) != WriteOut) {
        ::shardkit::detail::raise("fused_step_table: run ", i,
                                  WriteOut ? " has no working copy but run 0 has"
                                           : " has a working copy but run 0 has none");
      }
      auto& d = dev[i];
      d.params = in.params;
      for (std::size_t s = 0; s < Opt::state_count; ++s) d.state[s] = in.state[s];
      d.grads = in.grads;
      d.out = in.working_out;
      d.count = in.count;
      d.split = detail::plan_step<Opt, G, W, WriteOut>(d);
      extents.push_back({in.count, d.split, in.group});
    }
    bytes.resize(dev.size() * sizeof(dev[0]));
    std::memcpy(bytes.data(), dev.data(), bytes.size());
  }

  template <bool WriteOut>
  void launch_impl(std::span<const typename Opt::constants> k, device_stream stream,
                   const unsigned long long* skip, std::size_t max_blocks) const {
    using dev_run = detail::step_run<Opt, G, W>;
    const auto* runs = reinterpret_cast<const dev_run*>(table_.data());
    for (std::size_t g0 = 0; g0 < groups_; g0 += max_groups_per_launch) {
      const std::size_t g1 = std::min(groups_, g0 + max_groups_per_launch);
      const std::size_t c0 = group_begin_[g0], c1 = group_begin_[g1];
      if (c0 == c1) continue;
      detail::step_table_args<Opt> a{};
      a.chunks = chunks_ + c0;
      a.skip = skip;
      a.chunk_count = static_cast<std::uint32_t>(c1 - c0);
      a.first_group = static_cast<std::uint32_t>(g0);
      for (std::size_t g = g0; g < g1; ++g) a.k[g - g0] = k[g];
      const std::size_t grid = table_grid(c1 - c0, max_blocks);
      detail::launch(&detail::fused_step_table_kernel<Opt, G, W, WriteOut>, "gpu::fused_step_table",
                     grid, fused_step_policy.threads, stream, elements_, runs, a);
    }
  }

  std::size_t groups_ = 0;
  device_stream stream_ = nullptr;
  bool write_out_ = false;
  std::vector<std::size_t> group_begin_;
  std::size_t chunk_count_ = 0;
  std::size_t elements_ = 0;
  buffer<std::byte, cuda_space> table_;
  const work_chunk* chunks_ = nullptr;
};

}  // namespace gpu
SHARDKIT_NAMESPACE_END
