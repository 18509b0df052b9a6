//! \file comm/thread.hpp
//! The in-process thread communicator: N ranks as threads of one process, each with its own
//! communicator endpoint. It is the embedded default (train on several ranks without MPI) and
//! the oracle the other communicators are tested against.
//!
//!  - Deterministic: reductions sum in rank order 0..N-1 (fp32 accumulation for 16-bit data),
//!    so results do not depend on thread timing.
//!  - Asynchronous collectives run on the rank's progress thread and really progress while the
//!    rank computes; synchronous ones run on the caller's thread when nothing is queued.
//!  - Safe: ranks that call different collectives get `collective_mismatch` on every rank; a
//!    collective that waits longer than the timeout fails with `comm_timeout` on every waiting
//!    rank; when a rank's function throws, the group is aborted and every other rank's pending
//!    or later collective fails with `comm_aborted` naming that rank. Nothing hangs.
//!
//!     shardkit::run_ranks(4, [](shardkit::thread_comm& comm) {
//!       std::vector<float> x(8, float(comm.rank()));
//!       comm.all_reduce(x.data(), x.data(), x.size(), shardkit::reduce_op::sum);
//!     });
//!
//! One endpoint is used by one thread at a time (its rank's thread).
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/host/reduce.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Settings of a thread communicator group.
struct thread_comm_options {
  //! How long a collective waits for the other ranks before failing with comm_timeout.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  //! Compare kind, element type, count, operation and root across ranks at every collective and
  //! raise collective_mismatch when they differ (cheap: done once per collective, under a lock).
  bool check_matching = true;
};

//! One rank's failure inside thread_group::run.
struct rank_failure {
  int rank;
  std::string message;
  std::exception_ptr exception;
};

//! Thrown by thread_group::run when one or more ranks threw. The first failure is usually the
//! cause; the others are often the comm_aborted it triggered.
class group_error : public error {
 public:
  explicit group_error(std::vector<rank_failure> failures)
      : error(summarise(failures)), failures_(std::move(failures)) {}
  const std::vector<rank_failure>& failures() const noexcept { return failures_; }

 private:
  static std::string summarise(const std::vector<rank_failure>& f) {
    std::string s = std::to_string(f.size()) + " rank(s) failed";
    for (const auto& x : f) s += "; rank " + std::to_string(x.rank) + ": " + x.message;
    return s;
  }
  std::vector<rank_failure> failures_;
};

namespace detail {

struct thread_slot {
  collective_desc desc;
  bool is_split = false;
  const void* in = nullptr;
  void* out = nullptr;
};

//! Shared state of one group of thread ranks: the rendezvous barrier, the posted slots, abort
//! and timeout handling, and sub-groups made by split().
class thread_group_state {
 public:
  thread_group_state(int n, thread_comm_options opts)
      : n_(n),
        opts_(opts),
        slots_(static_cast<std::size_t>(n)),
        arrived_mask_(static_cast<std::size_t>(n), false),
        split_results_(static_cast<std::size_t>(n)) {}

  int size() const noexcept { return n_; }
  const thread_comm_options& options() const noexcept { return opts_; }
  const thread_slot& slot(int r) const noexcept { return slots_[static_cast<std::size_t>(r)]; }

  //! Posts rank's slot (when given) and waits until every rank has arrived at this phase.
  //! The last rank to arrive checks that the posted collectives match. Returns the mismatch
  //! message ("" when they match). Throws comm_aborted or comm_timeout.
  std::string arrive(int rank, const thread_slot* post, const char* phase, std::uint64_t call,
                     const collective_desc& what, bool what_split) {
    std::unique_lock lk(mu_);
    throw_if_aborted_locked();
    if (post != nullptr) slots_[static_cast<std::size_t>(rank)] = *post;
    const std::uint64_t gen = generation_;
    arrived_mask_[static_cast<std::size_t>(rank)] = true;
    if (++arrived_ == n_) {
      mismatch_.clear();
      if (post != nullptr) {
        if (opts_.check_matching) mismatch_ = check_locked(call);
        if (mismatch_.empty() && slots_[0].is_split) make_splits_locked();
      }
      arrived_ = 0;
      std::fill(arrived_mask_.begin(), arrived_mask_.end(), false);
      ++generation_;
      cv_.notify_all();
      return mismatch_;
    }
    const auto deadline = std::chrono::steady_clock::now() + opts_.timeout;
    while (generation_ == gen) {
      throw_if_aborted_locked();
      if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && generation_ == gen &&
          !aborted_) {
        std::string missing;
        for (int q = 0; q < n_; ++q) {
          if (!arrived_mask_[static_cast<std::size_t>(q)]) {
            missing += (missing.empty() ? "" : ", ") + std::to_string(q);
          }
        }
        abort_locked(
            concat(describe(what, what_split), " (call #", call, ", ", phase, ") timed out after ",
                   opts_.timeout.count(), " ms on rank ", rank, ": rank(s) {", missing, "} of ", n_,
                   " did not arrive (a rank died, hangs, or issued fewer collectives)"),
            true);
      }
    }
    return mismatch_;
  }

  //! Result of the last split for parent rank `rank`: the sub-group and the rank in it.
  std::pair<std::shared_ptr<thread_group_state>, int> take_split(int rank) {
    std::lock_guard lk(mu_);
    return std::exchange(split_results_[static_cast<std::size_t>(rank)], {});
  }

  //! Fails every pending and later collective of this group and of its sub-groups.
  void abort(const std::string& reason, bool is_timeout = false) {
    std::vector<std::shared_ptr<thread_group_state>> kids;
    {
      std::lock_guard lk(mu_);
      if (aborted_) return;
      abort_locked(reason, is_timeout);
      for (auto& w : children_) {
        if (auto k = w.lock()) kids.push_back(std::move(k));
      }
    }
    for (auto& k : kids) k->abort(reason, is_timeout);
  }

  bool aborted() const {
    std::lock_guard lk(mu_);
    return aborted_;
  }

 private:
  void abort_locked(const std::string& reason, bool is_timeout) {
    if (aborted_) return;
    aborted_ = true;
    abort_timeout_ = is_timeout;
    abort_reason_ = reason;
    cv_.notify_all();
  }

  void throw_if_aborted_locked() const {
    if (!aborted_) return;
    if (abort_timeout_) throw comm_timeout(abort_reason_);
    throw comm_aborted("thread communicator aborted: " + abort_reason_);
  }

  std::string check_locked(std::uint64_t call) const {
    const thread_slot& s0 = slots_[0];
    for (int q = 1; q < n_; ++q) {
      const thread_slot& sq = slots_[static_cast<std::size_t>(q)];
      if (sq.is_split != s0.is_split || (!s0.is_split && !sq.desc.matches(s0.desc))) {
        return concat("collective mismatch at call #", call, ": rank 0 called ",
                      describe(s0.desc, s0.is_split), " but rank ", q, " called ",
                      describe(sq.desc, sq.is_split),
                      " (every rank must issue the same collectives in the same order)");
      }
    }
    return {};
  }

  void make_splits_locked() {
    std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, parent rank)
    for (int q = 0; q < n_; ++q) {
      const auto& d = slots_[static_cast<std::size_t>(q)].desc;
      by_color[d.color].emplace_back(d.key, q);
    }
    for (auto& [color, members] : by_color) {
      std::sort(members.begin(), members.end());
      auto child = std::make_shared<thread_group_state>(static_cast<int>(members.size()), opts_);
      children_.push_back(child);
      for (std::size_t i = 0; i < members.size(); ++i) {
        split_results_[static_cast<std::size_t>(members[i].second)] = {child, static_cast<int>(i)};
      }
    }
  }

  const int n_;
  const thread_comm_options opts_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<thread_slot> slots_;
  std::vector<bool> arrived_mask_;
  std::string mismatch_;
  bool aborted_ = false;
  bool abort_timeout_ = false;
  std::string abort_reason_;
  std::vector<std::pair<std::shared_ptr<thread_group_state>, int>> split_results_;
  std::vector<std::weak_ptr<thread_group_state>> children_;
};

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
  std::exception_ptr error;
  std::chrono::steady_clock::time_point completed_at{};

  void finish(std::exception_ptr e) {
    std::lock_guard lk(mu);
    error = std::move(e);
    completed_at = std::chrono::steady_clock::now();
    done = true;
    cv.notify_all();
  }
};

}  // namespace detail

//! Handle to an asynchronous collective of a thread communicator. wait() blocks until it is
//! done and rethrows its error; the destructor waits too (without throwing), so a dropped
//! handle never leaves a collective writing into buffers the caller believes are free.
class thread_work {
 public:
  thread_work() = default;
  explicit thread_work(std::shared_ptr<detail::thread_op> op) : op_(std::move(op)) {}
  thread_work(thread_work&& o) noexcept
      : op_(std::move(o.op_)), waited_(std::exchange(o.waited_, false)) {}
  thread_work& operator=(thread_work&& o) noexcept {
    if (this != &o) {
      drain();
      op_ = std::move(o.op_);
      waited_ = std::exchange(o.waited_, false);
    }
    return *this;
  }
  thread_work(const thread_work&) = delete;
  thread_work& operator=(const thread_work&) = delete;
  ~thread_work() { drain(); }

  //! Blocks until the collective is done; rethrows its error. Calling it again is a no-op.
  void wait() {
    if (!op_ || waited_) return;
    waited_ = true;
    std::unique_lock lk(op_->mu);
    op_->cv.wait(lk, [&] { return op_->done; });
    if (op_->error) std::rethrow_exception(op_->error);
  }

  //! When the collective finished on this rank's progress thread (valid once test() is true).
  std::chrono::steady_clock::time_point completion_time() const {
    if (!op_) return {};
    std::lock_guard lk(op_->mu);
    return op_->completed_at;
  }

  //! True when the collective is done (or the handle is empty).
  bool test() const {
    if (!op_) return true;
    std::lock_guard lk(op_->mu);
    return op_->done;
  }

 private:
  void drain() noexcept {
    if (!op_) return;
    std::unique_lock lk(op_->mu);
    op_->cv.wait(lk, [&] { return op_->done; });
    lk.unlock();
    op_.reset();
  }
  std::shared_ptr<detail::thread_op> op_;
  bool waited_ = false;
};

//! One rank's endpoint of a thread communicator group in memory space `Space`.
template <memory_space Space = host_space>
class thread_communicator {
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

  template <element_type T>
  void all_reduce(const T* in, T* out, std::size_t n, reduce_op op = reduce_op::sum) {
    run_sync(slot(make(collective::all_reduce, dtype_of<T>, n, op), in, out));
  }
  template <element_type T>
  void reduce_scatter(const T* in, T* out, std::size_t count, reduce_op op = reduce_op::sum) {
    run_sync(slot(make(collective::reduce_scatter, dtype_of<T>, count, op), in, out));
  }
  template <element_type T>
  void all_gather(const T* in, T* out, std::size_t count) {
    run_sync(slot(make(collective::all_gather, dtype_of<T>, count), in, out));
  }
  template <element_type T>
  void broadcast(T* buf, std::size_t n, int root) {
    run_sync(slot(broadcast_desc(dtype_of<T>, n, root), buf, buf));
  }
  //! out[q·count, (q+1)·count) receives rank q's in[rank()·count, (rank()+1)·count).
  template <element_type T>
  void all_to_all(const T* in, T* out, std::size_t count) {
    run_sync(slot(make(collective::all_to_all, dtype_of<T>, count), in, out));
  }
  void barrier() { run_sync(slot(make(collective::barrier, dtype::u8, 0), nullptr, nullptr)); }

  template <element_type T>
  [[nodiscard]] thread_work all_reduce_async(const T* in, T* out, std::size_t n,
                                             reduce_op op = reduce_op::sum) {
    return enqueue(slot(make(collective::all_reduce, dtype_of<T>, n, op), in, out));
  }
  template <element_type T>
  [[nodiscard]] thread_work reduce_scatter_async(const T* in, T* out, std::size_t count,
                                                 reduce_op op = reduce_op::sum) {
    return enqueue(slot(make(collective::reduce_scatter, dtype_of<T>, count, op), in, out));
  }
  template <element_type T>
  [[nodiscard]] thread_work all_gather_async(const T* in, T* out, std::size_t count) {
    return enqueue(slot(make(collective::all_gather, dtype_of<T>, count), in, out));
  }
  template <element_type T>
  [[nodiscard]] thread_work broadcast_async(T* buf, std::size_t n, int root) {
    return enqueue(slot(broadcast_desc(dtype_of<T>, n, root), buf, buf));
  }
  template <element_type T>
  [[nodiscard]] thread_work all_to_all_async(const T* in, T* out, std::size_t count) {
    return enqueue(slot(make(collective::all_to_all, dtype_of<T>, count), in, out));
  }

  //! Collective: ranks with the same `color` form a new communicator, ordered by (key, rank).
  thread_communicator split(int color, int key) {
    if (color < 0) detail::raise("split: color must be non-negative, got ", color);
    detail::thread_slot s;
    s.is_split = true;
    s.desc.color = color;
    s.desc.key = key;
    run_sync(s);
    auto [child, r] = impl_->state->take_split(impl_->rank);
    return thread_communicator(std::move(child), r);
  }

  //! Bytes this rank sent per collective (ring volumes, see comm/volume.hpp).
  const traffic_ledger& traffic() const noexcept { return impl_->traffic; }
  void reset_traffic() noexcept { impl_->traffic.reset(); }

  //! Aborts the whole group: every rank's pending and later collectives fail with comm_aborted.
  void abort(const std::string& reason) {
    impl_->state->abort(detail::concat("rank ", impl_->rank, " aborted: ", reason));
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
    bool running = false;
    bool stop = false;
    std::thread worker;
  };

  static detail::collective_desc make(collective k, dtype t, std::size_t n,
                                      reduce_op op = reduce_op::sum) {
    detail::collective_desc d;
    d.kind = k;
    d.type = t;
    d.count = n;
    d.op = op;
    return d;
  }

  detail::collective_desc broadcast_desc(dtype t, std::size_t n, int root) const {
    if (root < 0 || root >= size()) {
      detail::raise("broadcast: root ", root, " is not a rank of this communicator (size ", size(),
                    ")");
    }
    auto d = make(collective::broadcast, t, n);
    d.root = root;
    return d;
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
    {
      std::lock_guard lk(m.mu);
      m.queue.push_back(op);
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
      m.cv.wait(lk, [&] { return m.stop || !m.queue.empty(); });
      if (m.queue.empty()) return;  // stop requested and nothing left
      auto op = std::move(m.queue.front());
      m.queue.pop_front();
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
    std::vector<const void*> srcs(static_cast<std::size_t>(n));

    switch (d.kind) {
      case collective::all_reduce: {
        const std::size_t b = chunk_begin(d.count, n, r), len = chunk_size(d.count, n, r);
        for (int q = 0; q < n; ++q) srcs[q] = in_of(q) + b * esize;
        transport::reduce(d.type, srcs.data(), n, out_of(r) + b * esize, len, d.op);
        detail::transport_fence<transport>();
        phase(nullptr, "reduction");
        for (int q = 0; q < n; ++q) {
          if (q == r) continue;
          const std::size_t bq = chunk_begin(d.count, n, q);
          transport::copy(out_of(r) + bq * esize, out_of(q) + bq * esize,
                          chunk_size(d.count, n, q) * esize);
        }
        break;
      }
      case collective::reduce_scatter: {
        for (int q = 0; q < n; ++q)
          srcs[q] = in_of(q) + static_cast<std::size_t>(r) * d.count * esize;
        transport::reduce(d.type, srcs.data(), n, out_of(r), d.count, d.op);
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
    m.traffic.record(
        d.kind, ring_bytes_sent(d.kind, d.count, esize, static_cast<std::size_t>(n),
                                static_cast<std::size_t>(r), static_cast<std::size_t>(d.root)));
  }

  std::unique_ptr<impl> impl_;
};

//! The host thread communicator.
using thread_comm = thread_communicator<host_space>;

//! Runs `fn(comm)` on `ranks` threads, each with its endpoint of a fresh group. Returns the
//! per-rank results (when fn returns a value). If any rank throws, the group is aborted so the
//! others fail fast instead of waiting, every thread is joined, and group_error is thrown.
template <memory_space Space = host_space, class F>
auto run_ranks(int ranks, F&& fn, thread_comm_options opts = {}) {
  using comm_t = thread_communicator<Space>;
  using R = std::invoke_result_t<F&, comm_t&>;
  if (ranks < 1) detail::raise("run_ranks: need at least 1 rank, got ", ranks);
  auto state = std::make_shared<detail::thread_group_state>(ranks, opts);
  std::vector<comm_t> comms;
  comms.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) comms.emplace_back(state, r);

  std::mutex mu;
  std::vector<rank_failure> failures;
  using stored = std::conditional_t<std::is_void_v<R>, char, R>;
  std::vector<std::optional<stored>> results(static_cast<std::size_t>(ranks));
  {
    std::vector<std::jthread> threads;
    threads.reserve(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        try {
          if constexpr (std::is_void_v<R>) {
            fn(comms[static_cast<std::size_t>(r)]);
          } else {
            results[static_cast<std::size_t>(r)].emplace(fn(comms[static_cast<std::size_t>(r)]));
          }
        } catch (const std::exception& e) {
          {
            std::lock_guard lk(mu);
            failures.push_back({r, e.what(), std::current_exception()});
          }
          state->abort(detail::concat("rank ", r, " failed: ", e.what()));
        } catch (...) {
          {
            std::lock_guard lk(mu);
            failures.push_back({r, "non-standard exception", std::current_exception()});
          }
          state->abort(detail::concat("rank ", r, " failed with a non-standard exception"));
        }
      });
    }
  }
  comms.clear();                                                  // joins progress threads
  if (!failures.empty()) throw group_error(std::move(failures));  // in the order they happened
  if constexpr (!std::is_void_v<R>) {
    std::vector<R> out;
    out.reserve(results.size());
    for (auto& x : results) out.push_back(std::move(*x));
    return out;
  }
}

static_assert(communicator<thread_comm>);

SHARDKIT_NAMESPACE_END
