// GPU tests of the CUDA backend: every kernel against its host implementation (bit for bit
// where the header promises it; this target builds with -fmad=false), device memory and the
// allocator hook, the thread communicator on device memory and the NCCL communicator against
// the rank-order reference of tests/comm/test_collectives.cpp, and the ZeRO engine on device
// memory against the host engine. Runs only where a CUDA device
// exists (test_cuda_main.cpp skips otherwise).
#include <shardkit/comm/thread.hpp>
#include <shardkit/comm/thread_cuda.cuh>
#include <shardkit/cuda.cuh>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/grad_stats.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/reduce.hpp>
#include <shardkit/zero/engine_cuda.cuh>
#if defined(SHARDKIT_TEST_NCCL)
#include <shardkit/comm/nccl.cuh>
#endif

#include "cuda/engine_case.hpp"
#include "support/world.hpp"

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

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

namespace {

// ---- data ----------------------------------------------------------------------------------

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
float random_float(std::uint64_t& s, float scale = 1.0f) {
  return scale * static_cast<float>(static_cast<double>(splitmix(s) >> 11) * 0x1.0p-53 * 2 - 1);
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

// Finite values over many binades (and some zeros), in T.
template <class T>
T random_value(std::uint64_t& s) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(splitmix(s) % 200);
  } else {
    const int e = static_cast<int>(splitmix(s) % 24) - 12;
    const float f = (splitmix(s) % 50 == 0) ? 0.0f : std::ldexp(random_float(s), e);
    return T(f);
  }
}

// A device array with host upload and download (synchronous), ordered on the calling thread's
// current device stream like its allocation and zeroing.
template <class T>
class dev_array {
 public:
  explicit dev_array(std::size_t n) : buf_(n, nullptr, memory_category::comm_scratch) {}
  explicit dev_array(const std::vector<T>& h) : dev_array(h.size()) { upload(h); }
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() == buf_.size());
    copy_elements(buf_.data(), h.data(), h.size(), current_device_stream());
  }
  std::vector<T> download() const {
    std::vector<T> h(buf_.size());
    copy_elements(h.data(), buf_.data(), h.size(), current_device_stream());
    return h;
  }
  T* data() { return buf_.data(); }
  std::size_t size() const { return buf_.size(); }

 private:
  buffer<T, cuda_space> buf_;
};

template <class T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want,
                             const char* what) {
  if (got.size() != want.size()) return std::string(what) + ": sizes differ";
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (bits_of(got[i]) != bits_of(want[i])) {
      std::ostringstream os;
      os << what << ": element " << i << " has bits " << std::hex << bits_of(got[i])
         << ", the host gives " << bits_of(want[i]);
      return os.str();
    }
  }
  return {};
}

void sync() {
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
}

}  // namespace

// ---- device memory ---------------------------------------------------------------------------

namespace {
class counting_resource final : public device_memory_resource {
 public:
  void* allocate(std::size_t bytes, device_stream stream) override {
    ++allocations;
    last_stream = stream;
    return inner.allocate(bytes, stream);
  }
  void deallocate(void* p, std::size_t bytes, device_stream stream) noexcept override {
    ++frees;
    inner.deallocate(p, bytes, stream);
  }
  const char* name() const noexcept override { return "counting"; }
  cuda_async_resource inner;
  int allocations = 0;
  int frees = 0;
  device_stream last_stream = nullptr;
};
}  // namespace

TEST_CASE("device buffers are zeroed, counted by the ledger, and use the installed resource",
          "[memory]") {
  REQUIRE(live_device_allocations().count == 0);
  memory_ledger ledger;
  {
    buffer<float, cuda_space> b(1000, &ledger, memory_category::grads);
    CHECK(ledger.current(memory_category::grads) == 4000);
    CHECK(live_device_allocations().count == 1);
    CHECK(live_device_allocations().bytes == 4000);
    std::vector<float> h(1000, 1.0f);
    copy_elements(h.data(), b.data(), h.size());
    CHECK(std::all_of(h.begin(), h.end(), [](float x) { return x == 0.0f; }));
    cudaPointerAttributes a{};
    REQUIRE(cudaPointerGetAttributes(&a, b.data()) == cudaSuccess);
    CHECK(a.type == cudaMemoryTypeDevice);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 16 == 0);
  }
  CHECK(ledger.current(memory_category::grads) == 0);
  CHECK(ledger.peak(memory_category::grads) == 4000);
  CHECK(live_device_allocations().count == 0);

  counting_resource r;
  REQUIRE(set_device_memory_resource(&r) == nullptr);
  {
    cuda_stream s;
    device_stream_scope scope(s);
    buffer<bf16, cuda_space> b(4096, &ledger, memory_category::working_params);
    CHECK(r.allocations == 1);
    CHECK(r.last_stream == s.get());
    REQUIRE_THROWS_AS(set_device_memory_resource(nullptr), usage_error);
    b.release();
    CHECK(r.frees == 1);
    s.synchronize();
  }
  CHECK(set_device_memory_resource(nullptr) == &r);
}

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
                               bool write_out, std::uint64_t seed) {
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
                               write_out ? dout.data() + offset : nullptr, n, nullptr);
  }
  sync();
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
          CAPTURE(Opt::name, dtype_of<G>, dtype_of<W>, n, off, goff, out);
          REQUIRE(compare_fused_step<Opt, G, W>(n, off, goff, out, n * 31 + off) == "");
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
  sync();
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
  dev_array<unsigned long long> count(1);
  gpu::count_nonfinite(dg.data() + offset, n, count.data(), nullptr);
  if (count.download()[0] != host::count_nonfinite(g.data() + offset, n)) {
    return "count_nonfinite differs";
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
std::string compare_convert(const std::vector<S>& in, std::size_t off) {
  const std::size_t n = in.size() - off;
  std::vector<D> want(in.size(), from_float<D>(5.0f));
  host::convert(in.data() + off, want.data() + off, n);
  dev_array<S> din(in);
  dev_array<D> dout(std::vector<D>(in.size(), from_float<D>(5.0f)));
  gpu::convert(din.data() + off, dout.data() + off, n, nullptr);
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
    CAPTURE(dtype_of<S>, dtype_of<D>, off);
    REQUIRE(compare_convert<S, D>(in, off) == "");
  }
}

template <class S, class D>
std::string compare_accumulate(std::size_t n, std::size_t off) {
  std::uint64_t s = n + off;
  std::vector<S> in(n + off);
  std::vector<D> acc(n + off);
  for (auto& x : in) x = random_value<S>(s);
  for (auto& x : acc) x = random_value<D>(s);
  dev_array<S> din(in);
  dev_array<D> dacc(acc);
  host::accumulate(in.data() + off, acc.data() + off, n);
  gpu::accumulate(din.data() + off, dacc.data() + off, n, nullptr);
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

TEST_CASE("accumulate adds in fp32 and rounds once, as on the host", "[convert]") {
  for (std::size_t n : {1u, 15u, 1000u, 100001u}) {
    for (std::size_t off : {0u, 3u}) {
      CAPTURE(n, off);
      REQUIRE(compare_accumulate<bf16, bf16>(n, off) == "");
      REQUIRE(compare_accumulate<float, bf16>(n, off) == "");
      REQUIRE(compare_accumulate<bf16, float>(n, off) == "");
      REQUIRE(compare_accumulate<fp16, fp16>(n, off) == "");
      REQUIRE(compare_accumulate<float, float>(n, off) == "");
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
std::string compare_shifted_flatten() {
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
  gpu::batched_copy<T, T> flatten(items, nullptr);
  flatten.run(nullptr);
  return first_difference(dflat.download(), want, "shifted flatten");
}
}  // namespace

TEST_CASE("batched copy moves 16-byte words between misaligned tensors, bit for bit", "[convert]") {
  REQUIRE(compare_shifted_flatten<bf16>() == "");
  REQUIRE(compare_shifted_flatten<fp16>() == "");
  REQUIRE(compare_shifted_flatten<float>() == "");
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

// ---- communicators on device memory --------------------------------------------------------

namespace {

// Host-pointer collectives over a device communicator: copy in, run on device buffers, copy
// out. In-place calls stay in place on the device. So the rank-order checks below (those of
// tests/comm/test_collectives.cpp) run unchanged against device communicators.
template <class Comm>
class staged {
 public:
  explicit staged(Comm& c) : c_(c) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  const traffic_ledger& traffic() const { return c_.traffic(); }

  template <class T>
  void all_reduce(const T* in, T* out, std::size_t n, reduce_op op) {
    dev_array<T> d(host(in, n));
    if (in == out) {
      c_.all_reduce(d.data(), d.data(), n, op);
      store(out, d);
    } else {
      dev_array<T> o(n);
      c_.all_reduce(d.data(), o.data(), n, op);
      store(out, o);
    }
  }
  template <class T>
  void reduce_scatter(const T* in, T* out, std::size_t count, reduce_op op) {
    const std::size_t N = static_cast<std::size_t>(size()), r = static_cast<std::size_t>(rank());
    dev_array<T> d(host(in, N * count));
    if (out == in + r * count) {
      c_.reduce_scatter(d.data(), d.data() + r * count, count, op);
      const auto h = d.download();
      std::copy(h.begin() + static_cast<std::ptrdiff_t>(r * count),
                h.begin() + static_cast<std::ptrdiff_t>((r + 1) * count), out);
    } else {
      dev_array<T> o(count);
      c_.reduce_scatter(d.data(), o.data(), count, op);
      store(out, o);
    }
  }
  template <class T>
  void all_gather(const T* in, T* out, std::size_t count) {
    const std::size_t N = static_cast<std::size_t>(size()), r = static_cast<std::size_t>(rank());
    dev_array<T> o(host(out, N * count));
    if (in == out + r * count) {
      c_.all_gather(o.data() + r * count, o.data(), count);
    } else {
      dev_array<T> d(host(in, count));
      c_.all_gather(d.data(), o.data(), count);
    }
    store(out, o);
  }
  template <class T>
  void broadcast(T* buf, std::size_t n, int root) {
    dev_array<T> d(host(buf, n));
    c_.broadcast(d.data(), n, root);
    store(buf, d);
  }
  template <class T>
  void all_to_all(const T* in, T* out, std::size_t count) {
    const std::size_t N = static_cast<std::size_t>(size());
    dev_array<T> d(host(in, N * count)), o(N * count);
    c_.all_to_all(d.data(), o.data(), count);
    store(out, o);
  }

 private:
  template <class T>
  static std::vector<T> host(const T* p, std::size_t n) {
    return std::vector<T>(p, p + n);
  }
  template <class T>
  static void store(T* out, const dev_array<T>& d) {
    const auto h = d.download();
    std::copy(h.begin(), h.end(), out);
  }
  Comm& c_;
};

// ---- the rank-order reference and checks of tests/comm/test_collectives.cpp ----

template <class T>
T input(int r, std::size_t i, std::uint64_t salt) {
  std::uint64_t z = (static_cast<std::uint64_t>(r) << 40) ^ (i * 0x9e3779b97f4a7c15ull) ^ salt;
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  z ^= z >> 29;
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(z % 1000);
  } else {
    const double u = static_cast<double>(z >> 11) * 0x1.0p-53 * 2 - 1;
    return T(static_cast<float>(u * 100.0));
  }
}

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

// exact: bit for bit against the rank-order reference; otherwise within a relative tolerance
// (NCCL's native reductions)
template <class T>
bool matches(T got, T want, bool exact) {
  if (exact || std::is_integral_v<T>) return bits_of(got) == bits_of(want);
  const double g = static_cast<double>(static_cast<float>(got));
  const double w = static_cast<double>(static_cast<float>(want));
  const double tol = std::is_same_v<T, float> || std::is_same_v<T, double> ? 1e-5 : 1e-1;
  return std::abs(g - w) <= tol * (1.0 + std::abs(w));
}

template <class Comm, class T>
std::string check_all_reduce(Comm& c, std::size_t n, reduce_op op, bool in_place, bool exact) {
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
    if (!matches(res[i], reduced<T>(c.size(), i, op, salt), exact)) {
      return "all_reduce(" + std::string(name(dtype_of<T>)) + ", " + name(op) + ") wrong at " +
             std::to_string(i);
    }
  }
  const auto d = c.traffic().since(before);
  if (d.bytes_sent(collective::all_reduce) !=
          ring_bytes_sent(collective::all_reduce, n, sizeof(T), c.size(), c.rank()) ||
      d.calls(collective::all_reduce) != 1) {
    return "all_reduce recorded the wrong traffic";
  }
  return {};
}

template <class Comm, class T>
std::string check_reduce_scatter(Comm& c, std::size_t count, reduce_op op, bool in_place,
                                 bool exact) {
  const int N = c.size(), r = c.rank();
  const std::uint64_t salt = count * 131 + static_cast<std::uint64_t>(op);
  std::vector<T> in(count * N), out(count);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = input<T>(r, i, salt);
  const auto before = c.traffic();
  T* dst = in_place ? in.data() + static_cast<std::size_t>(r) * count : out.data();
  c.reduce_scatter(in.data(), dst, count, op);
  for (std::size_t i = 0; i < count; ++i) {
    if (!matches(dst[i], reduced<T>(N, static_cast<std::size_t>(r) * count + i, op, salt), exact)) {
      return "reduce_scatter(" + std::string(name(dtype_of<T>)) + ", " + name(op) + ") wrong at " +
             std::to_string(i);
    }
  }
  if (c.traffic().since(before).bytes_sent(collective::reduce_scatter) !=
      ring_bytes_sent(collective::reduce_scatter, count, sizeof(T), N, r)) {
    return "reduce_scatter recorded the wrong traffic";
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
      if (bits_of(out[q * count + i]) != bits_of(input<T>(q, i, count))) {
        return "all_gather wrong at " + std::to_string(q * count + i);
      }
    }
  }
  if (c.traffic().since(before).bytes_sent(collective::all_gather) !=
      ring_bytes_sent(collective::all_gather, count, sizeof(T), N, r)) {
    return "all_gather recorded the wrong traffic";
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
        return "broadcast from root " + std::to_string(root) + " wrong at " + std::to_string(i);
      }
    }
  }
  return {};
}

template <class Comm, class T>
std::string check_everything(Comm& c, bool exact) {
  for (std::size_t n : {0u, 1u, 5u, 1000u, 70001u}) {
    for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
      if (!exact && op == reduce_op::avg && std::is_integral_v<T>) continue;
      for (bool ip : {false, true}) {
        if (auto e = check_all_reduce<Comm, T>(c, n, op, ip, exact); !e.empty()) return e;
        if (auto e = check_reduce_scatter<Comm, T>(c, n, op, ip, exact); !e.empty()) return e;
      }
    }
    for (bool ip : {false, true}) {
      if (auto e = check_all_gather<Comm, T>(c, n, ip); !e.empty()) return e;
    }
    if (auto e = check_broadcast<Comm, T>(c, n); !e.empty()) return e;
  }
  return {};
}

template <class Comm>
std::string check_all_types(Comm& c, bool exact) {
  for (auto e : {check_everything<Comm, float>(c, exact), check_everything<Comm, bf16>(c, exact),
                 check_everything<Comm, fp16>(c, exact), check_everything<Comm, double>(c, exact),
                 check_everything<Comm, std::int32_t>(c, exact),
                 check_everything<Comm, std::int64_t>(c, exact)}) {
    if (!e.empty()) return e;
  }
  // all_to_all: rank q's block r arrives at block q
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
  return {};
}

thread_comm_options short_timeout() {
  thread_comm_options o;
  o.timeout = std::chrono::seconds(60);
  return o;
}

}  // namespace

TEST_CASE("thread communicator on device memory: rank-order results bit for bit", "[thread_cuda]") {
  for (int n : {1, 2, 3, 4, 8}) {
    CAPTURE(n);
    test::require_all_ok(run_ranks<cuda_space>(
        n,
        [](thread_cuda_comm& c) -> std::string {
          staged<thread_cuda_comm> s(c);
          auto e = check_all_types(s, true);
          c.barrier();
          return e;
        },
        short_timeout()));
  }
}

TEST_CASE("thread communicator on device memory: asynchronous collectives overlap rank streams",
          "[thread_cuda]") {
  test::require_all_ok(run_ranks<cuda_space>(
      4,
      [](thread_cuda_comm& c) -> std::string {
        const int N = c.size();
        const std::size_t count = 1 << 16;
        cuda_stream own;  // this rank's compute stream
        device_stream_scope scope(own);
        std::vector<dev_array<float>> mine, full;
        std::vector<thread_work> works;
        for (int k = 0; k < 4; ++k) {
          mine.emplace_back(std::vector<float>(count, static_cast<float>(k * 10 + c.rank())));
          full.emplace_back(count * N);
        }
        own.synchronize();  // inputs (and the zeroing of the outputs) complete before the calls
        for (int k = 0; k < 4; ++k) {
          works.push_back(c.all_gather_async(mine[k].data(), full[k].data(), count));
        }
        // meanwhile, unrelated work on this rank's stream
        dev_array<float> scratch(count);
        gpu::convert(mine[0].data(), scratch.data(), count, own.get());
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        for (auto& w : works) {
          while (!w.test()) {
            if (std::chrono::steady_clock::now() > deadline) return "no progress";
            std::this_thread::sleep_for(std::chrono::microseconds(100));
          }
          w.wait();
        }
        own.synchronize();
        for (int k = 0; k < 4; ++k) {
          const auto h = full[k].download();
          for (int q = 0; q < N; ++q) {
            if (h[static_cast<std::size_t>(q) * count] != static_cast<float>(k * 10 + q) ||
                h[static_cast<std::size_t>(q + 1) * count - 1] != static_cast<float>(k * 10 + q)) {
              return "async all_gather wrong";
            }
          }
        }
        return {};
      },
      short_timeout()));
}

TEST_CASE("thread communicator on device memory refuses host buffers", "[thread_cuda]") {
  REQUIRE_THROWS_WITH(run_ranks<cuda_space>(
                          2,
                          [](thread_cuda_comm& c) {
                            std::vector<float> h(4);
                            c.all_reduce(h.data(), h.data(), h.size());
                          },
                          short_timeout()),
                      Catch::Contains("is not device memory"));
}

// ---- the ZeRO engine on device memory --------------------------------------------------------
// The training run of cuda/engine_case.hpp on the device engine over thread_cuda_comm (each rank
// with its own non-blocking compute stream) and on the host engine over thread_comm: every
// rank's working parameters, master shard, optimizer states and step reports must be equal bit
// for bit, and the ledger (device bytes) must hold what the host's holds and what
// plan/formulas.hpp predicts.

namespace {

struct device_io {
  cudaStream_t s = nullptr;
  std::vector<buffer<float, cuda_space>> d32;
  std::vector<buffer<bf16, cuda_space>> d16;

  device_io() {
    ::shardkit::detail::cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                   "cudaStreamCreateWithFlags");
  }
  device_io(const device_io&) = delete;
  device_io& operator=(const device_io&) = delete;
  ~device_io() {
    (void)cudaStreamSynchronize(s);
    {
      device_stream_scope scope(s);
      d32.clear();
      d16.clear();
    }
    (void)cudaStreamSynchronize(s);
    (void)cudaStreamDestroy(s);
  }

  device_stream stream() const { return s; }
  void sync() const { ::shardkit::detail::cuda_check(cudaStreamSynchronize(s), "sync"); }

  template <class T>
  buffer<T, cuda_space>& slot(std::vector<buffer<T, cuda_space>>& v, std::size_t i, std::size_t n) {
    if (v.size() <= i) v.resize(i + 1);
    if (v[i].size() != n) {
      device_stream_scope scope(s);
      v[i] = buffer<T, cuda_space>(n, nullptr, memory_category::comm_scratch);
    }
    return v[i];
  }

  // Uploads on the compute stream and hands over the device tensor; waits before returning,
  // since the host vector is rewritten for the next gradient.
  template <class Engine, class T>
  void grad_ready(Engine& eng, std::size_t i, const std::vector<T>& g) {
    buffer<T, cuda_space>* b = nullptr;
    if constexpr (std::is_same_v<T, float>)
      b = &slot(d32, i, g.size());
    else
      b = &slot(d16, i, g.size());
    copy_bytes_async(b->data(), g.data(), g.size() * sizeof(T), s);
    eng.grad_ready(i, tensor_view<T, cuda_space>(b->data(), g.size()));
    sync();
  }

  template <class T>
  std::vector<std::uint32_t> bits(tensor_view<T, cuda_space> v) const {
    using E = std::remove_const_t<T>;
    std::vector<E> h(v.size());
    if (!h.empty()) {
      ::shardkit::detail::cuda_check(
          cudaMemcpy(h.data(), v.data(), v.size() * sizeof(E), cudaMemcpyDeviceToHost),
          "cudaMemcpy (engine test)");
    }
    std::vector<std::uint32_t> b;
    for (const E& x : h) b.push_back(test::engine_bits(x));
    return b;
  }
};

template <class Policies, class W>
void check_engine_on_device(const test::engine_case& ec) {
  for (int n : {1, 2, 4}) {
    CAPTURE(n, Policies::stage, sizeof(W));
    const auto host =
        test::host_engine_reference(Policies::stage, !std::is_same_v<W, float>, n, ec);
    const auto dev = run_ranks<cuda_space>(
        n,
        [&](thread_cuda_comm& c) {
          device_io io;
          return test::train_engine<Policies, W>(c, ec, io);
        },
        short_timeout());
    REQUIRE(host.size() == static_cast<std::size_t>(n));
    REQUIRE(dev.size() == static_cast<std::size_t>(n));
    for (std::size_t r = 0; r < host.size(); ++r) {
      CAPTURE(r);
      REQUIRE(host[r].failure == "");
      REQUIRE(dev[r].failure == "");
      REQUIRE(host[r].reports.size() == static_cast<std::size_t>(3 * ec.steps));
      CHECK(dev[r].reports == host[r].reports);
      CHECK(dev[r].params == host[r].params);
      CHECK(dev[r].master == host[r].master);
      CHECK(dev[r].states == host[r].states);
      CHECK(dev[r].ledger == host[r].ledger);
    }
  }
}

template <class Policies>
void check_engine_stage() {
  SECTION("bf16, norm reported, clipping, two parameter groups") {
    test::engine_case ec;
    ec.options.report_grad_norm = true;
    ec.options.clip_grad_norm = 0.05f;
    check_engine_on_device<Policies, bf16>(ec);
  }
  SECTION("fp32, no statistics (the schedule check only)") {
    test::engine_case ec;
    check_engine_on_device<Policies, float>(ec);
  }
  SECTION("bf16, two micro-batches, small buckets double-buffered, an overflow skipped") {
    test::engine_case ec;
    ec.micro_batches = 2;
    ec.inject_inf_step = 2;
    ec.options.report_grad_norm = true;
    ec.options.bucket_elems = 64;
    ec.options.grad_buffers = 2;
    ec.options.alignment = 8;
    check_engine_on_device<Policies, bf16>(ec);
  }
}

}  // namespace

TEST_CASE("engine on device memory, ZeRO-0: equal to the host engine bit for bit", "[engine]") {
  check_engine_stage<zero0>();
}
TEST_CASE("engine on device memory, ZeRO-1: equal to the host engine bit for bit", "[engine]") {
  check_engine_stage<zero1>();
}
TEST_CASE("engine on device memory, ZeRO-2: equal to the host engine bit for bit", "[engine]") {
  check_engine_stage<zero2>();
}
TEST_CASE("engine on device memory, ZeRO-3: equal to the host engine bit for bit", "[engine]") {
  check_engine_stage<zero3>();
}

// ---- NCCL (built where NCCL was found) -------------------------------------------------------
#if defined(SHARDKIT_TEST_NCCL)

namespace {
int nccl_ranks() {
  return std::min(cuda_device_count(), 8);
}

template <class F>
std::vector<std::string> on_nccl_ranks(F&& fn, nccl_options opts = {}) {
  opts.timeout = std::chrono::seconds(120);
  return run_ranks(
      nccl_ranks(),
      [&](thread_comm& host) -> std::string {
        if (cudaSetDevice(host.rank()) != cudaSuccess) return "cudaSetDevice failed";
        auto comm = nccl_bootstrap(host, opts);
        return fn(comm, host);
      },
      short_timeout());
}
}  // namespace

TEST_CASE("NCCL communicator, deterministic: rank-order results bit for bit", "[nccl]") {
  WARN("NCCL tests run on " << nccl_ranks()
                            << " rank(s), one per GPU (NCCL allows one rank per GPU)");
  for (std::size_t staging : {std::size_t{64} << 20, std::size_t{256}}) {  // 256 bytes: many rounds
    CAPTURE(staging);
    nccl_options o;
    o.staging_bytes = staging;
    test::require_all_ok(on_nccl_ranks(
        [](nccl_communicator& c, thread_comm&) -> std::string {
          staged<nccl_communicator> s(c);
          auto e = check_all_types(s, true);
          c.barrier();
          return e;
        },
        o));
  }
}

TEST_CASE("NCCL communicator, native reductions: correct within rounding", "[nccl]") {
  nccl_options o;
  o.reduction = nccl_reduction::native;
  test::require_all_ok(on_nccl_ranks(
      [](nccl_communicator& c, thread_comm&) -> std::string {
        staged<nccl_communicator> s(c);
        return check_all_types(s, c.size() == 1);
      },
      o));
}

TEST_CASE("NCCL communicator: streams, groups, split, abort", "[nccl]") {
  test::require_all_ok(on_nccl_ranks([](nccl_communicator& c, thread_comm&) -> std::string {
    const int N = c.size(), r = c.rank();
    const std::size_t count = 1 << 20;
    cuda_stream compute;
    c.set_compute_stream(compute);
    device_stream_scope scope(compute);  // allocations, zeroing and copies on the compute stream
    // inputs written on the compute stream; the collective waits for them (no host sync)
    dev_array<float> src(std::vector<float>(count, static_cast<float>(r + 1)));
    dev_array<bf16> mine(count), full(count * N), other(count * N);
    gpu::convert(src.data(), mine.data(), count, compute.get());
    {
      auto g = c.group();
      auto w1 = c.all_gather_async(mine.data(), full.data(), count);
      auto w2 = c.all_gather_async(mine.data(), other.data(), count);
      bool refused = false;
      try {
        c.barrier();
      } catch (const usage_error&) {
        refused = true;
      }
      if (!refused) return "a synchronous call inside a group was not refused";
      g.end();
      // stream-ordered: the compute stream waits, the host does not
      w1.wait_on(compute);
      w2.wait_on(compute);
    }
    std::vector<bf16> h(count * N);
    if (cudaMemcpyAsync(h.data(), full.data(), h.size() * sizeof(bf16), cudaMemcpyDefault,
                        compute.get()) != cudaSuccess) {
      return "copy failed";
    }
    compute.synchronize();
    for (int q = 0; q < N; ++q) {
      if (static_cast<float>(h[static_cast<std::size_t>(q) * count]) != static_cast<float>(q + 1)) {
        return "grouped all_gather wrong";
      }
    }
    if (first_difference(other.download(), full.download(), "second gather") != "") {
      return "second grouped all_gather wrong";
    }
    // split into even and odd ranks
    auto sub = c.split(r % 2, r);
    if (sub.size() != (N + 1 - r % 2) / 2 || sub.rank() != r / 2) return "split ranks wrong";
    dev_array<std::int32_t> one(std::vector<std::int32_t>{1});
    sub.all_reduce(one.data(), one.data(), 1);
    if (one.download()[0] != sub.size()) return "all_reduce on the split communicator wrong";
    // abort: later calls fail with the reason
    c.abort("testing abort");
    try {
      c.barrier();
      return "a call after abort() did not raise";
    } catch (const comm_aborted& e) {
      if (std::string(e.what()).find("testing abort") == std::string::npos) {
        return std::string("comm_aborted without the reason: ") + e.what();
      }
    }
    return {};
  }));
}

TEST_CASE("NCCL bootstrap composes with any host communicator that broadcasts bytes", "[nccl]") {
  STATIC_REQUIRE(byte_broadcaster<thread_comm>);
  STATIC_REQUIRE(communicator<nccl_communicator>);
  // a user-distributed id: one rank, made here
  const ncclUniqueId id = nccl_unique_id();
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  nccl_communicator c(id, 0, 1);
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  CHECK(c.device() == 0);
  CHECK(c.native_handle() != nullptr);
  c.check();
  REQUIRE_THROWS_AS(nccl_communicator(id, 1, 1), invalid_argument);
}

// The engine over NCCL (one rank per GPU; one rank on a one-GPU machine), deterministic
// reductions: equal to the host engine bit for bit, ZeRO-0 to ZeRO-3.
template <class Policies, class W>
void check_engine_on_nccl(const test::engine_case& ec) {
  const int n = nccl_ranks();
  CAPTURE(n, Policies::stage, sizeof(W));
  const auto host = test::host_engine_reference(Policies::stage, !std::is_same_v<W, float>, n, ec);
  std::vector<test::engine_run> dev(static_cast<std::size_t>(n));
  test::require_all_ok(on_nccl_ranks([&](nccl_communicator& c, thread_comm& h) -> std::string {
    device_io io;
    dev[static_cast<std::size_t>(h.rank())] = test::train_engine<Policies, W>(c, ec, io);
    return {};
  }));
  REQUIRE(host.size() == dev.size());
  for (std::size_t r = 0; r < host.size(); ++r) {
    CAPTURE(r);
    REQUIRE(host[r].failure == "");
    REQUIRE(dev[r].failure == "");
    CHECK(dev[r].reports == host[r].reports);
    CHECK(dev[r].params == host[r].params);
    CHECK(dev[r].master == host[r].master);
    CHECK(dev[r].states == host[r].states);
    CHECK(dev[r].ledger == host[r].ledger);
  }
}

TEST_CASE("engine on NCCL, stages 0-3: equal to the host engine bit for bit", "[nccl]") {
  test::engine_case ec;
  ec.micro_batches = 2;
  ec.inject_inf_step = 2;
  ec.options.report_grad_norm = true;
  ec.options.clip_grad_norm = 0.05f;
  ec.options.bucket_elems = 64;
  ec.options.grad_buffers = 2;
  check_engine_on_nccl<zero0, bf16>(ec);
  check_engine_on_nccl<zero1, bf16>(ec);
  check_engine_on_nccl<zero2, bf16>(ec);
  check_engine_on_nccl<zero3, bf16>(ec);
  check_engine_on_nccl<zero2, float>(ec);
}

#endif  // SHARDKIT_TEST_NCCL
