//! \file comm/thread_cuda.cuh
//! The thread communicator on device memory: `thread_communicator<cuda_space>`, N ranks as
//! threads of one process sharing one GPU (or several GPUs with peer access). The rendezvous,
//! matching checks, timeouts and aborts are comm/thread.hpp's; this header supplies the data
//! movement: device-to-device copies and the rank-ordered reduction kernel
//! (kernels/cuda/reduce.cuh), so results are bit-identical to the host thread communicator's.
//!
//! Synchronisation. A collective's transfers run on the per-thread default stream
//! (cudaStreamPerThread) of the thread that executes it: the rank's own thread for a synchronous
//! collective, its progress thread for an asynchronous one, so an asynchronous collective
//! overlaps the rank's compute. Before every rendezvous that follows a transfer the transport
//! waits for that stream (fence), so when rank q passes the rendezvous everything every rank
//! wrote is complete; the collective returns (or its wait() returns) with the results in device
//! memory, visible to work on any stream.
//!
//! Preconditions (as for host memory, made explicit): the inputs are complete when the collective
//! is called (synchronise the stream that produced them, or record and wait an event), and no
//! stream writes the buffers until it returns or its wait() returns. Every transfer runs on the
//! device that holds its destination; every source and destination must be device memory
//! (invalid_argument names the one that is not). With ranks on several GPUs, the first transfer
//! between two devices enables peer access and access to the source device's default memory
//! pool (cudaMemPoolSetAccess: where the default resource allocates); devices that are not
//! peers raise invalid_argument.
//!
//!     shardkit::run_ranks<shardkit::cuda_space>(4, [&](shardkit::thread_cuda_comm& comm) {
//!       comm.all_reduce(dev_in, dev_out, n, shardkit::reduce_op::sum);   // device pointers
//!     });
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/thread.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/cuda_memory.cuh>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/cuda/reduce.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string_view>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace detail {

template <>
struct thread_transport<cuda_space> {
  //! Copies `bytes` to `dst` from `src` (device memory) on this thread's stream, on the device
  //! that holds `dst`.
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (dst == src || bytes == 0) return;
    const int device = device_of(dst, "the copy's destination", 0);
    grant_access(device, device_of(src, "the copy's source", 0));
    cuda_device_guard guard(device);
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamPerThread),
               concat("thread_communicator<cuda_space>: cudaMemcpyAsync of ", bytes,
                      " bytes on device ", device));
  }

  //! out = in[0] ∘ ... ∘ in[k-1] (device memory) on this thread's stream, on the device that
  //! holds `out`. Every source is checked (a host pointer read by the kernel would kill the
  //! context) and the output's device is given access to the sources on other devices.
  static void reduce(dtype t, const void* const* in, std::size_t k, void* out, std::size_t n,
                     reduce_op op) {
    if (n == 0 || k == 0) return;
    const int device = device_of(out, "the reduction's output", 0);
    for (std::size_t q = 0; q < k; ++q) grant_access(device, device_of(in[q], "source", q));
    cuda_device_guard guard(device);
    switch (t) {
      case dtype::f32:
        return run<float>(in, k, out, n, op);
      case dtype::f64:
        return run<double>(in, k, out, n, op);
      case dtype::bf16:
        return run<bf16>(in, k, out, n, op);
      case dtype::f16:
        return run<fp16>(in, k, out, n, op);
      case dtype::i32:
        return run<std::int32_t>(in, k, out, n, op);
      case dtype::i64:
        return run<std::int64_t>(in, k, out, n, op);
      case dtype::u8:
        return run<std::uint8_t>(in, k, out, n, op);
      case dtype::u32:
        return run<std::uint32_t>(in, k, out, n, op);
      case dtype::u64:
        return run<std::uint64_t>(in, k, out, n, op);
    }
  }

  //! Waits for everything this thread enqueued (on every device it used since the last fence).
  static void fence() {
    auto& used = devices_used();
    for (int d : used) {
      cuda_device_guard guard(d);
      cuda_check(
          cudaStreamSynchronize(cudaStreamPerThread),
          concat("thread_communicator<cuda_space>: waiting for the transfers on device ", d));
    }
    used.clear();
  }

 private:
  template <class T>
  static void run(const void* const* in, std::size_t k, void* out, std::size_t n, reduce_op op) {
    std::vector<const T*> src(k);
    for (std::size_t q = 0; q < k; ++q) src[q] = static_cast<const T*>(in[q]);
    gpu::reduce_ordered(src.data(), k, static_cast<T*>(out), n, op, cudaStreamPerThread);
  }

  static std::vector<int>& devices_used() {
    thread_local std::vector<int> used;
    return used;
  }

  // The device holding `p`, remembered for fence(). A pointer the runtime does not know as device
  // memory (host memory, pinned or not) raises invalid_argument naming its role: this is the
  // device transport.
  static int device_of(const void* p, const char* role, std::size_t index) {
    cudaPointerAttributes a{};
    cuda_check(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
      const bool source = std::string_view(role) == "source";
      raise<invalid_argument>(
          "thread_communicator<cuda_space>: ",
          source ? concat("source ", index, " of the reduction") : std::string(role), " (buffer ",
          p, ") is ", a.type == cudaMemoryTypeHost ? "pinned host memory" : "not device memory",
          "; use thread_communicator<host_space> for host buffers");
    }
    auto& used = devices_used();
    if (std::find(used.begin(), used.end(), a.device) == used.end()) used.push_back(a.device);
    return a.device;
  }

  // Lets work on device `reader` read and write memory of device `owner` (ranks on several GPUs):
  // peer access, plus access to `owner`'s default memory pool, where the default resource
  // (cudaMallocAsync) allocates; peer access alone does not cover pool memory. Done once per pair
  // and process. Memory of another pool (a framework's allocator) needs the same grant from its
  // owner. Raises invalid_argument when the two devices cannot access each other.
  static void grant_access(int reader, int owner) {
    if (reader == owner) return;
    static std::mutex mutex;
    static std::vector<std::pair<int, int>> granted;
    std::lock_guard lock(mutex);
    if (std::find(granted.begin(), granted.end(), std::pair{reader, owner}) != granted.end())
      return;
    int can = 0;
    cuda_check(cudaDeviceCanAccessPeer(&can, reader, owner), "cudaDeviceCanAccessPeer");
    if (can == 0) {
      raise<invalid_argument>("thread_communicator<cuda_space>: device ", reader,
                              " cannot access the memory of device ", owner,
                              " (no peer access between them): keep the ranks of one "
                              "communicator on devices that are peers");
    }
    {
      cuda_device_guard guard(reader);
      const cudaError_t e = cudaDeviceEnablePeerAccess(owner, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // not an error here: clear it
      } else {
        cuda_check(e, concat("cudaDeviceEnablePeerAccess(", owner, ") on device ", reader));
      }
    }
    cudaMemPool_t pool = nullptr;
    cuda_check(cudaDeviceGetDefaultMemPool(&pool, owner),
               concat("cudaDeviceGetDefaultMemPool(", owner, ")"));
    cudaMemAccessDesc access{};
    access.location.type = cudaMemLocationTypeDevice;
    access.location.id = reader;
    access.flags = cudaMemAccessFlagsProtReadWrite;
    cuda_check(
        cudaMemPoolSetAccess(pool, &access, 1),
        concat("cudaMemPoolSetAccess: device ", reader, " on the default pool of device ", owner));
    granted.emplace_back(reader, owner);
  }
};

}  // namespace detail

//! N ranks as threads sharing a GPU: the thread communicator over device memory.
using thread_cuda_comm = thread_communicator<cuda_space>;

static_assert(communicator<thread_cuda_comm>);

SHARDKIT_NAMESPACE_END
