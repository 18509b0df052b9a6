//! \file comm/thread/run_ranks.hpp
//! `run_ranks`: runs a function on N thread ranks of a fresh group and collects their results.
//! A rank that throws aborts the group, and a rank whose function returns leaves it, so the
//! others fail at once instead of waiting; a rank that never returns after the group failed is
//! reported as stuck rather than joined for ever.
#pragma once

#include <shardkit/comm/thread/communicator.hpp>
#include <shardkit/comm/thread/group.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

namespace detail {

//! What the rank threads of one run_ranks call share. Held by a shared_ptr in every thread, so
//! a detached (stuck) thread keeps its endpoint and slots alive after run_ranks returned.
template <class Comm, class Stored>
struct run_ranks_context {
  std::shared_ptr<thread_group_state> state;
  std::vector<Comm> comms;
  std::vector<std::optional<Stored>> results;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<rank_failure> failures;  // in the order they happened
  std::chrono::steady_clock::time_point first_failure{};
  std::vector<char> returned;  // per rank: its function has returned or thrown
  int running = 0;

  void fail(int r, std::string message, std::exception_ptr e) {
    {
      std::lock_guard lk(mu);
      if (failures.empty()) first_failure = std::chrono::steady_clock::now();
      failures.push_back({r, message, std::move(e)});
    }
    cv.notify_all();
    state->abort(concat("rank ", r, " failed: ", message));
  }
  void finished(int r) {
    {
      std::lock_guard lk(mu);
      returned[static_cast<std::size_t>(r)] = 1;
      --running;
    }
    cv.notify_all();
  }
};

}  // namespace detail

//! Runs `fn(comm)` on `ranks` threads, each with its endpoint of a fresh group, and returns the
//! per-rank results (when fn returns a value). Faults end in group_error, promptly:
//! - a rank that throws aborts the group: every other rank's pending and later collective fails
//!   with comm_aborted naming it;
//! - a rank whose function returns leaves the group (and every sub-group of it that it belongs
//!   to): a rank waiting in, or later calling, a collective of those groups fails at once with
//!   comm_aborted naming the rank that left, instead of waiting for the timeout;
//! - once a rank has failed, the others have opts.return_timeout to return. A rank still running
//!   then (stuck outside the collectives: they would have failed it) is listed in group_error
//!   with rank_failure::detached set, and its thread is detached, not joined. That thread keeps
//!   its endpoint (which stays aborted) and, when `fn` was passed as a temporary, its own copy
//!   of `fn`; but it still runs, and may touch what `fn` refers to (captures by reference, a
//!   named `fn`): treat such an error as fatal and end the process rather than destroy that
//!   state.
//! Without any failure run_ranks waits for every rank, however long it runs.
template <memory_space Space = host_space, class F>
auto run_ranks(int ranks, F&& fn, thread_comm_options opts = {}) {
  using comm_t = thread_communicator<Space>;
  using R = std::invoke_result_t<F&, comm_t&>;
  using stored = std::conditional_t<std::is_void_v<R>, char, R>;
  if (ranks < 1) detail::raise("run_ranks: need at least 1 rank, got ", ranks);
  const auto n = static_cast<std::size_t>(ranks);
  auto ctx = std::make_shared<detail::run_ranks_context<comm_t, stored>>();
  ctx->state = std::make_shared<detail::thread_group_state>(ranks, opts);
  ctx->comms.reserve(n);
  for (int r = 0; r < ranks; ++r) ctx->comms.emplace_back(ctx->state, r);
  ctx->results.resize(n);
  ctx->returned.assign(n, 0);
  ctx->running = ranks;

  // A temporary function object moves into storage the threads share, so a detached thread
  // never runs a destroyed closure; a named one is used where it is.
  using fn_t = std::remove_reference_t<F>;
  std::shared_ptr<fn_t> f;
  if constexpr (std::is_lvalue_reference_v<F>) {
    f = std::shared_ptr<fn_t>(&fn, [](fn_t*) {});
  } else {
    f = std::make_shared<fn_t>(std::move(fn));
  }
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([ctx, f, r] {
      // Rank r's large host buffers start on its own slot of the stagger across threads, so
      // that the ranks' buffers, which the collectives stream at the same offsets, do not agree
      // modulo 2 MiB (core/memory.hpp).
      space_allocator<host_space>::set_thread_slot(static_cast<std::size_t>(r));
      auto& comm = ctx->comms[static_cast<std::size_t>(r)];
      try {
        if constexpr (std::is_void_v<R>) {
          (*f)(comm);
        } else {
          ctx->results[static_cast<std::size_t>(r)].emplace((*f)(comm));
        }
        ctx->state->leave(r);
      } catch (const std::exception& e) {
        ctx->fail(r, e.what(), std::current_exception());
      } catch (...) {
        ctx->fail(r, "non-standard exception", std::current_exception());
      }
      ctx->finished(r);
    });
  }

  // Wait for every rank; after the first failure, for opts.return_timeout at most.
  std::vector<int> stuck;
  {
    std::unique_lock lk(ctx->mu);
    for (;;) {
      if (ctx->running == 0) break;
      if (ctx->failures.empty()) {
        ctx->cv.wait(lk);
      } else if (ctx->cv.wait_until(lk, ctx->first_failure + opts.return_timeout) ==
                     std::cv_status::timeout &&
                 ctx->running != 0) {
        break;
      }
    }
    for (int r = 0; r < ranks; ++r) {
      if (!ctx->returned[static_cast<std::size_t>(r)]) stuck.push_back(r);
    }
    for (int r : stuck) {
      ctx->failures.push_back(
          {r,
           detail::concat("rank ", r, " did not return within ", opts.return_timeout.count(),
                          " ms after the group failed (stuck outside the collectives); its "
                          "thread was detached and may still be running"),
           nullptr, true});
    }
  }
  for (int r = 0; r < ranks; ++r) {
    auto& t = threads[static_cast<std::size_t>(r)];
    if (std::find(stuck.begin(), stuck.end(), r) == stuck.end()) {
      t.join();
      // Its endpoint's progress thread is joined here; a stuck rank keeps its own.
      [[maybe_unused]] comm_t gone = std::move(ctx->comms[static_cast<std::size_t>(r)]);
    } else {
      t.detach();
    }
  }
  std::unique_lock lk(ctx->mu);
  if (!ctx->failures.empty()) {
    std::vector<rank_failure> failures = std::move(ctx->failures);
    lk.unlock();
    throw group_error(std::move(failures));
  }
  if constexpr (!std::is_void_v<R>) {
    std::vector<R> out;
    out.reserve(n);
    for (auto& x : ctx->results) out.push_back(std::move(*x));
    return out;
  }
}

SHARDKIT_NAMESPACE_END
