//! \file comm/thread/communicator.hpp
//! `thread_communicator<Space>`: one rank's endpoint of a group of thread ranks
//! (comm/thread.hpp has the overview). The typed calls come from comm/detail/frontend.hpp;
//! this file is the transport: every collective is a rendezvous of the group
//! (comm/thread/group.hpp) at which each rank reads the others' posted buffers directly and
//! reduces its own part in rank order, then a second rendezvous before anyone returns (so no
//! buffer is reused while another rank still reads or writes it). Asynchronous collectives run
//! on the rank's progress thread, in issue order. When the group's ranks fit on the machine's
//! cores (detail::ranks_fit_cores), the progress thread spins a few microseconds for the next
//! collective before it sleeps, and a rank waiting for one spins briefly before it sleeps: a
//! sleeping thread's wake-up cost an asynchronous 4 KiB all-gather 40-140 us on this project's
//! 2-core virtual machine in some runs (5-8 us in others); with the spin, 6-11 us in every run.
//!
//! The all-reduce is one pass: rank r reduces its chunk r of every rank's input and writes the
//! result straight into chunk r of every rank's output (on the host in the same loop,
//! host::reduce_ordered_to, with streaming stores when out of place and the rank's bytes exceed
//! the cache), so each rank reads B and writes B bytes of a B-byte all-reduce, the least shared
//! memory allows, and nothing is copied back.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/frontend.hpp>
#include <shardkit/comm/detail/work.hpp>
#include <shardkit/comm/thread/group.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/host/reduce.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

namespace detail {

//! How a thread communicator moves and reduces data in a memory space: copy(), reduce() and,
//! for transports that enqueue asynchronously (device memory, comm/thread_cuda.cuh), fence(),
//! which completes this thread's outstanding transfers before the next rendezvous.
template <memory_space Space>
struct thread_transport;

template <class Transport>
void transport_fence() {
  if constexpr (requires { Transport::fence(); }) Transport::fence();
}

template <>
struct thread_transport<host_space> {
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (dst != src && bytes != 0) std::memcpy(dst, src, bytes);
  }
  static void reduce(dtype t, const void* const* in, std::size_t k, void* out, std::size_t n,
                     reduce_op op) {
    host::reduce_ordered(t, in, k, out, n, op);
  }
};

//! One queued asynchronous collective.
struct thread_op {
  thread_slot slot;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::atomic<bool> done_flag{false};  // `done`, for a waiter's spin before it sleeps
  bool spin = false;                   // waiters spin first (detail::ranks_fit_cores)
  std::exception_ptr error;
  std::chrono::steady_clock::time_point completed_at{};

  void finish(std::exception_ptr e) {
    std::lock_guard lk(mu);
    error = std::move(e);
    completed_at = std::chrono::steady_clock::now();
    done = true;
    done_flag.store(true, std::memory_order_release);
    cv.notify_all();
  }
};

}  // namespace detail

namespace detail {
//! The thread transport's side of a work handle (comm/detail/work.hpp).
struct thread_handle {
  std::shared_ptr<thread_op> op;

  void wait() {
    // A collective waited for right after its issue is often microseconds from done: spin a
    // little, yielding soon (the rank's progress thread may need this core).
    if (op->spin) {
      spin_until([&] { return op->done_flag.load(std::memory_order_acquire); },
                 {.pauses = 16, .yields = 64});
    }
    std::unique_lock lk(op->mu);
    op->cv.wait(lk, [&] { return op->done; });
    if (op->error) std::rethrow_exception(op->error);
  }
  bool test() const {
    std::lock_guard lk(op->mu);
    return op->done;
  }
  void settle() noexcept {
    std::unique_lock lk(op->mu);
    op->cv.wait(lk, [&] { return op->done; });
  }
};
}  // namespace detail

//! Handle to an asynchronous collective of a thread communicator. wait() blocks until it is
//! done and rethrows its error; the destructor waits too (without throwing), so a dropped
//! handle never leaves a collective writing into buffers the caller believes are free.
class thread_work : public detail::basic_work<detail::thread_handle> {
 public:
  thread_work() = default;
  explicit thread_work(std::shared_ptr<detail::thread_op> op)
      : basic_work(detail::thread_handle{std::move(op)}) {}

  //! When the collective finished on this rank's progress thread (valid once test() is true).
  std::chrono::steady_clock::time_point completion_time() const {
    const auto& h = op();
    if (!h.op) return {};
    std::lock_guard lk(h.op->mu);
    return h.op->completed_at;
  }
};

//! One rank's endpoint of a thread communicator group in memory space `Space`.
template <memory_space Space = host_space>
class thread_communicator : public detail::comm_frontend<thread_communicator<Space>> {
 public:
  using memory_space = Space;
  using work_type = thread_work;

  thread_communicator(std::shared_ptr<detail::thread_group_state> state, int rank)
      : impl_(std::make_unique<impl>(std::move(state), rank)) {}
  thread_communicator(thread_communicator&&) noexcept = default;
  thread_communicator& operator=(thread_communicator&&) noexcept = default;
  ~thread_communicator() = default;

  int rank() const noexcept { return impl_->rank; }
  int size() const noexcept { return impl_->state->size(); }

  //! Collective: ranks with the same `color` form a new communicator, ordered by (key, rank).
  thread_communicator split(int color, int key) {
    detail::check_split_color(color);
    detail::thread_slot s;
    s.is_split = true;
    s.desc.color = color;
    s.desc.key = key;
    run_sync(s);
    auto [child, r] = impl_->state->take_split(impl_->rank);
    return thread_communicator(std::move(child), r);
  }

  //! Aborts the whole group: every rank's pending and later collectives fail with comm_aborted.
  void abort(const std::string& reason) {
    impl_->state->abort(detail::concat(impl_->state->who(impl_->rank), " aborted: ", reason));
  }

  const thread_comm_options& options() const noexcept { return impl_->state->options(); }

 private:
  struct impl {
    impl(std::shared_ptr<detail::thread_group_state> s, int r) : state(std::move(s)), rank(r) {}
    ~impl() {
      {
        std::lock_guard lk(mu);
        stop = true;
      }
      cv.notify_all();
      if (worker.joinable()) worker.join();
    }
    std::shared_ptr<detail::thread_group_state> state;
    int rank;
    traffic_ledger traffic;
    std::uint64_t calls = 0;  // collectives issued, for messages
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::shared_ptr<detail::thread_op>> queue;
    std::atomic<std::size_t> queued{0};  // queue.size(), for the worker's spin
    bool running = false;
    bool stop = false;
    std::thread worker;
  };

  friend class detail::comm_frontend<thread_communicator>;

  // The transport interface of comm/detail/frontend.hpp.
  traffic_ledger& ledger() noexcept { return impl_->traffic; }
  const traffic_ledger& ledger() const noexcept { return impl_->traffic; }
  template <class T>
  void run(const detail::collective_desc& d, const T* in, T* out) {
    run_sync(slot(d, in, out));
  }
  template <class T>
  thread_work start(const detail::collective_desc& d, const T* in, T* out) {
    return enqueue(slot(d, in, out));
  }

  static detail::thread_slot slot(const detail::collective_desc& d, const void* in, void* out) {
    detail::thread_slot s;
    s.desc = d;
    s.in = in;
    s.out = out;
    return s;
  }

  // Queues a collective for the progress thread (started on first use).
  thread_work enqueue(const detail::thread_slot& s) {
    auto op = std::make_shared<detail::thread_op>();
    op->slot = s;
    impl& m = *impl_;
    op->spin = detail::ranks_fit_cores(m.state->size());
    {
      std::lock_guard lk(m.mu);
      m.queue.push_back(op);
      m.queued.store(m.queue.size(), std::memory_order_release);
      if (!m.worker.joinable()) m.worker = std::thread([&m] { worker_loop(m); });
    }
    m.cv.notify_all();
    return thread_work(std::move(op));
  }

  // Runs a collective to completion: on the caller's thread when nothing is queued or running,
  // otherwise after the queued ones, on the progress thread.
  void run_sync(const detail::thread_slot& s) {
    impl& m = *impl_;
    {
      std::unique_lock lk(m.mu);
      if (!m.queue.empty() || m.running) {
        lk.unlock();
        enqueue(s).wait();
        return;
      }
      m.running = true;
    }
    struct idle_again {
      impl& m;
      ~idle_again() {
        std::lock_guard lk(m.mu);
        m.running = false;
      }
    } guard{m};
    execute(m, s);
  }

  static void worker_loop(impl& m) {
    std::unique_lock lk(m.mu);
    for (;;) {
      if (m.queue.empty() && !m.stop && detail::ranks_fit_cores(m.state->size())) {
        // Spin a little before sleeping: a step issues its collectives back to back, and a
        // sleeping worker would cost each of them a wake-up.
        lk.unlock();
        detail::spin_until([&] { return m.queued.load(std::memory_order_acquire) != 0; });
        lk.lock();
      }
      m.cv.wait(lk, [&] { return m.stop || !m.queue.empty(); });
      if (m.queue.empty()) return;  // stop requested and nothing left
      auto op = std::move(m.queue.front());
      m.queue.pop_front();
      m.queued.store(m.queue.size(), std::memory_order_release);
      m.running = true;
      lk.unlock();
      std::exception_ptr err;
      try {
        execute(m, op->slot);
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      m.running = false;
      lk.unlock();
      op->finish(std::move(err));
      lk.lock();
    }
  }

  static void execute(impl& m, const detail::thread_slot& s) {
    using transport = detail::thread_transport<Space>;
    detail::thread_group_state& g = *m.state;
    const int n = g.size();
    const int r = m.rank;
    const std::uint64_t call = ++m.calls;
    const auto& d = s.desc;
    auto phase = [&](const detail::thread_slot* post, const char* name) {
      std::string mismatch = g.arrive(r, post, name, call, d, s.is_split);
      if (!mismatch.empty()) throw collective_mismatch(mismatch);
    };
    phase(&s, "arrival");
    if (s.is_split) return;
    if (d.kind == collective::barrier) {
      m.traffic.record(collective::barrier, 0);
      return;
    }

    const std::size_t esize = size_of(d.type);
    auto in_of = [&](int q) { return static_cast<const std::byte*>(g.slot(q).in); };
    auto out_of = [&](int q) { return static_cast<std::byte*>(g.slot(q).out); };
    constexpr int small_group = 16;  // source pointers on the stack up to this many ranks
    const void* srcs_small[small_group];
    std::vector<const void*> srcs_large(n > small_group ? static_cast<std::size_t>(n) : 0);
    const void** srcs = n > small_group ? srcs_large.data() : srcs_small;

    switch (d.kind) {
      case collective::all_reduce: {
        // One pass (see the file comment): chunk r of every input, reduced in rank order, into
        // chunk r of every output. Only this rank touches chunk r of any buffer, so in-place
        // all-reduces are safe.
        const std::size_t b = chunk_begin(d.count, n, r), len = chunk_size(d.count, n, r);
        if constexpr (std::is_same_v<Space, host_space>) {
          void* outs_small[small_group];
          std::vector<void*> outs_large(n > small_group ? static_cast<std::size_t>(n) : 0);
          void** outs = n > small_group ? outs_large.data() : outs_small;
          for (int q = 0; q < n; ++q) {
            srcs[q] = in_of(q) + b * esize;
            outs[q] = out_of(q) + b * esize;
          }
          host::reduce_ordered_to(d.type, srcs, static_cast<std::size_t>(n), outs,
                                  static_cast<std::size_t>(n), len, d.op, host::stores::automatic);
        } else {
          // Device memory: reduced into this rank's output, which must be complete before the
          // other devices' streams copy it.
          for (int q = 0; q < n; ++q) srcs[q] = in_of(q) + b * esize;
          transport::reduce(d.type, srcs, n, out_of(r) + b * esize, len, d.op);
          detail::transport_fence<transport>();
          for (int q = 0; q < n; ++q) {
            if (q != r) transport::copy(out_of(q) + b * esize, out_of(r) + b * esize, len * esize);
          }
        }
        break;
      }
      case collective::reduce_scatter: {
        for (int q = 0; q < n; ++q)
          srcs[q] = in_of(q) + static_cast<std::size_t>(r) * d.count * esize;
        transport::reduce(d.type, srcs, n, out_of(r), d.count, d.op);
        break;
      }
      case collective::all_gather: {
        for (int q = 0; q < n; ++q) {
          transport::copy(out_of(r) + static_cast<std::size_t>(q) * d.count * esize, in_of(q),
                          d.count * esize);
        }
        break;
      }
      case collective::all_to_all: {
        for (int q = 0; q < n; ++q) {
          transport::copy(out_of(r) + static_cast<std::size_t>(q) * d.count * esize,
                          in_of(q) + static_cast<std::size_t>(r) * d.count * esize,
                          d.count * esize);
        }
        break;
      }
      case collective::broadcast: {
        if (r != d.root) transport::copy(out_of(r), in_of(d.root), d.count * esize);
        break;
      }
      case collective::barrier:
        break;
    }
    detail::transport_fence<transport>();
    phase(nullptr, "completion");
    detail::record(m.traffic, d, r, n);
  }

  std::unique_ptr<impl> impl_;
};

//! The host thread communicator.
using thread_comm = thread_communicator<host_space>;

static_assert(communicator<thread_comm>);

SHARDKIT_NAMESPACE_END
