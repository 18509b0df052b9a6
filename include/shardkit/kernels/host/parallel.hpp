//! \file kernels/host/parallel.hpp
//! Running the host loops on several threads of one rank: the `executor` interface (anything
//! that runs a batch of tasks and returns when all are done: shardkit's own `thread_team`, or
//! a framework's thread pool behind an adapter), and `parallel_for`, which cuts a range of
//! elements into contiguous pieces, one per thread.
//!
//! Results never depend on the number of threads: every host loop is element-wise, each
//! element goes through the same vector code wherever a piece boundary falls (the tail of a
//! piece too, kernels/host/simd.hpp), and the gradient statistics are integer sums. Pieces
//! start at multiples of 64 elements, so two threads never write the same cache line.
//!
//! `thread_team` is persistent: its threads are created once, wait for work on a futex
//! (std::atomic::wait) after a short spin, and run every batch they are given; a batch costs
//! two wake-ups, no thread creation.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace host {

//! A non-owning reference to a callable `void(std::size_t)` (valid while the callable lives).
class task_ref {
 public:
  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, task_ref> &&
           std::is_invocable_v<F&, std::size_t>) task_ref(F& f)
  noexcept  // NOLINT(google-explicit-constructor): a reference, like a view
      : obj_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o, std::size_t i) { (*static_cast<F*>(o))(i); }) {}
  void operator()(std::size_t i) const { call_(obj_, i); }

 private:
  void* obj_;
  void (*call_)(void*, std::size_t);
};

//! Runs batches of tasks on some threads. Implement it to hand shardkit's host loops to your
//! own thread pool; thread_team is shardkit's.
class executor {
 public:
  virtual ~executor() = default;
  //! How many tasks run at once (the calling thread included); parallel_for cuts a range into
  //! this many pieces.
  virtual std::size_t concurrency() const noexcept = 0;
  //! Runs task(i) once for every i in [0, count), on any of its threads (the caller's too),
  //! and returns when all have returned. If tasks throw, rethrows one of their exceptions
  //! after all have finished.
  virtual void bulk(std::size_t count, task_ref task) = 0;
};

//! A persistent team of `threads` threads (the caller of bulk() is one of them, so threads - 1
//! are created, once). bulk() calls from several threads at once run one after the other; a
//! bulk() from inside one of the team's tasks runs its tasks inline.
class thread_team final : public executor {
 public:
  explicit thread_team(std::size_t threads) : n_(threads) {
    if (threads == 0) ::shardkit::detail::raise("thread_team: needs at least 1 thread, got 0");
    workers_.reserve(threads - 1);
    for (std::size_t t = 1; t < threads; ++t) workers_.emplace_back([this] { work(); });
  }
  thread_team(const thread_team&) = delete;
  thread_team& operator=(const thread_team&) = delete;
  ~thread_team() override {
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (auto& w : workers_) w.join();
  }

  std::size_t concurrency() const noexcept override { return n_; }

  void bulk(std::size_t count, task_ref task) override {
    if (count == 0) return;
    if (n_ == 1 || count == 1 || inside()) {
      for (std::size_t i = 0; i < count; ++i) task(i);
      return;
    }
    std::lock_guard serial(bulk_mu_);
    task_ = &task;
    count_ = count;
    next_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    const std::size_t helpers = std::min(workers_.size(), count - 1);
    active_.store(helpers, std::memory_order_relaxed);
    // Published last: a worker that takes a place (acquire) sees the batch above, even one that
    // woke for an earlier generation.
    wanted_.store(helpers, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    inside() = true;
    drain();
    inside() = false;
    // Wait for the helpers (spin briefly: they finish about when the caller does).
    for (int spin = 0; active_.load(std::memory_order_acquire) != 0; ++spin) {
      if (spin < 4000) {
        pause();
      } else {
        const std::size_t a = active_.load(std::memory_order_acquire);
        if (a != 0) active_.wait(a, std::memory_order_acquire);
      }
    }
    task_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  static void pause() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }
  static bool& inside() noexcept {
    thread_local bool in = false;
    return in;
  }

  // Runs tasks until none is left.
  void drain() {
    for (;;) {
      const std::size_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= count_) return;
      try {
        (*task_)(i);
      } catch (...) {
        std::lock_guard lk(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void work() {
    inside() = true;
    std::uint32_t seen = 0;  // the generation at construction (a late start must not miss a batch)
    for (;;) {
      // Wait for the next batch: spin a little (a training step issues batches back to back),
      // then sleep on the generation word.
      std::uint32_t g = seen;
      for (int spin = 0; (g = generation_.load(std::memory_order_acquire)) == seen; ++spin) {
        if (spin < 2000) {
          pause();
        } else {
          generation_.wait(seen, std::memory_order_acquire);
        }
      }
      seen = g;
      if (stop_.load(std::memory_order_relaxed)) return;
      // Take part unless enough helpers already have (a batch of fewer tasks than threads).
      // Every place taken is given back through active_, so the caller returns only once
      // wanted_ is 0 again; a worker that takes two places of one batch finds no task the
      // second time.
      std::size_t w = wanted_.load(std::memory_order_relaxed);
      bool joined = false;
      while (w != 0) {
        if (wanted_.compare_exchange_weak(w, w - 1, std::memory_order_acq_rel)) {
          joined = true;
          break;
        }
      }
      if (!joined) continue;
      drain();
      if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) active_.notify_one();
    }
  }

  const std::size_t n_;
  std::vector<std::thread> workers_;
  std::mutex bulk_mu_;
  std::mutex error_mu_;
  std::exception_ptr error_;
  const task_ref* task_ = nullptr;
  std::size_t count_ = 0;
  std::atomic<std::size_t> next_{0};
  std::atomic<std::size_t> active_{0};
  std::atomic<std::size_t> wanted_{0};
  std::atomic<std::uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
};

//! Piece boundaries are multiples of this many elements (a 64-byte line of 16-bit data holds
//! 32, of fp32 16).
inline constexpr std::size_t piece_alignment = 64;

//! How parallel_for cuts n elements: `count` pieces of `per` elements (the last may be shorter).
struct pieces {
  std::size_t count = 1;
  std::size_t per = 0;
  static pieces of(const executor* exec, std::size_t n, std::size_t grain) noexcept {
    std::size_t c = exec != nullptr ? exec->concurrency() : 1;
    c = std::min(c, std::max<std::size_t>(1, n / std::max<std::size_t>(grain, 1)));
    if (c <= 1) return {1, n};
    const std::size_t per =
        ((n + c - 1) / c + piece_alignment - 1) / piece_alignment * piece_alignment;
    return {(n + per - 1) / per, per};
  }
};

//! Calls f(piece, begin, end) for contiguous pieces that cover [0, n), on `exec`'s threads: one
//! piece per thread, each at least `grain` elements (fewer pieces when n is small), boundaries
//! at multiples of piece_alignment (pieces::of says how many). With no executor, or one piece,
//! f(0, 0, n) runs on the caller.
template <class F>
void parallel_pieces(executor* exec, std::size_t n, std::size_t grain, F&& f) {
  if (n == 0) return;
  const pieces p = pieces::of(exec, n, grain);
  // pieces::of gives one piece without an executor; the second test says so to GCC, which
  // otherwise warns (-Wnonnull) that exec may be null below.
  if (p.count <= 1 || exec == nullptr) {
    f(std::size_t{0}, std::size_t{0}, n);
    return;
  }
  auto task = [&](std::size_t t) {
    const std::size_t b = std::min(n, t * p.per);
    const std::size_t e = std::min(n, b + p.per);
    if (b < e) f(t, b, e);
  };
  exec->bulk(p.count, task_ref(task));
}

//! Calls f(begin, end) for the pieces of parallel_pieces.
template <class F>
void parallel_for(executor* exec, std::size_t n, std::size_t grain, F&& f) {
  parallel_pieces(exec, n, grain, [&](std::size_t, std::size_t b, std::size_t e) { f(b, e); });
}

}  // namespace host
SHARDKIT_NAMESPACE_END
