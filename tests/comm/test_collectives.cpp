// Collective semantics, written once over a World and run for every communicator: results
// against a sequential rank-order reference computed independently on every rank, in-place
// forms, asynchronous forms, and the bytes each collective records.
#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/core/dtype.hpp>

#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace shardkit;

namespace {

// Input element i of rank r, identical on every rank that computes it.
template <class T>
T input(int r, std::size_t i, std::uint64_t salt) {
  std::uint64_t z = (static_cast<std::uint64_t>(r) << 40) ^ (i * 0x9e3779b97f4a7c15ull) ^ salt;
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  z ^= z >> 29;
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(z % 1000);
  } else {
    const double u = static_cast<double>(z >> 11) * 0x1.0p-53 * 2 - 1;  // [-1, 1)
    return T(static_cast<float>(u * 100.0));
  }
}

template <class T>
std::uint64_t bits_of(T x) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>)
    return x.bits;
  else if constexpr (sizeof(T) == 4)
    return std::bit_cast<std::uint32_t>(x);
  else
    return std::bit_cast<std::uint64_t>(x);
}

// Reference: element i reduced over ranks 0..n-1 in order, accumulating as shardkit specifies.
template <class T>
T reduced(int n, std::size_t i, reduce_op op, std::uint64_t salt) {
  using acc_t = std::conditional_t<std::is_integral_v<T> || std::is_same_v<T, double>, T, float>;
  acc_t acc = static_cast<acc_t>(input<T>(0, i, salt));
  for (int q = 1; q < n; ++q) {
    const acc_t x = static_cast<acc_t>(input<T>(q, i, salt));
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg:
        acc = static_cast<acc_t>(acc + x);
        break;
      case reduce_op::max:
        acc = x > acc ? x : acc;
        break;
      case reduce_op::min:
        acc = x < acc ? x : acc;
        break;
    }
  }
  if (op == reduce_op::avg) acc = static_cast<acc_t>(acc / static_cast<acc_t>(n));
  if constexpr (std::is_same_v<acc_t, T>)
    return acc;
  else
    return T(acc);
}

template <class T>
std::string describe_mismatch(const char* what, std::size_t i, T got, T want) {
  std::ostringstream os;
  os << what << ": element " << i << " is "
     << static_cast<double>(
            static_cast<std::conditional_t<std::is_integral_v<T>, long long, double>>(
                static_cast<std::conditional_t<std::is_integral_v<T>, T, float>>(got)))
     << " (bits " << std::hex << bits_of(got) << "), expected bits " << bits_of(want);
  return os.str();
}

template <class Comm, class T>
std::string check_all_reduce(Comm& c, std::size_t n, reduce_op op, bool in_place) {
  const std::uint64_t salt = n * 31 + static_cast<std::uint64_t>(op);
  std::vector<T> in(n), out(n);
  for (std::size_t i = 0; i < n; ++i) in[i] = input<T>(c.rank(), i, salt);
  const auto before = c.traffic();
  if (in_place)
    c.all_reduce(in.data(), in.data(), n, op);
  else
    c.all_reduce(in.data(), out.data(), n, op);
  const auto& res = in_place ? in : out;
  for (std::size_t i = 0; i < n; ++i) {
    const T want = reduced<T>(c.size(), i, op, salt);
    if (bits_of(res[i]) != bits_of(want)) return describe_mismatch("all_reduce", i, res[i], want);
  }
  const auto d = c.traffic().since(before);
  const auto want_bytes = ring_bytes_sent(collective::all_reduce, n, sizeof(T), c.size(), c.rank());
  if (d.bytes_sent(collective::all_reduce) != want_bytes || d.calls(collective::all_reduce) != 1) {
    return "all_reduce recorded " + std::to_string(d.bytes_sent(collective::all_reduce)) +
           " bytes, expected " + std::to_string(want_bytes);
  }
  return {};
}

template <class Comm, class T>
std::string check_reduce_scatter(Comm& c, std::size_t count, reduce_op op, bool in_place) {
  const int N = c.size(), r = c.rank();
  const std::uint64_t salt = count * 131 + static_cast<std::uint64_t>(op);
  std::vector<T> in(count * N), out(count);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = input<T>(r, i, salt);
  const auto before = c.traffic();
  T* dst = in_place ? in.data() + static_cast<std::size_t>(r) * count : out.data();
  c.reduce_scatter(in.data(), dst, count, op);
  for (std::size_t i = 0; i < count; ++i) {
    const T want = reduced<T>(N, static_cast<std::size_t>(r) * count + i, op, salt);
    if (bits_of(dst[i]) != bits_of(want))
      return describe_mismatch("reduce_scatter", i, dst[i], want);
  }
  const auto d = c.traffic().since(before);
  if (d.bytes_sent(collective::reduce_scatter) !=
      ring_bytes_sent(collective::reduce_scatter, count, sizeof(T), N, r)) {
    return "reduce_scatter recorded the wrong byte count";
  }
  return {};
}

template <class Comm, class T>
std::string check_all_gather(Comm& c, std::size_t count, bool in_place) {
  const int N = c.size(), r = c.rank();
  std::vector<T> mine(count), out(count * N);
  for (std::size_t i = 0; i < count; ++i) mine[i] = input<T>(r, i, count);
  const T* src = mine.data();
  if (in_place) {
    std::copy(mine.begin(), mine.end(), out.begin() + static_cast<std::ptrdiff_t>(r * count));
    src = out.data() + static_cast<std::size_t>(r) * count;
  }
  const auto before = c.traffic();
  c.all_gather(src, out.data(), count);
  for (int q = 0; q < N; ++q) {
    for (std::size_t i = 0; i < count; ++i) {
      const T want = input<T>(q, i, count);
      if (bits_of(out[q * count + i]) != bits_of(want)) {
        return describe_mismatch("all_gather", q * count + i, out[q * count + i], want);
      }
    }
  }
  if (c.traffic().since(before).bytes_sent(collective::all_gather) !=
      ring_bytes_sent(collective::all_gather, count, sizeof(T), N, r)) {
    return "all_gather recorded the wrong byte count";
  }
  return {};
}

template <class Comm, class T>
std::string check_broadcast(Comm& c, std::size_t n) {
  for (int root = 0; root < c.size(); ++root) {
    std::vector<T> buf(n);
    for (std::size_t i = 0; i < n; ++i) buf[i] = input<T>(c.rank(), i, 77);
    c.broadcast(buf.data(), n, root);
    for (std::size_t i = 0; i < n; ++i) {
      if (bits_of(buf[i]) != bits_of(input<T>(root, i, 77))) {
        return "broadcast from root " + std::to_string(root) + " wrong at element " +
               std::to_string(i);
      }
    }
  }
  return {};
}

template <class Comm, class T>
std::string check_everything(Comm& c) {
  for (std::size_t n : {0u, 1u, 5u, 1000u}) {
    for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
      for (bool ip : {false, true}) {
        if (auto e = check_all_reduce<Comm, T>(c, n, op, ip); !e.empty()) return e;
        if (auto e = check_reduce_scatter<Comm, T>(c, n, op, ip); !e.empty()) return e;
      }
    }
    for (bool ip : {false, true}) {
      if (auto e = check_all_gather<Comm, T>(c, n, ip); !e.empty()) return e;
    }
    if (auto e = check_broadcast<Comm, T>(c, n); !e.empty()) return e;
  }
  return {};
}

}  // namespace

TEMPLATE_TEST_CASE("collectives give the rank-order reference result bit for bit", "[comm]",
                   test::thread_world) {
  using World = TestType;
  using Comm = typename World::comm_type;
  for (int n : {1, 2, 3, 4, 7, 8}) {
    CAPTURE(World::name, n);
    test::require_all_ok(World::run(n, [](Comm& c) -> std::string {
      for (auto e :
           {check_everything<Comm, float>(c), check_everything<Comm, bf16>(c),
            check_everything<Comm, fp16>(c), check_everything<Comm, double>(c),
            check_everything<Comm, std::int32_t>(c), check_everything<Comm, std::int64_t>(c)}) {
        if (!e.empty()) return e;
      }
      return {};
    }));
  }
}

TEMPLATE_TEST_CASE("all_to_all and barrier", "[comm]", test::thread_world) {
  using World = TestType;
  using Comm = typename World::comm_type;
  test::require_all_ok(World::run(5, [](Comm& c) -> std::string {
    const int N = c.size(), r = c.rank();
    const std::size_t count = 3;
    std::vector<std::int32_t> in(count * N), out(count * N);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = r * 1000 + static_cast<int>(i);
    c.all_to_all(in.data(), out.data(), count);
    for (int q = 0; q < N; ++q) {
      for (std::size_t i = 0; i < count; ++i) {
        if (out[q * count + i] != q * 1000 + static_cast<int>(r * count + i))
          return "all_to_all wrong";
      }
    }
    for (int k = 0; k < 10; ++k) c.barrier();
    return {};
  }));
}

TEMPLATE_TEST_CASE("asynchronous collectives complete in issue order and progress without wait()",
                   "[comm][async]", test::thread_world) {
  using World = TestType;
  using Comm = typename World::comm_type;
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
    // Poll without wait(): the collectives must finish on their own while this rank "computes".
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (auto& w : works) {
      while (!w.test()) {
        if (std::chrono::steady_clock::now() > deadline) return "async collective made no progress";
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    for (auto& w : works) w.wait();
    for (int k = 0; k < 6; ++k) {
      for (int q = 0; q < N; ++q) {
        if (full[k][q * count] != static_cast<float>(k * 10 + q)) return "async all_gather wrong";
      }
    }
    // an async op followed by a synchronous one: the synchronous one waits its turn
    std::vector<bf16> a(100, bf16(1.0f)), b(100, bf16(2.0f));
    auto w1 = c.all_reduce_async(a.data(), a.data(), a.size());
    c.all_reduce(b.data(), b.data(), b.size());
    w1.wait();
    if (static_cast<float>(a[0]) != static_cast<float>(N) ||
        static_cast<float>(b[99]) != 2.0f * N) {
      return "mixed async/sync all_reduce wrong";
    }
    return {};
  }));
}
