//! \file comm/thread/group.hpp
//! The shared state of one group of thread ranks (comm/thread.hpp): the rendezvous every
//! collective passes through, the posted calls and their matching check, the timeout that turns
//! a missing rank into comm_timeout on every waiting rank, the abort that fails every pending
//! and later collective of the group and of its sub-groups, and the sub-groups split() makes.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/frontend.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
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
        return mismatch_message(call, s0.desc, s0.is_split, q, sq.desc, sq.is_split);
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

}  // namespace detail

SHARDKIT_NAMESPACE_END
