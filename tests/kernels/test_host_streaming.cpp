// Streaming stores and host::batched_copy: a cast written with streaming stores holds the bits
// of the scalar conversion in every build, at every length and every alignment of its input
// and its output, and writes nothing outside it; SHARDKIT_STREAMING_BYTES is read and checked;
// a batched copy (flatten with padding) equals its items done one by one, on 1 to 3 threads
// and with either kind of store, and refuses lists with null pointers or overlapping arrays,
// naming the items.
#include <shardkit/kernels/host/batched_copy.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/streaming.hpp>

#include "kernels/support.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

using namespace shardkit;
using Catch::Matchers::Contains;
using namespace kernel_test;

namespace {
// Random bit patterns of T: every class of value (NaN payloads, infinities, subnormals).
template <class T>
T random_pattern(std::uint64_t& s) {
  if constexpr (std::is_same_v<T, float>) {
    return std::bit_cast<float>(static_cast<std::uint32_t>(splitmix(s)));
  } else {
    return T::from_bits(static_cast<std::uint16_t>(splitmix(s)));
  }
}
// The scalar conversion of core/dtype.hpp, S -> float -> D.
template <class D, class S>
D reference(S x) {
  return from_float<D>(static_cast<float>(x));
}
constexpr std::size_t L = simd::max_width;
constexpr std::uint16_t sentinel = 0xabcd;

template <class T>
T sentinel_value() {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<float>(0xabcdabcdu);
  else
    return T::from_bits(sentinel);
}

// Every length up to a few vectors and around the prefetch hand-over, at every element offset
// of the output within a vector's alignment, with sentinels on both sides.
template <class S, class D>
void check_streaming_cast(host::stores how) {
  std::uint64_t s = 17;
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n < 3 * L + 2; ++n) lengths.push_back(n);
  for (std::size_t n = 0; n < 2 * L + 2; ++n) lengths.push_back(host::convert_prefetch + n);
  lengths.push_back(5000);
  // fp32 inputs also at every element offset from a 64-byte boundary, and so at every offset
  // relative to the output (the streaming path aligns its output, so its loads are then
  // unaligned, and split across lines).
  const std::size_t input_offsets = std::is_same_v<S, float> ? 64 / sizeof(S) : 1;
  for (const std::size_t n : lengths) {
    std::vector<S> storage(n + 64);
    auto* const aligned =
        reinterpret_cast<S*>((reinterpret_cast<std::uintptr_t>(storage.data()) + 63) / 64 * 64);
    for (std::size_t in_offset = 0; in_offset < input_offsets; ++in_offset) {
      S* const in = aligned + in_offset;
      for (std::size_t i = 0; i < n; ++i) in[i] = random_pattern<S>(s);
      for (std::size_t offset = 0; offset <= 64 / sizeof(D); ++offset) {
        std::vector<D> out(n + offset + 2 * L, sentinel_value<D>());
        host::convert(in, out.data() + offset, n, how);
        std::size_t wrong = out.size();  // the first element that differs
        for (std::size_t i = 0; i < out.size() && wrong == out.size(); ++i) {
          const bool inside = i >= offset && i < offset + n;
          const D expect = inside ? reference<D>(in[i - offset]) : sentinel_value<D>();
          if (pattern(out[i]) != pattern(expect)) wrong = i;
        }
        INFO("n " << n << ", input offset " << in_offset << " and output offset " << offset
                  << " elements from 64 bytes: element " << wrong << " differs (" << out.size()
                  << ": none)");
        REQUIRE(wrong == out.size());
      }
    }
  }
}

}  // namespace

TEST_CASE("streaming casts write the bits of the scalar conversion, and only their output",
          "[kernels][streaming]") {
  in_every_build([] {
    for (const host::stores how : {host::stores::streaming, host::stores::cached}) {
      INFO((how == host::stores::streaming ? "streaming" : "cached") << " stores");
      check_streaming_cast<float, bf16>(how);
      check_streaming_cast<float, fp16>(how);
      check_streaming_cast<bf16, float>(how);
      check_streaming_cast<fp16, float>(how);
      check_streaming_cast<bf16, fp16>(how);
      check_streaming_cast<fp16, bf16>(how);
    }
    // stores::automatic streams from the threshold on (a threshold of 0: every cast)
    host::scoped_streaming_threshold every(0);
    check_streaming_cast<float, bf16>(host::stores::automatic);
  });
}

TEST_CASE("the streaming threshold: the cache share by default, SHARDKIT_STREAMING_BYTES, scopes",
          "[kernels][streaming]") {
  CHECK(host::detail::count_cpu_list("0-1") == 2);
  CHECK(host::detail::count_cpu_list("0-3,8,10-11") == 7);
  CHECK(host::detail::count_cpu_list("5") == 1);
  CHECK(host::detail::count_cpu_list("") == 0);
  CHECK(host::detail::count_cpu_list("x") == 0);
  CHECK(host::detail::count_cpu_list("3-1") == 0);
  const std::size_t share = host::detail::llc_share_bytes();
  const std::size_t fallback = host::detail::default_streaming_threshold();
  WARN("last-level cache share of one CPU: " << share << " bytes; casts stream from "
                                             << host::streaming_threshold() << " bytes");
  CHECK(fallback == host::detail::streaming_threshold_for(host::detail::last_level_cache()));
  // the rule on the two caches it was measured on, and its ends
  constexpr std::size_t MiB = std::size_t{1} << 20;
  using llc = host::detail::llc_info;
  CHECK(host::detail::streaming_threshold_for(llc{480 * MiB, 2}) == 60 * MiB);  // a quarter share
  CHECK(host::detail::streaming_threshold_for(llc{32 * MiB, 2}) == 32 * MiB);   // the whole cache
  CHECK(host::detail::streaming_threshold_for(llc{8 * MiB, 1}) == 8 * MiB);
  CHECK(host::detail::streaming_threshold_for(llc{256 * MiB, 128}) == 32 * MiB);  // the cap
  CHECK(host::detail::streaming_threshold_for(llc{0, 1}) == 8 * MiB);             // unknown

  {
    scoped_env set("SHARDKIT_STREAMING_BYTES", "12345");
    CHECK(host::detail::streaming_threshold_from_environment() == 12345);
  }
  {
    scoped_env empty("SHARDKIT_STREAMING_BYTES", "");
    CHECK(host::detail::streaming_threshold_from_environment() == fallback);
  }
  for (const char* bad : {"-1", "1e6", "12 ", "lots", "99999999999999999999999"}) {
    scoped_env set("SHARDKIT_STREAMING_BYTES", bad);
    REQUIRE_THROWS_WITH(host::detail::streaming_threshold_from_environment(),
                        Contains(std::string("SHARDKIT_STREAMING_BYTES=\"") + bad + "\"") &&
                            Contains("expected a non-negative integer number of bytes"));
  }

  {
    host::scoped_streaming_threshold outer(100);
    CHECK(host::streaming_threshold() == 100);
    CHECK(host::streams(host::stores::automatic, 100));
    CHECK_FALSE(host::streams(host::stores::automatic, 99));
    CHECK_FALSE(host::streams(host::stores::cached, 1000));
    CHECK(host::streams(host::stores::streaming, 1));
    {
      host::scoped_streaming_threshold inner(7);
      CHECK(host::streaming_threshold() == 7);
    }
    CHECK(host::streaming_threshold() == 100);
  }
  REQUIRE_THROWS_WITH(host::scoped_streaming_threshold(~std::size_t{0}), Contains("reserved"));
}

namespace {
// A flatten: `sizes` tensors of S into one padded D buffer, each followed by `pad` zeros, then
// compared with the scalar conversion of every element; the padding must read zero and the
// slack after the buffer must keep its sentinel.
template <class S, class D>
void check_flatten(host::executor* exec, host::stores how, const std::vector<std::size_t>& sizes,
                   std::size_t pad) {
  std::uint64_t s = 29;
  std::vector<std::vector<S>> tensors;
  std::size_t total = 0;
  for (std::size_t n : sizes) {
    tensors.emplace_back(n);
    for (auto& x : tensors.back()) x = random_pattern<S>(s);
    total += n + pad;
  }
  std::vector<D> flat(total + L, sentinel_value<D>());
  std::vector<typename host::batched_copy<S, D>::item> items;
  std::size_t at = 0;
  for (auto& t : tensors) {
    items.push_back({t.data(), flat.data() + at, t.size(), pad});
    at += t.size() + pad;
  }
  const host::batched_copy<S, D> copy(items);
  REQUIRE(copy.elements() == total);
  copy.run(exec, how);
  std::vector<D> expect;
  for (auto& t : tensors) {
    for (const S& x : t) expect.push_back(reference<D>(x));
    expect.insert(expect.end(), pad, D{});
  }
  expect.insert(expect.end(), L, sentinel_value<D>());
  std::size_t wrong = flat.size();  // the first element that differs
  for (std::size_t i = 0; i < flat.size() && wrong == flat.size(); ++i) {
    if (pattern(flat[i]) != pattern(expect[i])) wrong = i;
  }
  INFO("element " << wrong << " of the flat buffer differs (" << flat.size() << ": none)");
  REQUIRE(wrong == flat.size());
}
}  // namespace

TEST_CASE("batched_copy flattens with padding: the bits of one convert per item, any threads",
          "[kernels][streaming]") {
  // Many small tensors (pieces span several), one large one (pieces cut inside it), odd sizes
  // (misaligned destinations), empty tensors.
  const std::vector<std::size_t> small = {1, 33, 0, 100, 7, 64, 1000, 3, 0, 257};
  const std::vector<std::size_t> mixed = {300000, 17, 70000, 5, 131072, 0, 99999};
  host::thread_team two(2), three(3);
  in_every_build([&] {
    for (host::executor* exec :
         {static_cast<host::executor*>(nullptr), static_cast<host::executor*>(&two),
          static_cast<host::executor*>(&three)}) {
      for (const host::stores how : {host::stores::cached, host::stores::streaming}) {
        INFO((exec == nullptr ? 1 : exec->concurrency())
             << " threads, " << (how == host::stores::streaming ? "streaming" : "cached"));
        for (const std::size_t pad : {std::size_t{0}, std::size_t{3}, std::size_t{64}}) {
          check_flatten<float, bf16>(exec, how, small, pad);
          check_flatten<float, bf16>(exec, how, mixed, pad);
          check_flatten<bf16, float>(exec, how, mixed, pad);
          check_flatten<bf16, bf16>(exec, how, mixed, pad);
          check_flatten<fp16, float>(exec, how, small, pad);
        }
      }
    }
  });
}

TEST_CASE("batched_copy refuses null pointers and overlapping arrays, naming the items",
          "[kernels][streaming]") {
  using copy = host::batched_copy<float, bf16>;
  std::vector<float> src(100);
  std::vector<bf16> dst(200);
  auto* d = dst.data();
  REQUIRE_THROWS_WITH(copy(std::vector<copy::item>{{src.data(), d, 10}, {nullptr, d + 10, 5}}),
                      Contains("item 1 has a null pointer for 5 elements"));
  REQUIRE_THROWS_WITH(copy(std::vector<copy::item>{{src.data(), nullptr, 0, 4}}),
                      Contains("item 0 has a null pointer for 0 elements and 4 zeros"));
  // destinations overlapping through the padding
  REQUIRE_THROWS_WITH(
      copy(std::vector<copy::item>{{src.data(), d, 10, 5}, {src.data(), d + 12, 10}}),
      Contains("the destination of item 0 overlaps the destination of item 1"));
  REQUIRE_THROWS_WITH(
      copy(std::vector<copy::item>{{src.data(), d + 50, 10}, {src.data(), d + 40, 11}}),
      Contains("the destination of item 1 overlaps the destination of item 0"));
  // a destination inside a source (same type, in place)
  using same = host::batched_copy<float, float>;
  std::vector<float> buf(100);
  REQUIRE_THROWS_WITH(
      same(std::vector<same::item>{{buf.data(), buf.data() + 90, 5},
                                   {buf.data() + 20, buf.data(), 50}}),
      Contains("overlaps") && Contains("(destinations must not overlap each other or any source)"));
  // sources may overlap each other; adjacent destinations are fine
  const copy ok(std::vector<copy::item>{{src.data(), d, 50}, {src.data() + 10, d + 50, 50, 2}});
  ok.run();
  CHECK(ok.elements() == 102);
  CHECK(ok.bytes_moved() == 100 * (sizeof(float) + sizeof(bf16)) + 2 * sizeof(bf16));
  const copy empty;
  empty.run();
  CHECK(empty.elements() == 0);
}
