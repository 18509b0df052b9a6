// mpi_comm beyond the shared collective tests: bit-identity with the thread communicator run
// inside each MPI process (special values included), collectives split into several MPI calls,
// the matching check, timeouts, progress modes, borrowed communicators, MPI error messages.
// Runs under mpiexec (test_comm_mpi).
#include <shardkit/comm/mpi.hpp>
#include <shardkit/comm/thread.hpp>

#include "comm/collective_checks.hpp"
#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

using namespace shardkit;
using namespace std::chrono_literals;
using test::mpi_world;

namespace {

// Element i of rank r: every other element is a raw bit pattern (NaNs with payloads,
// infinities, subnormals, -0, huge values), the rest ordinary values.
template <class T>
T special_input(int r, std::size_t i, std::uint64_t salt) {
  std::uint64_t z = (static_cast<std::uint64_t>(r + 1) * 0x9e3779b97f4a7c15ull) ^
                    (i * 0xbf58476d1ce4e5b9ull) ^ (salt << 17);
  z ^= z >> 31;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 29;
  if (i % 2 == 0) return test::coll::input<T>(r, i, salt);
  T v;
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) {
    v = T::from_bits(static_cast<std::uint16_t>(z));
  } else {
    std::memcpy(&v, &z, sizeof(T));
  }
  return v;
}

// Runs every collective (sync and async) on `c` with special inputs and returns the outputs,
// concatenated in a fixed order, as raw bits.
template <class T, class Comm>
std::vector<std::uint64_t> run_sequence(Comm& c) {
  const int N = c.size(), r = c.rank();
  std::vector<std::uint64_t> bits;
  auto keep = [&](const std::vector<T>& v) {
    for (const T& x : v) bits.push_back(test::coll::bits_of(x));
  };
  for (std::size_t n : {1u, 3u, 64u, 1001u}) {
    for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
      const std::uint64_t salt = n * 7 + static_cast<std::uint64_t>(op);
      std::vector<T> in(n * N), out(n * N);
      for (std::size_t i = 0; i < in.size(); ++i) in[i] = special_input<T>(r, i, salt);
      c.all_reduce(in.data(), out.data(), n * N - 1, op);  // uneven chunks
      keep(out);
      c.all_reduce_async(in.data(), out.data(), n, op).wait();
      keep(out);
      c.reduce_scatter(in.data(), out.data(), n, op);
      keep(out);
      std::vector<T> inplace = in;
      c.reduce_scatter_async(inplace.data(), inplace.data() + r * n, n, op).wait();
      keep(inplace);
    }
    std::vector<T> mine(n), all(n * N), a2a_in(n * N);
    for (std::size_t i = 0; i < n; ++i) mine[i] = special_input<T>(r, i, 99);
    for (std::size_t i = 0; i < n * N; ++i) a2a_in[i] = special_input<T>(r, i, 98);
    c.all_gather(mine.data(), all.data(), n);
    keep(all);
    c.all_to_all(a2a_in.data(), all.data(), n);
    keep(all);
    c.broadcast(mine.data(), n, N - 1);
    keep(mine);
  }
  return bits;
}

template <class T>
std::string compare_with_thread_comm(mpi_comm& c) {
  const auto mine = run_sequence<T>(c);
  // The same sequence on an in-process thread group of the same size, inside this process.
  const auto oracle = run_ranks(c.size(), [](thread_comm& t) { return run_sequence<T>(t); });
  const auto& want = oracle[static_cast<std::size_t>(c.rank())];
  if (mine.size() != want.size()) return "different output sizes";
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (mine[i] != want[i]) {
      return std::string(name(dtype_of<T>)) + ": output " + std::to_string(i) + " has bits " +
             std::to_string(mine[i]) + ", thread_comm gives " + std::to_string(want[i]);
    }
  }
  return {};
}

}  // namespace

TEST_CASE("mpi_comm gives thread_comm's results bit for bit, NaN, inf and subnormals included",
          "[mpi]") {
  for (int n : {1, 2, 3, 4}) {
    if (!test::fits<mpi_world>(n)) continue;
    CAPTURE(n);
    test::require_all_ok(mpi_world::run(n, [](mpi_comm& c) -> std::string {
      std::string first;
      for (auto e :
           {compare_with_thread_comm<float>(c), compare_with_thread_comm<bf16>(c),
            compare_with_thread_comm<fp16>(c), compare_with_thread_comm<double>(c),
            compare_with_thread_comm<std::int32_t>(c), compare_with_thread_comm<std::uint8_t>(c),
            compare_with_thread_comm<std::uint64_t>(c)}) {
        if (first.empty()) first = e;
      }
      return first;
    }));
  }
}

TEST_CASE("collectives larger than max_call_elems are carried by several MPI calls, unchanged",
          "[mpi]") {
  for (int n : {3, 4}) {
    if (!test::fits<mpi_world>(n)) continue;
    CAPTURE(n);
    test::require_all_ok(mpi_world::run(n, [](mpi_comm& c) -> std::string {
      auto opts = c.options();
      opts.max_call_elems = 7;  // 1000 elements: 143 pieces, the last one shorter
      auto small = mpi_comm::duplicate(c.native(), opts);
      std::string first;
      for (auto e : {test::coll::check_everything<mpi_comm, float>(small, {5, 7, 8, 1000}),
                     test::coll::check_everything<mpi_comm, bf16>(small, {13, 1000}),
                     test::coll::check_everything<mpi_comm, double>(small, {29}),
                     test::coll::check_everything<mpi_comm, std::uint8_t>(small, {15})}) {
        if (first.empty()) first = e;
      }
      return first;
    }));
  }
}

TEST_CASE("reduction scratch is kept for later collectives up to its bound, and counted",
          "[mpi][memory]") {
  for (int n : {2, 3}) {
    if (!test::fits<mpi_world>(n)) continue;
    CAPTURE(n);
    test::require_all_ok(mpi_world::run(n, [](mpi_comm& c) -> std::string {
      const auto N = static_cast<std::size_t>(c.size());
      const auto r = static_cast<std::size_t>(c.rank());
      constexpr std::size_t elems = 6000;
      // An all-reduce's scratch: every other rank's chunk of this rank's part.
      const std::size_t A = (N - 1) * chunk_size(elems, N, r) * sizeof(float);
      std::string failed;
      auto expect = [&](bool ok, const std::string& what) {
        if (!ok && failed.empty()) failed = what;
      };
      auto all_reduce = [&](mpi_comm& p, std::vector<float>& x) {
        std::fill(x.begin(), x.end(), static_cast<float>(p.rank() + 1));
        return p.all_reduce_async(x.data(), x.data(), x.size());
      };
      const float sum = static_cast<float>(N * (N + 1) / 2);
      std::vector<float> x(elems), y(elems);
      memory_ledger ledger;
      auto scratch = [&] { return ledger.current(memory_category::comm_scratch); };
      auto peak = [&] { return ledger.peak(memory_category::comm_scratch); };
      {
        auto opts = c.options();
        opts.ledger = &ledger;  // and the default bound, far above these blocks
        auto p = mpi_comm::duplicate(c.native(), opts);
        all_reduce(p, x).wait();
        expect(scratch() == A && peak() == A, "one all-reduce keeps its block");
        all_reduce(p, y).wait();
        expect(peak() == A, "the second all-reduce reuses the kept block");
        {
          auto wx = all_reduce(p, x);
          auto wy = all_reduce(p, y);  // two in flight: one more block
          wx.wait();
          wy.wait();
        }
        expect(peak() == 2 * A && scratch() == 2 * A, "two in flight keep two blocks");
        // A block of a small reduce-scatter: not lent one of the large kept blocks (more than
        // twice its size), and kept as well.
        std::vector<float> in(10 * N, 1.0f), out(10);
        p.reduce_scatter(in.data(), out.data(), 10);
        expect(scratch() == 2 * A + (N - 1) * 10 * sizeof(float),
               "a small reduce-scatter gets a block of its own");
        expect(out[0] == static_cast<float>(N), "the small reduce-scatter's result");
        const std::string results =
            test::coll::check_everything<mpi_comm, float>(p, {5, 1000, elems}) +
            test::coll::check_everything<mpi_comm, bf16>(p, {13, 1000});
        expect(results.empty(), "results with kept scratch: " + results);
      }
      expect(scratch() == 0, "the communicator frees what it kept");

      ledger.reset_peaks();
      {
        auto opts = c.options();
        opts.ledger = &ledger;
        opts.scratch_cache_bytes = A;  // room for one all-reduce block
        auto p = mpi_comm::duplicate(c.native(), opts);
        {
          auto wx = all_reduce(p, x);
          auto wy = all_reduce(p, y);
          wx.wait();
          wy.wait();
        }
        expect(peak() == 2 * A && scratch() == A, "a bound of one block keeps one");
        const std::string results =
            test::coll::check_everything<mpi_comm, float>(p, {5, 1000, elems});
        expect(results.empty(), "results with a bound of one block: " + results);
      }
      ledger.reset_peaks();
      {
        auto opts = c.options();
        opts.ledger = &ledger;
        opts.scratch_cache_bytes = 0;
        opts.progress = mpi_progress::thread;  // blocks come back on the progress thread
        auto p = mpi_comm::duplicate(c.native(), opts);
        auto w = all_reduce(p, x);
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        while (p.traffic().calls(collective::all_reduce) == 0 &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(1ms);
        }
        // Done on the progress thread, but only calls on the communicator free (and count).
        expect(scratch() == A, "the progress thread leaves the ledger alone");
        w.wait();
        expect(scratch() == 0 && peak() == A, "a bound of 0 frees every block");
        const std::string results =
            test::coll::check_everything<mpi_comm, float>(p, {5, 1000, elems});
        expect(results.empty(), "results without kept scratch: " + results);
      }
      expect(x[0] == sum && y[elems - 1] == sum, "all-reduce results");
      return failed;
    }));
  }
}

TEST_CASE("the progress thread completes collectives while the rank makes no MPI call",
          "[mpi][async]") {
  if (!test::fits<mpi_world>(4)) return;
  auto r = mpi_world::run(4, [](mpi_comm& c) {
    auto opts = c.options();
    opts.progress = mpi_progress::thread;
    auto p = mpi_comm::duplicate(c.native(), opts);
    std::vector<float> x(1000, static_cast<float>(p.rank()));
    auto w = p.all_reduce_async(x.data(), x.data(), x.size());
    // No call into MPI from this thread: only the progress thread can finish the collective
    // (its completion is visible in the traffic ledger, which is recorded when it finishes).
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    bool finished_alone = false;
    while (std::chrono::steady_clock::now() < deadline) {
      if (p.traffic().calls(collective::all_reduce) == 1) {
        finished_alone = true;
        break;
      }
      std::this_thread::sleep_for(1ms);
    }
    w.wait();
    // And the results of many queued collectives are right while the thread runs.
    const std::string check = test::coll::check_everything<mpi_comm, bf16>(p, {1, 1000});
    return std::tuple{finished_alone, x[999], check};
  });
  for (const auto& [finished_alone, value, check] : r) {
    REQUIRE(finished_alone);
    REQUIRE(value == 6.0f);
    REQUIRE(check == "");
  }
}

TEST_CASE("without a progress thread, a collective advances only inside calls on its communicator",
          "[mpi][async]") {
  if (!test::fits<mpi_world>(2)) return;
  auto r = mpi_world::run(2, [](mpi_comm& c) {
    std::vector<float> x(64, 1.0f);
    auto w = c.all_reduce_async(x.data(), x.data(), x.size());
    std::this_thread::sleep_for(100ms);  // plenty of time, but nobody drives it
    const auto before_wait = c.traffic().calls(collective::all_reduce);
    w.wait();
    return std::tuple{before_wait, c.traffic().calls(collective::all_reduce), x[0]};
  });
  for (const auto& [before_wait, after_wait, value] : r) {
    REQUIRE(before_wait == 0);
    REQUIRE(after_wait == 1);
    REQUIRE(value == 2.0f);
  }
}

TEST_CASE("check_matching turns mismatched collectives into collective_mismatch on every rank",
          "[mpi][errors]") {
  if (!test::fits<mpi_world>(3)) return;
  auto m = mpi_world::run(3, [](mpi_comm& c) {
    auto opts = c.options();
    opts.check_matching = true;
    auto checked = mpi_comm::duplicate(c.native(), opts);
    std::vector<std::string> msgs;
    std::vector<bf16> x(8, bf16(1.0f));
    try {  // different counts
      checked.all_reduce(x.data(), x.data(), checked.rank() == 1 ? 4 : 8);
    } catch (const collective_mismatch& e) {
      msgs.push_back(e.what());
    }
    try {  // different kinds
      if (checked.rank() == 2)
        checked.barrier();
      else
        checked.all_gather(x.data(), x.data(), 0);
    } catch (const collective_mismatch& e) {
      msgs.push_back(e.what());
    }
    try {  // split against a collective
      if (checked.rank() == 0)
        (void)checked.split(0, 0);
      else
        checked.barrier();
    } catch (const collective_mismatch& e) {
      msgs.push_back(e.what());
    }
    // Nothing was started, so the communicator is still in step and usable.
    float one = 1.0f;
    checked.all_reduce(&one, &one, 1);
    msgs.push_back(std::to_string(one));
    return msgs;
  });
  for (const auto& msgs : m) {
    REQUIRE(msgs.size() == 4);
    REQUIRE_THAT(
        msgs[0],
        Catch::Contains("collective mismatch at call #1") &&
            Catch::Contains("rank 0 (world rank 0) called all_reduce(bf16, count 8, sum)") &&
            Catch::Contains("rank 1 (world rank 1) called all_reduce(bf16, count 4, sum)"));
    REQUIRE_THAT(msgs[1], Catch::Contains("call #2") &&
                              Catch::Contains("all_gather(bf16, count 0)") &&
                              Catch::Contains("rank 2 (world rank 2) called barrier"));
    REQUIRE_THAT(msgs[2], Catch::Contains("rank 0 (world rank 0) called split") &&
                              Catch::Contains("rank 1 (world rank 1) called barrier"));
    REQUIRE(msgs[3] == std::to_string(3.0f));
  }
}

TEST_CASE("a rank that arrives too late makes the others fail with comm_timeout, not hang",
          "[mpi][errors]") {
  if (!test::fits<mpi_world>(3)) return;
  const auto t0 = std::chrono::steady_clock::now();
  auto m = mpi_world::run(3, [](mpi_comm& c) {
    auto opts = c.options();
    opts.timeout = 300ms;
    auto t = mpi_comm::duplicate(c.native(), opts);
    std::vector<std::string> msgs;
    if (t.rank() == 2) {
      std::this_thread::sleep_for(3s);  // the others have long given up
      t.barrier();                      // completes: their abandoned barrier is still posted in MPI
      msgs.push_back("late rank done");
      return msgs;
    }
    try {
      t.barrier();
    } catch (const comm_timeout& e) {
      msgs.push_back(e.what());
    }
    try {
      float x = 0;
      t.all_reduce(&x, &x, 1);
    } catch (const comm_aborted& e) {
      msgs.push_back(e.what());
    }
    return msgs;
  });
  REQUIRE(std::chrono::steady_clock::now() - t0 < 30s);
  for (int q : {0, 1}) {
    const auto& msgs = m[static_cast<std::size_t>(q)];
    REQUIRE(msgs.size() == 2);
    REQUIRE_THAT(msgs[0], Catch::Contains("barrier (call #1) timed out after 300 ms on rank " +
                                          std::to_string(q) + " of 3 (world rank " +
                                          std::to_string(q) + ")") &&
                              Catch::Contains("not every rank reached it") &&
                              Catch::Contains("rank(s) {2} of 3 (world rank(s) {2}) did not "
                                              "answer"));
    REQUIRE_THAT(msgs[1], Catch::Contains("all_reduce(fp32, count 1, sum)") &&
                              Catch::Contains("unusable") && Catch::Contains("timed out"));
  }
  REQUIRE(m[2] == std::vector<std::string>{"late rank done"});
}

TEST_CASE("a timeout in a split communicator names the missing ranks by world rank",
          "[mpi][errors][hybrid]") {
  if (!test::fits<mpi_world>(4)) return;
  const bool checked = GENERATE(false, true);  // detect_divergence, then check_matching
  CAPTURE(checked);
  auto m = mpi_world::run(4, [checked](mpi_comm& c) -> std::string {
    auto opts = c.options();
    opts.timeout = 300ms;
    opts.check_matching = checked;
    auto base = mpi_comm::duplicate(c.native(), opts);
    auto pair = base.split(base.rank() % 2, base.rank());  // {0, 2} and {1, 3}
    std::string msg;
    if (base.rank() == 3) {
      std::this_thread::sleep_for(1500ms);  // stalls: world rank 1 gives up waiting
      try {
        pair.barrier();  // completes the abandoned barrier (check_matching never started it)
      } catch (const comm_timeout&) {
      }
      return "late";
    }
    if (base.rank() == 1) {
      try {
        pair.barrier();
      } catch (const comm_timeout& e) {
        msg = e.what();
      }
    }
    return msg;
  });
  INFO(m[1]);
  REQUIRE(m[0].empty());
  REQUIRE(m[2].empty());
  REQUIRE(m[3] == "late");
  REQUIRE_THAT(m[1], Catch::Contains("timed out after 300 ms on rank 0 of 2 (world rank 1)") &&
                         Catch::Contains("rank(s) {1} of 2 (world rank(s) {3}) did not answer"));
}

TEST_CASE("a borrowed MPI communicator is used as is and never freed", "[mpi]") {
  if (!test::fits<mpi_world>(4)) return;
  auto r = mpi_world::run(4, [](mpi_comm& c) {
    int same = 0;
    {
      mpi_comm borrowed(c.native());
      same = borrowed.native() == c.native() ? 1 : 0;
      int v = borrowed.rank();
      borrowed.all_reduce(&v, &v, 1);
      same += v == 6 ? 1 : 0;
    }
    int one = 1;
    MPI_Allreduce(MPI_IN_PLACE, &one, 1, MPI_INT, MPI_SUM, c.native());  // still valid
    c.all_reduce(&one, &one, 1);
    return same + one;
  });
  for (int v : r) REQUIRE(v == 2 + 16);
}

TEST_CASE("options and arguments are validated with messages that say what is expected",
          "[mpi][errors]") {
  mpi_comm_options bad;
  bad.max_call_elems = 0;
  REQUIRE_THROWS_WITH(mpi_comm::duplicate(MPI_COMM_SELF, bad),
                      Catch::Contains("max_call_elems must be in [1, 2^30], got 0"));
  bad = {};
  bad.timeout = -1ms;
  REQUIRE_THROWS_WITH(mpi_comm(MPI_COMM_SELF, bad),
                      Catch::Contains("timeout must not be negative"));
  auto self = mpi_comm::duplicate(MPI_COMM_SELF);
  std::vector<float> buf(8);
  REQUIRE_THROWS_WITH(self.all_to_all(buf.data(), buf.data() + 2, 4),
                      Catch::Contains("all_to_all: `in` and `out` overlap"));
  self.barrier();  // still usable
}

TEST_CASE("MPI error codes become comm_error naming the collective, the rank and MPI's text",
          "[mpi][errors]") {
  REQUIRE_THROWS_AS(detail::mpi_check(MPI_ERR_COUNT, "MPI_Ialltoall",
                                      "reduce_scatter(bf16, count 4, sum) (call #3)", 2, 4),
                    comm_error);
  REQUIRE_THROWS_WITH(
      detail::mpi_check(MPI_ERR_COUNT, "MPI_Ialltoall",
                        "reduce_scatter(bf16, count 4, sum) (call #3)", 2, 4),
      Catch::Contains("mpi_comm: reduce_scatter(bf16, count 4, sum) (call #3) failed on rank 2 "
                      "of 4: MPI_Ialltoall returned MPI_ERR_COUNT"));
  REQUIRE_NOTHROW(detail::mpi_check(MPI_SUCCESS, "MPI_Ibarrier", "barrier", 0, 1));
}

TEST_CASE("by default, ranks that issue different collectives get collective_mismatch at once",
          "[mpi][errors]") {
  if (!test::fits<mpi_world>(3)) return;
  const int variant = GENERATE(0, 1, 2);
  CAPTURE(variant);
  auto m = mpi_world::run(3, [variant](mpi_comm& c) {
    auto opts = c.options();
    REQUIRE(opts.detect_divergence);  // the default
    REQUIRE_FALSE(opts.check_matching);
    opts.timeout = std::chrono::seconds(60);
    auto comm = mpi_comm::duplicate(c.native(), opts);
    std::vector<float> x(8, 1.0f), y(24, 0.0f);
    std::vector<std::string> msgs;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      if (variant == 0) {  // the same bytes, another collective: would hang without the check
        if (comm.rank() == 1) {
          comm.all_reduce(x.data(), x.data(), 8);
        } else {
          comm.all_reduce(x.data(), x.data(), 8, reduce_op::max);
        }
      } else if (variant == 1) {  // asynchronous: issuing does not wait; wait() reports it
        auto w = comm.rank() == 2 ? comm.all_gather_async(x.data(), y.data(), 8)
                                  : comm.all_reduce_async(x.data(), x.data(), 8);
        w.wait();
      } else {  // another count
        comm.all_reduce(x.data(), x.data(), comm.rank() == 0 ? 4 : 8);
      }
      msgs.push_back("no error");
    } catch (const collective_mismatch& e) {
      msgs.push_back(e.what());
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    msgs.push_back(s < 30.0 ? "prompt" : "took " + std::to_string(s) + " s");
    try {  // the mismatched collective was started: the communicator is unusable now
      float one = 1.0f;
      comm.all_reduce(&one, &one, 1);
      msgs.push_back("usable");
    } catch (const comm_aborted&) {
      msgs.push_back("aborted");
    }
    return msgs;
  });
  for (const auto& msgs : m) {
    REQUIRE(msgs.size() == 3);
    REQUIRE_THAT(msgs[0], Catch::Contains("collective mismatch at call #1"));
    if (variant == 0) REQUIRE_THAT(msgs[0], Catch::Contains("max") && Catch::Contains("sum"));
    if (variant == 1) REQUIRE_THAT(msgs[0], Catch::Contains("all_gather"));
    if (variant == 2) REQUIRE_THAT(msgs[0], Catch::Contains("count 4"));
    REQUIRE(msgs[1] == "prompt");
    REQUIRE(msgs[2] == "aborted");
  }
}
