// Checks of collective semantics against a sequential rank-order reference that every rank
// computes independently, plus the bytes each collective records. Each check runs on one rank's
// endpoint of any communicator and returns "" or a description of the first mismatch; the tests
// (test_collectives.cpp for every World, test_mpi_comm.cpp for MPI-only settings) call them
// inside World::run.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/core/dtype.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace test::coll {

using namespace shardkit;

//! Whether a check uses the blocking form or the *_async form followed by wait().
enum class mode { sync, async };

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
  else if constexpr (sizeof(T) == 1)
    return std::bit_cast<std::uint8_t>(x);
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
std::string describe_mismatch(const std::string& what, std::size_t i, T got, T want) {
  std::ostringstream os;
  os << what << " (" << name(dtype_of<T>) << "): element " << i << " is "
     << static_cast<double>(
            static_cast<std::conditional_t<std::is_integral_v<T>, long long, double>>(
                static_cast<std::conditional_t<std::is_integral_v<T>, T, float>>(got)))
     << " (bits " << std::hex << bits_of(got) << "), expected bits " << bits_of(want);
  return os.str();
}

// "" when the collective recorded exactly one call and the ring volume.
template <class Comm>
std::string check_traffic(const Comm& c, const traffic_ledger& before, collective k,
                          std::uint64_t want_bytes, const std::string& what) {
  const auto d = c.traffic().since(before);
  if (d.calls(k) != 1 || d.bytes_sent(k) != want_bytes || d.total_calls() != 1) {
    std::ostringstream os;
    os << what << " recorded " << d.calls(k) << " call(s) and " << d.bytes_sent(k) << " bytes ("
       << d.total_calls() << " calls in all), expected 1 call and " << want_bytes << " bytes";
    return os.str();
  }
  return {};
}

template <class Comm, class T>
std::string check_all_reduce(Comm& c, std::size_t n, reduce_op op, bool in_place, mode m) {
  const std::uint64_t salt = n * 31 + static_cast<std::uint64_t>(op);
  std::vector<T> in(n), out(n);
  for (std::size_t i = 0; i < n; ++i) in[i] = input<T>(c.rank(), i, salt);
  const auto before = c.traffic();
  T* dst = in_place ? in.data() : out.data();
  if (m == mode::async)
    c.all_reduce_async(in.data(), dst, n, op).wait();
  else
    c.all_reduce(in.data(), dst, n, op);
  std::ostringstream what;
  what << "all_reduce(n " << n << ", " << name(op) << (in_place ? ", in place" : "")
       << (m == mode::async ? ", async" : "") << ")";
  for (std::size_t i = 0; i < n; ++i) {
    const T want = reduced<T>(c.size(), i, op, salt);
    if (bits_of(dst[i]) != bits_of(want)) return describe_mismatch(what.str(), i, dst[i], want);
  }
  return check_traffic(c, before, collective::all_reduce,
                       ring_bytes_sent(collective::all_reduce, n, sizeof(T), c.size(), c.rank()),
                       what.str());
}

template <class Comm, class T>
std::string check_reduce_scatter(Comm& c, std::size_t count, reduce_op op, bool in_place, mode m) {
  const int N = c.size(), r = c.rank();
  const std::uint64_t salt = count * 131 + static_cast<std::uint64_t>(op);
  std::vector<T> in(count * N), out(count);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = input<T>(r, i, salt);
  const auto before = c.traffic();
  T* dst = in_place ? in.data() + static_cast<std::size_t>(r) * count : out.data();
  if (m == mode::async)
    c.reduce_scatter_async(in.data(), dst, count, op).wait();
  else
    c.reduce_scatter(in.data(), dst, count, op);
  std::ostringstream what;
  what << "reduce_scatter(count " << count << ", " << name(op) << (in_place ? ", in place" : "")
       << (m == mode::async ? ", async" : "") << ")";
  for (std::size_t i = 0; i < count; ++i) {
    const T want = reduced<T>(N, static_cast<std::size_t>(r) * count + i, op, salt);
    if (bits_of(dst[i]) != bits_of(want)) return describe_mismatch(what.str(), i, dst[i], want);
  }
  return check_traffic(c, before, collective::reduce_scatter,
                       ring_bytes_sent(collective::reduce_scatter, count, sizeof(T), N, r),
                       what.str());
}

template <class Comm, class T>
std::string check_all_gather(Comm& c, std::size_t count, bool in_place, mode m) {
  const int N = c.size(), r = c.rank();
  std::vector<T> mine(count), out(count * N);
  for (std::size_t i = 0; i < count; ++i) mine[i] = input<T>(r, i, count);
  const T* src = mine.data();
  if (in_place) {
    std::copy(mine.begin(), mine.end(), out.begin() + static_cast<std::ptrdiff_t>(r * count));
    src = out.data() + static_cast<std::size_t>(r) * count;
  }
  const auto before = c.traffic();
  if (m == mode::async)
    c.all_gather_async(src, out.data(), count).wait();
  else
    c.all_gather(src, out.data(), count);
  const std::string what = std::string("all_gather") + (in_place ? " in place" : "") +
                           (m == mode::async ? " async" : "");
  for (int q = 0; q < N; ++q) {
    for (std::size_t i = 0; i < count; ++i) {
      const T want = input<T>(q, i, count);
      if (bits_of(out[q * count + i]) != bits_of(want)) {
        return describe_mismatch(what, q * count + i, out[q * count + i], want);
      }
    }
  }
  return check_traffic(c, before, collective::all_gather,
                       ring_bytes_sent(collective::all_gather, count, sizeof(T), N, r), what);
}

template <class Comm, class T>
std::string check_all_to_all(Comm& c, std::size_t count, mode m) {
  const int N = c.size(), r = c.rank();
  std::vector<T> in(count * N), out(count * N);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = input<T>(r, i, 5 + count);
  const auto before = c.traffic();
  if (m == mode::async)
    c.all_to_all_async(in.data(), out.data(), count).wait();
  else
    c.all_to_all(in.data(), out.data(), count);
  const std::string what = m == mode::async ? "all_to_all async" : "all_to_all";
  for (int q = 0; q < N; ++q) {
    for (std::size_t i = 0; i < count; ++i) {
      const T want = input<T>(q, static_cast<std::size_t>(r) * count + i, 5 + count);
      if (bits_of(out[q * count + i]) != bits_of(want)) {
        return describe_mismatch(what, q * count + i, out[q * count + i], want);
      }
    }
  }
  return check_traffic(c, before, collective::all_to_all,
                       ring_bytes_sent(collective::all_to_all, count, sizeof(T), N, r), what);
}

template <class Comm, class T>
std::string check_broadcast(Comm& c, std::size_t n, mode m) {
  std::string first;
  for (int root = 0; root < c.size(); ++root) {
    std::vector<T> buf(n);
    for (std::size_t i = 0; i < n; ++i) buf[i] = input<T>(c.rank(), i, 77);
    const auto before = c.traffic();
    if (m == mode::async)
      c.broadcast_async(buf.data(), n, root).wait();
    else
      c.broadcast(buf.data(), n, root);
    const std::string what =
        "broadcast from root " + std::to_string(root) + (m == mode::async ? " async" : "");
    for (std::size_t i = 0; i < n && first.empty(); ++i) {
      if (bits_of(buf[i]) != bits_of(input<T>(root, i, 77))) {
        first = describe_mismatch(what, i, buf[i], input<T>(root, i, 77));
      }
    }
    auto e = check_traffic(
        c, before, collective::broadcast,
        ring_bytes_sent(collective::broadcast, n, sizeof(T), c.size(), c.rank(), root), what);
    if (first.empty()) first = e;
  }
  return first;
}

template <class Comm>
std::string check_barrier(Comm& c) {
  const auto before = c.traffic();
  c.barrier();
  return check_traffic(c, before, collective::barrier, 0, "barrier");
}

//! Every collective, sync and async, in and out of place, every reduce_op, several sizes.
//! Every rank runs every collective even after a failed check (returning early would leave the
//! other ranks waiting); the first failure is returned.
template <class Comm, class T>
std::string check_everything(Comm& c, std::vector<std::size_t> sizes = {0, 1, 5, 1000}) {
  std::string first;
  auto keep = [&](std::string e) {
    if (first.empty()) first = std::move(e);
  };
  for (std::size_t n : sizes) {
    for (mode m : {mode::sync, mode::async}) {
      for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
        for (bool ip : {false, true}) {
          keep(check_all_reduce<Comm, T>(c, n, op, ip, m));
          keep(check_reduce_scatter<Comm, T>(c, n, op, ip, m));
        }
      }
      for (bool ip : {false, true}) keep(check_all_gather<Comm, T>(c, n, ip, m));
      keep(check_all_to_all<Comm, T>(c, n, m));
      keep(check_broadcast<Comm, T>(c, n, m));
    }
  }
  keep(check_barrier(c));
  return first;
}

//! check_everything for every element type a communicator supports.
template <class Comm>
std::string check_every_type(Comm& c, std::vector<std::size_t> sizes = {0, 1, 5, 1000}) {
  for (auto e : {check_everything<Comm, float>(c, sizes), check_everything<Comm, bf16>(c, sizes),
                 check_everything<Comm, fp16>(c, sizes), check_everything<Comm, double>(c, sizes),
                 check_everything<Comm, std::int32_t>(c, sizes),
                 check_everything<Comm, std::int64_t>(c, sizes),
                 check_everything<Comm, std::uint8_t>(c, sizes),
                 check_everything<Comm, std::uint32_t>(c, sizes),
                 check_everything<Comm, std::uint64_t>(c, sizes)}) {
    if (!e.empty()) return e;
  }
  return {};
}

}  // namespace test::coll
