// GPU tests of the CUDA kernels, each against its host implementation (bit for bit where the
// header promises it; the test_cuda target builds with -fmad=false): the fused optimizer step
// and its table, gradient statistics, conversions, accumulation, batched copies (flatten, pad,
// unflatten), the rank-ordered reductions. Runs only where a CUDA device exists
// (test_cuda_main.cpp skips otherwise).
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/grad_stats.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/reduce.hpp>

#include "cuda/gpu_support.cuh"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using namespace shardkit;
using namespace shardkit_test_gpu;

// ---- the fused optimizer step ----------------------------------------------------------------

namespace {

template <class Opt>
typename Opt::options optimizer_options(int variant) {
  typename Opt::options o{};
  o.lr = variant == 0 ? 1e-2f : 3e-3f;
  o.weight_decay = variant == 0 ? 0.1f : 0.0f;
  if constexpr (std::is_same_v<typename Opt::options, adam_options>) {
    o.beta1 = 0.9f;
    o.beta2 = variant == 0 ? 0.99f : 0.999f;
  }
  return o;
}

// Steps n elements at element offset `offset` of every array (grads at `grad_offset`) three
// times on host and device; returns the first difference.
template <class Opt, class G, class W>
std::string compare_fused_step(std::size_t n, std::size_t offset, std::size_t grad_offset,
                               bool write_out, std::uint64_t seed, gpu::elementwise_path path) {
  constexpr std::size_t S = Opt::state_count;
  const std::size_t len = n + 16;
  std::uint64_t s = seed;
  std::vector<float> p(len);
  std::vector<std::vector<float>> st(S, std::vector<float>(len));
  for (auto& x : p) x = random_float(s);
  for (auto& v : st)
    for (auto& x : v) x = std::abs(random_float(s, 0.01f));
  std::vector<W> out(len, from_float<W>(-7.0f));
  dev_array<float> dp(p);
  std::vector<dev_array<float>> dst;
  for (auto& v : st) dst.emplace_back(v);
  dev_array<W> dout(out);
  dev_array<G> dg(len);
  for (int t = 1; t <= 3; ++t) {
    std::vector<G> g(len);
    for (auto& x : g) x = G(random_float(s, 4.0f));
    dg.upload(g);
    const auto o = optimizer_options<Opt>(t % 2);
    const auto k = Opt::prepare(o, static_cast<std::uint64_t>(t), o.lr, 0.37f);
    float* hs[S];
    float* ds[S];
    for (std::size_t j = 0; j < S; ++j) {
      hs[j] = st[j].data() + offset;
      ds[j] = dst[j].data() + offset;
    }
    host::fused_step_scalar<Opt, G, W>(k, p.data() + offset, hs, g.data() + grad_offset,
                                       write_out ? out.data() + offset : nullptr, n);
    gpu::fused_step<Opt, G, W>(k, dp.data() + offset, ds, dg.data() + grad_offset,
                               write_out ? dout.data() + offset : nullptr, n, nullptr, nullptr,
                               path);
  }
  device_sync();
  if (auto e = first_difference(dp.download(), p, "params"); !e.empty()) return e;
  for (std::size_t j = 0; j < S; ++j) {
    if (auto e = first_difference(dst[j].download(), st[j], "state"); !e.empty()) return e;
  }
  return first_difference(dout.download(), out, "working copy");
}

template <class Opt, class G, class W>
void check_fused_step() {
  for (std::size_t n : {1u, 7u, 8u, 9u, 1000u, 4099u, 70001u}) {
    for (std::size_t off : {0u, 1u, 3u}) {
      for (bool out : {true, false}) {
        // grads at the same offset (vector path with a head), and one element further (the
        // arrays cannot be aligned together when the gradient is 16-bit: scalar path)
        for (std::size_t goff : {off, off + 1}) {
          // both paths: cub::DeviceTransform (the default) and the hand-written kernel
          for (auto path :
               {gpu::elementwise_path::cub_transform, gpu::elementwise_path::handwritten}) {
            CAPTURE(Opt::name, dtype_of<G>, dtype_of<W>, n, off, goff, out, static_cast<int>(path));
            REQUIRE(compare_fused_step<Opt, G, W>(n, off, goff, out, n * 31 + off, path) == "");
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("fused step on the GPU equals host::fused_step_scalar bit for bit", "[fused]") {
  check_fused_step<adamw, bf16, bf16>();
  check_fused_step<adamw, fp16, fp16>();
  check_fused_step<adamw, float, bf16>();
  check_fused_step<adamw, float, float>();
  check_fused_step<adam, bf16, bf16>();
  check_fused_step<sgd_momentum, bf16, bf16>();
}

TEST_CASE("fused step skips on the device when the non-finite count is not zero", "[fused]") {
  const std::size_t n = 4099;
  std::uint64_t s = 5;
  std::vector<float> p(n), m(n, 0.001f), v(n, 0.002f);
  std::vector<bf16> g(n);
  for (auto& x : p) x = random_float(s);
  for (auto& x : g) x = bf16(random_float(s, 2.0f));
  g[1234] = bf16(std::numeric_limits<float>::infinity());
  dev_array<float> dp(p), dm(m), dv(v);
  dev_array<bf16> dg(g), dw(std::vector<bf16>(n, bf16(-5.0f)));
  dev_array<unsigned long long> count(std::vector<unsigned long long>{0});
  float* state[2] = {dm.data(), dv.data()};
  const auto k = adamw::prepare({.lr = 1e-3f, .weight_decay = 0.1f}, 1, 1e-3f, 1.0f);
  // one infinity: counted on the device, the step (single run and table) changes nothing
  gpu::count_nonfinite(dg.data(), n, count.data(), nullptr);
  gpu::fused_step<adamw>(k, dp.data(), state, dg.data(), dw.data(), n, nullptr, count.data());
  using table = gpu::fused_step_table<adamw, bf16, bf16>;
  table::run r;
  r.params = dp.data();
  r.state = {dm.data(), dv.data()};
  r.grads = dg.data();
  r.working_out = dw.data();
  r.count = n;
  table t(std::span<const table::run>(&r, 1), 1, nullptr);
  t.launch(std::span<const adamw::constants>(&k, 1), nullptr, count.data());
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(count.download()[0] == 1);
  REQUIRE(first_difference(dp.download(), p, "params after a skipped step") == "");
  REQUIRE(first_difference(dm.download(), m, "m after a skipped step") == "");
  REQUIRE(first_difference(dw.download(), std::vector<bf16>(n, bf16(-5.0f)), "working") == "");
  // a zero count: the step runs, as without the pointer
  g[1234] = bf16(0.5f);
  dg.upload(g);
  count.upload({0});
  gpu::count_nonfinite(dg.data(), n, count.data(), nullptr);
  gpu::fused_step<adamw>(k, dp.data(), state, dg.data(), dw.data(), n, nullptr, count.data());
  std::vector<bf16> w(n);
  float* hs[2] = {m.data(), v.data()};
  host::fused_step_scalar<adamw, bf16, bf16>(k, p.data(), hs, g.data(), w.data(), n);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(count.download()[0] == 0);
  REQUIRE(first_difference(dp.download(), p, "params after a step") == "");
  REQUIRE(first_difference(dw.download(), w, "working copy after a step") == "");
}

namespace {
template <class Opt, class G, class W>
std::string compare_step_table(std::size_t groups, bool write_out, std::uint64_t seed) {
  constexpr std::size_t S = Opt::state_count;
  using table = gpu::fused_step_table<Opt, G, W>;
  std::uint64_t s = seed;
  // runs of assorted lengths at assorted offsets of one set of arrays, some empty
  std::vector<std::size_t> lengths = {0, 1, 5, 17, 4096, 100003, 64, 9, 65536 * 3 + 5};
  std::vector<std::size_t> offsets;
  std::size_t total = 0;
  for (std::size_t i = 0; i < 3 * groups; ++i) {
    const std::size_t n = lengths[i % lengths.size()];
    total += i % 3;  // misalign some runs against the 16-byte grid
    offsets.push_back(total);
    total += n;
  }
  std::vector<float> p(total + 8);
  std::vector<std::vector<float>> st(S, std::vector<float>(total + 8));
  std::vector<G> g(total + 8);
  std::vector<W> out(total + 8, from_float<W>(-3.0f));
  for (auto& x : p) x = random_float(s);
  for (auto& x : g) x = G(random_float(s, 2.0f));
  dev_array<float> dp(p);
  std::vector<dev_array<float>> dst;
  for (auto& v : st) dst.emplace_back(v);
  dev_array<G> dg(g);
  dev_array<W> dout(out);
  std::vector<typename table::run> runs;
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    typename table::run r;
    r.params = dp.data() + offsets[i];
    for (std::size_t j = 0; j < S; ++j) r.state[j] = dst[j].data() + offsets[i];
    r.grads = dg.data() + offsets[i];
    r.working_out = write_out ? dout.data() + offsets[i] : nullptr;
    r.count = lengths[i % lengths.size()];
    r.group = (i * 7) % groups;
    runs.push_back(r);
  }
  table t(runs, groups, nullptr);
  for (int step = 1; step <= 2; ++step) {
    std::vector<typename Opt::constants> k;
    for (std::size_t gi = 0; gi < groups; ++gi) {
      auto o = optimizer_options<Opt>(static_cast<int>(gi % 2));
      o.lr *= static_cast<float>(gi + 1);
      k.push_back(Opt::prepare(o, static_cast<std::uint64_t>(step), o.lr, 0.5f));
    }
    t.launch(k, nullptr);
    for (std::size_t i = 0; i < runs.size(); ++i) {
      float* hs[S];
      for (std::size_t j = 0; j < S; ++j) hs[j] = st[j].data() + offsets[i];
      host::fused_step_scalar<Opt, G, W>(
          k[runs[i].group], p.data() + offsets[i], hs, g.data() + offsets[i],
          write_out ? out.data() + offsets[i] : nullptr, runs[i].count);
    }
  }
  device_sync();
  if (auto e = first_difference(dp.download(), p, "params"); !e.empty()) return e;
  for (std::size_t j = 0; j < S; ++j) {
    if (auto e = first_difference(dst[j].download(), st[j], "state"); !e.empty()) return e;
  }
  return first_difference(dout.download(), out, "working copy");
}
}  // namespace

TEST_CASE("fused step table: many runs and groups in few launches, equal to the host", "[fused]") {
  for (std::size_t groups : {1u, 3u, 20u}) {  // 20 > 16 groups: two launches
    CAPTURE(groups);
    REQUIRE(compare_step_table<adamw, bf16, bf16>(groups, true, groups) == "");
    REQUIRE(compare_step_table<sgd_momentum, bf16, bf16>(groups, false, groups + 100) == "");
  }
  using table = gpu::fused_step_table<adamw, bf16, bf16>;
  std::vector<table::run> mixed(2);
  mixed[0].count = mixed[1].count = 1;
  bf16 dummy[2];
  mixed[0].working_out = dummy;
  REQUIRE_THROWS_WITH(table(mixed, 1, nullptr),
                      Catch::Contains("has no working copy but run 0 has"));
  table empty(std::span<const table::run>{}, 2, nullptr);
  std::vector<adam_constants> k(2);
  empty.launch(k, nullptr);
  REQUIRE_THROWS_WITH(empty.launch(std::span<const adam_constants>(k.data(), 1), nullptr),
                      Catch::Contains("1 constants given for a table of 2 group(s)"));
}

// ---- gradient statistics -------------------------------------------------------------------

namespace {
template <class G>
std::vector<G> stats_data(std::size_t n, std::uint64_t seed) {
  std::uint64_t s = seed;
  std::vector<G> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t kind = splitmix(s) % 100;
    if constexpr (std::is_same_v<G, float>) {
      if (kind < 3)  // any bit pattern: infinities, NaNs, subnormals
        g[i] = std::bit_cast<float>(static_cast<std::uint32_t>(splitmix(s)));
      else
        g[i] = std::ldexp(random_float(s), static_cast<int>(splitmix(s) % 40) - 30);
    } else {
      if (kind < 3)
        g[i] = G::from_bits(static_cast<std::uint16_t>(splitmix(s)));
      else
        g[i] = G(std::ldexp(random_float(s), static_cast<int>(splitmix(s) % 30) - 20));
    }
  }
  return g;
}

template <class G>
std::string compare_stats(std::size_t n, std::size_t offset, std::uint64_t seed) {
  const auto g = stats_data<G>(n + offset, seed);
  dev_array<G> dg(g);
  host::grad_stats want;
  host::accumulate_stats(g.data() + offset, n, want);
  dev_array<gpu::device_grad_stats> ds(1);
  gpu::clear_stats(ds.data(), nullptr);
  // in two calls, split unevenly: integer sums do not care
  const std::size_t a = n / 3;
  gpu::accumulate_stats(dg.data() + offset, a, ds.data(), nullptr);
  gpu::accumulate_stats(dg.data() + offset + a, n - a, ds.data(), nullptr);
  const host::grad_stats got = gpu::to_host(ds.download()[0]);
  for (std::size_t w = 0; w < got.words.size(); ++w) {
    if (got.words[w] != want.words[w]) {
      return "word " + std::to_string(w) + " is " + std::to_string(got.words[w]) + ", host " +
             std::to_string(want.words[w]);
    }
  }
  if (got.max_abs_bits != want.max_abs_bits) return "max |g| differs";
  if (got.norm_squared() != want.norm_squared()) return "norm differs";
  // both paths (cub::DeviceReduce and the hand-written kernel); the count is added to
  for (auto path : {gpu::elementwise_path::cub_transform, gpu::elementwise_path::handwritten}) {
    dev_array<unsigned long long> count(std::vector<unsigned long long>{5});
    gpu::count_nonfinite(dg.data() + offset, n, count.data(), nullptr, path);
    if (count.download()[0] != 5 + host::count_nonfinite(g.data() + offset, n)) {
      return "count_nonfinite differs on path " + std::to_string(static_cast<int>(path));
    }
  }
  return {};
}
}  // namespace

TEST_CASE("exact gradient statistics on the GPU equal the host's words", "[stats]") {
  for (std::size_t n : {1u, 3u, 100u, 4097u, 1000003u}) {
    for (std::size_t off : {0u, 1u}) {
      CAPTURE(n, off);
      REQUIRE(compare_stats<bf16>(n, off, n + off) == "");
      REQUIRE(compare_stats<fp16>(n, off, n + off + 1) == "");
      REQUIRE(compare_stats<float>(n, off, n + off + 2) == "");
    }
  }
  SECTION("a gradient of one exponent (the worst case for the bins) and all zeros") {
    std::vector<bf16> g(1 << 20, bf16(1.5f));
    dev_array<bf16> dg(g);
    dev_array<gpu::device_grad_stats> ds(1);
    gpu::clear_stats(ds.data(), nullptr);
    gpu::accumulate_stats(dg.data(), g.size(), ds.data(), nullptr);
    host::grad_stats want;
    host::accumulate_stats(g.data(), g.size(), want);
    CHECK(gpu::to_host(ds.download()[0]).words == want.words);
    CHECK(want.norm_squared() == 2.25 * static_cast<double>(g.size()));
  }
}

// ---- conversions, accumulation, flatten ----------------------------------------------------

namespace {
template <class S, class D>
std::string compare_convert(const std::vector<S>& in, std::size_t off, gpu::elementwise_path path) {
  const std::size_t n = in.size() - off;
  std::vector<D> want(in.size(), from_float<D>(5.0f));
  host::convert(in.data() + off, want.data() + off, n);
  dev_array<S> din(in);
  dev_array<D> dout(std::vector<D>(in.size(), from_float<D>(5.0f)));
  gpu::convert(din.data() + off, dout.data() + off, n, nullptr, path);
  return first_difference(dout.download(), want, "convert");
}

template <class S>
std::vector<S> every_pattern_or_random(std::uint64_t seed) {
  std::vector<S> v;
  if constexpr (std::is_same_v<S, float>) {
    std::uint64_t s = seed;
    for (int i = 0; i < (1 << 18); ++i)
      v.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(splitmix(s))));
    for (int i = 0; i < 4096; ++i) v.push_back(std::ldexp(random_float(s), -30 + i % 50));
  } else {
    for (std::uint32_t i = 0; i < 65536; ++i)
      v.push_back(S::from_bits(static_cast<std::uint16_t>(i)));
  }
  return v;
}

template <class S, class D>
void check_convert_pair() {
  const auto in = every_pattern_or_random<S>(17);
  for (std::size_t off : {0u, 1u, 5u}) {
    for (auto path : {gpu::elementwise_path::cub_transform, gpu::elementwise_path::handwritten}) {
      CAPTURE(dtype_of<S>, dtype_of<D>, off, static_cast<int>(path));
      REQUIRE(compare_convert<S, D>(in, off, path) == "");
    }
  }
}

template <class S, class D>
std::string compare_accumulate(std::size_t n, std::size_t off, gpu::elementwise_path path) {
  std::uint64_t s = n + off;
  std::vector<S> in(n + off);
  std::vector<D> acc(n + off);
  for (auto& x : in) x = random_value<S>(s);
  for (auto& x : acc) x = random_value<D>(s);
  dev_array<S> din(in);
  dev_array<D> dacc(acc);
  host::accumulate(in.data() + off, acc.data() + off, n);
  gpu::accumulate(din.data() + off, dacc.data() + off, n, nullptr, path);
  return first_difference(dacc.download(), acc, "accumulate");
}
}  // namespace

TEST_CASE("casts on the GPU equal the host's, every 16-bit pattern included", "[convert]") {
  check_convert_pair<float, bf16>();
  check_convert_pair<float, fp16>();
  check_convert_pair<bf16, float>();
  check_convert_pair<fp16, float>();
  check_convert_pair<bf16, fp16>();
  check_convert_pair<fp16, bf16>();
  check_convert_pair<bf16, bf16>();
}

TEST_CASE("a launch is not blamed for an error an earlier call left", "[convert]") {
  dev_array<float> a(std::vector<float>(1000, 1.5f));
  dev_array<bf16> b(1000);
  // a failed call whose result is discarded leaves its error on the thread
  REQUIRE(cudaSetDevice(cuda_device_count() + 5) != cudaSuccess);
  for (auto path : {gpu::elementwise_path::cub_transform, gpu::elementwise_path::handwritten}) {
    CAPTURE(static_cast<int>(path));
    (void)cudaSetDevice(cuda_device_count() + 5);
    REQUIRE_NOTHROW(gpu::convert(a.data(), b.data(), 1000, nullptr, path));
  }
  device_sync();
  for (const bf16& x : b.download()) REQUIRE(to_float(x) == 1.5f);
}

TEST_CASE("accumulate adds in fp32 and rounds once, as on the host", "[convert]") {
  for (std::size_t n : {1u, 15u, 1000u, 100001u}) {
    for (std::size_t off : {0u, 3u}) {
      for (auto path : {gpu::elementwise_path::cub_transform, gpu::elementwise_path::handwritten}) {
        CAPTURE(n, off, static_cast<int>(path));
        REQUIRE(compare_accumulate<bf16, bf16>(n, off, path) == "");
        REQUIRE(compare_accumulate<float, bf16>(n, off, path) == "");
        REQUIRE(compare_accumulate<bf16, float>(n, off, path) == "");
        REQUIRE(compare_accumulate<fp16, fp16>(n, off, path) == "");
        REQUIRE(compare_accumulate<float, float>(n, off, path) == "");
      }
    }
  }
}

TEST_CASE("batched copy flattens, pads and unflattens many tensors in one launch", "[convert]") {
  std::uint64_t s = 99;
  const std::vector<std::size_t> sizes = {3, 0, 1000, 1, 65536 * 2 + 7, 17, 250000};
  std::vector<std::vector<bf16>> tensors;
  std::vector<dev_array<bf16>> dtensors;
  for (std::size_t n : sizes) {
    std::vector<bf16> t(n);
    for (auto& x : t) x = bf16(random_float(s, 3.0f));
    tensors.push_back(t);
    dtensors.emplace_back(t);
  }
  // flat fp32 buffer: tensors back to back with 5 zeros of padding after each, 2 more at the end
  std::size_t total = 0;
  std::vector<std::size_t> offsets;
  for (std::size_t n : sizes) {
    offsets.push_back(total);
    total += n + 5;
  }
  dev_array<float> flat(std::vector<float>(total + 2, -1.0f));
  std::vector<gpu::batched_copy<bf16, float>::item> in;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    in.push_back({dtensors[i].data(), flat.data() + offsets[i], sizes[i], 5});
  }
  gpu::batched_copy<bf16, float> flatten(in, nullptr);
  CHECK(flatten.elements() == total);
  CHECK(flatten.bytes_moved() == (total - 5 * sizes.size()) * 6 + 5 * sizes.size() * 4);
  flatten.run(nullptr);
  const auto h = flat.download();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (std::size_t j = 0; j < sizes[i]; ++j) {
      REQUIRE(std::bit_cast<std::uint32_t>(h[offsets[i] + j]) ==
              std::bit_cast<std::uint32_t>(static_cast<float>(tensors[i][j])));
    }
    for (std::size_t j = 0; j < 5; ++j) REQUIRE(h[offsets[i] + sizes[i] + j] == 0.0f);
  }
  REQUIRE(h[total] == -1.0f);  // nothing written past the last item
  REQUIRE(h[total + 1] == -1.0f);

  // back: fp32 -> bf16 into fresh tensors (an unflatten), exact since the values came from bf16
  std::vector<dev_array<bf16>> back;
  std::vector<gpu::batched_copy<float, bf16>::item> out;
  for (std::size_t i = 0; i < sizes.size(); ++i) back.emplace_back(sizes[i]);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    out.push_back({flat.data() + offsets[i], back[i].data(), sizes[i], 0});
  }
  gpu::batched_copy<float, bf16> unflatten(out, nullptr);
  unflatten.run(nullptr);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    REQUIRE(first_difference(back[i].download(), tensors[i], "unflatten") == "");
  }
  std::vector<gpu::batched_copy<float, bf16>::item> bad = {{nullptr, back[2].data(), 4, 0}};
  REQUIRE_THROWS_WITH((gpu::batched_copy<float, bf16>(bad, nullptr)),
                      Catch::Contains("item 0 has a null pointer"));
}

namespace {
// A same-type batched copy of tensors at every element offset of one source array into every
// element offset of a flat buffer (shifted 16-byte loads where they cannot be aligned together),
// with one zero of padding after each; every bit pattern must arrive unchanged.
template <class T>
std::string compare_shifted_flatten(gpu::elementwise_path path) {
  constexpr std::size_t pack = 16 / sizeof(T);
  std::uint64_t s = 7 + sizeof(T);
  std::vector<std::size_t> sizes;
  for (std::size_t so = 0; so < pack; ++so) {
    for (std::size_t n : {std::size_t{5}, 3 * pack + 1, std::size_t{4099}, std::size_t{70001}}) {
      sizes.push_back(n + so);
    }
  }
  std::size_t src_total = 0, dst_total = 0;
  for (std::size_t n : sizes) src_total += n, dst_total += n + 1;
  std::vector<T> src(src_total);
  for (auto& x : src) {
    const auto b = splitmix(s);
    if constexpr (sizeof(T) == 2)
      x.bits = static_cast<std::uint16_t>(b);
    else
      x = std::bit_cast<T>(static_cast<std::uint32_t>(b));
  }
  dev_array<T> dsrc(src);
  dev_array<T> dflat(std::vector<T>(dst_total + 3, T(1.0f)));
  std::vector<typename gpu::batched_copy<T, T>::item> items;
  std::vector<T> want(dst_total + 3, T(1.0f));
  std::size_t at = 0, out = 1;  // the flat buffer starts one element in: every relative offset
  for (std::size_t n : sizes) {
    items.push_back({dsrc.data() + at, dflat.data() + out, n, 1});
    for (std::size_t j = 0; j < n; ++j) want[out + j] = src[at + j];
    want[out + n] = T(0.0f);
    at += n;
    out += n + 1;
  }
  gpu::batched_copy<T, T> flatten(items, nullptr, path);
  // the CUB path: one cub::DeviceMemcpy::Batched call of every copy and padding
  if ((flatten.memcpy_buffers() != 0) != (path == gpu::elementwise_path::cub_transform))
    return "the batched copy took the other path";
  flatten.run(nullptr);
  return first_difference(dflat.download(), want, "shifted flatten");
}
}  // namespace

TEST_CASE("batched copy moves 16-byte words between misaligned tensors, bit for bit", "[convert]") {
  for (auto path : {gpu::elementwise_path::cub_transform, gpu::elementwise_path::handwritten}) {
    CAPTURE(static_cast<int>(path));
    REQUIRE(compare_shifted_flatten<bf16>(path) == "");
    REQUIRE(compare_shifted_flatten<fp16>(path) == "");
    REQUIRE(compare_shifted_flatten<float>(path) == "");
  }
}

// ---- the rank-ordered reduction --------------------------------------------------------------

namespace {
template <class T>
std::string compare_reduce(std::size_t k, std::size_t n, std::size_t off, reduce_op op,
                           bool in_place, bool with_nan) {
  std::uint64_t s = k * 1000 + n + off;
  std::vector<std::vector<T>> in(k, std::vector<T>(n + off));
  for (auto& v : in) {
    for (auto& x : v) x = random_value<T>(s);
    if constexpr (!std::is_integral_v<T>) {
      if (with_nan && n > 2) v[off + splitmix(s) % n] = T(std::numeric_limits<float>::quiet_NaN());
    }
  }
  std::vector<dev_array<T>> din;
  for (auto& v : in) din.emplace_back(v);
  std::vector<T> want(n + off, T{});
  std::vector<const T*> hp;
  for (auto& v : in) hp.push_back(v.data() + off);
  T* hout = in_place ? in[0].data() + off : want.data() + off;
  host::reduce_ordered(hp.data(), k, hout, n, op);
  if (in_place) want = in[0];
  dev_array<T> dout(std::vector<T>(n + off, T{}));
  std::vector<const T*> dp;
  for (auto& d : din) dp.push_back(d.data() + off);
  T* out = in_place ? din[0].data() + off : dout.data() + off;
  gpu::reduce_ordered(dp.data(), k, out, n, op, nullptr);
  return first_difference(in_place ? din[0].download() : dout.download(), want, "reduce_ordered");
}

template <class T>
void check_reduce() {
  for (std::size_t k : {1u, 2u, 5u, 70u}) {  // 70 > 64: the pointer table in device memory
    for (std::size_t n : {1u, 37u, 4099u}) {
      for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
        const bool nan = op == reduce_op::max || op == reduce_op::min;
        for (std::size_t off : {0u, 1u}) {
          CAPTURE(dtype_of<T>, k, n, op, off);
          REQUIRE(compare_reduce<T>(k, n, off, op, false, nan) == "");
        }
        CAPTURE(dtype_of<T>, k, n, op);
        REQUIRE(compare_reduce<T>(k, n, 0, op, true, nan) == "");
      }
    }
  }
}
}  // namespace

TEST_CASE("rank-ordered reduction on the GPU equals host::reduce_ordered", "[reduce]") {
  check_reduce<float>();
  check_reduce<bf16>();
  check_reduce<fp16>();
  check_reduce<double>();
  check_reduce<std::int32_t>();
  check_reduce<std::int64_t>();
  check_reduce<std::uint8_t>();
  check_reduce<std::uint32_t>();
  check_reduce<std::uint64_t>();
}

TEST_CASE("strided reduction reads k blocks of a staging buffer in rank order", "[reduce]") {
  std::uint64_t s = 5;
  for (std::size_t stride : {1000u, 1003u}) {
    const std::size_t k = 7, n = 997;
    std::vector<bf16> staging(k * stride);
    for (auto& x : staging) x = random_value<bf16>(s);
    dev_array<bf16> d(staging);
    std::vector<const bf16*> hp;
    for (std::size_t q = 0; q < k; ++q) hp.push_back(staging.data() + q * stride);
    std::vector<bf16> want(n);
    host::reduce_ordered(hp.data(), k, want.data(), n, reduce_op::sum);
    dev_array<bf16> out(n);
    gpu::reduce_strided(d.data(), stride, k, out.data(), n, reduce_op::sum, nullptr);
    CAPTURE(stride);
    REQUIRE(first_difference(out.download(), want, "reduce_strided") == "");
  }
  dev_array<float> x(10);
  REQUIRE_THROWS_WITH(gpu::reduce_strided(x.data(), 4, 2, x.data(), 5, reduce_op::sum, nullptr),
                      Catch::Contains("stride 4 is shorter than the 5 elements"));
}
