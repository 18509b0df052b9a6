//! \file kernels/cuda/grad_stats.cuh
//! Gradient statistics on the GPU, identical to kernels/host/grad_stats.hpp: the exact squared
//! norm in 256 exponent bins of uint64 (each element adds the square of its top 16 mantissa
//! bits to the bin of its exponent), the number of non-finite elements and the largest finite
//! magnitude. Integer sums do not depend on order, so the device gives the host's words bit for
//! bit, and clipping stays bit-identical across stages and backends.
//!
//! Design: each block keeps the 257 counters (256 bins + the non-finite count, the host's
//! `words` layout) in shared memory. Neighbouring gradient elements mostly share a few
//! exponents, so a warp first combines the lanes that hit the same bin (__match_any_sync, then
//! __reduce_add_sync on the two 16-bit halves of each square) and one lane adds the warp's sum
//! with a shared-memory atomic; at the end each block adds its non-zero counters to the global
//! ones with one atomic each. The largest magnitude is a CUB block reduction and one atomicMax
//! per block.
//!
//! Cost against the fused step: a separate pass reads the gradient once more, 2 bytes per
//! element with bf16 gradients against the step's 28, about 7% more traffic. The statistics
//! cannot be fused into the step itself: clipping and the overflow skip need the *global* norm
//! and non-finite count (an all-reduce over ranks) before any element is updated. They can be
//! fused into whatever writes the gradient shard (the reduction of a deterministic
//! reduce-scatter), which saves that 7%; see docs/cuda.md.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/cuda_memory.cuh>
#include <shardkit/core/device.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/cuda/common.cuh>
#include <shardkit/kernels/cuda/launch.hpp>
#include <shardkit/kernels/cuda/transform.cuh>
#include <shardkit/kernels/host/grad_stats.hpp>

#include <cub/block/block_reduce.cuh>
#include <cub/device/device_reduce.cuh>
#include <cuda/functional>
#include <cuda/std/functional>
#include <cuda_runtime.h>
#include <thrust/iterator/transform_output_iterator.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN
namespace gpu {

//! The statistics in device memory: words as host::grad_stats::words (256 bins, then the
//! non-finite count), and the largest finite |element|'s bit pattern. Zero it (clear_stats)
//! before the first accumulate_stats.
struct device_grad_stats {
  unsigned long long words[host::grad_stats::bins + 1];
  unsigned long long max_abs_bits;
};

//! The host form of device statistics (copied back with copy_elements).
inline host::grad_stats to_host(const device_grad_stats& d) {
  host::grad_stats s;
  for (std::size_t i = 0; i < s.words.size(); ++i) s.words[i] = d.words[i];
  s.max_abs_bits = static_cast<std::uint32_t>(d.max_abs_bits);
  return s;
}

namespace detail {

//! The float bit pattern of a gradient element (bf16 and fp16 widened exactly), as the host's.
template <class G>
__device__ SHARDKIT_FORCEINLINE std::uint32_t stats_bits(G g) {
  if constexpr (std::is_same_v<G, bf16>)
    return static_cast<std::uint32_t>(g.bits) << 16;
  else
    return ::shardkit::detail::float_bits(to_float(g));
}

//! Adds `value` to shared counter `key`, combining the lanes of a warp that share a key first.
__device__ SHARDKIT_FORCEINLINE void add_counter(unsigned long long* counters, unsigned key,
                                                 std::uint32_t value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned active = __activemask();
  const unsigned peers = __match_any_sync(active, key);
  const unsigned lo = __reduce_add_sync(peers, value & 0xffffu);
  const unsigned hi = __reduce_add_sync(peers, value >> 16);
  if ((threadIdx.x & 31u) == static_cast<unsigned>(__ffs(peers) - 1)) {
    atomicAdd(counters + key,
              (static_cast<unsigned long long>(hi) << 16) + static_cast<unsigned long long>(lo));
  }
#else
  atomicAdd(counters + key, static_cast<unsigned long long>(value));
#endif
}

//! One pack of raw elements.
template <class G, int E>
struct raw_pack {
  G v[E];
};

//! One element: its bin and squared mantissa, or the non-finite counter and 1.
__device__ SHARDKIT_FORCEINLINE void stats_one(unsigned long long* counters, std::uint32_t u,
                                               std::uint32_t& max_bits) {
  const std::uint32_t a = u & 0x7fffffffu;
  const std::uint32_t e = a >> 23;
  if (e == 0xffu) {
    add_counter(counters, host::grad_stats::bins, 1u);
  } else {
    const std::uint32_t m = ((a & 0x7fffffu) | (e != 0 ? 0x800000u : 0u)) >> 8;
    add_counter(counters, e, m * m);
    max_bits = a > max_bits ? a : max_bits;
  }
}

template <class G>
__global__ void __launch_bounds__(grad_stats_policy.threads, grad_stats_policy.blocks_per_sm)
    grad_stats_kernel(const G* g, std::size_t n, vector_split split, device_grad_stats* out) {
  constexpr int threads = grad_stats_policy.threads;
  constexpr int counters = static_cast<int>(host::grad_stats::bins + 1);
  constexpr int E = pack_of<sizeof(G)>;
  using block_max = cub::BlockReduce<std::uint32_t, threads>;
  __shared__ unsigned long long bins[counters];
  __shared__ typename block_max::TempStorage temp;
  for (int t = static_cast<int>(threadIdx.x); t < counters; t += threads) bins[t] = 0;
  __syncthreads();
  std::uint32_t max_bits = 0;
  for_each_element_ilp<E, grad_stats_policy.unroll, raw_pack<G, E>>(
      split, 0, n, global_thread(), global_threads(),
      [&](std::size_t i) { stats_one(bins, stats_bits(g[i]), max_bits); },
      [&](std::size_t i, raw_pack<G, E>& r) { load_raw<G, E>(g + i, r.v); },
      [&](std::size_t, const raw_pack<G, E>& r) {
#pragma unroll
        for (int e = 0; e < E; ++e) stats_one(bins, stats_bits(r.v[e]), max_bits);
      });
  __syncthreads();
  const std::uint32_t block = block_max(temp).Reduce(max_bits, ::cuda::maximum<>{});
  if (threadIdx.x == 0 && block != 0) {
    atomicMax(&out->max_abs_bits, static_cast<unsigned long long>(block));
  }
  for (int t = static_cast<int>(threadIdx.x); t < counters; t += threads) {
    if (bins[t] != 0) atomicAdd(&out->words[t], bins[t]);
  }
}

template <class G>
__global__ void __launch_bounds__(copy_policy.threads, copy_policy.blocks_per_sm)
    nonfinite_kernel(const G* g, std::size_t n, vector_split split, unsigned long long* count) {
  constexpr int E = pack_of<sizeof(G)>;
  using block_sum = cub::BlockReduce<unsigned long long, copy_policy.threads>;
  __shared__ typename block_sum::TempStorage temp;
  unsigned long long c = 0;
  auto one = [&](std::uint32_t u) { c += (u & 0x7fffffffu) >= 0x7f800000u ? 1u : 0u; };
  for_each_element_ilp<E, copy_policy.unroll, raw_pack<G, E>>(
      split, 0, n, global_thread(), global_threads(), [&](std::size_t i) { one(stats_bits(g[i])); },
      [&](std::size_t i, raw_pack<G, E>& r) { load_raw<G, E>(g + i, r.v); },
      [&](std::size_t, const raw_pack<G, E>& r) {
#pragma unroll
        for (int e = 0; e < E; ++e) one(stats_bits(r.v[e]));
      });
  const unsigned long long block = block_sum(temp).Sum(c);
  if (threadIdx.x == 0 && block != 0) atomicAdd(count, block);
}

//! 1 for an infinity or NaN, else 0 (the test of nonfinite_kernel).
template <class G>
struct nonfinite_op {
  __device__ SHARDKIT_FORCEINLINE unsigned long long operator()(G g) const {
    return (stats_bits(g) & 0x7fffffffu) >= 0x7f800000u ? 1u : 0u;
  }
};

//! Turns the reduction's result into `*count + result` as it is written (one write, by one
//! thread, after the whole reduction): count_nonfinite adds to the count like its kernel.
struct add_to {
  const unsigned long long* count;
  __device__ SHARDKIT_FORCEINLINE unsigned long long operator()(unsigned long long x) const {
    return *count + x;
  }
};

}  // namespace detail

//! Sets `stats` (device memory) to zero, on `stream`.
inline void clear_stats(device_grad_stats* stats, device_stream stream) {
  ::shardkit::detail::cuda_check(cudaMemsetAsync(stats, 0, sizeof(device_grad_stats), stream),
                                 "cudaMemsetAsync(device_grad_stats)");
}

//! Adds the statistics of g[0, n) (device memory) to `stats` (device memory), on `stream`.
//! The result equals host::accumulate_stats over the same elements bit for bit, however the
//! gradient is split into calls.
template <float_storage G>
void accumulate_stats(const G* g, std::size_t n, device_grad_stats* stats, device_stream stream) {
  if (n == 0) return;
  const vector_split split = plan_vector_split({ref(g)}, n);
  const std::size_t items = split.vectorised ? split.packs + split.pack : n;
  detail::launch(&detail::grad_stats_kernel<G>, "gpu::accumulate_stats",
                 detail::grid_for(items, grad_stats_policy), grad_stats_policy.threads, stream, n,
                 g, n, split, stats);
}

//! Adds the number of infinities and NaNs in g[0, n) (device memory) to `*count` (device
//! memory), on `stream`: the overflow check without a norm, equal to host::count_nonfinite.
//! By default a cub::DeviceReduce::TransformReduce (temporary storage allocated and freed in
//! stream order, the sum added to `*count` by the one thread that writes the result); the
//! hand-written vectorised kernel with elementwise_path::handwritten, kept until a GPU
//! measurement decides between them.
template <float_storage G>
void count_nonfinite(const G* g, std::size_t n, unsigned long long* count, device_stream stream,
                     elementwise_path path = default_elementwise_path) {
  if (n == 0) return;
  if (path == elementwise_path::cub_transform) {
    const auto out = thrust::make_transform_output_iterator(count, detail::add_to{count});
    auto reduce = [&](void* temp, std::size_t& bytes) {
      return cub::DeviceReduce::TransformReduce(temp, bytes, g, out, static_cast<std::int64_t>(n),
                                                ::cuda::std::plus<>{}, detail::nonfinite_op<G>{},
                                                0ull, stream);
    };
    std::size_t bytes = 0;
    detail::cub_call("gpu::count_nonfinite (cub::DeviceReduce, sizing)", n,
                     [&] { return reduce(nullptr, bytes); });
    device_stream_scope scope(stream);
    // (never null: CUB takes a null pointer for a sizing query)
    buffer<std::byte, cuda_space> temp(std::max<std::size_t>(bytes, 1), nullptr,
                                       memory_category::comm_scratch);
    detail::cub_call("gpu::count_nonfinite (cub::DeviceReduce)", n,
                     [&] { return reduce(temp.data(), bytes); });
    return;  // temp is freed on `stream`, after the reduction
  }
  const vector_split split = plan_vector_split({ref(g)}, n);
  const std::size_t items = split.vectorised ? split.packs + split.pack : n;
  detail::launch(&detail::nonfinite_kernel<G>, "gpu::count_nonfinite",
                 detail::grid_for(items, copy_policy), copy_policy.threads, stream, n, g, n, split,
                 count);
}

}  // namespace gpu
SHARDKIT_NAMESPACE_END
