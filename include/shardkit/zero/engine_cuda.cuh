//! \file zero/engine_cuda.cuh
//! The ZeRO engine on CUDA device memory: the kernel set `detail::engine_kernels<cuda_space,
//! ...>` that `zero/engine.hpp` dispatches its element-wise work to when the communicator's
//! memory space is `cuda_space` (thread_cuda_comm, nccl_communicator). Include it in a CUDA
//! translation unit (nvcc) that instantiates such an engine:
//!
//!     #include <shardkit/comm/thread_cuda.cuh>
//!     #include <shardkit/zero/engine_cuda.cuh>
//!     shardkit::engine<shardkit::thread_cuda_comm, shardkit::zero2, shardkit::bf16> eng(
//!         comm, model, shardkit::adam_options{.lr = 1e-3f},
//!         shardkit::engine_options{.compute_stream = stream});
//!
//! Every buffer lives in device memory (counted by the engine's ledger as on the host) and is
//! allocated, zeroed and freed in stream order on the compute stream
//! (engine_options::compute_stream). Gradients handed to grad_ready() and tensors given to
//! copy_param_to() are device tensors; the work on them is enqueued on the compute stream, so a
//! framework produces gradients and consumes parameters on that stream (or orders its own
//! streams against it). Initial values stay host tensors (model_spec).
//!
//! Ordering against the collectives:
//!  - a communicator with set_compute_stream (nccl_communicator) gets the compute stream at
//!    construction; its collectives wait for the compute stream by themselves, and the engine
//!    makes later compute-stream work wait for an asynchronous collective with wait_on() — the
//!    host does not block, except at step() for the small control messages (statistics,
//!    overflow count, schedule check: one copy to the host and back).
//!  - the thread communicator on device memory (thread_cuda_comm) needs its inputs complete
//!    when a collective is called and is complete when wait() returns: the engine synchronises
//!    the compute stream before each collective and waits on the host for it.
//! Results equal the host engine's bit for bit when the translation unit is built with
//! -fmad=false (docs/cuda.md, "What is bit-identical").
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/cuda_memory.cuh>
#include <shardkit/core/device.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/cuda/convert.cuh>
#include <shardkit/kernels/cuda/grad_stats.cuh>
#include <shardkit/kernels/cuda/optimizer.cuh>
#include <shardkit/zero/engine.hpp>

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace detail {

template <float_storage Working, optimizer_policy Opt>
struct engine_kernels<cuda_space, Working, Opt> {
  static constexpr bool available = true;
  using step_run = engine_step_run<Working, Opt>;

  engine_kernels(device_stream compute, bool comm_orders_by_stream)
      : stream_(compute), stream_ordered_(comm_orders_by_stream) {}

  engine_kernels(const engine_kernels&) = delete;
  engine_kernels& operator=(const engine_kernels&) = delete;
  ~engine_kernels() {
    device_stream_scope scope(stream_);
    control_.release();
    stats_.release();
  }

  device_stream stream() const noexcept { return stream_; }

  //! Allocations, zeroing and frees of the engine's buffers in this scope run on the compute
  //! stream.
  device_stream_scope scope() const noexcept { return device_stream_scope(stream_); }

  //! Before a collective reads what the compute stream wrote: nothing for a stream-ordered
  //! communicator, a host wait for the compute stream otherwise.
  void before_collective() const {
    if (!stream_ordered_) synchronize();
  }
  //! After an asynchronous collective: later compute-stream work waits for it (wait_on), or,
  //! for a communicator without stream-ordered handles, the host waits.
  template <class Work>
  void finish(Work& w) const {
    if constexpr (requires { w.wait_on(stream_); }) {
      if (stream_ordered_) {
        w.wait_on(stream_);
        return;
      }
    }
    w.wait();
  }
  void synchronize() const {
    cuda_check(cudaStreamSynchronize(stream_), "engine: waiting for the compute stream");
  }

  void convert_in(const void* src, dtype t, Working* dst, std::size_t n) const {
    switch (t) {
      case dtype::f32:
        return gpu::convert(static_cast<const float*>(src), dst, n, stream_);
      case dtype::bf16:
        return gpu::convert(static_cast<const bf16*>(src), dst, n, stream_);
      case dtype::f16:
        return gpu::convert(static_cast<const fp16*>(src), dst, n, stream_);
      default:
        raise("engine: gradients must be fp32, bf16 or fp16, got ", name(t));
    }
  }
  void accumulate_in(const void* src, dtype t, Working* dst, std::size_t n) const {
    switch (t) {
      case dtype::f32:
        return gpu::accumulate(static_cast<const float*>(src), dst, n, stream_);
      case dtype::bf16:
        return gpu::accumulate(static_cast<const bf16*>(src), dst, n, stream_);
      case dtype::f16:
        return gpu::accumulate(static_cast<const fp16*>(src), dst, n, stream_);
      default:
        raise("engine: gradients must be fp32, bf16 or fp16, got ", name(t));
    }
  }
  void accumulate(const Working* src, Working* dst, std::size_t n) const {
    gpu::accumulate(src, dst, n, stream_);
  }
  void fill_zero(Working* p, std::size_t n) const {
    if (n == 0) return;
    cuda_check(cudaMemsetAsync(p, 0, n * sizeof(Working), stream_),
               "engine: cudaMemsetAsync of a staging bucket's padding");
  }
  void convert_out(const Working* src, void* dst, dtype t, std::size_t n) const {
    switch (t) {
      case dtype::f32:
        return gpu::convert(src, static_cast<float*>(dst), n, stream_);
      case dtype::bf16:
        return gpu::convert(src, static_cast<bf16*>(dst), n, stream_);
      case dtype::f16:
        return gpu::convert(src, static_cast<fp16*>(dst), n, stream_);
      default:
        raise("engine::copy_param_to: the tensor must be fp32, bf16 or fp16, got ", name(t));
    }
  }

  //! Host values converted on the host (the same integer code as the host engine), then copied
  //! to the device; waits, since the host staging is freed on return.
  template <float_storage D>
  void upload(const void* src, dtype t, D* dst, std::size_t n) const {
    if (n == 0) return;
    std::vector<D> tmp(n);
    host::convert(src, t, tmp.data(), dtype_of<D>, n);
    copy_bytes_async(dst, tmp.data(), n * sizeof(D), stream_);
    synchronize();
  }

  template <class Comm>
  void broadcast_host(Comm& comm, float* values, std::size_t n, int root) const {
    if (n == 0) return;
    buffer<float, cuda_space> dev;
    {
      auto s = scope();
      dev = buffer<float, cuda_space>(n, nullptr, memory_category::comm_scratch);
    }
    copy_bytes_async(dev.data(), values, n * sizeof(float), stream_);
    synchronize();
    comm.broadcast(dev.data(), n, root);
    copy_bytes_async(values, dev.data(), n * sizeof(float), stream_);
    synchronize();
    auto s = scope();
    dev.release();
  }

  //! The control messages: a small device buffer (uint64 words; the engine's messages hold at
  //! most 260), copied there and back with one host wait each way.
  template <class Comm, class T>
  void all_reduce_host(Comm& comm, T* values, std::size_t n, reduce_op op) {
    static_assert(sizeof(T) <= sizeof(std::uint64_t));
    if (n == 0) return;
    const std::size_t words = (n * sizeof(T) + 7) / 8;
    if (control_.size() < words) {
      auto s = scope();
      control_ = buffer<std::uint64_t, cuda_space>(std::max<std::size_t>(words, 512), nullptr,
                                                   memory_category::comm_scratch);
    }
    T* dev = reinterpret_cast<T*>(control_.data());
    copy_bytes_async(dev, values, n * sizeof(T), stream_);
    synchronize();
    comm.all_reduce(dev, dev, n, op);
    copy_bytes_async(values, dev, n * sizeof(T), stream_);
    synchronize();
  }

  //! Exact statistics on the device (bit-identical to the host's for any split), one copy of
  //! the 2 KB of words to the host.
  template <class ForEach>
  host::grad_stats grad_stats(ForEach&& for_each) {
    ensure_stats();
    gpu::clear_stats(stats_.data(), stream_);
    for_each([&](const Working* g, std::size_t n) {
      gpu::accumulate_stats(g, n, stats_.data(), stream_);
    });
    gpu::device_grad_stats h{};
    copy_bytes_async(&h, stats_.data(), sizeof h, stream_);
    synchronize();
    return gpu::to_host(h);
  }
  template <class ForEach>
  std::uint64_t count_nonfinite(ForEach&& for_each) {
    ensure_stats();
    gpu::clear_stats(stats_.data(), stream_);
    unsigned long long* count = &stats_.data()->words[host::grad_stats::bins];
    for_each([&](const Working* g, std::size_t n) { gpu::count_nonfinite(g, n, count, stream_); });
    unsigned long long h = 0;
    copy_bytes_async(&h, count, sizeof h, stream_);
    synchronize();
    return h;
  }

  //! Plans the fused step over the engine's runs once: one gpu::fused_step_table, groups =
  //! parameter groups.
  void prepare_step(const std::vector<step_run>& runs, std::size_t groups) {
    std::vector<typename table::run> t;
    t.reserve(runs.size());
    for (const auto& r : runs) {
      if (r.count == 0) continue;
      typename table::run x;
      x.params = r.params;
      for (std::size_t s = 0; s < Opt::state_count; ++s) x.state[s] = r.state[s];
      x.grads = r.grads;
      x.working_out = r.working;
      x.count = r.count;
      x.group = r.group;
      t.push_back(x);
    }
    table_ = std::make_unique<table>(std::span<const typename table::run>(t), groups, stream_);
  }
  void step(const std::vector<step_run>& /*runs*/,
            const std::vector<typename Opt::constants>& k) const {
    table_->launch(std::span<const typename Opt::constants>(k), stream_);
  }

 private:
  using table = gpu::fused_step_table<Opt, Working, Working>;

  void ensure_stats() {
    if (!stats_.empty()) return;
    auto s = scope();
    stats_ = buffer<gpu::device_grad_stats, cuda_space>(1, nullptr, memory_category::comm_scratch);
  }

  device_stream stream_ = nullptr;
  bool stream_ordered_ = false;
  std::unique_ptr<table> table_;
  buffer<std::uint64_t, cuda_space> control_;
  buffer<gpu::device_grad_stats, cuda_space> stats_;
};

}  // namespace detail
SHARDKIT_NAMESPACE_END
