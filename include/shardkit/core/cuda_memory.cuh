//! \file core/cuda_memory.cuh
//! Device memory: `space_allocator<cuda_space>`, so that `buffer<T, cuda_space>` (and through it
//! every ledger-counted allocation of the library) lives on the GPU.
//!
//! Allocation goes through the installed device_memory_resource (core/device.hpp), by default
//! the CUDA stream-ordered allocator (cudaMallocAsync/cudaFreeAsync), ordered on the calling
//! thread's current_device_stream() (the legacy default stream unless a device_stream_scope says
//! otherwise). New buffers are zeroed with cudaMemsetAsync on the same stream. Work on another
//! stream that uses a buffer must be ordered after its allocation and before its release (an
//! event, or a stream that synchronises with the legacy default stream).
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/device.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>

#include <cuda_runtime.h>

#include <cstddef>

SHARDKIT_CORE_NAMESPACE_BEGIN

//! The default resource: CUDA's stream-ordered allocator on the current device's default pool.
class cuda_async_resource final : public device_memory_resource {
 public:
  void* allocate(std::size_t bytes, device_stream stream) override {
    void* p = nullptr;
    core_detail::cuda_check(cudaMallocAsync(&p, bytes, stream),
                       core_detail::concat("cudaMallocAsync of ", bytes, " bytes"));
    return p;
  }
  void deallocate(void* p, std::size_t, device_stream stream) noexcept override {
    (void)cudaFreeAsync(p, stream);
  }
  const char* name() const noexcept override { return "cuda_malloc_async"; }
};

//! cudaMalloc/cudaFree: synchronous allocation, for devices or drivers without memory pools.
class cuda_malloc_resource final : public device_memory_resource {
 public:
  void* allocate(std::size_t bytes, device_stream) override {
    void* p = nullptr;
    core_detail::cuda_check(cudaMalloc(&p, bytes), core_detail::concat("cudaMalloc of ", bytes, " bytes"));
    return p;
  }
  void deallocate(void* p, std::size_t, device_stream) noexcept override { (void)cudaFree(p); }
  const char* name() const noexcept override { return "cuda_malloc"; }
};

namespace core_detail {
inline cuda_async_resource& default_device_resource() noexcept {
  static cuda_async_resource r;
  return r;
}
}  // namespace core_detail

//! Device memory for buffer<T, cuda_space>: the installed resource (default cudaMallocAsync),
//! ordered on current_device_stream(). zero() raises cuda_error when cudaMemsetAsync fails (from
//! buffer::zero(), which is noexcept, that terminates: device memory that cannot be written is
//! not a state to go on from).
template <>
struct space_allocator<cuda_space> {
  static constexpr std::size_t alignment = 256;
  static void* allocate(std::size_t bytes) {
    return core_detail::allocate_device_bytes(core_detail::default_device_resource(), bytes,
                                         current_device_stream());
  }
  static void deallocate(void* p, std::size_t bytes) noexcept {
    core_detail::deallocate_device_bytes(core_detail::default_device_resource(), p, bytes,
                                    current_device_stream());
  }
  static void zero(void* p, std::size_t bytes) {
    if (bytes == 0) return;
    core_detail::cuda_check(cudaMemsetAsync(p, 0, bytes, current_device_stream()),
                       core_detail::concat("cudaMemsetAsync of ", bytes, " bytes"));
  }
};

//! Copies `bytes` between any two memories (host or device; cudaMemcpyDefault) on `stream`,
//! without waiting.
inline void copy_bytes_async(void* dst, const void* src, std::size_t bytes, device_stream stream) {
  if (bytes == 0 || dst == src) return;
  core_detail::cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream),
                     core_detail::concat("cudaMemcpyAsync of ", bytes, " bytes"));
}

//! Copies `n` elements between any two memories and waits for the copy (and everything before it
//! on `stream`) to finish.
template <class T>
void copy_elements(T* dst, const T* src, std::size_t n, device_stream stream = nullptr) {
  copy_bytes_async(dst, src, n * sizeof(T), stream);
  core_detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

SHARDKIT_CORE_NAMESPACE_END
