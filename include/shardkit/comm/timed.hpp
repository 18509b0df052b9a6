//! \file comm/timed.hpp
//! `timed_comm<C>`: a Communicator that forwards every call to a communicator C it owns and
//! adds up the host seconds spent inside them, per kind of collective. Use it to measure what a
//! training step spends in communication (engine<timed_comm<thread_comm>, ...> works like
//! engine<thread_comm, ...>), e.g. to check plan/time.hpp's predictions:
//!
//!     shardkit::timed_comm<shardkit::thread_comm> comm(std::move(endpoint));
//!     shardkit::engine<decltype(comm), shardkit::zero2> e(comm, model);
//!     ... e.step(); ...
//!     double s = comm.timing().total_seconds();   // seconds inside collectives on this rank
//!
//! What is counted: the wall time of every synchronous call from entry to return, and for an
//! asynchronous collective the time to issue it plus the time its work handle spends in wait()
//! and test(). That is the time the calling thread was blocked on communication ("exposed"
//! communication); an asynchronous collective that finished while the caller did other work
//! adds only its issue time. Calls are counted when issued. Communicators made by split() share
//! the parent's timing (one total for a rank, whatever group a collective ran on).
//!
//! With `timing().serialize` set, asynchronous collectives complete before their issue returns
//! (see comm_timing::serialize).
//!
//! With `timing().record` set, every call is also logged (call_record: when this rank entered
//! and left it). Comparing the ranks' logs separates a collective's own time, from the last
//! rank's arrival to its completion, from the time early ranks wait for late ones
//! (benchmarks/time_model.cpp does so).
//!
//! Like the endpoint it wraps, a timed_comm is used by one thread at a time; the timing is not
//! atomic. Overhead: two steady_clock reads per call.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/reduce_op.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! One collective call as this rank saw it: when the rank entered it and when it left it (for an
//! asynchronous one: when it was issued, and when wait() or a successful test() returned), in
//! seconds of std::chrono::steady_clock. Ranks of one process, or of one machine (whose steady
//! clock is CLOCK_MONOTONIC, shared by every process), can compare these times directly.
struct call_record {
  collective kind = collective::barrier;
  double entered = 0.0;
  double left = 0.0;
  std::size_t count = 0;       //!< elements, as the call counts them (per rank for RS/AG)
  std::size_t elem_bytes = 0;  //!< bytes per element
  //! In place: the all-reduce's output is its input, the reduce-scatter's output the rank's
  //! slice of its input, the all-gather's input the rank's slice of its output (broadcast:
  //! always; barrier: never).
  bool in_place = false;
};

//! Seconds and calls per kind of collective (indexed by `collective`), and, when `record` is
//! set, one call_record per call in issue order.
struct comm_timing {
  static constexpr std::size_t kinds = collective_count;
  std::array<double, kinds> seconds{};
  std::array<std::uint64_t, kinds> calls{};
  bool record = false;  //!< append every call to `log`
  //! Run every asynchronous collective to completion when it is issued (its work handle is then
  //! already complete, and an error is thrown at the issue): the collectives of a step one
  //! after another, none overlapping the caller's work or each other. This is what the time
  //! model of plan/time.hpp assumes, so a step measured this way is what it predicts.
  bool serialize = false;
  std::vector<call_record> log;  //!< the calls since the last clear(), when `record` is set

  double seconds_of(collective c) const noexcept { return seconds[index(c)]; }
  std::uint64_t calls_of(collective c) const noexcept { return calls[index(c)]; }
  double total_seconds() const noexcept {
    double s = 0;
    for (const double x : seconds) s += x;
    return s;
  }
  std::uint64_t total_calls() const noexcept {
    std::uint64_t n = 0;
    for (const auto x : calls) n += x;
    return n;
  }
  void reset() noexcept {
    seconds.fill(0.0);
    calls.fill(0);
    log.clear();
  }
  static double now() noexcept {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  static constexpr std::size_t index(collective c) noexcept {
    const auto i = static_cast<std::size_t>(c);
    return i < kinds ? i : kinds - 1;
  }
};

namespace detail {
//! Adds the seconds of its lifetime to one kind of `comm_timing`.
//! With `record` (an index into t.log, or npos), also stamps that record's `left` at the end.
class timing_scope {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  timing_scope(comm_timing& t, collective c, std::size_t record = npos) noexcept
      : t_(t), i_(comm_timing::index(c)), record_(record), t0_(std::chrono::steady_clock::now()) {}
  timing_scope(const timing_scope&) = delete;
  timing_scope& operator=(const timing_scope&) = delete;
  ~timing_scope() {
    const auto t1 = std::chrono::steady_clock::now();
    t_.seconds[i_] += std::chrono::duration<double>(t1 - t0_).count();
    if (record_ != npos && record_ < t_.log.size()) {
      t_.log[record_].left = std::chrono::duration<double>(t1.time_since_epoch()).count();
    }
  }
  //! Stops stamping a record (an asynchronous collective is left at its wait(), not its issue).
  void release_record() noexcept { record_ = npos; }

 private:
  comm_timing& t_;
  std::size_t i_;
  std::size_t record_;
  std::chrono::steady_clock::time_point t0_;
};
}  // namespace detail

template <communicator C>
class timed_comm {
 public:
  using memory_space = typename C::memory_space;
  using inner_type = C;

  //! The work handle: the inner one, with wait() and test() timed.
  class work_type {
   public:
    work_type(typename C::work_type w, std::shared_ptr<comm_timing> t, collective c,
              std::size_t record = detail::timing_scope::npos)
        : w_(std::move(w)), t_(std::move(t)), c_(c), record_(record) {}
    void wait() {
      if (completed_) return;
      detail::timing_scope s(*t_, c_, record_);
      w_.wait();
    }
    bool test() {
      if (completed_) return true;
      detail::timing_scope s(*t_, c_, record_);
      const bool done = static_cast<bool>(w_.test());
      if (!done) s.release_record();
      return done;
    }

   private:
    friend class timed_comm;
    typename C::work_type w_;
    std::shared_ptr<comm_timing> t_;
    collective c_;
    std::size_t record_;
    bool completed_ = false;  // waited for at its issue (comm_timing::serialize)
  };

  explicit timed_comm(C inner)
      : inner_(std::move(inner)), timing_(std::make_shared<comm_timing>()) {}
  timed_comm(C inner, std::shared_ptr<comm_timing> shared)
      : inner_(std::move(inner)), timing_(std::move(shared)) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }

  //! Seconds and calls so far (shared with the communicators split() made).
  const comm_timing& timing() const noexcept { return *timing_; }
  comm_timing& timing() noexcept { return *timing_; }
  C& inner() noexcept { return inner_; }
  const C& inner() const noexcept { return inner_; }

  template <class T>
  void all_reduce(const T* in, T* out, std::size_t n, reduce_op op = reduce_op::sum) {
    auto s = scope(collective::all_reduce, n, sizeof(T), in == out);
    inner_.all_reduce(in, out, n, op);
  }
  template <class T>
  void reduce_scatter(const T* in, T* out, std::size_t count, reduce_op op = reduce_op::sum) {
    auto s = scope(collective::reduce_scatter, count, sizeof(T), rs_in_place(in, out, count));
    inner_.reduce_scatter(in, out, count, op);
  }
  template <class T>
  void all_gather(const T* in, T* out, std::size_t count) {
    auto s = scope(collective::all_gather, count, sizeof(T), ag_in_place(in, out, count));
    inner_.all_gather(in, out, count);
  }
  template <class T>
  void broadcast(T* buf, std::size_t n, int root) {
    auto s = scope(collective::broadcast, n, sizeof(T), true);
    inner_.broadcast(buf, n, root);
  }
  template <class T>
  void all_to_all(const T* in, T* out, std::size_t count) requires requires(C& c) {
    c.all_to_all(in, out, count);
  }
  {
    auto s = scope(collective::all_to_all, count, sizeof(T), in == out);
    inner_.all_to_all(in, out, count);
  }
  void barrier() {
    auto s = scope(collective::barrier);
    inner_.barrier();
  }

  template <class T>
  [[nodiscard]] work_type all_reduce_async(const T* in, T* out, std::size_t n,
                                           reduce_op op = reduce_op::sum) {
    return start(collective::all_reduce, {n, sizeof(T), in == out},
                 [&] { return inner_.all_reduce_async(in, out, n, op); });
  }
  template <class T>
  [[nodiscard]] work_type reduce_scatter_async(const T* in, T* out, std::size_t count,
                                               reduce_op op = reduce_op::sum) {
    return start(collective::reduce_scatter, {count, sizeof(T), rs_in_place(in, out, count)},
                 [&] { return inner_.reduce_scatter_async(in, out, count, op); });
  }
  template <class T>
  [[nodiscard]] work_type all_gather_async(const T* in, T* out, std::size_t count) {
    return start(collective::all_gather, {count, sizeof(T), ag_in_place(in, out, count)},
                 [&] { return inner_.all_gather_async(in, out, count); });
  }
  template <class T>
  [[nodiscard]] work_type broadcast_async(T* buf, std::size_t n, int root) requires requires(C& c) {
    c.broadcast_async(buf, n, root);
  }
  {
    return start(collective::broadcast, {n, sizeof(T), true},
                 [&] { return inner_.broadcast_async(buf, n, root); });
  }

  //! Collective, like C::split; the new communicator adds to this one's timing.
  timed_comm split(int color, int key) { return timed_comm(inner_.split(color, key), timing_); }

  const traffic_ledger& traffic() const noexcept { return inner_.traffic(); }
  void reset_traffic() noexcept requires requires(C& c) { c.reset_traffic(); }
  { inner_.reset_traffic(); }
  //! Device communicators that order their work after a compute stream keep doing so.
  template <class Stream>
  void set_compute_stream(Stream s) requires requires(C& c) {
    c.set_compute_stream(s);
  }
  { inner_.set_compute_stream(s); }

 private:
  // What a record says about the call besides its times.
  struct call_shape {
    std::size_t count = 0;
    std::size_t elem_bytes = 0;
    bool in_place = false;
  };
  template <class T>
  bool rs_in_place(const T* in, const T* out, std::size_t count) const {
    return out == in + static_cast<std::size_t>(rank()) * count;
  }
  template <class T>
  bool ag_in_place(const T* in, const T* out, std::size_t count) const {
    return in == out + static_cast<std::size_t>(rank()) * count;
  }
  // A new record of the call (when recording), stamped `entered` now.
  std::size_t open_record(collective c, call_shape x = {}) {
    if (!timing_->record) return detail::timing_scope::npos;
    const double t = comm_timing::now();
    timing_->log.push_back(call_record{c, t, t, x.count, x.elem_bytes, x.in_place});
    return timing_->log.size() - 1;
  }
  detail::timing_scope scope(collective c, std::size_t count = 0, std::size_t elem_bytes = 0,
                             bool in_place = false) {
    ++timing_->calls[comm_timing::index(c)];
    return detail::timing_scope(*timing_, c, open_record(c, {count, elem_bytes, in_place}));
  }
  template <class F>
  work_type start(collective c, call_shape x, F&& issue) {
    ++timing_->calls[comm_timing::index(c)];
    const std::size_t record = open_record(c, x);
    detail::timing_scope s(*timing_, c, record);
    if (timing_->serialize) {  // left when done, here
      work_type w(issue(), timing_, c, detail::timing_scope::npos);
      w.w_.wait();
      w.completed_ = true;
      return w;
    }
    s.release_record();  // left at its wait()
    return work_type(issue(), timing_, c, record);
  }

  C inner_;
  std::shared_ptr<comm_timing> timing_;
};

SHARDKIT_NAMESPACE_END
