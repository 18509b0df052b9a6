//! \file zero/space_ops_cuda.cuh
//! `space_ops<cuda_space>`: the element-wise work of the ZeRO components on CUDA device memory
//! (zero/space_ops.hpp has the host's and the interface). Every operation is enqueued on the
//! compute stream; buffers are allocated, zeroed and freed in stream order on it (scope()).
//!
//! Ordering against the collectives:
//!  - a communicator with set_compute_stream (nccl_communicator) orders its collectives after
//!    the compute stream's work by itself, and finish(work) makes later compute-stream work wait
//!    for an asynchronous collective with wait_on(): the host does not block, except for the
//!    small control messages (statistics, overflow count, schedule check: one copy to the host
//!    and back);
//!  - the thread communicator on device memory (thread_cuda_comm) needs its inputs complete when
//!    a collective is called and is complete when wait() returns: before_collective()
//!    synchronises the compute stream, finish() waits on the host.
//! Results equal the host's bit for bit when the translation unit is built with -fmad=false
//! (docs/cuda.md, "What is bit-identical").
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
#include <shardkit/zero/space_ops.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

template <>
struct space_ops<cuda_space> {
  static constexpr bool available = true;
  using space = cuda_space;

  space_ops() : space_ops(nullptr, false) {}
  //! Work on `compute`; `comm_orders_by_stream`: the communicator orders its collectives after
  //! the compute stream's work (see the file comment).
  space_ops(device_stream compute, bool comm_orders_by_stream)
      : stream_(compute),
        stream_ordered_(comm_orders_by_stream),
        scratch_(std::make_shared<scratch>(compute)) {}

  device_stream stream() const noexcept { return stream_; }

  //! Allocations, zeroing and frees in this scope run on the compute stream.
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
    detail::cuda_check(cudaStreamSynchronize(stream_), "waiting for the compute stream");
  }

  template <float_storage D>
  void convert_in(const void* src, dtype t, D* dst, std::size_t n) const {
    switch (t) {
      case dtype::f32:
        return gpu::convert(static_cast<const float*>(src), dst, n, stream_);
      case dtype::bf16:
        return gpu::convert(static_cast<const bf16*>(src), dst, n, stream_);
      case dtype::f16:
        return gpu::convert(static_cast<const fp16*>(src), dst, n, stream_);
      default:
        detail::raise("gradients must be fp32, bf16 or fp16, got ", name(t));
    }
  }
  template <float_storage D>
  void accumulate_in(const void* src, dtype t, D* dst, std::size_t n) const {
    switch (t) {
      case dtype::f32:
        return gpu::accumulate(static_cast<const float*>(src), dst, n, stream_);
      case dtype::bf16:
        return gpu::accumulate(static_cast<const bf16*>(src), dst, n, stream_);
      case dtype::f16:
        return gpu::accumulate(static_cast<const fp16*>(src), dst, n, stream_);
      default:
        detail::raise("gradients must be fp32, bf16 or fp16, got ", name(t));
    }
  }
  template <float_storage D>
  void accumulate(const D* src, D* dst, std::size_t n) const {
    gpu::accumulate(src, dst, n, stream_);
  }
  template <float_storage D>
  void fill_zero(D* p, std::size_t n) const {
    if (n == 0) return;
    detail::cuda_check(cudaMemsetAsync(p, 0, n * sizeof(D), stream_),
                       "cudaMemsetAsync of a buffer");
  }
  template <float_storage S>
  void convert_out(const S* src, void* dst, dtype t, std::size_t n) const {
    switch (t) {
      case dtype::f32:
        return gpu::convert(src, static_cast<float*>(dst), n, stream_);
      case dtype::bf16:
        return gpu::convert(src, static_cast<bf16*>(dst), n, stream_);
      case dtype::f16:
        return gpu::convert(src, static_cast<fp16*>(dst), n, stream_);
      default:
        detail::raise("copy_param_to: the tensor must be fp32, bf16 or fp16, got ", name(t));
    }
  }

  //! Host values converted on the host (the same integer code as the host), then copied to
  //! the device; waits, since the host staging is freed on return.
  template <float_storage D>
  void upload(const void* src, dtype t, D* dst, std::size_t n) const {
    if (n == 0) return;
    std::vector<D> tmp(n);
    host::convert(src, t, tmp.data(), dtype_of<D>, n);
    copy_bytes_async(dst, tmp.data(), n * sizeof(D), stream_);
    synchronize();
  }
  //! Device buffer to device buffer, converting (round to nearest even when narrowing).
  template <float_storage S, float_storage D>
  void convert_between(const S* src, D* dst, std::size_t n) const {
    gpu::convert(src, dst, n, stream_);
  }
  //! Device values into host memory of dtype t (waits for them).
  template <float_storage S>
  void download(const S* src, void* dst, dtype t, std::size_t n) const {
    if (n == 0) return;
    std::vector<S> tmp(n);
    copy_bytes_async(tmp.data(), src, n * sizeof(S), stream_);
    synchronize();
    host::convert(tmp.data(), dtype_of<S>, dst, t, n);
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

  //! The control messages: a small device buffer (uint64 words), copied there and back with
  //! one host wait each way.
  template <class Comm, class T>
  void all_reduce_host(Comm& comm, T* values, std::size_t n, reduce_op op) const {
    static_assert(sizeof(T) <= sizeof(std::uint64_t));
    if (n == 0) return;
    const std::size_t words = (n * sizeof(T) + 7) / 8;
    auto& control = scratch_->control;
    if (control.size() < words) {
      auto s = scope();
      control = buffer<std::uint64_t, cuda_space>(std::max<std::size_t>(words, 512), nullptr,
                                                  memory_category::comm_scratch);
    }
    T* dev = reinterpret_cast<T*>(control.data());
    copy_bytes_async(dev, values, n * sizeof(T), stream_);
    synchronize();
    comm.all_reduce(dev, dev, n, op);
    copy_bytes_async(values, dev, n * sizeof(T), stream_);
    synchronize();
  }

  //! All-gather of a small host array through a device buffer: `out` holds comm.size()·n.
  template <class Comm, class T>
  void all_gather_host(Comm& comm, const T* in, T* out, std::size_t n) const {
    if (n == 0) return;
    const std::size_t N = static_cast<std::size_t>(comm.size());
    buffer<T, cuda_space> dev;
    {
      auto s = scope();
      dev = buffer<T, cuda_space>(n * (N + 1), nullptr, memory_category::comm_scratch);
    }
    copy_bytes_async(dev.data() + N * n, in, n * sizeof(T), stream_);
    synchronize();
    comm.all_gather(dev.data() + N * n, dev.data(), n);
    copy_bytes_async(out, dev.data(), N * n * sizeof(T), stream_);
    synchronize();
    auto s = scope();
    dev.release();
  }

  //! Exact statistics on the device (bit-identical to the host's for any split), one copy of
  //! the 2 KB of words to the host.
  template <float_storage G, class ForEach>
  host::grad_stats grad_stats(ForEach&& for_each) const {
    gpu::device_grad_stats* stats = ensure_stats();
    gpu::clear_stats(stats, stream_);
    for_each([&](const G* g, std::size_t n) { gpu::accumulate_stats(g, n, stats, stream_); });
    gpu::device_grad_stats h{};
    copy_bytes_async(&h, stats, sizeof h, stream_);
    synchronize();
    return gpu::to_host(h);
  }
  template <float_storage G, class ForEach>
  std::uint64_t count_nonfinite(ForEach&& for_each) const {
    gpu::device_grad_stats* stats = ensure_stats();
    gpu::clear_stats(stats, stream_);
    unsigned long long* count = &stats->words[host::grad_stats::bins];
    for_each([&](const G* g, std::size_t n) { gpu::count_nonfinite(g, n, count, stream_); });
    unsigned long long h = 0;
    copy_bytes_async(&h, count, sizeof h, stream_);
    synchronize();
    return h;
  }

  //! The fused step over the engine's runs, planned once. Up to max_transform_runs runs: one
  //! gpu::fused_step per run, on its default path (cub::DeviceTransform); measured on an H200
  //! (benchmarks/bench_cuda.cu, 256Mi elements in two runs, bf16 gradients and working copy)
  //! at 0.98x a device-to-device copy of the same bytes, against 0.77x for the hand-written
  //! table kernel. More runs: one gpu::fused_step_table, where one launch beats many. Both give
  //! the same bits.
  template <optimizer_policy Opt, float_storage G, float_storage W>
  class step_plan {
   public:
    using run = step_run<Opt, G, W>;
    static constexpr std::size_t max_transform_runs = 16;

    step_plan(std::span<const run> runs, std::size_t groups, device_stream stream)
        : stream_(stream) {
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
      if (t.size() <= max_transform_runs) {
        for (const auto& x : t) {
          if (x.group >= groups) {
            detail::raise("step_plan: a run of group ", x.group, " but ", groups, " group(s)");
          }
        }
        groups_ = groups;
        runs_ = std::move(t);
        return;
      }
      table_ = std::make_unique<table>(std::span<const typename table::run>(t), groups, stream);
    }
    void launch(std::span<const typename Opt::constants> k) const {
      if (table_) {
        table_->launch(k, stream_);
        return;
      }
      if (k.size() != groups_) {
        detail::raise("step_plan::launch: ", k.size(), " constants given for ", groups_,
                      " group(s)");
      }
      for (const auto& x : runs_) {
        gpu::fused_step<Opt, G, W>(k[x.group], x.params, x.state.data(), x.grads, x.working_out,
                                   x.count, stream_);
      }
    }

   private:
    using table = gpu::fused_step_table<Opt, G, W>;
    device_stream stream_;
    std::size_t groups_ = 0;
    std::vector<typename table::run> runs_;  // the per-run form
    std::unique_ptr<table> table_;           // the table form
  };
  template <optimizer_policy Opt, float_storage G, float_storage W>
  step_plan<Opt, G, W> make_step_plan(std::span<const step_run<Opt, G, W>> runs,
                                      std::size_t groups) const {
    return step_plan<Opt, G, W>(runs, groups, stream_);
  }

 private:
  // Small device buffers shared by the copies of one engine's operations.
  struct scratch {
    explicit scratch(device_stream s) : stream(s) {}
    scratch(const scratch&) = delete;
    scratch& operator=(const scratch&) = delete;
    ~scratch() {
      device_stream_scope scope(stream);
      control.release();
      stats.release();
    }
    device_stream stream;
    buffer<std::uint64_t, cuda_space> control;
    buffer<gpu::device_grad_stats, cuda_space> stats;
  };

  gpu::device_grad_stats* ensure_stats() const {
    if (scratch_->stats.empty()) {
      auto s = scope();
      scratch_->stats =
          buffer<gpu::device_grad_stats, cuda_space>(1, nullptr, memory_category::comm_scratch);
    }
    return scratch_->stats.data();
  }

  device_stream stream_ = nullptr;
  bool stream_ordered_ = false;
  std::shared_ptr<scratch> scratch_;
};

SHARDKIT_NAMESPACE_END
