//! \file core/device.hpp
//! The host-side vocabulary of the CUDA backend, usable without CUDA headers: stream and event
//! handle types, the `cuda_error` exception and its message format, the replaceable device
//! memory resource with the bookkeeping of live device allocations, and the calling thread's
//! current stream. The CUDA headers (core/cuda.cuh, core/cuda_memory.cuh, kernels/cuda/,
//! comm/nccl.cuh) build on it; host code can hold streams and install a resource with it alone.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

// The CUDA runtime's opaque handle types: cudaStream_t is `CUstream_st*`, cudaEvent_t is
// `CUevent_st*`. Declaring them here lets host-only code name streams and events.
struct CUstream_st;
struct CUevent_st;

SHARDKIT_CORE_NAMESPACE_BEGIN

//! A CUDA stream (the same type as cudaStream_t). nullptr is the legacy default stream.
using device_stream = ::CUstream_st*;
//! A CUDA event (the same type as cudaEvent_t).
using device_event = ::CUevent_st*;

//! A CUDA runtime call, or a kernel launch, failed. code() is the cudaError_t value.
class cuda_error : public error {
 public:
  cuda_error(int code, const std::string& what) : error(what), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

namespace core_detail {

//! The message of a failed CUDA call: "<what>: <name> (<code>): <description>".
inline std::string format_cuda_error(std::string_view what, int code, const char* name,
                                     const char* description) {
  return concat(what, ": ", name != nullptr ? name : "unknown CUDA error", " (", code,
                "): ", description != nullptr ? description : "no description");
}

//! What a failed kernel launch was: "kernel <name> (<grid> blocks of <threads> threads,
//! <elements> elements)".
inline std::string describe_launch(std::string_view kernel, std::size_t grid, std::size_t threads,
                                   std::size_t elements) {
  return concat("kernel ", kernel, " (", grid, " blocks of ", threads, " threads, ", elements,
                " elements)");
}

}  // namespace core_detail

//! Where shardkit's device memory comes from. The default (core/cuda_memory.cuh) is the CUDA
//! stream-ordered allocator, cudaMallocAsync/cudaFreeAsync. A framework with its own caching
//! allocator installs a resource that forwards to it (set_device_memory_resource).
class device_memory_resource {
 public:
  virtual ~device_memory_resource() = default;
  //! Returns `bytes` (> 0) bytes of device memory, usable by work ordered after this point of
  //! `stream`, aligned to at least 256 bytes. Throws (cuda_error or std::bad_alloc) on failure.
  virtual void* allocate(std::size_t bytes, device_stream stream) = 0;
  //! Frees memory that allocate() returned with the same byte count. Work already enqueued on
  //! `stream` may still use it; work on other streams must be ordered before this point.
  virtual void deallocate(void* p, std::size_t bytes, device_stream stream) noexcept = 0;
  //! A short name for messages.
  virtual const char* name() const noexcept = 0;
};

//! Device allocations made through shardkit that are alive now.
struct device_allocation_stats {
  std::size_t count = 0;       //!< live allocations
  std::size_t bytes = 0;       //!< their bytes
  std::size_t peak_bytes = 0;  //!< the most bytes live at once since the process started
};

namespace core_detail {

//! Process-wide state of device allocation: the installed resource (nullptr: the default of
//! core/cuda_memory.cuh) and the live allocations. The one piece of global state of the CUDA
//! backend, and the price of a replaceable allocator hook.
class device_memory_registry {
 public:
  //! Reserves a slot for an allocation of `bytes` and returns the resource to allocate it from
  //! (nullptr: the default). Paired with commit() or cancel().
  device_memory_resource* reserve(std::size_t bytes) {
    std::lock_guard lk(mu_);
    ++stats_.count;
    stats_.bytes += bytes;
    if (stats_.bytes > stats_.peak_bytes) stats_.peak_bytes = stats_.bytes;
    return resource_;
  }
  //! Undoes reserve() after the resource failed to allocate.
  void cancel(std::size_t bytes) noexcept {
    std::lock_guard lk(mu_);
    --stats_.count;
    stats_.bytes -= bytes;
  }
  //! Records that an allocation of `bytes` was freed; returns the resource it came from.
  device_memory_resource* release(std::size_t bytes) noexcept {
    std::lock_guard lk(mu_);
    if (stats_.count != 0) --stats_.count;
    stats_.bytes -= bytes <= stats_.bytes ? bytes : stats_.bytes;
    return resource_;
  }

  device_memory_resource* exchange(device_memory_resource* r) {
    std::lock_guard lk(mu_);
    if (stats_.count != 0) {
      raise<usage_error>("set_device_memory_resource: ", stats_.count,
                         " device allocation(s) of shardkit (", stats_.bytes,
                         " bytes) from the current resource '",
                         resource_ != nullptr ? resource_->name() : "cuda_malloc_async",
                         "' are still alive; install a resource before the first allocation or "
                         "after the last one is freed, since memory must return to the resource "
                         "it came from");
    }
    device_memory_resource* old = resource_;
    resource_ = r;
    return old;
  }

  device_memory_resource* current() const {
    std::lock_guard lk(mu_);
    return resource_;
  }

  device_allocation_stats stats() const {
    std::lock_guard lk(mu_);
    return stats_;
  }

 private:
  mutable std::mutex mu_;
  device_memory_resource* resource_ = nullptr;
  device_allocation_stats stats_;
};

inline device_memory_registry& device_registry() {
  static device_memory_registry r;
  return r;
}

inline device_stream& thread_device_stream() noexcept {
  thread_local device_stream s = nullptr;
  return s;
}

}  // namespace core_detail

//! Installs `r` as the source of every later device allocation of shardkit (nullptr restores
//! the default, cudaMallocAsync). Returns the previous one (nullptr: the default). Raises
//! usage_error while allocations from the current resource are alive. `r` must outlive its
//! allocations.
inline device_memory_resource* set_device_memory_resource(device_memory_resource* r) {
  return core_detail::device_registry().exchange(r);
}

//! The installed resource; nullptr means the default (cudaMallocAsync).
inline device_memory_resource* get_device_memory_resource() {
  return core_detail::device_registry().current();
}

//! Device allocations of shardkit alive now (through any resource).
inline device_allocation_stats live_device_allocations() {
  return core_detail::device_registry().stats();
}

//! The stream this thread's shardkit device allocations, frees and zeroing are ordered on
//! (buffer<T, cuda_space> has no stream argument). nullptr, the default, is the legacy default
//! stream, which orders them with all work on blocking streams.
inline device_stream current_device_stream() noexcept {
  return core_detail::thread_device_stream();
}

//! Sets the calling thread's current device stream for its lifetime (restoring the previous one
//! after), e.g. an engine's compute stream while it allocates and frees its buffers.
class device_stream_scope {
 public:
  explicit device_stream_scope(device_stream s) noexcept
      : previous_(core_detail::thread_device_stream()) {
    core_detail::thread_device_stream() = s;
  }
  device_stream_scope(const device_stream_scope&) = delete;
  device_stream_scope& operator=(const device_stream_scope&) = delete;
  ~device_stream_scope() { core_detail::thread_device_stream() = previous_; }

 private:
  device_stream previous_;
};

namespace core_detail {

//! Allocates through `fallback` or the installed resource, with the bookkeeping of
//! live_device_allocations(). Zero bytes give nullptr. A resource that returns nullptr is an
//! error that names the resource and the size.
inline void* allocate_device_bytes(device_memory_resource& fallback, std::size_t bytes,
                                   device_stream stream) {
  if (bytes == 0) return nullptr;
  device_memory_registry& reg = device_registry();
  device_memory_resource* installed = reg.reserve(bytes);
  device_memory_resource& r = installed != nullptr ? *installed : fallback;
  void* p = nullptr;
  try {
    p = r.allocate(bytes, stream);
  } catch (...) {
    reg.cancel(bytes);
    throw;
  }
  if (p == nullptr) {
    reg.cancel(bytes);
    raise<error>("device memory resource '", r.name(), "' returned no memory for ", bytes,
                 " bytes");
  }
  return p;
}

//! Frees memory from allocate_device_bytes (nullptr and zero bytes are no-ops).
inline void deallocate_device_bytes(device_memory_resource& fallback, void* p, std::size_t bytes,
                                    device_stream stream) noexcept {
  if (p == nullptr || bytes == 0) return;
  device_memory_resource* installed = device_registry().release(bytes);
  (installed != nullptr ? *installed : fallback).deallocate(p, bytes, stream);
}

}  // namespace core_detail

SHARDKIT_CORE_NAMESPACE_END
