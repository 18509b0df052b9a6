//! \file kernels/cuda/reduce.cuh
//! The rank-ordered reduction on the GPU, the device twin of kernels/host/reduce.hpp:
//!     out[i] = in[0][i] ∘ in[1][i] ∘ ... ∘ in[k-1][i]
//! always in this order; fp32, bf16 and fp16 accumulate in fp32 and round once, double in
//! double, integers in their own type; max/min let a NaN win as the host does. So the device
//! result equals host::reduce_ordered bit for bit (adds and one division: nothing to contract),
//! which is what keeps a device communicator's reductions identical to the thread
//! communicator's. `out` may be one of the inputs.
//!
//! Sources are k device pointers (up to max_inline_sources in the launch's parameters, more
//! through a table in device memory) or k arrays at a fixed stride (the all-to-all receive
//! buffer of a deterministic reduce-scatter).
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/cuda_memory.cuh>
#include <shardkit/core/device.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/reduce_op.hpp>
#include <shardkit/kernels/cuda/common.cuh>
#include <shardkit/kernels/cuda/launch.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace gpu {

namespace detail {

//! Where source q of a reduction starts.
template <class T>
struct reduce_sources {
  const T* inline_ptr[max_inline_sources];  // when table == nullptr and stride == 0
  const T* const* table;                    // device table of k pointers, or nullptr
  const T* base;                            // strided form: source q at base + q·stride
  std::size_t stride;                       // elements; 0 when not strided

  __device__ SHARDKIT_FORCEINLINE const T* get(std::size_t q) const {
    if (stride != 0) return base + q * stride;
    if (table != nullptr) return table[q];
    return inline_ptr[q];
  }
};

//! The type a reduction of T accumulates in.
template <class T>
using reduce_acc_t = std::conditional_t<float_storage<T>, float, T>;

template <class A>
__device__ SHARDKIT_FORCEINLINE A reduce_combine(A acc, A x, reduce_op op) {
  switch (op) {
    case reduce_op::sum:
    case reduce_op::avg:
      return static_cast<A>(acc + x);
    case reduce_op::max:
      if constexpr (std::is_floating_point_v<A>) {
        if (x > acc || x != x) acc = x;  // NaN wins, as on the host
      } else {
        if (x > acc) acc = x;
      }
      return acc;
    case reduce_op::min:
      if constexpr (std::is_floating_point_v<A>) {
        if (x < acc || x != x) acc = x;
      } else {
        if (x < acc) acc = x;
      }
      return acc;
  }
  return acc;
}

template <class A>
__device__ SHARDKIT_FORCEINLINE A reduce_finish(A acc, std::size_t k, reduce_op op) {
  if (op == reduce_op::avg) return static_cast<A>(acc / static_cast<A>(k));
  return acc;
}

template <class T>
__global__ void __launch_bounds__(reduce_policy.threads, reduce_policy.blocks_per_sm)
    reduce_kernel(const __grid_constant__ reduce_sources<T> src, std::size_t k, T* out,
                  std::size_t n, reduce_op op, vector_split split) {
  using A = reduce_acc_t<T>;
  constexpr int E = pack_of<sizeof(T)>;
  for_each_element<E>(
      split, 0, n, global_thread(), global_threads(),
      [&](std::size_t i) {
        A acc = widen(src.get(0)[i]);
        for (std::size_t q = 1; q < k; ++q) acc = reduce_combine<A>(acc, widen(src.get(q)[i]), op);
        out[i] = narrow<T>(reduce_finish(acc, k, op));
      },
      [&](std::size_t i) {
        T raw[E];
        A acc[E];
        load_raw<T, E>(src.get(0) + i, raw);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = widen(raw[e]);
        for (std::size_t q = 1; q < k; ++q) {
          load_raw<T, E>(src.get(q) + i, raw);
#pragma unroll
          for (int e = 0; e < E; ++e) acc[e] = reduce_combine<A>(acc[e], widen(raw[e]), op);
        }
#pragma unroll
        for (int e = 0; e < E; ++e) raw[e] = narrow<T>(reduce_finish(acc[e], k, op));
        store_raw<T, E>(out + i, raw);
      });
}

template <class T>
void launch_reduce(const reduce_sources<T>& src, std::size_t k, T* out, std::size_t n, reduce_op op,
                   const vector_split& split, cudaStream_t stream) {
  const std::size_t items = split.vectorised ? split.packs + split.pack : n;
  launch(&reduce_kernel<T>, "gpu::reduce_ordered", grid_for(items, reduce_policy),
         reduce_policy.threads, stream, n, src, k, out, n, op, split);
}

}  // namespace detail

//! Reduces k device arrays of n elements element-wise in the fixed order in[0], ..., in[k-1]
//! into `out` (device memory; may be one of the inputs), on `stream`. `in` is a host array of k
//! device pointers. Equal to host::reduce_ordered bit for bit.
template <element_type T>
void reduce_ordered(const T* const* in, std::size_t k, T* out, std::size_t n, reduce_op op,
                    device_stream stream) {
  if (n == 0 || k == 0) return;
  detail::reduce_sources<T> src{};
  std::vector<array_ref> arrays;
  arrays.reserve(k + 1);
  for (std::size_t q = 0; q < k; ++q) arrays.push_back(ref(in[q]));
  arrays.push_back(ref(out));
  const vector_split split = plan_vector_split(arrays, n);
  if (k <= max_inline_sources) {
    for (std::size_t q = 0; q < k; ++q) src.inline_ptr[q] = in[q];
    detail::launch_reduce(src, k, out, n, op, split, stream);
    return;
  }
  // More sources than fit in the launch parameters: a table in device memory, freed on the same
  // stream after the kernel (stream-ordered).
  device_stream_scope scope(stream);
  buffer<const T*, cuda_space> table(k, nullptr, memory_category::comm_scratch);
  copy_bytes_async(table.data(), in, k * sizeof(const T*), stream);
  src.table = table.data();
  detail::launch_reduce(src, k, out, n, op, split, stream);
}

//! Reduces k arrays of n elements that lie at `base + q·stride` (q = 0..k-1, stride >= n
//! elements) in rank order into `out`, on `stream`.
template <element_type T>
void reduce_strided(const T* base, std::size_t stride, std::size_t k, T* out, std::size_t n,
                    reduce_op op, device_stream stream) {
  if (n == 0 || k == 0) return;
  if (stride < n) {
    ::shardkit::detail::raise("reduce_strided: stride ", stride, " is shorter than the ", n,
                              " elements of each source");
  }
  detail::reduce_sources<T> src{};
  src.base = base;
  src.stride = stride;
  // Every source is 16-byte aligned like the first when the stride is a multiple of 16 bytes.
  const vector_split split =
      (stride * sizeof(T)) % 16 == 0 ? plan_vector_split({ref(base), ref(out)}, n) : vector_split{};
  detail::launch_reduce(src, k, out, n, op, split, stream);
}

}  // namespace gpu
SHARDKIT_NAMESPACE_END
