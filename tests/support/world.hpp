// Worlds: how a test runs one function on N ranks of a given communicator. Collective and
// engine tests are written once as templates over a World and instantiated for every
// communicator of the binary (SHARDKIT_TEST_WORLDS): thread_world in the ordinary test
// binaries, mpi_world in the binaries built with SHARDKIT_TEST_MPI and run under mpiexec.
//
// A rank function returns a value (often a string describing the first failed check, empty when
// everything held); World::run(n, fn) returns every rank's value, in rank order, so the test
// asserts after all ranks are done (Catch2 assertions are not thread-safe, and under MPI every
// process must take the same path through the test). If a rank throws, run() throws
// shardkit::group_error listing every failed rank.
#pragma once

#include <shardkit/comm/thread.hpp>
#include <shardkit/core/checked.hpp>

#if defined(SHARDKIT_TEST_MPI)
#include <shardkit/comm/mpi.hpp>

#include "support/serial.hpp"
#endif

#include <catch2/catch.hpp>

#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace test {

struct thread_world {
  using comm_type = shardkit::thread_comm;
  static constexpr const char* name = "thread";
  static shardkit::thread_comm_options options() {
    shardkit::thread_comm_options o;
    o.timeout = std::chrono::seconds(60);
    return o;
  }
  //! Rank counts are unrestricted.
  static int max_ranks() { return INT_MAX; }
  //! Runs fn(comm) on n ranks.
  template <class F>
  static auto run(int n, F&& fn) {
    return shardkit::run_ranks(n, std::forward<F>(fn), options());
  }
};

//! Runs fn(comm) on n thread ranks; returns each rank's exception message ("" for none), so a
//! test can check that every rank raised the expected error.
template <class F>
std::vector<std::string> errors_per_rank(int n, F fn) {
  return shardkit::run_ranks(n, [&](shardkit::thread_comm& c) -> std::string {
    try {
      fn(c);
    } catch (const std::exception& e) {
      return e.what();
    }
    return {};
  });
}

#if defined(SHARDKIT_TEST_MPI)
//! The processes of the MPI job (mpiexec -np K). run(n, fn) runs fn on the first n processes
//! (a split communicator; the others sit out) and gathers the results to every process, so all
//! processes assert on the same values. The test binary's main() calls open() after MPI_Init
//! and close() before MPI_Finalize.
struct mpi_world {
  using comm_type = shardkit::mpi_comm;
  static constexpr const char* name = "mpi";

  //! Options of the communicators the rank functions get.
  static shardkit::mpi_comm_options options() {
    shardkit::mpi_comm_options o;
    o.timeout = std::chrono::seconds(60);  // a broken test fails instead of hanging the job
    return o;
  }
  //! The whole job, for splitting and gathering results: default (long) timeout, because the
  //! processes that sit out a case wait here for as long as the others run it.
  static void open() { slot() = std::make_unique<shardkit::mpi_comm>(shardkit::mpi_comm::world()); }
  static void close() { slot().reset(); }
  static shardkit::mpi_comm& world() {
    if (!slot()) throw std::logic_error("mpi_world: open() was not called");
    return *slot();
  }
  static int max_ranks() { return world().size(); }

  template <class F>
  static auto run(int n, F&& fn) {
    using R = std::invoke_result_t<F&, shardkit::mpi_comm&>;
    auto& w = world();
    if (n < 1 || n > w.size()) {
      throw std::logic_error("mpi_world::run: " + std::to_string(n) +
                             " ranks requested, the job has " + std::to_string(w.size()) +
                             " (check test::fits<World>(n) first)");
    }
    const bool participates = w.rank() < n;
    std::string mine;  // 1 + encoded result, or 0 + error message
    {
      auto group = w.split(participates ? 0 : 1, w.rank());
      if (participates) {
        try {
          auto sub = shardkit::mpi_comm::duplicate(group.native(), options());
          if constexpr (std::is_void_v<R>) {
            fn(sub);
            mine = serial::encode(std::uint8_t{1});
          } else {
            R r = fn(sub);
            mine = serial::encode(std::uint8_t{1}) + serial::encode(r);
          }
        } catch (const std::exception& e) {
          mine = serial::encode(std::uint8_t{0}) + serial::encode(std::string(e.what()));
        } catch (...) {
          mine = serial::encode(std::uint8_t{0}) +
                 serial::encode(std::string("non-standard exception"));
        }
      }
    }
    const std::vector<std::string> all = gather(w, mine);
    std::vector<shardkit::rank_failure> failures;
    using stored = std::conditional_t<std::is_void_v<R>, char, R>;
    std::vector<stored> results;
    for (int q = 0; q < n; ++q) {
      const std::string& b = all[static_cast<std::size_t>(q)];
      if (b.empty() || b[0] == 0) {
        failures.push_back(
            {q, b.empty() ? "no result" : serial::decode<std::string>(b.substr(1)), nullptr});
      } else if constexpr (!std::is_void_v<R>) {
        results.push_back(serial::decode<R>(b.substr(1)));
      }
    }
    if (!failures.empty()) throw shardkit::group_error(std::move(failures));
    if constexpr (!std::is_void_v<R>) return results;
  }

 private:
  static std::unique_ptr<shardkit::mpi_comm>& slot() {
    static std::unique_ptr<shardkit::mpi_comm> comm;
    return comm;
  }
  // Every process's bytes, on every process.
  static std::vector<std::string> gather(shardkit::mpi_comm& w, const std::string& mine) {
    const auto N = static_cast<std::size_t>(w.size());
    std::uint64_t len = mine.size();
    std::vector<std::uint64_t> lens(N);
    w.all_gather(&len, lens.data(), 1);
    std::uint64_t longest = 0;
    for (auto l : lens) longest = std::max(longest, l);
    std::vector<std::uint8_t> padded(longest), all(longest * N);
    std::copy(mine.begin(), mine.end(), reinterpret_cast<char*>(padded.data()));
    w.all_gather(padded.data(), all.data(), longest);
    std::vector<std::string> out(N);
    for (std::size_t q = 0; q < N; ++q) {
      out[q].assign(reinterpret_cast<const char*>(all.data()) + q * longest, lens[q]);
    }
    return out;
  }
};
#define SHARDKIT_TEST_WORLDS test::mpi_world
#else
#define SHARDKIT_TEST_WORLDS test::thread_world
#endif

//! True when World can run n ranks; otherwise says so with WARN (the case is skipped).
template <class World>
bool fits(int n) {
  if (n <= World::max_ranks()) return true;
  WARN(World::name << " world has " << World::max_ranks() << " ranks; skipping the case with " << n
                   << " ranks");
  return false;
}

//! Runs fn(comm) on n ranks of World; returns each rank's exception message ("" for none), or
//! nothing (with a warning) when World has fewer than n ranks: errors_per_rank over every
//! communicator.
template <class World, class F>
std::vector<std::string> messages_on(int n, F fn) {
  if (!fits<World>(n)) return {};
  using Comm = typename World::comm_type;
  return World::run(n, [&](Comm& c) -> std::string {
    try {
      fn(c);
    } catch (const std::exception& e) {
      return e.what();
    }
    return {};
  });
}

//! Runs fn(comm) on n ranks of World; returns each rank's error as "<type>: <message>" (type one
//! of size_overflow, invalid_argument, usage_error, comm_timeout, comm_aborted,
//! collective_mismatch, comm_error, error, std) or "" when it raised none, so a test checks
//! that every rank raised the expected error, over every communicator.
template <class World, class F>
std::vector<std::string> typed_errors_on(int n, F fn) {
  using Comm = typename World::comm_type;
  return World::run(n, [&](Comm& c) -> std::string {
    try {
      fn(c);
    } catch (const shardkit::size_overflow& e) {
      return std::string("size_overflow: ") + e.what();
    } catch (const shardkit::invalid_argument& e) {
      return std::string("invalid_argument: ") + e.what();
    } catch (const shardkit::usage_error& e) {
      return std::string("usage_error: ") + e.what();
    } catch (const shardkit::comm_timeout& e) {
      return std::string("comm_timeout: ") + e.what();
    } catch (const shardkit::comm_aborted& e) {
      return std::string("comm_aborted: ") + e.what();
    } catch (const shardkit::collective_mismatch& e) {
      return std::string("collective_mismatch: ") + e.what();
    } catch (const shardkit::comm_error& e) {
      return std::string("comm_error: ") + e.what();
    } catch (const shardkit::error& e) {
      return std::string("error: ") + e.what();
    } catch (const std::exception& e) {
      return std::string("std: ") + e.what();
    }
    return {};
  });
}

//! Asserts that every rank reported no failure.
inline void require_all_ok(const std::vector<std::string>& per_rank) {
  for (std::size_t r = 0; r < per_rank.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(per_rank[r] == "");
  }
}

}  // namespace test
