//! \file core/cuda.cuh
//! The CUDA runtime underneath shardkit's CUDA backend: checked calls that raise cuda_error with
//! the call's name, checked kernel launches that name the kernel, device queries, and owning
//! stream and event handles. Include from CUDA translation units (nvcc) only.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/device.hpp>
#include <shardkit/core/error.hpp>

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <string_view>
#include <type_traits>
#include <utility>

static_assert(std::is_same_v<::shardkit::device_stream, cudaStream_t>,
              "shardkit::device_stream must be cudaStream_t");
static_assert(std::is_same_v<::shardkit::device_event, cudaEvent_t>,
              "shardkit::device_event must be cudaEvent_t");

SHARDKIT_CORE_NAMESPACE_BEGIN

namespace core_detail {

//! Raises cuda_error naming `what` unless `e` is cudaSuccess.
inline void cuda_check(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess) {
    throw cuda_error(
        static_cast<int>(e),
        format_cuda_error(what, static_cast<int>(e), cudaGetErrorName(e), cudaGetErrorString(e)));
  }
}

//! True when `e` is the error of a CUDA call just made, not a sticky one the context holds:
//! after cudaGetLastError reset it, cudaPeekAtLastError no longer reports it.
inline bool cuda_error_cleared() noexcept {
  return cudaPeekAtLastError() == cudaSuccess;
}

//! Before a launch: clears an error an earlier call left on this thread (a failed call whose
//! result its caller discarded), so that check_launch after the launch reports the launch's
//! own error only. A sticky error (an earlier kernel's fault: the context is unusable) cannot
//! be cleared; it is raised here, naming the kernel that was not launched and saying the error
//! came before it.
inline void clear_error_before_launch(std::string_view kernel) {
  const cudaError_t stale = cudaGetLastError();
  if (stale == cudaSuccess || cuda_error_cleared()) return;
  throw cuda_error(static_cast<int>(stale),
                   format_cuda_error(concat("before launching ", kernel,
                                            " (an earlier call or kernel left this sticky error; "
                                            "the kernel was not launched)"),
                                     static_cast<int>(stale), cudaGetErrorName(stale),
                                     cudaGetErrorString(stale)));
}

//! Checks the launch that just happened on this thread (cudaGetLastError after
//! clear_error_before_launch), naming the kernel and its geometry in the error.
inline void check_launch(std::string_view kernel, std::size_t grid, std::size_t threads,
                         std::size_t elements) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw cuda_error(
        static_cast<int>(e),
        format_cuda_error(concat("launching ", describe_launch(kernel, grid, threads, elements)),
                          static_cast<int>(e), cudaGetErrorName(e), cudaGetErrorString(e)));
  }
}

}  // namespace core_detail

//! Number of CUDA devices this process can use; 0 when there is none or no driver (any error
//! of cudaGetDeviceCount counts as none, and is cleared).
inline int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

//! The calling thread's current device.
inline int cuda_current_device() {
  int d = 0;
  core_detail::cuda_check(cudaGetDevice(&d), "cudaGetDevice");
  return d;
}

//! Multiprocessors of `device` (cached per device; the grid sizes of shardkit's kernels).
inline int cuda_sm_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < static_cast<int>(cache.size())) {
    const int c = cache[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
    if (c != 0) return c;
  }
  int n = 0;
  core_detail::cuda_check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
                          "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
  if (device >= 0 && device < static_cast<int>(cache.size())) {
    cache[static_cast<std::size_t>(device)].store(n, std::memory_order_relaxed);
  }
  return n;
}

//! Multiprocessors of the calling thread's current device.
inline int cuda_sm_count() {
  return cuda_sm_count(cuda_current_device());
}

//! Makes `device` current on the calling thread for the guard's lifetime (no-op when it is).
class cuda_device_guard {
 public:
  explicit cuda_device_guard(int device) : previous_(cuda_current_device()) {
    if (device != previous_) core_detail::cuda_check(cudaSetDevice(device), "cudaSetDevice");
    changed_ = device != previous_;
  }
  cuda_device_guard(const cuda_device_guard&) = delete;
  cuda_device_guard& operator=(const cuda_device_guard&) = delete;
  ~cuda_device_guard() {
    if (changed_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_;
  bool changed_ = false;
};

//! An owned CUDA stream (non-blocking: it does not synchronise with the legacy default stream).
class cuda_stream {
 public:
  cuda_stream() {
    core_detail::cuda_check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking),
                            "cudaStreamCreateWithFlags");
  }
  cuda_stream(cuda_stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  cuda_stream& operator=(cuda_stream&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  cuda_stream(const cuda_stream&) = delete;
  cuda_stream& operator=(const cuda_stream&) = delete;
  ~cuda_stream() { reset(); }

  cudaStream_t get() const noexcept { return s_; }
  operator cudaStream_t() const noexcept { return s_; }  // NOLINT(google-explicit-constructor)
  //! Blocks the host until the stream's work is done.
  void synchronize() const {
    core_detail::cuda_check(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
  }

 private:
  void reset() noexcept {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
    s_ = nullptr;
  }
  cudaStream_t s_ = nullptr;
};

//! An owned CUDA event (without timing unless asked for).
class cuda_event {
 public:
  explicit cuda_event(bool timing = false) {
    core_detail::cuda_check(
        cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming),
        "cudaEventCreateWithFlags");
  }
  cuda_event(cuda_event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  cuda_event& operator=(cuda_event&& o) noexcept {
    if (this != &o) {
      reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  cuda_event(const cuda_event&) = delete;
  cuda_event& operator=(const cuda_event&) = delete;
  ~cuda_event() { reset(); }

  cudaEvent_t get() const noexcept { return e_; }
  //! Captures the work enqueued on `s` so far.
  void record(cudaStream_t s) {
    core_detail::cuda_check(cudaEventRecord(e_, s), "cudaEventRecord");
  }
  //! Makes later work on `s` wait for the captured work (no host blocking).
  void wait_on(cudaStream_t s) const {
    core_detail::cuda_check(cudaStreamWaitEvent(s, e_, 0), "cudaStreamWaitEvent");
  }
  //! True when the captured work is done.
  bool query() const {
    const cudaError_t e = cudaEventQuery(e_);
    if (e == cudaErrorNotReady) return false;
    core_detail::cuda_check(e, "cudaEventQuery");
    return true;
  }
  void synchronize() const {
    core_detail::cuda_check(cudaEventSynchronize(e_), "cudaEventSynchronize");
  }

 private:
  void reset() noexcept {
    if (e_ != nullptr) (void)cudaEventDestroy(e_);
    e_ = nullptr;
  }
  cudaEvent_t e_ = nullptr;
};

SHARDKIT_CORE_NAMESPACE_END
