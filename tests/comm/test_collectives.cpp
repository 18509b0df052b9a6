// Collective semantics, written once over a World and run for every communicator of the binary
// (SHARDKIT_TEST_WORLDS): results against a sequential rank-order reference computed
// independently on every rank (also with streaming stores), in-place forms, asynchronous forms, the
// bytes each collective records, completion order, progress, and split().
#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/kernels/host/streaming.hpp>

#include "comm/collective_checks.hpp"
#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

using namespace shardkit;

TEMPLATE_TEST_CASE("collectives give the rank-order reference result bit for bit", "[comm]",
                   SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  static_assert(communicator<Comm>);
  for (int n : {1, 2, 3, 4, 7, 8}) {
    if (!test::fits<World>(n)) continue;
    CAPTURE(World::name, n);
    test::require_all_ok(
        World::run(n, [](Comm& c) -> std::string { return test::coll::check_every_type(c); }));
  }
}

TEMPLATE_TEST_CASE("collectives give the same bits when the host writes with streaming stores",
                   "[comm]", SHARDKIT_TEST_WORLDS) {
  // Every host reduction and cast that can stream does (the thread communicator's all-reduce
  // streams large outputs, kernels/host/reduce.hpp): sizes around vector and chunk boundaries.
  using World = TestType;
  using Comm = typename World::comm_type;
  host::scoped_streaming_threshold always(0);
  for (int n : {2, 3, 4}) {
    if (!test::fits<World>(n)) continue;
    CAPTURE(World::name, n);
    test::require_all_ok(World::run(n, [](Comm& c) -> std::string {
      return test::coll::check_every_type(c, {1, 31, 1000, 4099});
    }));
  }
}

TEMPLATE_TEST_CASE("all_to_all and barrier", "[comm]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  for (int n : {2, 4, 5}) {
    if (!test::fits<World>(n)) continue;
    CAPTURE(World::name, n);
    test::require_all_ok(World::run(n, [](Comm& c) -> std::string {
      const int N = c.size(), r = c.rank();
      const std::size_t count = 3;
      std::vector<std::int32_t> in(count * N), out(count * N);
      for (std::size_t i = 0; i < in.size(); ++i) in[i] = r * 1000 + static_cast<int>(i);
      c.all_to_all(in.data(), out.data(), count);
      std::string failure;
      for (int q = 0; q < N; ++q) {
        for (std::size_t i = 0; i < count; ++i) {
          if (out[q * count + i] != q * 1000 + static_cast<int>(r * count + i))
            failure = "all_to_all wrong";
        }
      }
      const auto before = c.traffic();
      for (int k = 0; k < 10; ++k) c.barrier();
      const auto d = c.traffic().since(before);
      if (d.calls(collective::barrier) != 10 || d.total_bytes_sent() != 0) {
        failure = "10 barriers recorded " + std::to_string(d.calls(collective::barrier)) +
                  " calls and " + std::to_string(d.total_bytes_sent()) + " bytes";
      }
      return failure;
    }));
  }
}

TEMPLATE_TEST_CASE("asynchronous collectives complete in issue order and progress without wait()",
                   "[comm][async]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  if (!test::fits<World>(4)) return;
  test::require_all_ok(World::run(4, [](Comm& c) -> std::string {
    const int N = c.size();
    const std::size_t count = 1 << 12;
    std::vector<std::vector<float>> full(6, std::vector<float>(count * N));
    std::vector<std::vector<float>> mine(6, std::vector<float>(count));
    std::vector<typename Comm::work_type> works;
    for (int k = 0; k < 6; ++k) {
      std::fill(mine[k].begin(), mine[k].end(), static_cast<float>(k * 10 + c.rank()));
      works.push_back(c.all_gather_async(mine[k].data(), full[k].data(), count));
    }
    // Poll without wait(): the collectives must finish while this rank only calls test().
    std::string failure;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (std::size_t k = 0; k < works.size(); ++k) {
      while (!works[k].test()) {
        if (std::chrono::steady_clock::now() > deadline) {
          failure = "async collective made no progress";
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      // Issue order: once collective k is done, every earlier one is done too.
      for (std::size_t j = 0; j < k; ++j) {
        if (!works[j].test())
          failure = "collective " + std::to_string(k) + " finished before " + std::to_string(j);
      }
    }
    for (auto& w : works) w.wait();
    for (int k = 0; k < 6; ++k) {
      for (int q = 0; q < N; ++q) {
        if (full[k][q * count] != static_cast<float>(k * 10 + q))
          failure = "async all_gather wrong";
      }
    }
    // an async op followed by a synchronous one: the synchronous one waits its turn
    std::vector<bf16> a(100, bf16(1.0f)), b(100, bf16(2.0f));
    auto w1 = c.all_reduce_async(a.data(), a.data(), a.size());
    c.all_reduce(b.data(), b.data(), b.size());
    w1.wait();
    if (static_cast<float>(a[0]) != static_cast<float>(N) ||
        static_cast<float>(b[99]) != 2.0f * N) {
      failure = "mixed async/sync all_reduce wrong";
    }
    return failure;
  }));
}

TEMPLATE_TEST_CASE("many asynchronous collectives in flight, waited in reverse order",
                   "[comm][async]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  for (int n : {1, 3, 4}) {
    if (!test::fits<World>(n)) continue;
    CAPTURE(World::name, n);
    test::require_all_ok(World::run(n, [](Comm& c) -> std::string {
      const int N = c.size(), r = c.rank();
      constexpr int K = 8;
      const std::size_t count = 257;  // not a multiple of N: uneven all_reduce chunks
      std::vector<std::vector<float>> ar(K), rs_in(K), rs_out(K);
      std::vector<typename Comm::work_type> works;
      for (int k = 0; k < K; ++k) {
        ar[k].assign(count, static_cast<float>(k + r));
        rs_in[k].assign(count * N, static_cast<float>(k * r));
        rs_out[k].assign(count, -1.0f);
        works.push_back(c.all_reduce_async(ar[k].data(), ar[k].data(), count));
        works.push_back(c.reduce_scatter_async(rs_in[k].data(), rs_out[k].data(), count));
      }
      for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
      const float ranks_sum = static_cast<float>(N * (N - 1) / 2);
      for (int k = 0; k < K; ++k) {
        for (std::size_t i = 0; i < count; ++i) {
          if (ar[k][i] != static_cast<float>(k * N) + ranks_sum) return "async all_reduce wrong";
          if (rs_out[k][i] != static_cast<float>(k) * ranks_sum)
            return "async reduce_scatter wrong";
        }
      }
      const auto& t = c.traffic();
      if (t.calls(collective::all_reduce) != K || t.calls(collective::reduce_scatter) != K)
        return "traffic ledger missed asynchronous collectives";
      return {};
    }));
  }
}

TEMPLATE_TEST_CASE("a dropped work handle waits for its collective before returning",
                   "[comm][async]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  for (int n : {2, 4}) {
    if (!test::fits<World>(n)) continue;
    CAPTURE(World::name, n);
    test::require_all_ok(World::run(n, [](Comm& c) -> std::string {
      const int N = c.size();
      const std::size_t count = 1 << 14;
      std::vector<float> mine(count, static_cast<float>(c.rank() + 1));
      std::vector<float> full(count * N, 0.0f);
      {
        auto w = c.all_gather_async(mine.data(), full.data(), count);
      }  // the destructor must not return before `full` is written
      for (int q = 0; q < N; ++q) {
        if (full[q * count + count - 1] != static_cast<float>(q + 1))
          return "the handle's destructor returned before the collective finished";
      }
      // A moved-from handle and a moved-to handle: waiting twice is harmless.
      auto w1 = c.all_gather_async(mine.data(), full.data(), count);
      auto w2 = std::move(w1);
      w1.wait();
      w2.wait();
      w2.wait();
      return {};
    }));
  }
}

TEMPLATE_TEST_CASE("split forms sub-groups ordered by key while the parent keeps working",
                   "[comm][split]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  if (!test::fits<World>(4)) return;
  auto r = World::run(4, [](Comm& c) {
    // two groups of two: even and odd ranks, reversed order by key
    auto sub = c.split(c.rank() % 2, -c.rank());
    int v = c.rank();
    sub.all_reduce(&v, &v, 1);
    std::vector<int> members(2);
    int me = c.rank();
    sub.all_gather(&me, members.data(), 1);
    // a split of the split: every rank alone
    auto alone = sub.split(sub.rank(), 0);
    int solo = 5;
    alone.all_reduce(&solo, &solo, 1);
    // the parent still works after the split, with an asynchronous collective pending
    int one = 1;
    auto w = c.all_reduce_async(&one, &one, 1);
    auto again = c.split(0, 0);  // waits for the pending collective first
    w.wait();
    return std::tuple{sub.size(), sub.rank(), v, members, one, alone.size(), solo, again.rank()};
  });
  for (int q = 0; q < 4; ++q) {
    auto [size, rank, sum, members, total, alone_size, solo, again_rank] =
        r[static_cast<std::size_t>(q)];
    CAPTURE(q);
    REQUIRE(size == 2);
    REQUIRE(rank == 1 - q / 2);  // larger parent rank, smaller key
    REQUIRE(sum == (q % 2 == 0 ? 0 + 2 : 1 + 3));
    REQUIRE(members == (q % 2 == 0 ? std::vector<int>{2, 0} : std::vector<int>{3, 1}));
    REQUIRE(total == 4);
    REQUIRE(alone_size == 1);
    REQUIRE(solo == 5);
    REQUIRE(again_rank == q);
  }
}

TEMPLATE_TEST_CASE("bad arguments are rejected on the calling rank and leave it usable",
                   "[comm][errors]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  if (!test::fits<World>(2)) return;
  auto m = World::run(2, [](Comm& c) {
    std::vector<std::string> msgs;
    float x = 0;
    try {
      c.broadcast(&x, 1, 5);
    } catch (const shardkit::invalid_argument& e) {
      msgs.push_back(e.what());
    }
    try {
      c.broadcast(&x, 1, -1);
    } catch (const shardkit::invalid_argument& e) {
      msgs.push_back(e.what());
    }
    try {
      (void)c.split(-1, 0);
    } catch (const shardkit::invalid_argument& e) {
      msgs.push_back(e.what());
    }
    x = 1;
    c.all_reduce(&x, &x, 1);  // still usable
    msgs.push_back(std::to_string(x));
    return msgs;
  });
  for (const auto& msgs : m) {
    REQUIRE(msgs.size() == 4);
    REQUIRE_THAT(msgs[0], Catch::Contains("root 5 is not a rank") && Catch::Contains("size 2"));
    REQUIRE_THAT(msgs[1], Catch::Contains("root -1 is not a rank"));
    REQUIRE_THAT(msgs[2], Catch::Contains("color must be non-negative, got -1"));
    REQUIRE(msgs[3] == std::to_string(2.0f));
  }
}

TEMPLATE_TEST_CASE("integer sums wrap around in two's complement", "[comm]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  if (!test::fits<World>(2)) return;
  auto r = World::run(2, [](Comm& c) {
    std::int32_t a = std::numeric_limits<std::int32_t>::max();
    std::int64_t b = std::numeric_limits<std::int64_t>::min();
    std::uint32_t u = 0xffffffffu;
    c.all_reduce(&a, &a, 1);
    c.all_reduce(&b, &b, 1);
    c.all_reduce(&u, &u, 1);
    return std::tuple{a, b, u};
  });
  for (const auto& [a, b, u] : r) {
    REQUIRE(a == -2);  // 2 x (2^31 - 1) mod 2^32
    REQUIRE(b == 0);   // 2 x -2^63 mod 2^64
    REQUIRE(u == 0xfffffffeu);
  }
}
