//! \file zero/space_ops.hpp
//! `space_ops<Space>`: the element-wise work the ZeRO components do on buffers in memory space
//! `Space`, and how that work is ordered against collectives. One specialisation per space: the
//! host's here, the CUDA one in zero/space_ops_cuda.cuh (which a device engine must include, so
//! that a CUDA buffer is never touched by host loops). `available` says whether the
//! specialisation was seen.
//!
//! The operations: gradients of a framework's dtype into a buffer (convert_in, accumulate_in),
//! buffer to buffer accumulation and zeroing, working values out into a framework tensor
//! (convert_out), host values in (upload), the small host-side control all-reduce, the exact
//! gradient statistics, and the fused optimizer step over a table of runs (make_step_plan).
//! Every element's arithmetic is kernels/math.hpp's, so both spaces compute the same bits.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/device.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/reduce_op.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/grad_stats.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/math.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! One run of the fused step: `count` consecutive elements of a rank's shard, optimizer group
//! `group`. Working-copy output is nullptr when the parameters are the fp32 working values.
template <optimizer_policy Opt, float_storage Grad, float_storage Working>
struct step_run {
  float* params = nullptr;  //!< fp32 master (16-bit training) or the fp32 working values
  float* state[Opt::state_count > 0 ? Opt::state_count : 1] = {};
  const Grad* grads = nullptr;
  Working* working = nullptr;  //!< rounded working copy to write, or nullptr
  std::size_t count = 0;
  std::size_t group = 0;
};

//! Primary template: no operations for this memory space (see the file comment).
template <memory_space Space>
struct space_ops {
  static constexpr bool available = false;
};

namespace detail {
struct no_scope {};
}  // namespace detail

//! Host memory: the host kernels, called directly; collectives complete on return or wait().
//! With an executor (host::thread_team, or a framework's pool), the optimizer step, the casts
//! and the gradient statistics run on its threads; results are the same bits for any number of
//! threads. Copies share the executor.
template <>
struct space_ops<host_space> {
  static constexpr bool available = true;
  using space = host_space;

  space_ops() = default;
  //! The stream and ordering arguments of device spaces mean nothing on the host.
  space_ops(device_stream /*compute*/, bool /*comm_orders_by_stream*/) noexcept {}
  //! Runs the element-wise work on `exec`'s threads (nullptr: the calling thread only).
  explicit space_ops(std::shared_ptr<host::executor> exec) noexcept : exec_(std::move(exec)) {}
  //! Runs it on a team of `threads` threads of its own (1: the calling thread only).
  static space_ops with_threads(std::size_t threads) {
    if (threads == 0) detail::raise("space_ops: the number of host threads must be at least 1");
    return space_ops(threads > 1 ? std::make_shared<host::thread_team>(threads) : nullptr);
  }
  //! The executor the work runs on (nullptr: the calling thread).
  host::executor* executor() const noexcept { return exec_.get(); }

  //! The scope in which buffers are allocated and freed (device spaces: the compute stream).
  detail::no_scope scope() const noexcept { return {}; }
  //! Before a collective reads what the element-wise work wrote.
  void before_collective() const noexcept {}
  //! After an asynchronous collective: later element-wise work may use its result.
  template <class Work>
  void finish(Work& w) const {
    w.wait();
  }
  //! Everything issued so far is complete.
  void synchronize() const noexcept {}

  //! A framework's gradient (fp32, bf16 or fp16 at `src`) into `dst`: copy, or add.
  template <float_storage D>
  void convert_in(const void* src, dtype t, D* dst, std::size_t n) const {
    host::parallel_convert(exec_.get(), src, t, dst, dtype_of<D>, n);
  }
  template <float_storage D>
  void accumulate_in(const void* src, dtype t, D* dst, std::size_t n) const {
    host::parallel_accumulate(exec_.get(), src, t, dst, n);
  }
  template <float_storage D>
  void accumulate(const D* src, D* dst, std::size_t n) const {
    host::parallel_accumulate(exec_.get(), src, dst, n);
  }
  template <float_storage D>
  void fill_zero(D* p, std::size_t n) const {
    host::parallel_for(exec_.get(), n, host::convert_grain,
                       [&](std::size_t b, std::size_t e) { std::fill(p + b, p + e, D{}); });
  }
  //! Values of this space out into a framework tensor of dtype t (in this space).
  template <float_storage S>
  void convert_out(const S* src, void* dst, dtype t, std::size_t n) const {
    host::parallel_convert(exec_.get(), src, dtype_of<S>, dst, t, n);
  }
  //! Host values (initial parameters, a checkpoint's) into a buffer of this space.
  template <float_storage D>
  void upload(const void* src, dtype t, D* dst, std::size_t n) const {
    host::parallel_convert(exec_.get(), src, t, dst, dtype_of<D>, n);
  }
  //! Buffer to buffer of this space, converting (round to nearest even when narrowing).
  template <float_storage S, float_storage D>
  void convert_between(const S* src, D* dst, std::size_t n) const {
    host::convert(src, dst, n);
  }
  //! Values of this space into host memory of dtype t.
  template <float_storage S>
  void download(const S* src, void* dst, dtype t, std::size_t n) const {
    host::parallel_convert(exec_.get(), src, dtype_of<S>, dst, t, n);
  }
  //! Broadcast of host values from `root` through a communicator of this space.
  template <class Comm>
  void broadcast_host(Comm& comm, float* values, std::size_t n, int root) const {
    comm.broadcast(values, n, root);
  }
  //! All-reduce of a small host array (the control messages).
  template <class Comm, class T>
  void all_reduce_host(Comm& comm, T* values, std::size_t n, reduce_op op) const {
    comm.all_reduce(values, values, n, op);
  }
  //! All-gather of a small host array: `out` holds comm.size()·n elements.
  template <class Comm, class T>
  void all_gather_host(Comm& comm, const T* in, T* out, std::size_t n) const {
    comm.all_gather(in, out, n);
  }

  //! Exact gradient statistics over the runs for_each(f) visits, f(const G*, count): small runs
  //! into one accumulator, large ones on the executor's threads.
  template <float_storage G, class ForEach>
  host::grad_stats grad_stats(ForEach&& for_each) const {
    host::grad_stats st;
    auto acc = std::make_unique<host::stats_accumulator>();
    for_each([&](const G* g, std::size_t n) {
      if (exec_ && n >= 4 * host::convert_grain) {
        host::parallel_accumulate_stats(exec_.get(), g, n, st);
      } else {
        acc->add(g, n);
      }
    });
    acc->add_to(st);
    return st;
  }
  template <float_storage G, class ForEach>
  std::uint64_t count_nonfinite(ForEach&& for_each) const {
    std::uint64_t nonfinite = 0;
    for_each([&](const G* g, std::size_t n) { nonfinite += host::count_nonfinite(g, n); });
    return nonfinite;
  }

  //! The fused optimizer step over a fixed table of runs. With an executor, the runs are laid
  //! end to end and cut into one contiguous piece per thread (a piece may span runs, a run
  //! several pieces): every element is stepped once, with its run's group constants.
  template <optimizer_policy Opt, float_storage G, float_storage W>
  class step_plan {
   public:
    using run = step_run<Opt, G, W>;
    step_plan(std::span<const run> runs, std::size_t /*groups*/, host::executor* exec = nullptr)
        : runs_(runs.begin(), runs.end()), exec_(exec) {
      starts_.reserve(runs_.size() + 1);
      std::size_t total = 0;
      for (const auto& r : runs_) {
        starts_.push_back(total);
        total += r.count;
      }
      starts_.push_back(total);
    }
    //! Steps every run with its group's constants k[run.group].
    void launch(std::span<const typename Opt::constants> k) const {
      host::parallel_for(exec_, starts_.back(), host::step_grain,
                         [&](std::size_t b, std::size_t e) { step_range(k, b, e); });
    }

   private:
    // Elements [b, e) of the runs laid end to end.
    void step_range(std::span<const typename Opt::constants> k, std::size_t b,
                    std::size_t e) const {
      std::size_t i = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), b) -
                                               starts_.begin() - 1);
      for (; i < runs_.size() && starts_[i] < e; ++i) {
        const auto& r = runs_[i];
        const std::size_t lo = std::max(b, starts_[i]) - starts_[i];
        const std::size_t hi = std::min(e, starts_[i + 1]) - starts_[i];
        if (lo >= hi) continue;
        float* st[Opt::state_count > 0 ? Opt::state_count : 1];
        for (std::size_t s = 0; s < Opt::state_count; ++s) st[s] = r.state[s] + lo;
        host::fused_step<Opt, G, W>(k[r.group], r.params + lo, st, r.grads + lo,
                                    r.working != nullptr ? r.working + lo : nullptr, hi - lo);
      }
    }

    std::vector<run> runs_;
    std::vector<std::size_t> starts_;  // starts_[i]: first element of run i; then the total
    host::executor* exec_;
  };
  template <optimizer_policy Opt, float_storage G, float_storage W>
  step_plan<Opt, G, W> make_step_plan(std::span<const step_run<Opt, G, W>> runs,
                                      std::size_t groups) const {
    return step_plan<Opt, G, W>(runs, groups, exec_.get());
  }

 private:
  std::shared_ptr<host::executor> exec_;
};

SHARDKIT_NAMESPACE_END
