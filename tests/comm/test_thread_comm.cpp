// The thread communicator's failure handling: mismatched collectives, timeouts, ranks that
// throw, abort; and split() into sub-groups of three. (Collective semantics, split and argument
// checks shared by every communicator are in test_collectives.cpp.)
#include <shardkit/comm/thread.hpp>

#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

using namespace shardkit;
using namespace std::chrono_literals;

namespace {
thread_comm_options fast_timeout() {
  thread_comm_options o;
  o.timeout = 300ms;
  return o;
}

// Runs fn on n ranks and returns each rank's exception message ("" for none).
template <class F>
std::vector<std::string> messages(int n, F fn, thread_comm_options o = {}) {
  std::vector<std::string> out(static_cast<std::size_t>(n));
  try {
    run_ranks(n, fn, o);
  } catch (const group_error& e) {
    for (const auto& f : e.failures()) out[static_cast<std::size_t>(f.rank)] = f.message;
  }
  return out;
}
}  // namespace

TEST_CASE("ranks that call different collectives get collective_mismatch on every rank",
          "[comm][thread][errors]") {
  SECTION("different kinds") {
    auto m = messages(3, [](thread_comm& c) {
      float x = 0;
      if (c.rank() == 2)
        c.all_gather(&x, &x, 0);
      else
        c.all_reduce(&x, &x, 1);
    });
    for (const auto& s : m) {
      REQUIRE_THAT(s, Catch::Contains("collective mismatch at call #1") &&
                          Catch::Contains("all_reduce(fp32, count 1, sum)") &&
                          Catch::Contains("all_gather"));
    }
  }
  SECTION("different counts or element types") {
    auto m = messages(2, [](thread_comm& c) {
      std::vector<bf16> x(8);
      c.all_reduce(x.data(), x.data(), c.rank() == 0 ? 8 : 4);
    });
    for (const auto& s : m)
      REQUIRE_THAT(s, Catch::Contains("count 8") && Catch::Contains("count 4"));
    m = messages(2, [](thread_comm& c) {
      std::vector<float> f(4);
      std::vector<bf16> h(4);
      if (c.rank() == 0)
        c.all_reduce(f.data(), f.data(), 4);
      else
        c.all_reduce(h.data(), h.data(), 4);
    });
    for (const auto& s : m) REQUIRE_THAT(s, Catch::Contains("fp32") && Catch::Contains("bf16"));
  }
  SECTION("the exception type is collective_mismatch") {
    auto r = run_ranks(2, [](thread_comm& c) -> int {
      float x = 0;
      try {
        if (c.rank() == 0)
          c.barrier();
        else
          c.all_reduce(&x, &x, 1);
      } catch (const collective_mismatch&) {
        return 1;
      }
      return 0;
    });
    REQUIRE(r == std::vector<int>{1, 1});
  }
}

TEST_CASE("a rank that never arrives makes the others fail with comm_timeout, not hang",
          "[comm][thread][errors]") {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      3,
      [](thread_comm& c) -> std::string {
        if (c.rank() == 1) {  // stalls outside the collectives, longer than the timeout
          std::this_thread::sleep_for(1s);
          return "late";
        }
        float x = 1;
        try {
          c.all_reduce(&x, &x, 1);
        } catch (const comm_timeout& e) {
          return e.what();
        }
        return "no error";
      },
      fast_timeout());
  REQUIRE(std::chrono::steady_clock::now() - t0 < 10s);
  for (int q : {0, 2}) {
    REQUIRE_THAT(r[static_cast<std::size_t>(q)], Catch::Contains("timed out after 300 ms") &&
                                                     Catch::Contains("{1}") &&
                                                     Catch::Contains("all_reduce"));
  }
}

TEST_CASE("a rank that throws aborts the group: others fail at once naming it",
          "[comm][thread][errors]") {
  const auto t0 = std::chrono::steady_clock::now();
  auto m = messages(4, [](thread_comm& c) {
    if (c.rank() == 3) throw std::runtime_error("model diverged on rank 3");
    c.barrier();  // would wait for rank 3 forever (default timeout: minutes)
    c.barrier();
  });
  REQUIRE(std::chrono::steady_clock::now() - t0 < 10s);
  REQUIRE(m[3] == "model diverged on rank 3");
  for (int q = 0; q < 3; ++q) {
    REQUIRE_THAT(m[static_cast<std::size_t>(q)],
                 Catch::Contains("aborted") && Catch::Contains("rank 3 failed: model diverged"));
  }
}

TEST_CASE("abort() fails pending asynchronous collectives too", "[comm][thread][errors]") {
  auto m = messages(2, [](thread_comm& c) {
    std::vector<float> a(16), b(32);
    if (c.rank() == 0) {
      auto w = c.all_gather_async(a.data(), b.data(), 16);
      w.wait();  // rank 1 aborts instead of joining
    } else {
      c.abort("stopping early");
    }
  });
  REQUIRE_THAT(m[0], Catch::Contains("rank 1 aborted: stopping early"));
}

TEST_CASE("split forms sub-groups ordered by key", "[comm][thread]") {
  auto r = run_ranks(6, [](thread_comm& c) {
    // two groups of three: even and odd ranks, reversed order by key
    auto sub = c.split(c.rank() % 2, -c.rank());
    int v = c.rank();
    sub.all_reduce(&v, &v, 1);
    std::vector<int> ranks(3);
    int me = c.rank();
    sub.all_gather(&me, ranks.data(), 1);
    // the parent still works after the split
    int one = 1;
    c.all_reduce(&one, &one, 1);
    return std::tuple{sub.size(), sub.rank(), v, ranks, one};
  });
  for (int q = 0; q < 6; ++q) {
    auto [size, rank, sum, members, total] = r[static_cast<std::size_t>(q)];
    REQUIRE(size == 3);
    REQUIRE(rank == 2 - q / 2);  // larger parent rank, smaller key
    REQUIRE(sum == (q % 2 == 0 ? 0 + 2 + 4 : 1 + 3 + 5));
    REQUIRE(members == (q % 2 == 0 ? std::vector<int>{4, 2, 0} : std::vector<int>{5, 3, 1}));
    REQUIRE(total == 6);
  }
}

TEST_CASE("bad arguments are rejected", "[comm][thread][errors]") {
  REQUIRE_THROWS_WITH(run_ranks(0, [](thread_comm&) {}), Catch::Contains("at least 1 rank"));
  auto m = messages(2, [](thread_comm& c) {
    float x = 0;
    c.broadcast(&x, 1, 5);
  });
  REQUIRE_THAT(m[0], Catch::Contains("root 5 is not a rank"));
  m = messages(2, [](thread_comm& c) { (void)c.split(-1, 0); });
  REQUIRE_THAT(m[0], Catch::Contains("color must be non-negative"));
}
