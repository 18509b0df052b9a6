// Optimizer step on the host: shardkit's fused AdamW step against three baselines in the same
// binary and run.
//
//  optimizer/adamw_bf16   host::fused_step<adamw>: bf16 gradients, fp32 master/m/v updated in
//                         place, bf16 working copy written (28 bytes/element, docs/accounting.md)
//  optimizer/adamw_fp32   the same with fp32 gradients and fp32 parameters, no 16-bit copy
//                         (read 4 + 12, write 12: also 28 bytes/element)
//  optimizer/rmw          baseline, the roofline: one pass over the same bytes (bf16 in, three
//                         fp32 arrays read-modified-written, bf16 out) with an add per array
//  optimizer/memcpy       baseline: memcpy of 14 bytes/element (28 bytes of traffic)
//  optimizer/naive_adam   baseline: the multi-pass scalar loop a user writes without shardkit
//                         (unscale, m, v, parameter, working copy: five passes)
//  optimizer/torch_adamw_fp32
//                         peer (when LibTorch was found): LibTorch's C++ torch::optim::AdamW on
//                         one fp32 parameter of n elements, torch::set_num_threads(threads)
//  optimizer/isa_adamw_bf16/isa:<build>, isa_adamw_fp32, isa_rmw
//                         the same step and roofline in every build of the host loops this CPU
//                         runs (kernels/host/isa.hpp), one size, one thread
//  optimizer/prefetch_adamw_bf16/prefetch:on|off, prefetch_adamw_fp32, prefetch_rmw
//                         the same with software prefetch on and off (kernels/host/prefetch.hpp:
//                         off by default on AMD's Zen 4), one thread
//  optimizer/placement_adamw_fp32/arrays:malloc, arrays:staggered
//                         the fp32 step, one thread, on four arrays from std::malloc (large
//                         blocks: glibc maps them back to back, n * 4 + 4 KiB apart, as a user's
//                         tensors are; counter distance_kib), and on the arena's staggered ones
//
// bytes_per_second counts 28 bytes per element for every run, so ratios of bandwidths are
// inverse ratios of times. Each size runs on 1 and 2 threads: a persistent host::thread_team
// runs every variant (shardkit's through host::parallel_fused_step, the baselines one piece per
// thread); the time includes the start and join of the team.
#include <shardkit/kernels/host/dispatch.hpp>
#include <shardkit/kernels/host/isa.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/host/prefetch.hpp>
#include <shardkit/kernels/host/simd_storage.hpp>
#include <shardkit/kernels/math.hpp>

#include "common.hpp"

#if defined(SHARDKIT_BENCH_LIBTORCH)
#include <torch/torch.h>
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string>

namespace {

constexpr double bytes_per_element = 28.0;

//! The fp32 starting state of every step: parameters, zero moments, gradients.
void fill_fp32(float* p, float* m, float* v, float* g, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = 0.5f - static_cast<float>(i % 1000) * 1e-3f;
    m[i] = 0.0f;
    v[i] = 0.0f;
    g[i] = 1e-3f * (static_cast<float>(i % 77) - 38.0f);
  }
}

//! One allocation, carved into the arrays of every variant: p, m, v, g32 (fp32), g16 and out
//! (bf16), and 14 bytes per element of scratch: the naive loop's tmp (fp32), and the memcpy
//! baseline's destination (it copies the first 14 bytes/element, p, m and part of v, there).
//! No two arrays share bytes: a gradient array that doubled as another's storage once fed the
//! fp32 step subnormal gradients (two bf16 patterns read as one float), and microcode assists
//! made it 1.2-2.8x slower than the bf16 step.
struct arena {
  std::size_t n = 0;
  bench::array<std::byte> bytes;
  float *p, *m, *v, *g32, *tmp;
  std::byte* copy_dst;
  static constexpr std::size_t stagger = 4096 + 64 * 7;
  shardkit::bf16 *g16, *out;

  void resize(std::size_t elems) {
    if (elems == n) return;
    // Arrays start `stagger` bytes apart beyond their sizes, so that equal indices do not fall
    // on the same cache sets and 4 KiB page offsets (with power-of-two sizes they otherwise
    // would, and every stream would evict the others).
    bytes = bench::array<std::byte>();
    bytes = bench::make_array<std::byte>(elems * 34 + 7 * stagger);
    n = elems;
    std::byte* b = bytes.data();
    p = reinterpret_cast<float*>(b);
    m = reinterpret_cast<float*>(b + 4 * n + stagger);
    v = reinterpret_cast<float*>(b + 8 * n + 2 * stagger);
    g32 = reinterpret_cast<float*>(b + 12 * n + 3 * stagger);
    g16 = reinterpret_cast<shardkit::bf16*>(b + 16 * n + 4 * stagger);
    out = reinterpret_cast<shardkit::bf16*>(b + 18 * n + 5 * stagger);
    tmp = reinterpret_cast<float*>(b + 20 * n + 6 * stagger);
    copy_dst = b + 20 * n + 6 * stagger;  // memcpy: the first 14n bytes to here
  }

  //! The state every variant starts from: parameters, gradients, zero moments (each benchmark
  //! starts here, so that none runs on what the previous one left, rmw's sums or NaNs).
  void reset() {
    fill_fp32(p, m, v, g32, n);
    for (std::size_t i = 0; i < n; ++i) {
      g16[i] = shardkit::bf16(1e-3f * (static_cast<float>(i % 91) - 45.0f));
    }
  }
};

arena& the_arena() {
  static arena a;
  return a;
}

const shardkit::adamw::constants& constants() {
  static const auto k = shardkit::adamw::prepare(
      shardkit::adam_options{.lr = 1e-4f, .weight_decay = 0.01f}, 10, 1e-4f, 1.0f);
  return k;
}

// The roofline: the same bytes as the fused step, one add per array, through the same
// dispatch (so it runs as wide as the fused step does).
struct rmw_kernel {
  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(const shardkit::bf16* g, float* p, float* m, float* v,
                                       shardkit::bf16* out, std::size_t n, bool prefetch) {
    namespace simd = shardkit::simd;
    constexpr std::size_t L = Isa::width;
    std::size_t i = 0;
    for (; i + L <= n; i += L) {
      // The step's software prefetch (host::prefetch_distance, where host::software_prefetch()
      // is on), so that the roofline stays the fastest pass over these bytes. A prefetch past
      // the end is a hint and never faults.
      const std::size_t a = i + shardkit::host::prefetch_distance;
      if (prefetch && a < n) {
        simd::prefetch_at(a, g, p, m, v);
        simd::prefetch_for_write(out + a);
      }
      const auto gv = simd::load<Isa>(g + i);
      const auto pv = simd::load<Isa>(p + i) + gv;
      simd::store<Isa>(p + i, pv);
      simd::store<Isa>(m + i, simd::load<Isa>(m + i) + gv);
      simd::store<Isa>(v + i, simd::load<Isa>(v + i) + gv);
      // truncation to bf16: no rounding work
      simd::impl::store_h<Isa::width>(out + i, simd::impl::narrow(simd::bits(pv) >> 16));
    }
    for (; i < n; ++i) {
      const float gi = static_cast<float>(g[i]);
      p[i] += gi;
      m[i] += gi;
      v[i] += gi;
      out[i] = shardkit::bf16(p[i]);
    }
  }
};

// What a user writes without a fused kernel: one simple scalar loop per operation.
[[gnu::optimize("no-tree-vectorize")]] void naive_adam(const shardkit::adamw::constants& k,
                                                       const shardkit::bf16* g, float* p, float* m,
                                                       float* v, float* tmp, shardkit::bf16* out,
                                                       std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(g[i]) * k.grad_scale;
  for (std::size_t i = 0; i < n; ++i) m[i] = k.beta1 * m[i] + k.one_minus_beta1 * tmp[i];
  for (std::size_t i = 0; i < n; ++i) v[i] = k.beta2 * v[i] + k.one_minus_beta2 * tmp[i] * tmp[i];
  for (std::size_t i = 0; i < n; ++i) {
    const float mh = m[i] * k.inv_bias_correction1;
    const float vh = v[i] * k.inv_bias_correction2;
    p[i] -= k.lr * (mh / (std::sqrt(vh) + k.eps) + k.weight_decay * p[i]);
  }
  for (std::size_t i = 0; i < n; ++i) out[i] = shardkit::bf16(p[i]);
}

enum class variant { adamw_bf16, adamw_fp32, rmw, memcpy, naive_adam, torch_adamw_fp32 };

const char* name_of(variant v) {
  switch (v) {
    case variant::adamw_bf16:
      return "adamw_bf16";
    case variant::adamw_fp32:
      return "adamw_fp32";
    case variant::rmw:
      return "rmw";
    case variant::memcpy:
      return "memcpy";
    case variant::naive_adam:
      return "naive_adam";
    case variant::torch_adamw_fp32:
      return "torch_adamw_fp32";
  }
  return "?";
}

//! One persistent team per thread count, shared by every benchmark of that count.
shardkit::host::executor* team_of(int threads) {
  static std::map<int, std::unique_ptr<shardkit::host::thread_team>> teams;
  auto& t = teams[threads];
  if (!t) t = std::make_unique<shardkit::host::thread_team>(static_cast<std::size_t>(threads));
  return t.get();
}

void run_part(variant which, arena& a, std::size_t b, std::size_t e) {
  const std::size_t len = e - b;
  if (len == 0) return;
  const auto& k = constants();
  switch (which) {
    case variant::rmw:
      shardkit::dispatch<rmw_kernel>(
          static_cast<const shardkit::bf16*>(a.g16 + b), a.p + b, a.m + b, a.v + b, a.out + b, len,
          shardkit::host::software_prefetch(shardkit::host::prefetch_loop::step));
      break;
    case variant::memcpy:
      std::memcpy(a.copy_dst + 14 * b, a.bytes.data() + 14 * b, 14 * len);
      break;
    case variant::naive_adam:
      naive_adam(k, a.g16 + b, a.p + b, a.m + b, a.v + b, a.tmp + b, a.out + b, len);
      break;
    default:
      break;
  }
}

void run(variant which, arena& a, std::size_t n, shardkit::host::executor* team) {
  const auto& k = constants();
  float* st[2] = {a.m, a.v};
  switch (which) {
    case variant::adamw_bf16:
      shardkit::host::parallel_fused_step<shardkit::adamw>(team, k, a.p, st, a.g16, a.out, n);
      break;
    case variant::adamw_fp32:
      shardkit::host::parallel_fused_step<shardkit::adamw, float, float>(
          team, k, a.p, st, a.g32, static_cast<float*>(nullptr), n);
      break;
    default:  // one piece per thread
      shardkit::host::parallel_for(team, n, 1,
                                   [&](std::size_t b, std::size_t e) { run_part(which, a, b, e); });
  }
}

void bm_step(benchmark::State& state, variant which, std::size_t n, int threads) {
  arena& a = the_arena();
  a.resize(n);
  a.reset();
  shardkit::host::executor* team = team_of(threads);
  for (auto _ : state) {
    run(which, a, n, team);
    benchmark::ClobberMemory();
  }
  bench::set_bytes(state, bytes_per_element * static_cast<double>(n));
  state.counters["elements"] = static_cast<double>(n);
  state.counters["threads"] = threads;
}

#if defined(SHARDKIT_BENCH_LIBTORCH)
// LibTorch's torch::optim::AdamW (C++ API) on one fp32 parameter over the arena's p, with the
// arena's fp32 gradient; torch keeps its own moments.
void bm_torch(benchmark::State& state, std::size_t n, int threads) {
  arena& a = the_arena();
  a.resize(n);
  a.reset();
  torch::set_num_threads(threads);
  const auto n64 = static_cast<std::int64_t>(n);
  torch::Tensor prm = torch::from_blob(a.p, {n64}, torch::kFloat32).detach().requires_grad_(true);
  prm.mutable_grad() = torch::from_blob(a.g32, {n64}, torch::kFloat32);
  torch::optim::AdamW opt(std::vector<torch::Tensor>{prm},
                          torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  opt.step();  // allocates the moments
  for (auto _ : state) {
    opt.step();
    benchmark::ClobberMemory();
  }
  bench::set_bytes(state, bytes_per_element * static_cast<double>(n));
  state.counters["elements"] = static_cast<double>(n);
  state.counters["threads"] = threads;
}
#endif

//! Four fp32 arrays of n elements, each from std::malloc, as a framework's own tensors are.
struct malloc_arrays {
  float* a[4] = {};
  explicit malloc_arrays(std::size_t n) {
    for (auto*& x : a) {
      x = static_cast<float*>(std::malloc(n * sizeof(float)));
      if (x == nullptr) throw std::bad_alloc();
    }
    fill_fp32(a[0], a[1], a[2], a[3], n);
  }
  malloc_arrays(const malloc_arrays&) = delete;
  malloc_arrays& operator=(const malloc_arrays&) = delete;
  ~malloc_arrays() {
    for (auto* x : a) std::free(x);
  }
};

// The fp32 step where the arrays lie as malloc put them, or staggered (the arena's).
void bm_placement(benchmark::State& state, bool from_malloc, std::size_t n) {
  std::optional<malloc_arrays> own;
  float *p, *m, *v, *g;
  if (from_malloc) {
    own.emplace(n);
    p = own->a[0], m = own->a[1], v = own->a[2], g = own->a[3];
  } else {
    arena& a = the_arena();
    a.resize(n);
    a.reset();
    p = a.p, m = a.m, v = a.v, g = a.g32;
  }
  float* st[2] = {m, v};
  for (auto _ : state) {
    shardkit::host::fused_step<shardkit::adamw, float, float>(constants(), p, st, g, nullptr, n);
    benchmark::ClobberMemory();
  }
  const auto dist = [](const float* x, const float* y) {
    const auto a = reinterpret_cast<std::uintptr_t>(x), b = reinterpret_cast<std::uintptr_t>(y);
    return static_cast<double>(a > b ? a - b : b - a) / 1024.0;
  };
  bench::set_bytes(state, bytes_per_element * static_cast<double>(n));
  state.counters["elements"] = static_cast<double>(n);
  state.counters["distance_kib"] = dist(p, m);  // between the first two arrays
}

// One variant in one build of the host loops.
void bm_isa(benchmark::State& state, variant which, shardkit::host::isa isa, std::size_t n) {
  shardkit::host::scoped_isa forced(isa);
  bm_step(state, which, n, 1);
}

// One variant with software prefetch on or off (kernels/host/prefetch.hpp).
void bm_prefetch(benchmark::State& state, variant which, bool on, std::size_t n) {
  shardkit::host::scoped_prefetch forced(on);
  bm_step(state, which, n, 1);
}

void register_all(bench::size_set s) {
  benchmark::AddCustomContext("shardkit_host_isa", shardkit::host_isa());
  benchmark::AddCustomContext("shardkit_host_prefetch", shardkit::host::software_prefetch_name());
  std::string isas;
  for (auto i : shardkit::host::available_isas()) {
    isas += std::string(isas.empty() ? "" : ",") + shardkit::host::name(i);
  }
  benchmark::AddCustomContext("shardkit_host_isas", isas);
  const auto sizes = s == bench::size_set::tiny    ? std::vector<std::size_t>{1 << 12}
                     : s == bench::size_set::quick ? bench::geometric(1 << 20, 16 << 20, 4)
                                                   : bench::geometric(1 << 20, 256 << 20, 4);
  auto reg = [](const std::string& name, auto fn, auto... args) {
    benchmark::RegisterBenchmark(name.c_str(), fn, args...)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  for (std::size_t n : sizes) {
    for (int threads : {1, 2}) {
      const std::string tail = "/n:" + std::to_string(n) + "/threads:" + std::to_string(threads);
      for (variant v : {variant::adamw_bf16, variant::adamw_fp32, variant::rmw, variant::memcpy,
                        variant::naive_adam}) {
        reg(std::string("optimizer/") + name_of(v) + tail, bm_step, v, n, threads);
      }
#if defined(SHARDKIT_BENCH_LIBTORCH)
      reg(std::string("optimizer/torch_adamw_fp32") + tail, bm_torch, n, threads);
#endif
    }
  }
  const auto placement_sizes = s == bench::size_set::tiny ? std::vector<std::size_t>{1 << 12}
                               : s == bench::size_set::quick
                                   ? std::vector<std::size_t>{1 << 20}
                                   : std::vector<std::size_t>{16 << 20, 32 << 20};
  for (std::size_t n : placement_sizes) {
    for (bool from_malloc : {true, false}) {
      reg(std::string("optimizer/placement_adamw_fp32/arrays:") +
              (from_malloc ? "malloc" : "staggered") + "/n:" + std::to_string(n) + "/threads:1",
          bm_placement, from_malloc, n);
    }
  }
  const std::size_t isa_n = s == bench::size_set::tiny    ? (1 << 12)
                            : s == bench::size_set::quick ? (4 << 20)
                                                          : (16 << 20);
  for (auto i : shardkit::host::available_isas()) {
    for (variant v : {variant::adamw_bf16, variant::adamw_fp32, variant::rmw}) {
      reg(std::string("optimizer/isa_") + name_of(v) + "/isa:" + shardkit::host::name(i) +
              "/n:" + std::to_string(isa_n) + "/threads:1",
          bm_isa, v, i, isa_n);
    }
  }
  for (std::size_t n : s == bench::size_set::full ? std::vector<std::size_t>{16 << 20, 64 << 20}
                                                  : std::vector<std::size_t>{isa_n}) {
    for (variant v : {variant::adamw_bf16, variant::adamw_fp32, variant::rmw}) {
      for (bool on : {true, false}) {
        reg(std::string("optimizer/prefetch_") + name_of(v) + "/prefetch:" + (on ? "on" : "off") +
                "/n:" + std::to_string(n) + "/threads:1",
            bm_prefetch, v, on, n);
      }
    }
  }
}

}  // namespace

SHARDKIT_BENCH_MAIN(register_all)
