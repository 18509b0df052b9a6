//! \file comm/thread/group.hpp
//! The shared state of one group of thread ranks (comm/thread.hpp): the rendezvous every
//! collective passes through, the posted calls and their matching check, the timeout that turns
//! a missing rank into comm_timeout on every waiting rank, the abort that fails every pending
//! and later collective of the group and of its sub-groups, and the sub-groups split() makes.
//!
//! The rendezvous is an atomic arrival counter and a generation word: ranks that arrive early
//! spin on the generation for a few microseconds (pausing, then yielding the core to the ranks
//! they wait for), and only then sleep on a condition variable with the timeout. The last rank
//! to arrive checks the posted calls, bumps the generation and wakes sleepers, if any. A
//! collective on idle ranks therefore costs a few cache-line transfers, not a mutex handoff per
//! rank.
//!
//! Ranks are named by their world rank (their rank in the group run_ranks made) in every
//! message, and a sub-group by its members' world ranks, so an error under hybrid sharding says
//! which thread it means. A rank whose function returns leaves the group (leave()): every group
//! it belongs to is aborted at once, since none of their collectives can complete without it.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/frontend.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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
  //! run_ranks only: once a rank has failed, how long the others have to return before
  //! run_ranks reports those still running as stuck (rank_failure::detached), detaches their
  //! threads and throws group_error. A rank in a collective of the failed group fails at once;
  //! this bounds a rank that never calls one again (an endless loop, a deadlock of its own).
  std::chrono::milliseconds return_timeout{std::chrono::seconds(30)};
};

//! One rank's failure inside thread_group::run.
struct rank_failure {
  int rank;
  std::string message;
  std::exception_ptr exception;
  //! The rank did not return within thread_comm_options::return_timeout after the group failed:
  //! its thread was detached and may still be running (see run_ranks).
  bool detached = false;
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

//! A pause instruction where there is one (a spin-wait hint), else a yield.
inline void cpu_pause() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

//! How long a thread rank spins before it sleeps: `pauses` pause instructions (the other side
//! may be a few hundred cycles behind), then `yields` yields of the core (to the threads it
//! waits for, when ranks share cores).
struct spin_budget {
  int pauses = 256;
  int yields = 64;
};

//! Whether `ranks` threads each have a core of their own (std::thread::hardware_concurrency();
//! unknown counts as 1). Only then does a rank that waits for its progress thread, or a
//! progress thread waiting for work, spin before it sleeps: with more ranks than cores a spinning
//! thread takes the core of one it waits for (measured: ZeRO-3 steps of 4 ranks on 2 cores up
//! to 1.3x slower with the spin; of 2 ranks, 1M parameters, 0.90x, median of 5 rounds).
inline bool ranks_fit_cores(int ranks) noexcept {
  static const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return ranks > 0 && static_cast<unsigned>(ranks) <= cores;
}

//! Spins until done() or the budget is spent; true when done() became true. Callers sleep on
//! their condition variable afterwards when it did not: waking a sleeping thread costs tens of
//! microseconds (more in a virtual machine whose idle CPUs halt), spinning a few microseconds
//! costs nothing when the event is that close.
template <class Done>
bool spin_until(Done&& done, spin_budget b = {}) {
  for (int spin = 0; spin < b.pauses + b.yields; ++spin) {
    if (done()) return true;
    if (spin < b.pauses) {
      cpu_pause();
    } else {
      std::this_thread::yield();
    }
  }
  return done();
}

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
  //! A group of n ranks; `world` holds the world rank of each (empty: ranks 0..n-1, a group
  //! of its own, as run_ranks makes).
  thread_group_state(int n, thread_comm_options opts, std::vector<int> world = {})
      : n_(n),
        opts_(opts),
        world_(std::move(world)),
        slots_(static_cast<std::size_t>(n)),
        arrived_at_(std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(n))),
        split_results_(static_cast<std::size_t>(n)) {
    for (int q = 0; q < n; ++q) arrived_at_[static_cast<std::size_t>(q)].store(0);
    if (world_.empty()) {
      for (int q = 0; q < n; ++q) world_.push_back(q);
    } else {
      is_sub_ = true;
    }
  }

  int size() const noexcept { return n_; }
  //! The world rank of member r.
  int world_rank(int r) const noexcept { return world_[static_cast<std::size_t>(r)]; }
  //! "rank 2" in a world group; "world rank 3 (rank 1 of the sub-group of world ranks {1, 3})"
  //! in a sub-group.
  std::string who(int r) const {
    if (!is_sub_) return concat("rank ", r);
    return concat("world rank ", world_rank(r), " (rank ", r, " of ", group_name(), ")");
  }
  //! "the group of 4 ranks" or "the sub-group of world ranks {1, 3}".
  std::string group_name() const {
    if (!is_sub_) return concat("the group of ", n_, " ranks");
    return concat("the sub-group of world ranks {", list(world_), "}");
  }
  const thread_comm_options& options() const noexcept { return opts_; }
  const thread_slot& slot(int r) const noexcept { return slots_[static_cast<std::size_t>(r)]; }

  //! Posts rank's slot (when given) and waits until every rank has arrived at this phase.
  //! The last rank to arrive checks that the posted collectives match. Returns the mismatch
  //! message ("" when they match). Throws comm_aborted or comm_timeout.
  std::string arrive(int rank, const thread_slot* post, const char* phase, std::uint64_t call,
                     const collective_desc& what, bool what_split) {
    if (aborted_flag_.load(std::memory_order_acquire)) {
      std::lock_guard lk(mu_);
      throw_if_aborted_locked(rank, phase, call, what, what_split);
    }
    // The slot is published by the arrival below (release), read by the last rank (acquire).
    if (post != nullptr) slots_[static_cast<std::size_t>(rank)] = *post;
    const std::uint64_t gen = generation_.load(std::memory_order_acquire);
    arrived_at_[static_cast<std::size_t>(rank)].store(gen + 1, std::memory_order_relaxed);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      std::string mismatch;
      if (post != nullptr) {
        if (opts_.check_matching) mismatch = check_locked(call);
        if (mismatch.empty() && slots_[0].is_split) {
          std::lock_guard lk(mu_);
          make_splits_locked();
        }
      }
      mismatch_ = mismatch;  // read by the others once they see the new generation
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) != 0) {
        { std::lock_guard lk(mu_); }  // a sleeper is either waiting (and notified) or not yet
        cv_.notify_all();             // checking (and will see the generation)
      }
      return mismatch;
    }
    // Spin: pause first (the others may be a few hundred cycles behind), then yield the core.
    bool stopped = false;
    const bool released = spin_until([&] {
      if (generation_.load(std::memory_order_acquire) != gen) return true;
      stopped = aborted_flag_.load(std::memory_order_relaxed);
      return stopped;
    });
    if (released && !stopped) return mismatch_;
    std::unique_lock lk(mu_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    struct not_sleeping {
      std::atomic<int>& n;
      ~not_sleeping() { n.fetch_sub(1, std::memory_order_seq_cst); }
    } guard{sleepers_};
    const auto deadline = std::chrono::steady_clock::now() + opts_.timeout;
    while (generation_.load(std::memory_order_seq_cst) == gen) {
      throw_if_aborted_locked(rank, phase, call, what, what_split);
      if (cv_.wait_until(lk, deadline) == std::cv_status::timeout &&
          generation_.load(std::memory_order_seq_cst) == gen && !aborted_) {
        std::vector<int> missing;
        for (int q = 0; q < n_; ++q) {
          if (arrived_at_[static_cast<std::size_t>(q)].load(std::memory_order_relaxed) != gen + 1) {
            missing.push_back(world_rank(q));
          }
        }
        const std::string whom =
            is_sub_ ? concat("world rank(s) {", list(missing), "} of ", group_name())
                    : concat("rank(s) {", list(missing), "} of ", n_);
        abort_locked(
            concat(describe(what, what_split), " (call #", call, ", ", phase, ") timed out after ",
                   opts_.timeout.count(), " ms on ", who(rank), ": ", whom,
                   " did not arrive (a rank hangs outside the collectives, or issued "
                   "fewer collectives)"),
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

  //! World rank `world_rank` returned from its rank function: every group it belongs to (this
  //! one or a sub-group) is aborted, so whoever waits in, or later calls, one of their
  //! collectives fails at once with comm_aborted naming it. Groups without it are untouched.
  void leave(int world_rank) {
    std::vector<std::shared_ptr<thread_group_state>> kids;
    {
      std::lock_guard lk(mu_);
      if (std::find(world_.begin(), world_.end(), world_rank) != world_.end()) {
        abort_locked(concat(is_sub_ ? "world rank " : "rank ", world_rank,
                            " returned from its rank function and left ", group_name(),
                            ": no collective of it can complete any more (every rank must issue "
                            "the same collectives)"),
                     false);
      }
      for (auto& w : children_) {
        if (auto k = w.lock()) kids.push_back(std::move(k));
      }
    }
    for (auto& k : kids) k->leave(world_rank);
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
    aborted_flag_.store(true, std::memory_order_release);
    cv_.notify_all();
  }

  void throw_if_aborted_locked(int rank, const char* phase, std::uint64_t call,
                               const collective_desc& what, bool what_split) const {
    if (!aborted_) return;
    if (abort_timeout_) throw comm_timeout(abort_reason_);
    throw comm_aborted(concat("thread communicator aborted: ", abort_reason_, " [seen by ",
                              who(rank), " in ", describe(what, what_split), " (call #", call, ", ",
                              phase, ")]"));
  }

  static std::string list(const std::vector<int>& v) {
    std::string s;
    for (int x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
    return s;
  }

  std::string check_locked(std::uint64_t call) const {
    const thread_slot& s0 = slots_[0];
    for (int q = 1; q < n_; ++q) {
      const thread_slot& sq = slots_[static_cast<std::size_t>(q)];
      if (sq.is_split != s0.is_split || (!s0.is_split && !sq.desc.matches(s0.desc))) {
        return mismatch_message(call, s0.desc, s0.is_split, q, sq.desc, sq.is_split, who(0),
                                who(q));
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
      std::vector<int> world;
      for (const auto& m : members) world.push_back(world_rank(m.second));
      auto child =
          std::make_shared<thread_group_state>(static_cast<int>(members.size()), opts_, world);
      children_.push_back(child);
      for (std::size_t i = 0; i < members.size(); ++i) {
        split_results_[static_cast<std::size_t>(members[i].second)] = {child, static_cast<int>(i)};
      }
    }
  }

  const int n_;
  const thread_comm_options opts_;
  std::vector<int> world_;  // world rank of each member
  bool is_sub_ = false;     // made by split()
  mutable std::mutex mu_;   // sleepers, abort, splits
  std::condition_variable cv_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<std::uint64_t> generation_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> aborted_flag_{false};
  std::vector<thread_slot> slots_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> arrived_at_;  // generation + 1 once arrived
  std::string mismatch_;
  bool aborted_ = false;
  bool abort_timeout_ = false;
  std::string abort_reason_;
  std::vector<std::pair<std::shared_ptr<thread_group_state>, int>> split_results_;
  std::vector<std::weak_ptr<thread_group_state>> children_;
};

}  // namespace detail

SHARDKIT_NAMESPACE_END
