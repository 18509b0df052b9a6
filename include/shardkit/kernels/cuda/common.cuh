//! \file kernels/cuda/common.cuh
//! What every CUDA kernel of shardkit shares: 16-byte pack loads and stores with the exact
//! conversions of core/dtype.hpp (the same functions the host uses, so a bf16 or fp16 value
//! widens and rounds to the same bits on both), the loop that walks a range of elements as a
//! scalar head, whole packs and a scalar tail (kernels/cuda/launch.hpp), and the checked launch.
//!
//! Floating-point contraction: kernels call the per-element math of kernels/math.hpp with
//! V = float, and nvcc fuses a multiply and a dependent add into one FMA unless told not to.
//! Translation units that want the device to match host::fused_step_scalar (and the baseline
//! host build) bit for bit compile with `-fmad=false`; shardkit's own tests and benchmarks do.
//! Either way every element goes through the same code, so device results never depend on where
//! an element falls in a pack, a chunk or a shard.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/dtype.hpp>
#include <shardkit/kernels/cuda/launch.hpp>

#include <cub/version.cuh>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

// The kernels use CCCL 2.8 APIs (::cuda::maximum, cub::DeviceTransform,
// cub::DeviceMemcpy::Batched).
#if CUB_VERSION < 200800
#error "shardkit's CUDA backend needs CCCL 2.8 or later (CUDA 12.9 or later)"
#endif

SHARDKIT_NAMESPACE_BEGIN
namespace gpu {
namespace detail {

//! Elements per pack when the smallest element touched has `Bytes` bytes.
template <std::size_t Bytes>
inline constexpr int pack_of = static_cast<int>(pack_elems(Bytes));

//! Widens a storage value to the type the kernels compute in (float for the float types,
//! itself otherwise).
template <class T>
__device__ SHARDKIT_FORCEINLINE auto widen(T v) {
  if constexpr (float_storage<T>)
    return to_float(v);
  else
    return v;
}

//! Rounds a computed value back to storage T (nearest even for bf16/fp16).
template <class T, class A>
__device__ SHARDKIT_FORCEINLINE T narrow(A v) {
  if constexpr (float_storage<T>)
    return from_float<T>(v);
  else
    return static_cast<T>(v);
}

//! One 16-byte load and store of global memory (ld.global.ca.v4 / st.global.wb.v4: the default
//! caching, spelled out so that the compiler neither splits an unrolled group of stores into
//! 32-bit ones nor loses the global address space of pointers read from a table). `p` is
//! 16-byte aligned.
__device__ SHARDKIT_FORCEINLINE uint4 load16(const void* p) {
  return __ldca(static_cast<const uint4*>(p));
}
__device__ SHARDKIT_FORCEINLINE void store16(void* p, uint4 v) {
  __stwb(static_cast<uint4*>(p), v);
}

//! E raw elements from a 16-byte aligned address (E·sizeof(T) a multiple of 16).
template <class T, int E>
__device__ SHARDKIT_FORCEINLINE void load_raw(const T* p, T (&out)[E]) {
  constexpr int words = static_cast<int>(E * sizeof(T) / 16);
  static_assert(words * 16 == static_cast<int>(E * sizeof(T)),
                "a pack must be whole 16-byte words");
  uint4 v[words];
#pragma unroll
  for (int j = 0; j < words; ++j) v[j] = load16(p + j * (16 / sizeof(T)));
  __builtin_memcpy(out, v, sizeof(out));
}

//! Stores E raw elements to a 16-byte aligned address.
template <class T, int E>
__device__ SHARDKIT_FORCEINLINE void store_raw(T* p, const T (&in)[E]) {
  constexpr int words = static_cast<int>(E * sizeof(T) / 16);
  static_assert(words * 16 == static_cast<int>(E * sizeof(T)),
                "a pack must be whole 16-byte words");
  uint4 v[words];
  __builtin_memcpy(v, in, sizeof(in));
#pragma unroll
  for (int j = 0; j < words; ++j) store16(p + j * (16 / sizeof(T)), v[j]);
}

//! E elements of fp32/bf16/fp16 storage as floats.
template <class T, int E>
__device__ SHARDKIT_FORCEINLINE void load_pack(const T* p, float (&out)[E]) {
  T raw[E];
  load_raw<T, E>(p, raw);
#pragma unroll
  for (int e = 0; e < E; ++e) out[e] = to_float(raw[e]);
}

//! E floats rounded to fp32/bf16/fp16 storage.
template <class T, int E>
__device__ SHARDKIT_FORCEINLINE void store_pack(T* p, const float (&in)[E]) {
  T raw[E];
#pragma unroll
  for (int e = 0; e < E; ++e) raw[e] = from_float<T>(in[e]);
  store_raw<T, E>(p, raw);
}

//! Walks elements [begin, end) of a run split by `s`: `scalar(i)` for elements outside whole
//! packs, `packed(i)` for the first element of each whole pack (E elements, E == s.pack). Thread
//! `tid` of `threads` takes every threads-th item, so consecutive threads touch consecutive
//! elements or packs (coalesced).
template <int E, class Scalar, class Packed>
__device__ SHARDKIT_FORCEINLINE void for_each_element(const vector_split& s, std::size_t begin,
                                                      std::size_t end, std::size_t tid,
                                                      std::size_t threads, Scalar&& scalar,
                                                      Packed&& packed) {
  const range_split r = split_range(s, begin, end);
  for (std::size_t i = begin + tid; i < r.vec_begin; i += threads) scalar(i);
  const std::size_t step = threads * static_cast<std::size_t>(E);
  for (std::size_t i = r.vec_begin + tid * E; i < r.vec_end; i += step) packed(i);
  for (std::size_t i = r.vec_end + tid; i < end; i += threads) scalar(i);
}

//! for_each_element for memory-bound bodies: the whole packs are processed `U` at a time, all U
//! loads issued before the first store (several 16-byte loads in flight per thread), through
//! `load(i, regs)` and `store(i, regs)` on a `Regs` per pack. Same elements, same order of
//! operations per element: the results equal for_each_element's.
template <int E, int U, class Regs, class Scalar, class Load, class Store>
__device__ SHARDKIT_FORCEINLINE void for_each_element_ilp(const vector_split& s, std::size_t begin,
                                                          std::size_t end, std::size_t tid,
                                                          std::size_t threads, Scalar&& scalar,
                                                          Load&& load, Store&& store) {
  const range_split r = split_range(s, begin, end);
  for (std::size_t i = begin + tid; i < r.vec_begin; i += threads) scalar(i);
  const std::size_t step = threads * static_cast<std::size_t>(E);
  std::size_t i = r.vec_begin + tid * E;
  if (r.vec_end > r.vec_begin) {
    for (; i + (U - 1) * step < r.vec_end; i += U * step) {
      Regs regs[U];
#pragma unroll
      for (int u = 0; u < U; ++u) load(i + u * step, regs[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) store(i + u * step, regs[u]);
    }
    for (; i < r.vec_end; i += step) {
      Regs regs;
      load(i, regs);
      store(i, regs);
    }
  }
  for (std::size_t j = r.vec_end + tid; j < end; j += threads) scalar(j);
}

//! Global thread index and thread count of a grid-stride launch.
__device__ SHARDKIT_FORCEINLINE std::size_t global_thread() {
  return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ SHARDKIT_FORCEINLINE std::size_t global_threads() {
  return static_cast<std::size_t>(gridDim.x) * blockDim.x;
}

//! Launches `kernel<<<grid, threads, 0, stream>>>(args...)` and checks it (cudaGetLastError),
//! raising cuda_error that names the kernel, its geometry and the element count. An error an
//! earlier call left on this thread is cleared first, so it is not blamed on this kernel (a
//! sticky one is raised before the launch, saying so).
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), std::string_view name, std::size_t grid, int threads,
            cudaStream_t stream, std::size_t elements, Args&&... args) {
  ::shardkit::detail::clear_error_before_launch(name);
  kernel<<<static_cast<unsigned>(grid), static_cast<unsigned>(threads), 0, stream>>>(
      static_cast<Params>(args)...);
  ::shardkit::detail::check_launch(name, grid, static_cast<std::size_t>(threads), elements);
}

//! Blocks for a grid-stride launch of `items` items under `p` on the current device.
inline std::size_t grid_for(std::size_t items, const launch_policy& p) {
  return grid_blocks(items, p, cuda_sm_count());
}

}  // namespace detail
}  // namespace gpu
SHARDKIT_NAMESPACE_END
