// shardkit's fused AdamW step behind a C interface, so that benchmarks/peers.py can run it in the
// same Python process as torch's and DeepSpeed's optimizers, on tensors allocated by torch, on
// the same sizes and thread counts, interleaved (scripts/bench --peers).
//
//   team = shardkit_peer_team(threads)          a persistent host::thread_team (or none for 1)
//   shardkit_peer_adamw_fp32(team, p, m, v, g, n, step, lr, beta1, beta2, eps, weight_decay)
//   shardkit_peer_adamw_bf16(team, master, m, v, g_bf16, out_bf16, n, step, ...)
//   shardkit_peer_team_free(team);  shardkit_peer_isa()  shardkit_peer_prefetch() (1: on)
//   shardkit_peer_stream_fp32(team, p, m, v, g, n)   the roofline: the fp32 step's bytes (read
//                                                     p, m, v, g; write p, m, v), one add each
//                                                     (v += g * g)
//   own = shardkit_peer_own_new(p0, g0, n)     fp32 p, m, v, g in shardkit's own host buffers
//   shardkit_peer_own_adamw_fp32(team, own, step, lr, ...); shardkit_peer_own_free(own)
//                                 (what a shardkit engine steps: core/memory.hpp's allocations,
//                                 staggered and on huge pages, where torch's tensors are not)
//
// Bias corrections and all per-step constants come from shardkit::adamw::prepare, as in the
// engine; the gradient multiplier is 1.
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/host/dispatch.hpp>
#include <shardkit/kernels/host/isa.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/host/prefetch.hpp>
#include <shardkit/kernels/math.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {
shardkit::adamw::constants constants(std::uint64_t step, float lr, float beta1, float beta2,
                                     float eps, float weight_decay) {
  const shardkit::adam_options o{
      .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay};
  return shardkit::adamw::prepare(o, step, lr, 1.0f);
}

shardkit::host::executor* exec(void* team) {
  return static_cast<shardkit::host::executor*>(static_cast<shardkit::host::thread_team*>(team));
}

// The roofline of the fp32 step: the same loads and stores through the same dispatch, one add
// per array instead of AdamW's arithmetic (a multiply-add for v, which so stays non-negative:
// peers.py runs this pass on the tensors the AdamW contenders also step, whose square root of v
// must stay finite).
struct stream_kernel {
  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(float* p, float* m, float* v, const float* g, std::size_t n,
                                       bool prefetch) {
    namespace simd = shardkit::simd;
    constexpr std::size_t L = Isa::width;
    std::size_t i = 0;
    // Two vectors at a time, stored stream by stream, as the fused step does (its loads and
    // stores in the same order: kernels/host/optimizer.hpp).
    for (; i + 2 * L <= n; i += 2 * L) {
      // The step's software prefetch (host::prefetch_distance, where host::software_prefetch()
      // is on): the roofline stays the fastest pass over these bytes.
      const std::size_t a = i + shardkit::host::prefetch_distance;
      if (prefetch && a < n) simd::prefetch_at(a, g, p, m, v);
      const auto ga = simd::load<Isa>(g + i), gb = simd::load<Isa>(g + i + L);
      const auto pa = simd::load<Isa>(p + i) + ga, pb = simd::load<Isa>(p + i + L) + gb;
      const auto ma = simd::load<Isa>(m + i) + ga, mb = simd::load<Isa>(m + i + L) + gb;
      const auto va = simd::load<Isa>(v + i) + ga * ga, vb = simd::load<Isa>(v + i + L) + gb * gb;
      simd::store<Isa>(v + i, va);
      simd::store<Isa>(v + i + L, vb);
      simd::store<Isa>(m + i, ma);
      simd::store<Isa>(m + i + L, mb);
      simd::store<Isa>(p + i, pa);
      simd::store<Isa>(p + i + L, pb);
    }
    for (; i < n; ++i) {
      p[i] += g[i];
      m[i] += g[i];
      v[i] += g[i] * g[i];
    }
  }
};

// fp32 parameters, moments and gradient in shardkit's host buffers, as an engine holds them.
struct own_buffers {
  shardkit::buffer<float> p, m, v, g;
  own_buffers(const float* p0, const float* g0, std::size_t n)
      : p(n, nullptr, shardkit::memory_category::working_params),
        m(n, nullptr, shardkit::memory_category::optimizer_moments),
        v(n, nullptr, shardkit::memory_category::optimizer_moments),
        g(n, nullptr, shardkit::memory_category::grads) {
    std::memcpy(p.data(), p0, n * sizeof(float));
    std::memcpy(g.data(), g0, n * sizeof(float));
  }
};
}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* shardkit_peer_team(int threads) {
  if (threads <= 1) return nullptr;
  return new shardkit::host::thread_team(static_cast<std::size_t>(threads));
}

__attribute__((visibility("default"))) void shardkit_peer_team_free(void* team) {
  delete static_cast<shardkit::host::thread_team*>(team);
}

__attribute__((visibility("default"))) const char* shardkit_peer_isa() {
  return shardkit::host_isa();
}

__attribute__((visibility("default"))) int shardkit_peer_prefetch() {
  return shardkit::host::software_prefetch(shardkit::host::prefetch_loop::step) ? 1 : 0;
}

__attribute__((visibility("default"))) void shardkit_peer_adamw_fp32(
    void* team, float* p, float* m, float* v, const float* g, std::size_t n, std::uint64_t step,
    float lr, float beta1, float beta2, float eps, float weight_decay) {
  float* state[2] = {m, v};
  shardkit::host::parallel_fused_step<shardkit::adamw, float, float>(
      exec(team), constants(step, lr, beta1, beta2, eps, weight_decay), p, state, g, nullptr, n);
}

__attribute__((visibility("default"))) void shardkit_peer_stream_fp32(void* team, float* p,
                                                                      float* m, float* v,
                                                                      const float* g,
                                                                      std::size_t n) {
  const bool prefetch = shardkit::host::software_prefetch(shardkit::host::prefetch_loop::step);
  shardkit::host::parallel_for(
      exec(team), n, shardkit::host::step_grain, [&](std::size_t b, std::size_t e) {
        shardkit::dispatch<stream_kernel>(p + b, m + b, v + b, g + b, e - b, prefetch);
      });
}

__attribute__((visibility("default"))) void* shardkit_peer_own_new(const float* p0, const float* g0,
                                                                   std::size_t n) {
  return new own_buffers(p0, g0, n);
}

__attribute__((visibility("default"))) void shardkit_peer_own_free(void* own) {
  delete static_cast<own_buffers*>(own);
}

__attribute__((visibility("default"))) void shardkit_peer_own_adamw_fp32(void* team, void* own,
                                                                         std::uint64_t step,
                                                                         float lr, float beta1,
                                                                         float beta2, float eps,
                                                                         float weight_decay) {
  auto& b = *static_cast<own_buffers*>(own);
  shardkit_peer_adamw_fp32(team, b.p.data(), b.m.data(), b.v.data(), b.g.data(), b.p.size(), step,
                           lr, beta1, beta2, eps, weight_decay);
}

__attribute__((visibility("default"))) void shardkit_peer_adamw_bf16(
    void* team, float* master, float* m, float* v, const std::uint16_t* g, std::uint16_t* out,
    std::size_t n, std::uint64_t step, float lr, float beta1, float beta2, float eps,
    float weight_decay) {
  float* state[2] = {m, v};
  shardkit::host::parallel_fused_step<shardkit::adamw, shardkit::bf16, shardkit::bf16>(
      exec(team), constants(step, lr, beta1, beta2, eps, weight_decay), master, state,
      reinterpret_cast<const shardkit::bf16*>(g), reinterpret_cast<shardkit::bf16*>(out), n);
}
}
