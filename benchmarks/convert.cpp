// Flatten/pad and casts on the host, against memcpy of the same bytes.
//
//  convert/flatten_bf16      a model's bf16 gradients (uneven sizes, transformer-like) copied
//                            into the flat buffer of core/layout.hpp (4 ranks, 64-element
//                            alignment), and the padding zeroed, in one host::batched_copy
//  convert/flatten_f32_bf16  the same from fp32 gradients (flatten and cast in one pass)
//  convert/cast_<from>_<to>  host::convert between fp32, bf16 and fp16 over one array (streaming
//                            stores from host::streaming_threshold() on)
//  convert/cast_<..>_cached  the same with ordinary stores, at the sizes where the casts stream
//  convert/memcpy            baseline: memcpy of half the traffic (so the same bytes move)
//  convert/prefetch_<op>/prefetch:on|off
//                            flatten_f32_bf16 and the four casts with software prefetch forced
//                            on and off (kernels/host/prefetch.hpp), 16Mi and 64Mi elements:
//                            the measurement behind the default of
//                            host::software_prefetch(prefetch_loop::copy) on this processor.
//                            flatten_bf16 is the control: a bf16 -> bf16 flatten is
//                            a memcpy that prefetch does not touch, so its two rows differ only
//                            by the pairing's own bias (the two runs' buffers lie elsewhere)
//  convert/cast_read_f32_bf16_{cached,streaming}
//                            a cast fp32 -> bf16 and then a read of its output, with either kind
//                            of store (2Mi-32Mi elements): where streaming stores start to pay
//
// `bytes` (and bytes_per_second) count the traffic: bytes read plus bytes written. Each
// operation is compared with the memcpy run of the same `bytes`.
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/kernels/host/batched_copy.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/prefetch.hpp>

#include "common.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

using shardkit::bf16;
using shardkit::fp16;

template <class T>
void fill(T* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = shardkit::from_float<T>(1e-3f * (static_cast<float>(i % 97) - 48.0f));
  }
}

//! Parameter sizes of `layers` transformer-like layers of width d: qkv, its bias, output
//! projection, its bias, MLP up, its bias, MLP down, its bias, two norm weights.
std::vector<std::size_t> model_sizes(std::size_t target_elems) {
  const std::size_t layers = 4;
  const auto d = static_cast<std::size_t>(
      std::max(8.0, std::sqrt(static_cast<double>(target_elems) / (12.0 * layers))));
  std::vector<std::size_t> s;
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t x : {3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d}) {
      s.push_back(x);
    }
  }
  return s;
}

struct flatten_case {
  std::vector<std::size_t> sizes;
  shardkit::flat_layout layout;
  std::size_t numel = 0;
  explicit flatten_case(std::size_t target) : sizes(model_sizes(target)), layout(sizes, {}, 4, 64) {
    for (auto x : sizes) numel += x;
  }
  std::size_t padded() const { return layout.padded_numel(); }
  template <class S>
  double traffic() const {
    return static_cast<double>(numel * sizeof(S) + padded() * sizeof(bf16));
  }
};

template <class S>
void bm_flatten(benchmark::State& state, std::size_t target) {
  const flatten_case fc(target);
  std::vector<bench::array<S>> grads;
  for (auto n : fc.sizes) {
    grads.push_back(bench::make_array<S>(n));
    fill(grads.back().data(), n);
  }
  auto flat = bench::make_array<bf16>(fc.padded());
  // each tensor, then the padding at the end of its group (core/layout.hpp)
  std::vector<typename shardkit::host::batched_copy<S, bf16>::item> items;
  for (std::size_t i = 0; i < fc.sizes.size(); ++i) {
    items.push_back({grads[i].data(), flat.data() + fc.layout.param(i).offset, fc.sizes[i], 0});
  }
  for (const auto& g : fc.layout.groups()) {
    if (g.padded == g.numel) continue;
    for (std::size_t i = 0; i < fc.sizes.size(); ++i) {
      if (fc.layout.param(i).offset + fc.sizes[i] == g.offset + g.numel) {
        items[i].zero_fill = g.padded - g.numel;
      }
    }
  }
  const shardkit::host::batched_copy<S, bf16> flatten(items);
  for (auto _ : state) {
    flatten.run();
    benchmark::ClobberMemory();
  }
  bench::set_bytes(state, fc.traffic<S>());
  state.counters["elements"] = static_cast<double>(fc.numel);
}

template <class S, class D, shardkit::host::stores How = shardkit::host::stores::automatic>
void bm_cast(benchmark::State& state, std::size_t n) {
  auto in = bench::make_array<S>(n);
  auto out = bench::make_array<D>(n);
  fill(in.data(), n);
  for (auto _ : state) {
    shardkit::host::convert(in.data(), out.data(), n, How);
    benchmark::ClobberMemory();
  }
  bench::set_bytes(state, static_cast<double>(n * (sizeof(S) + sizeof(D))));
  state.counters["elements"] = static_cast<double>(n);
}

// A cast, then a pass that reads one element of every line of its output (as the collective
// after a flatten does), with ordinary or streaming stores: where streaming starts to pay, the
// measurement behind host::streaming_threshold()'s default.
template <shardkit::host::stores How>
void bm_cast_read(benchmark::State& state, std::size_t n) {
  auto in = bench::make_array<float>(n);
  auto out = bench::make_array<bf16>(n);
  fill(in.data(), n);
  for (auto _ : state) {
    shardkit::host::convert(in.data(), out.data(), n, How);
    float sum = 0.0f;
    for (std::size_t i = 0; i < n; i += 64 / sizeof(bf16)) sum += static_cast<float>(out.data()[i]);
    benchmark::DoNotOptimize(sum);
  }
  bench::set_bytes(state, static_cast<double>(n * (sizeof(float) + 2 * sizeof(bf16))));
  state.counters["elements"] = static_cast<double>(n);
}

void bm_memcpy(benchmark::State& state, std::size_t traffic) {
  const std::size_t bytes = traffic / 2;
  auto src = bench::make_array<std::byte>(bytes);
  auto dst = bench::make_array<std::byte>(bytes);
  std::memset(src.data(), 1, bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  bench::set_bytes(state, static_cast<double>(2 * bytes));
}

void register_all(bench::size_set s) {
  const auto sizes = s == bench::size_set::tiny    ? std::vector<std::size_t>{1 << 12}
                     : s == bench::size_set::quick ? bench::geometric(1 << 20, 16 << 20, 16)
                                                   : bench::geometric(1 << 20, 64 << 20, 4);
  std::set<std::size_t> traffic;  // memcpy baselines needed
  auto reg = [](const std::string& name, auto fn, auto arg) {
    benchmark::RegisterBenchmark(name.c_str(), fn, arg)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  };
  for (std::size_t n : sizes) {
    const std::string tail = "/n:" + std::to_string(n);
    const flatten_case fc(n);
    reg("convert/flatten_bf16" + tail, bm_flatten<bf16>, n);
    reg("convert/flatten_f32_bf16" + tail, bm_flatten<float>, n);
    traffic.insert(static_cast<std::size_t>(fc.traffic<bf16>()) & ~std::size_t{1});
    traffic.insert(static_cast<std::size_t>(fc.traffic<float>()) & ~std::size_t{1});
    reg("convert/cast_f32_bf16" + tail, bm_cast<float, bf16>, n);
    reg("convert/cast_bf16_f32" + tail, bm_cast<bf16, float>, n);
    reg("convert/cast_f32_f16" + tail, bm_cast<float, fp16>, n);
    reg("convert/cast_f16_f32" + tail, bm_cast<fp16, float>, n);
    if (n * 6 >= shardkit::host::streaming_threshold()) {
      // where the casts stream: the same casts with ordinary stores
      constexpr auto cached = shardkit::host::stores::cached;
      reg("convert/cast_f32_bf16_cached" + tail, bm_cast<float, bf16, cached>, n);
      reg("convert/cast_bf16_f32_cached" + tail, bm_cast<bf16, float, cached>, n);
    }
    traffic.insert(6 * n);
  }
  // Software prefetch on and off, paired in one run (their own memcpy rows are those above).
  const auto prefetch_sizes = s == bench::size_set::tiny ? std::vector<std::size_t>{1 << 12}
                              : s == bench::size_set::quick
                                  ? std::vector<std::size_t>{16 << 20}
                                  : std::vector<std::size_t>{16 << 20, 64 << 20};
  using bm = void (*)(benchmark::State&, std::size_t);
  const std::pair<const char*, bm> prefetched[] = {
      {"flatten_f32_bf16", bm_flatten<float>}, {"flatten_bf16", bm_flatten<bf16>},
      {"cast_f32_bf16", bm_cast<float, bf16>}, {"cast_bf16_f32", bm_cast<bf16, float>},
      {"cast_f32_f16", bm_cast<float, fp16>},  {"cast_f16_f32", bm_cast<fp16, float>}};
  for (std::size_t n : prefetch_sizes) {
    for (const auto& [op, fn] : prefetched) {
      for (bool on : {true, false}) {
        reg(
            std::string("convert/prefetch_") + op + "/prefetch:" + (on ? "on" : "off") +
                "/n:" + std::to_string(n),
            [fn, on](benchmark::State& state, std::size_t m) {
              shardkit::host::scoped_prefetch forced(on);
              fn(state, m);
            },
            n);
      }
    }
  }
  for (std::size_t t : traffic) reg("convert/memcpy/bytes:" + std::to_string(t), bm_memcpy, t);
  const auto read_sizes =
      s == bench::size_set::tiny ? std::vector<std::size_t>{1 << 12}
      : s == bench::size_set::quick
          ? std::vector<std::size_t>{4 << 20}
          : std::vector<std::size_t>{2 << 20, 4 << 20, 8 << 20, 12 << 20, 16 << 20, 32 << 20};
  for (std::size_t n : read_sizes) {
    const std::string tail = "/n:" + std::to_string(n);
    reg("convert/cast_read_f32_bf16_cached" + tail, bm_cast_read<shardkit::host::stores::cached>,
        n);
    reg("convert/cast_read_f32_bf16_streaming" + tail,
        bm_cast_read<shardkit::host::stores::streaming>, n);
  }
}

}  // namespace

SHARDKIT_BENCH_MAIN(register_all)
