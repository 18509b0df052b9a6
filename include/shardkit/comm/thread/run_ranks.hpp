//! \file comm/thread/run_ranks.hpp
//! `run_ranks`: runs a function on N thread ranks of a fresh group and collects their results;
//! a rank that throws aborts the group, so the others fail fast instead of waiting.
#pragma once

#include <shardkit/comm/thread/communicator.hpp>
#include <shardkit/comm/thread/group.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>

#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

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

SHARDKIT_NAMESPACE_END
