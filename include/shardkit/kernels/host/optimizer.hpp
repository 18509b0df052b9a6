//! \file kernels/host/optimizer.hpp
//! The fused optimizer step on the host: one pass over a contiguous run of a shard that reads
//! the gradient (fp32, bf16 or fp16) and the fp32 parameter and state, applies the optimizer's
//! per-element `update` (kernels/math.hpp), writes parameter and state back, and writes the
//! 16-bit working copy in the same pass. With bf16 gradients and Adam that is the minimum
//! traffic of docs/accounting.md: read 2 + 12, write 12 + 2 = 28 bytes per element.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/kernels/host/simd.hpp>
#include <shardkit/kernels/math.hpp>

#include <cstddef>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN
namespace host {

namespace detail {
template <class Opt, class G, class W, bool WriteOut>
struct fused_step_kernel {
  static constexpr std::size_t S = Opt::state_count;

  SHARDKIT_FORCEINLINE static void one(const typename Opt::constants& k, float* p,
                                       float* const* state, const G* g, W* out, std::size_t i,
                                       std::size_t n) {
    constexpr std::size_t L = simd::width;
    const bool full = n == L;
    simd::vfloat pv = full ? simd::load(p + i) : simd::load_partial(p + i, n);
    simd::vfloat sv[S];
    for (std::size_t s = 0; s < S; ++s) {
      sv[s] = full ? simd::load(state[s] + i) : simd::load_partial(state[s] + i, n);
    }
    const simd::vfloat gv = full ? simd::load(g + i) : simd::load_partial(g + i, n);
    Opt::update(pv, sv, gv, k);
    if (full) {
      simd::store(p + i, pv);
      for (std::size_t s = 0; s < S; ++s) simd::store(state[s] + i, sv[s]);
      if constexpr (WriteOut) simd::store(out + i, pv);
    } else {
      simd::store_partial(p + i, pv, n);
      for (std::size_t s = 0; s < S; ++s) simd::store_partial(state[s] + i, sv[s], n);
      if constexpr (WriteOut) simd::store_partial(out + i, pv, n);
    }
  }

  SHARDKIT_FORCEINLINE static void run(const typename Opt::constants* k, float* p,
                                       float* const* state, const G* g, W* out, std::size_t n) {
    constexpr std::size_t L = simd::width;
    const typename Opt::constants kk = *k;
    std::size_t i = 0;
    for (; i + L <= n; i += L) one(kk, p, state, g, out, i, L);
    if (i < n) one(kk, p, state, g, out, i, n - i);
  }
};
#if defined(SHARDKIT_DETAIL_HOST_WIDE)
//! The same loop on 8-lane vectors, for the AVX2 build: every element, the tail too, goes
//! through the same vector code, and the per-element arithmetic is Opt::update as above.
template <class Opt, class G, class W, bool WriteOut>
struct fused_step_wide_kernel {
  static constexpr std::size_t S = Opt::state_count;
  using V = simd::wide::vfloat;

  SHARDKIT_FORCEINLINE static void one(const typename Opt::constants& k, float* p,
                                       float* const* state, const G* g, W* out, std::size_t i,
                                       std::size_t n) {
    namespace w = simd::wide;
    const bool full = n == w::width;
    V pv = full ? w::load(p + i) : w::load_partial(p + i, n);
    V sv[S];
    for (std::size_t s = 0; s < S; ++s) {
      sv[s] = full ? w::load(state[s] + i) : w::load_partial(state[s] + i, n);
    }
    const V gv = full ? w::load(g + i) : w::load_partial(g + i, n);
    Opt::update(pv, sv, gv, k);
    if (full) {
      w::store(p + i, pv);
      for (std::size_t s = 0; s < S; ++s) w::store(state[s] + i, sv[s]);
      if constexpr (WriteOut) w::store(out + i, pv);
    } else {
      w::store_partial(p + i, pv, n);
      for (std::size_t s = 0; s < S; ++s) w::store_partial(state[s] + i, sv[s], n);
      if constexpr (WriteOut) w::store_partial(out + i, pv, n);
    }
  }

  SHARDKIT_FORCEINLINE static void run(const typename Opt::constants* k, float* p,
                                       float* const* state, const G* g, W* out, std::size_t n) {
    constexpr std::size_t L = simd::wide::width;
    const typename Opt::constants kk = *k;
    float* st[S];  // local copies: the stores cannot alias them, so they stay in registers
    for (std::size_t s = 0; s < S; ++s) st[s] = state[s];
    std::size_t i = 0;
    for (; i + L <= n; i += L) one(kk, p, st, g, out, i, L);
    if (i < n) one(kk, p, st, g, out, i, n - i);
  }
};

template <class T>
inline constexpr bool wide_storage = std::is_same_v<T, float> || std::is_same_v<T, bf16>;
#endif

//! Runs the fused loop in the best build for this CPU: the 8-lane AVX2 loop where it applies
//! (fp32/bf16 storage on an AVX2+FMA CPU, from a translation unit built below AVX2), dispatch()
//! otherwise.
template <class Opt, class G, class W, bool WriteOut>
void run_fused(const typename Opt::constants* k, float* p, float* const* state, const G* g, W* out,
               std::size_t n) {
#if defined(SHARDKIT_DETAIL_HOST_WIDE)
  if constexpr (wide_storage<G> && wide_storage<W>) {
    if (::shardkit::detail::cpu_has_avx2_fma()) {
      ::shardkit::detail::run_avx2<fused_step_wide_kernel<Opt, G, W, WriteOut>>(k, p, state, g, out,
                                                                                n);
      return;
    }
  }
#endif
  dispatch<fused_step_kernel<Opt, G, W, WriteOut>>(k, p, state, g, out, n);
}
}  // namespace detail

//! One optimizer step over `n` consecutive elements.
//!  - `params`: fp32 parameters (the master copy, or the working parameters when training in
//!    fp32), updated in place;
//!  - `state`: Opt::state_count pointers to fp32 optimizer state, updated in place;
//!  - `grads`: the raw gradients (k.grad_scale is applied inside);
//!  - `working_out`: where to write the rounded 16-bit working copy, or nullptr for none.
//! Every element goes through the same vector code (the tail too), so a result never depends on
//! where an element falls in a run.
template <optimizer_policy Opt, float_storage G, float_storage W = bf16>
void fused_step(const typename Opt::constants& k, float* params, float* const* state,
                const G* grads, W* working_out, std::size_t n) {
  if (n == 0) return;
  if (working_out != nullptr) {
    detail::run_fused<Opt, G, W, true>(&k, params, state, grads, working_out, n);
  } else {
    detail::run_fused<Opt, G, W, false>(&k, params, state, grads, working_out, n);
  }
}

//! The same step, one element at a time through the scalar per-element function. Slow; it is
//! the reference the vector loop is checked against and the shape the CUDA kernel has.
template <optimizer_policy Opt, float_storage G, float_storage W = bf16>
void fused_step_scalar(const typename Opt::constants& k, float* params, float* const* state,
                       const G* grads, W* working_out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    float s[Opt::state_count];
    for (std::size_t j = 0; j < Opt::state_count; ++j) s[j] = state[j][i];
    float p = params[i];
    Opt::update(p, s, to_float(grads[i]), k);
    params[i] = p;
    for (std::size_t j = 0; j < Opt::state_count; ++j) state[j][i] = s[j];
    if (working_out != nullptr) working_out[i] = from_float<W>(p);
  }
}

}  // namespace host
SHARDKIT_NAMESPACE_END
