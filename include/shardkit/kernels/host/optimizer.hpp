//! \file kernels/host/optimizer.hpp
//! The fused optimizer step on the host: one pass over a contiguous run of a shard that reads
//! the gradient (fp32, bf16 or fp16) and the fp32 parameter and state, applies the optimizer's
//! per-element `update` (kernels/math.hpp), writes parameter and state back, and writes the
//! 16-bit working copy in the same pass. With bf16 gradients and Adam that is the minimum
//! traffic of docs/accounting.md: read 2 + 12, write 12 + 2 = 28 bytes per element.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/kernels/host/dispatch.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/host/prefetch.hpp>
#include <shardkit/kernels/host/simd_storage.hpp>
#include <shardkit/kernels/math.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN
namespace host {

//! How far ahead of the element being updated the fused step prefetches each stream it reads,
//! in elements (2 KiB of fp32). The hardware prefetchers track a limited number of streams and
//! stop at every 4 KiB page boundary; the step reads 3-4 streams at once and its division and
//! square root slow the rate at which its loads are issued. Measured on an Intel Xeon
//! (AVX-512, one thread, 16Mi-64Mi fp32 elements, paired with the step without it): 1.10-1.13x
//! on 4 KiB pages and on 2 MiB pages; 1 KiB ahead 1.07-1.13x, 8 KiB 0.99-1.05x
//! (benchmarks/README.md). The 16-bit working copy's line is prefetched with intent to write
//! (its ordinary stores would otherwise wait for the line): the bf16 step went from 0.88x to
//! 0.95-0.98x of the read-modify-write roofline on the same machine. Where
//! host::software_prefetch(prefetch_loop::step) is off (by default on AMD's Zen 4: there the
//! step was faster without; kernels/host/prefetch.hpp), the step issues no prefetch.
inline constexpr std::size_t prefetch_distance = 512;

namespace detail {
template <class Opt, class G, class W, bool WriteOut>
struct fused_step_kernel {
  static constexpr std::size_t S = Opt::state_count;

  //! The whole vector at i: loads, update, stores of the parameters and the state; returns
  //! the new parameters (for the working copy).
  template <class Isa>
  SHARDKIT_FORCEINLINE static simd::vf<Isa::width> update_whole(const typename Opt::constants& k,
                                                                float* p, float* const* state,
                                                                const G* g, std::size_t i) {
    using V = simd::vf<Isa::width>;
    V pv = simd::load<Isa>(p + i);
    V sv[S > 0 ? S : 1];
    for (std::size_t s = 0; s < S; ++s) sv[s] = simd::load<Isa>(state[s] + i);
    Opt::update(pv, sv, simd::load<Isa>(g + i), k);
    simd::store<Isa>(p + i, pv);
    for (std::size_t s = 0; s < S; ++s) simd::store<Isa>(state[s] + i, sv[s]);
    return pv;
  }

  template <class Isa>
  SHARDKIT_FORCEINLINE static void one(const typename Opt::constants& k, float* p,
                                       float* const* state, const G* g, W* out, std::size_t i,
                                       std::size_t n) {
    using V = simd::vf<Isa::width>;
    if (n == Isa::width) {
      const V pv = update_whole<Isa>(k, p, state, g, i);
      if constexpr (WriteOut) simd::store<Isa>(out + i, pv);
      return;
    }
    V pv = simd::load_partial<Isa>(p + i, n);
    V sv[S > 0 ? S : 1];
    for (std::size_t s = 0; s < S; ++s) sv[s] = simd::load_partial<Isa>(state[s] + i, n);
    Opt::update(pv, sv, simd::load_partial<Isa>(g + i, n), k);
    simd::store_partial<Isa>(p + i, pv, n);
    for (std::size_t s = 0; s < S; ++s) simd::store_partial<Isa>(state[s] + i, sv[s], n);
    if constexpr (WriteOut) simd::store_partial<Isa>(out + i, pv, n);
  }

  //! Vectors i and i + L, whole (one 64-byte line of each fp32 stream in the AVX2 build). Both
  //! are updated before anything is stored, and the stores go stream by stream, a whole line
  //! each (the state, last first, then the parameters). Stores that alternate between the
  //! streams every 32 bytes ran 1.2-1.8x slower on an AMD EPYC when the arrays lay 64 or 128 MiB
  //! (+ 4 KiB) apart, as malloc places 16Mi- or 32Mi-float arrays allocated one after another;
  //! at other distances the two orders are as fast (benchmarks/README.md). The working copy of
  //! both vectors is written by one simd::store2 (one NaN test and one pack for bf16).
  template <class Isa>
  SHARDKIT_FORCEINLINE static void two(const typename Opt::constants& k, float* p,
                                       float* const* state, const G* g, W* out, std::size_t i) {
    using V = simd::vf<Isa::width>;
    constexpr std::size_t L = Isa::width;
    V pa = simd::load<Isa>(p + i);
    V pb = simd::load<Isa>(p + i + L);
    V sa[S > 0 ? S : 1];
    V sb[S > 0 ? S : 1];
    for (std::size_t s = 0; s < S; ++s) {
      sa[s] = simd::load<Isa>(state[s] + i);
      sb[s] = simd::load<Isa>(state[s] + i + L);
    }
    Opt::update(pa, sa, simd::load<Isa>(g + i), k);
    Opt::update(pb, sb, simd::load<Isa>(g + i + L), k);
    for (std::size_t s = S; s-- > 0;) {
      simd::store<Isa>(state[s] + i, sa[s]);
      simd::store<Isa>(state[s] + i + L, sb[s]);
    }
    simd::store<Isa>(p + i, pa);
    simd::store<Isa>(p + i + L, pb);
    if constexpr (WriteOut) simd::store2<Isa>(out + i, pa, pb);
  }

  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(const typename Opt::constants* k, float* p,
                                       float* const* state, const G* g, W* out, std::size_t n,
                                       bool prefetch) {
    constexpr std::size_t L = Isa::width;
    const typename Opt::constants kk = *k;
    float*
        st[S > 0 ? S : 1];  // local copies: the stores cannot alias them, so they stay in registers
    for (std::size_t s = 0; s < S; ++s) st[s] = state[s];
    std::size_t i = 0;
    // Where the parameters do not start on a cache line, the first elements up to the next one
    // go through the partial-vector code (as every tail does: the same bits), so that the
    // loop's vectors do not straddle lines. Arrays from malloc start 16 bytes into a line;
    // there half the loads and stores of the loop straddled two.
    if (n > prefetch_distance && L > 1) {
      const std::size_t off = reinterpret_cast<std::uintptr_t>(p) % 64;  // a float's multiple
      const std::size_t head = (64 - off) % 64 / sizeof(float);
      for (; i < head; i += L) one<Isa>(kk, p, st, g, out, i, std::min(L, head - i));
      i = head;
    }
    if (!prefetch) {
      // software prefetch is off: two vectors at a time (two 64-byte lines of each fp32
      // stream in the AVX-512 build), stored stream by stream. On an AMD EPYC with AVX-512, one
      // vector at a time was 1.04-1.19x slower on malloc's layout and as fast on the engine's
      // buffers (benchmarks/README.md).
      if constexpr (L > 1) {
        for (; i + 2 * L <= n; i += 2 * L) two<Isa>(kk, p, st, g, out, i);
      }
    } else {
      // While a stream has prefetch_distance elements left, each vector also asks for the line
      // that distance ahead in every stream it reads (parameters, state, gradients), and for
      // the working copy's line with intent to write.
      if constexpr (L == 8) {
        // AVX2: two vectors (one 64-byte line of each fp32 stream) per prefetch
        if (n > prefetch_distance) {
          for (; i + 2 * L <= n - prefetch_distance; i += 2 * L) {
            const std::size_t a = i + prefetch_distance;
            simd::prefetch_at(a, p, g);
            for (std::size_t s = 0; s < S; ++s) simd::prefetch_at(a, st[s]);
            if constexpr (WriteOut) simd::prefetch_for_write(out + a);
            two<Isa>(kk, p, st, g, out, i);
          }
        }
      }
      if (n > prefetch_distance) {
        for (; i + L <= n - prefetch_distance; i += L) {
          const std::size_t a = i + prefetch_distance;
          simd::prefetch_at(a, p, g);
          for (std::size_t s = 0; s < S; ++s) simd::prefetch_at(a, st[s]);
          if constexpr (WriteOut) simd::prefetch_for_write(out + a);
          one<Isa>(kk, p, st, g, out, i, L);
        }
      }
    }
    for (; i + L <= n; i += L) one<Isa>(kk, p, st, g, out, i, L);
    if constexpr (L > 1) {  // one lane leaves no tail (and GCC 12 cannot see that here)
      if (i < n) one<Isa>(kk, p, st, g, out, i, n - i);
    }
  }
};
}  // namespace detail

//! One optimizer step over `n` consecutive elements.
//!  - `params`: fp32 parameters (the master copy, or the working parameters when training in
//!    fp32), updated in place;
//!  - `state`: Opt::state_count pointers to fp32 optimizer state, updated in place;
//!  - `grads`: the raw gradients (k.grad_scale is applied inside);
//!  - `working_out`: where to write the rounded 16-bit working copy, or nullptr for none.
//! Every element goes through the same vector code (the tail too), so a result never depends on
//! where an element falls in a run, and every build (host_isa()) computes the same bits as
//! fused_step_scalar.
template <optimizer_policy Opt, float_storage G, float_storage W = bf16>
void fused_step(const typename Opt::constants& k, float* params, float* const* state,
                const G* grads, W* working_out, std::size_t n) {
  if (n == 0) return;
  const bool prefetch = software_prefetch(prefetch_loop::step);
  if (working_out != nullptr) {
    dispatch<detail::fused_step_kernel<Opt, G, W, true>>(&k, params, state, grads, working_out, n,
                                                         prefetch);
  } else {
    dispatch<detail::fused_step_kernel<Opt, G, W, false>>(&k, params, state, grads, working_out, n,
                                                          prefetch);
  }
}

//! Elements per thread below which a parallel step uses fewer threads.
inline constexpr std::size_t step_grain = 16384;

//! fused_step on the threads of `exec` (nullptr: the caller's only): the same bits whatever
//! the number of threads (see kernels/host/parallel.hpp).
template <optimizer_policy Opt, float_storage G, float_storage W = bf16>
void parallel_fused_step(executor* exec, const typename Opt::constants& k, float* params,
                         float* const* state, const G* grads, W* working_out, std::size_t n) {
  parallel_for(exec, n, step_grain, [&](std::size_t b, std::size_t e) {
    float* st[Opt::state_count > 0 ? Opt::state_count : 1];
    for (std::size_t s = 0; s < Opt::state_count; ++s) st[s] = state[s] + b;
    fused_step<Opt, G, W>(k, params + b, st, grads + b,
                          working_out != nullptr ? working_out + b : nullptr, e - b);
  });
}

//! The same step, one element at a time through the scalar per-element function and the
//! scalar conversions of core/dtype.hpp. Slow; it is the reference every vector build equals
//! bit for bit, and the shape the CUDA kernel has. Its lane type (simd::vf<1>) keeps the
//! compiler from contracting products into fused multiply-adds, as every build does.
template <optimizer_policy Opt, float_storage G, float_storage W = bf16>
void fused_step_scalar(const typename Opt::constants& k, float* params, float* const* state,
                       const G* grads, W* working_out, std::size_t n) {
  using V = simd::vf<1>;
  for (std::size_t i = 0; i < n; ++i) {
    V s[Opt::state_count > 0 ? Opt::state_count : 1];
    for (std::size_t j = 0; j < Opt::state_count; ++j) s[j] = V{state[j][i]};
    V p{params[i]};
    Opt::update(p, s, V{to_float(grads[i])}, k);
    params[i] = p.v;
    for (std::size_t j = 0; j < Opt::state_count; ++j) state[j][i] = s[j].v;
    if (working_out != nullptr) working_out[i] = from_float<W>(p.v);
  }
}

}  // namespace host
SHARDKIT_NAMESPACE_END
