// Worlds: how a test runs one function on N ranks of a given communicator. Collective and
// engine tests are written once as templates over a World and instantiated for every
// communicator that exists in the build. A rank function returns a value (often a string
// describing the first failed check, empty when everything held); World::run returns every
// rank's value, so the test asserts after all ranks are done (Catch2 assertions are not
// thread-safe).
#pragma once

#include <shardkit/comm/thread.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
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
  //! Runs fn(comm) on n ranks; rank counts are unrestricted.
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

//! Asserts that every rank reported no failure.
inline void require_all_ok(const std::vector<std::string>& per_rank) {
  for (std::size_t r = 0; r < per_rank.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(per_rank[r] == "");
  }
}

}  // namespace test
