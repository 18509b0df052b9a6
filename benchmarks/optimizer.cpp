// Optimizer step on the host: shardkit's fused AdamW step against three baselines in the same
// binary and run.
//
//  optimizer/adamw_bf16   host::fused_step<adamw>: bf16 gradients, fp32 master/m/v updated in
//                         place, bf16 working copy written (28 bytes/element, FACTS.md)
//  optimizer/adamw_fp32   the same with fp32 gradients and fp32 parameters, no 16-bit copy
//                         (read 4 + 12, write 12: also 28 bytes/element)
//  optimizer/rmw          baseline, the roofline: one pass over the same bytes (bf16 in, three
//                         fp32 arrays read-modified-written, bf16 out) with an add per array
//  optimizer/memcpy       baseline: memcpy of 14 bytes/element (28 bytes of traffic)
//  optimizer/naive_adam   baseline: the multi-pass scalar loop a user writes without shardkit
//                         (unscale, m, v, parameter, working copy: five passes)
//
// bytes_per_second counts 28 bytes per element for every run, so ratios of bandwidths are
// inverse ratios of times. Each size runs on 1 and 2 threads (a persistent team splits the
// elements; the time includes the start and join of the team).
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/simd.hpp>
#include <shardkit/kernels/math.hpp>

#include "common.hpp"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>

namespace {

constexpr double bytes_per_element = 28.0;

//! One allocation of 28 bytes per element, carved into the arrays of every variant: p, m, v
//! (fp32), g (fp32; its first half doubles as the bf16 gradient), out (bf16), tmp (fp32, the
//! naive loop's scratch). memcpy copies the first 14 bytes/element onto the last 14.
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
    bytes = bench::make_array<std::byte>(elems * 28 + 8 * stagger);
    n = elems;
    std::byte* b = bytes.data();
    p = reinterpret_cast<float*>(b);
    m = reinterpret_cast<float*>(b + 4 * n + stagger);
    v = reinterpret_cast<float*>(b + 8 * n + 2 * stagger);
    g32 = reinterpret_cast<float*>(b + 12 * n + 3 * stagger);
    g16 = reinterpret_cast<shardkit::bf16*>(b + 12 * n + 3 * stagger);
    out = reinterpret_cast<shardkit::bf16*>(b + 16 * n + 4 * stagger);
    tmp = reinterpret_cast<float*>(b + 18 * n + 5 * stagger);
    copy_dst = b + 14 * n + 7 * stagger;  // memcpy: the first 14n bytes to here
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = 0.5f - static_cast<float>(i % 1000) * 1e-3f;
      g32[i] = 1e-3f * (static_cast<float>(i % 77) - 38.0f);
    }
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
  SHARDKIT_FORCEINLINE static void run(const shardkit::bf16* g, float* p, float* m, float* v,
                                       shardkit::bf16* out, std::size_t n) {
    namespace simd = shardkit::simd;
    constexpr std::size_t L = simd::width;
    std::size_t i = 0;
    for (; i + L <= n; i += L) {
      const simd::vfloat gv = simd::load(g + i);
      const simd::vfloat pv = simd::load(p + i) + gv;
      simd::store(p + i, pv);
      simd::store(m + i, simd::load(m + i) + gv);
      simd::store(v + i, simd::load(v + i) + gv);
      const simd::vu32 h = simd::as_bits(pv) >> 16;  // truncation: no rounding work
      h.copy_to(reinterpret_cast<std::uint16_t*>(out + i), simd::stdx::element_aligned);
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

enum class variant { adamw_bf16, adamw_fp32, rmw, memcpy, naive_adam };

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
  }
  return "?";
}

void run_part(variant which, arena& a, std::size_t b, std::size_t e) {
  const std::size_t len = e - b;
  if (len == 0) return;
  const auto& k = constants();
  switch (which) {
    case variant::adamw_bf16: {
      float* st[2] = {a.m + b, a.v + b};
      shardkit::host::fused_step<shardkit::adamw>(k, a.p + b, st, a.g16 + b, a.out + b, len);
      break;
    }
    case variant::adamw_fp32: {
      float* st[2] = {a.m + b, a.v + b};
      shardkit::host::fused_step<shardkit::adamw, float, float>(k, a.p + b, st, a.g32 + b,
                                                                static_cast<float*>(nullptr), len);
      break;
    }
    case variant::rmw:
      shardkit::dispatch<rmw_kernel>(static_cast<const shardkit::bf16*>(a.g16 + b), a.p + b,
                                     a.m + b, a.v + b, a.out + b, len);
      break;
    case variant::memcpy:
      std::memcpy(a.copy_dst + 14 * b, a.bytes.data() + 14 * b, 14 * len);
      break;
    case variant::naive_adam:
      naive_adam(k, a.g16 + b, a.p + b, a.m + b, a.v + b, a.tmp + b, a.out + b, len);
      break;
  }
}

void bm_step(benchmark::State& state, variant which, std::size_t n, int threads) {
  arena& a = the_arena();
  a.resize(n);
  bench::team team(threads);
  const std::function<void(int)> job = [&](int t) {
    const auto [b, e] = bench::part(n, t, threads);
    run_part(which, a, b, e);
  };
  for (auto _ : state) {
    team.run(job);
    benchmark::ClobberMemory();
  }
  bench::set_bytes(state, bytes_per_element * static_cast<double>(n));
  state.counters["elements"] = static_cast<double>(n);
  state.counters["threads"] = threads;
}

void register_all(bench::size_set s) {
  benchmark::AddCustomContext("shardkit_host_isa", shardkit::host_isa());
  const auto sizes = s == bench::size_set::tiny    ? std::vector<std::size_t>{1 << 12}
                     : s == bench::size_set::quick ? bench::geometric(1 << 20, 16 << 20, 4)
                                                   : bench::geometric(1 << 20, 256 << 20, 4);
  for (std::size_t n : sizes) {
    for (int threads : {1, 2}) {
      for (variant v : {variant::adamw_bf16, variant::adamw_fp32, variant::rmw, variant::memcpy,
                        variant::naive_adam}) {
        const std::string name = std::string("optimizer/") + name_of(v) +
                                 "/n:" + std::to_string(n) + "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), bm_step, v, n, threads)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

}  // namespace

SHARDKIT_BENCH_MAIN(register_all)
