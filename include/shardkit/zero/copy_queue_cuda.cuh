//! \file zero/copy_queue_cuda.cuh
//! `copy_queue<cuda_space>`: the copies of an offloaded optimizer step (zero/offload_optimizer.hpp)
//! between device memory and host memory, on a copy stream of their own. A copy is one
//! cudaMemcpyAsync on that stream and its event is a CUDA event recorded after it, so wait(e)
//! returns once that copy and every earlier one are done, while the compute stream and the host
//! step go on. The host side of the copies (the optimizer's staging shards) is pinned with pin():
//! pageable memory would make every copy synchronous and slower.
//!
//! Include it (or <shardkit/cuda.cuh>) in a CUDA translation unit to offload a device engine:
//!     shardkit::engine<shardkit::thread_cuda_comm, shardkit::zero2_offload, shardkit::bf16>
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/zero/copy_queue.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

template <>
class copy_queue<cuda_space> {
 public:
  static constexpr bool available = true;
  //! Completion of a copy and of every copy enqueued before it.
  using event = std::uint64_t;

  //! The copy stream is created on the calling thread's current device.
  copy_queue() = default;
  copy_queue(const copy_queue&) = delete;
  copy_queue& operator=(const copy_queue&) = delete;
  //! Waits for the copies, then unpins what pin() pinned.
  ~copy_queue() {
    (void)cudaStreamSynchronize(stream_.get());
    for (void* p : pinned_) (void)cudaHostUnregister(p);
  }

  //! Copies `bytes` bytes of the device buffer `from` into the host buffer `to`.
  event to_host(const void* from, void* to, std::size_t bytes) {
    return enqueue(to, from, bytes, cudaMemcpyDeviceToHost);
  }
  //! Copies `bytes` bytes of the host buffer `from` into the device buffer `to`.
  event to_device(const void* from, void* to, std::size_t bytes) {
    return enqueue(to, from, bytes, cudaMemcpyHostToDevice);
  }
  //! Returns once copy `e` (and everything enqueued before it) is complete.
  void wait(event e) {
    std::size_t k = 0;  // events of copies up to e, oldest first
    while (k < events_.size() && events_[k].first <= e) ++k;
    if (k == 0) return;  // waited for already
    detail::cuda_check(cudaEventSynchronize(events_[k - 1].second.get()),
                       "copy_queue<cuda_space>: waiting for a copy");
    for (; k > 0; --k) {
      spare_.push_back(std::move(events_.front().second));
      events_.pop_front();
    }
  }
  //! Every copy enqueued so far is complete.
  void synchronize() {
    detail::cuda_check(cudaStreamSynchronize(stream_.get()),
                       "copy_queue<cuda_space>: waiting for the copies");
    while (!events_.empty()) {
      spare_.push_back(std::move(events_.front().second));
      events_.pop_front();
    }
  }
  //! Copies enqueued since construction.
  std::uint64_t copies() const noexcept { return issued_; }
  //! The copy stream.
  cudaStream_t stream() const noexcept { return stream_.get(); }

  //! Page-locks `bytes` bytes of host memory at `p` for the lifetime of this queue (the host
  //! side of its copies). Raises cuda_error naming the bytes when the system refuses.
  void pin(void* p, std::size_t bytes) {
    if (p == nullptr || bytes == 0) return;
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
    if (e == cudaErrorHostMemoryAlreadyRegistered) {  // shares a page with pinned memory
      (void)cudaGetLastError();
      return;
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw cuda_error(static_cast<int>(e),
                       detail::concat("copy_queue<cuda_space>: pinning ", bytes,
                                      " bytes of host memory for the offloaded step failed (",
                                      cudaGetErrorString(e),
                                      "); the staging shards must be page-locked to stream"));
    }
    pinned_.push_back(p);
  }

 private:
  event enqueue(void* to, const void* from, std::size_t bytes, cudaMemcpyKind kind) {
    ++issued_;
    if (bytes != 0) {
      detail::cuda_check(
          cudaMemcpyAsync(to, from, bytes, kind, stream_.get()),
          detail::concat("copy_queue<cuda_space>: cudaMemcpyAsync of ", bytes, " bytes ",
                         kind == cudaMemcpyDeviceToHost ? "to the host" : "to the device"));
    }
    cuda_event ev = spare_.empty() ? cuda_event() : std::move(spare_.back());
    if (!spare_.empty()) spare_.pop_back();
    ev.record(stream_.get());
    events_.emplace_back(issued_, std::move(ev));
    return issued_;
  }

  cuda_stream stream_;
  std::deque<std::pair<event, cuda_event>> events_;  // recorded, not yet waited for, in order
  std::vector<cuda_event> spare_;                    // events to record again
  std::vector<void*> pinned_;
  std::uint64_t issued_ = 0;
};

SHARDKIT_NAMESPACE_END
