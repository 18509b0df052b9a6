// Thread ranks that leave early or never return: run_ranks fails the group at once, naming the
// rank that left, and reports a rank stuck outside the collectives instead of joining it for
// ever. Errors in sub-groups (hybrid sharding) name world ranks and the sub-group.
#include <shardkit/comm/thread.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

using namespace shardkit;
using namespace std::chrono_literals;

namespace {
// A timeout no test reaches: a rank that left must be noticed long before it.
thread_comm_options long_timeout() {
  thread_comm_options o;
  o.timeout = 60s;
  return o;
}

std::chrono::steady_clock::duration since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::steady_clock::now() - t0;
}
}  // namespace

TEST_CASE("a rank whose function returns while others wait in a collective fails them at once",
          "[comm][thread][errors][leave]") {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> m(3);
  try {
    run_ranks(
        3,
        [&](thread_comm& c) {
          if (c.rank() == 1) return;  // leaves: the others' all-reduce can never complete
          float x = 1;
          c.all_reduce(&x, &x, 1);
        },
        long_timeout());
    FAIL("run_ranks returned");
  } catch (const group_error& e) {
    for (const auto& f : e.failures()) {
      REQUIRE_FALSE(f.detached);
      m[static_cast<std::size_t>(f.rank)] = f.message;
      REQUIRE_THROWS_AS(std::rethrow_exception(f.exception), comm_aborted);
    }
  }
  REQUIRE(since(t0) < 10s);
  REQUIRE(m[1].empty());  // the rank that left did not fail
  for (int q : {0, 2}) {
    INFO(m[static_cast<std::size_t>(q)]);
    REQUIRE_THAT(m[static_cast<std::size_t>(q)],
                 Catch::Contains("rank 1 returned from its rank function") &&
                     Catch::Contains("the group of 3 ranks") &&
                     Catch::Contains("all_reduce(fp32, count 1, sum)") &&
                     Catch::Contains("seen by rank " + std::to_string(q)));
  }
}

TEST_CASE("a collective called after a rank left fails at once", "[comm][thread][errors][leave]") {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [](thread_comm& c) -> std::string {
        if (c.rank() == 0) return "";
        std::this_thread::sleep_for(50ms);  // rank 0 has long returned
        try {
          c.barrier();
        } catch (const comm_aborted& e) {
          return e.what();
        }
        return "no error";
      },
      long_timeout());
  REQUIRE(since(t0) < 10s);
  REQUIRE_THAT(r[1], Catch::Contains("rank 0 returned from its rank function") &&
                         Catch::Contains("barrier"));
}

TEST_CASE("ranks that all return normally, and sub-groups the leaver is not in, are unaffected",
          "[comm][thread][leave]") {
  auto r = run_ranks(
      4,
      [](thread_comm& c) -> std::string {
        auto pair = c.split(c.rank() / 2, c.rank());  // {0, 1} and {2, 3}
        int v = 1;
        c.all_reduce(&v, &v, 1);  // the last collective of the whole group
        if (c.rank() == 3) return "left";
        if (c.rank() <= 1) {
          std::this_thread::sleep_for(20ms);  // rank 3 has left by now
          int w = 1;
          pair.all_reduce(&w, &w, 1);  // {0, 1}: complete, rank 3 is not in it
          return w == 2 && v == 4 ? "ok" : "wrong sum";
        }
        try {
          pair.barrier();  // {2, 3}: rank 3 left
        } catch (const comm_aborted& e) {
          return e.what();
        }
        return "no error";
      },
      long_timeout());
  REQUIRE(r[0] == "ok");
  REQUIRE(r[1] == "ok");
  REQUIRE(r[3] == "left");
  REQUIRE_THAT(r[2], Catch::Contains("world rank 3 returned from its rank function and left the "
                                     "sub-group of world ranks {2, 3}") &&
                         Catch::Contains("seen by world rank 2 (rank 0 of the sub-group"));
}

TEST_CASE("a rank stuck outside the collectives does not keep run_ranks waiting for ever",
          "[comm][thread][errors][stuck]") {
  std::atomic<bool> release{false}, exited{false};
  thread_comm_options o;
  o.timeout = 200ms;
  o.return_timeout = 300ms;
  const auto t0 = std::chrono::steady_clock::now();
  bool threw = false;
  try {
    run_ranks(
        3,
        [&](thread_comm& c) {
          if (c.rank() == 2) {  // never calls a collective, never returns (until released)
            while (!release.load()) std::this_thread::sleep_for(5ms);
            exited.store(true);
            return;
          }
          c.barrier();  // times out: rank 2 does not arrive
        },
        o);
  } catch (const group_error& e) {
    threw = true;
    const auto took = since(t0);
    REQUIRE(took < 5s);
    REQUIRE(took >= 500ms);  // the timeout, then return_timeout
    bool named_stuck = false;
    for (const auto& f : e.failures()) {
      INFO(f.message);
      if (f.rank == 2) {
        named_stuck = true;
        REQUIRE(f.detached);
        REQUIRE(f.exception == nullptr);
        REQUIRE_THAT(f.message, Catch::Contains("rank 2 did not return within 300 ms") &&
                                    Catch::Contains("detached"));
      } else {
        REQUIRE_FALSE(f.detached);
        REQUIRE_THAT(f.message, Catch::Contains("rank(s) {2} of 3 did not arrive"));
      }
    }
    REQUIRE(named_stuck);
    REQUIRE_THAT(e.what(), Catch::Contains("rank 2 did not return"));
  }
  REQUIRE(threw);
  // Let the detached thread finish before the state its function refers to goes away.
  release.store(true);
  while (!exited.load()) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(20ms);
}

TEST_CASE("a timeout in a sub-group names world ranks and the sub-group",
          "[comm][thread][errors][hybrid]") {
  thread_comm_options o;
  o.timeout = 300ms;
  auto r = run_ranks(
      4,
      [](thread_comm& c) -> std::string {
        auto pair = c.split(c.rank() / 2, c.rank());  // {0, 1} and {2, 3}
        if (c.rank() == 3) {
          std::this_thread::sleep_for(1s);  // stalls, then returns
          return "";
        }
        if (c.rank() != 2) return "";
        try {
          pair.barrier();
        } catch (const comm_timeout& e) {
          return e.what();
        }
        return "no error";
      },
      o);
  INFO(r[2]);
  REQUIRE_THAT(r[2], Catch::Contains("timed out after 300 ms on world rank 2 (rank 0 of the "
                                     "sub-group of world ranks {2, 3})") &&
                         Catch::Contains("world rank(s) {3} of the sub-group of world ranks "
                                         "{2, 3} did not arrive"));
}

TEST_CASE("a mismatch in a sub-group names world ranks", "[comm][thread][errors][hybrid]") {
  auto r = run_ranks(
      4,
      [](thread_comm& c) -> std::string {
        auto pair = c.split(c.rank() % 2, c.rank());  // {0, 2} and {1, 3}
        try {
          if (c.rank() == 3) {
            pair.barrier();
          } else {
            float x = 0;
            pair.all_reduce(&x, &x, 1);
          }
        } catch (const collective_mismatch& e) {
          return e.what();
        }
        return "";
      },
      long_timeout());
  REQUIRE(r[0].empty());
  REQUIRE(r[2].empty());
  for (int q : {1, 3}) {
    REQUIRE_THAT(r[static_cast<std::size_t>(q)],
                 Catch::Contains("world rank 1 (rank 0 of the sub-group of world ranks {1, 3}) "
                                 "called all_reduce") &&
                     Catch::Contains("but world rank 3 (rank 1 of the sub-group of world ranks "
                                     "{1, 3}) called barrier"));
  }
}
