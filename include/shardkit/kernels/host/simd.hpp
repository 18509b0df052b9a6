//! \file kernels/host/simd.hpp
//! Portable host vectorisation: fp32 and uint32 vectors of 1, 4, 8 or 16 lanes with the
//! arithmetic the per-element math of kernels/math.hpp uses, exact loads and stores of
//! bf16/fp16/fp32 storage, and run-time dispatch of a loop to the best build this CPU runs
//! (kernels/host/isa.hpp): the x86-64 baseline (4 lanes), AVX2 (8), AVX-512 (16), AVX-512 with
//! the AVX512-BF16 conversion instruction, whatever flags the user compiles with.
//!
//! **Every build computes the same bits**, and the same bits as the scalar reference
//! (host::fused_step_scalar, the one-lane build, core/dtype.hpp's conversions):
//!  - each lane does the scalar IEEE operation (+, -, ×, ÷, square root are correctly rounded
//!    at every width);
//!  - no build contracts a multiplication and an addition into a fused multiply-add: products
//!    pass through an empty `asm` (GCC) or `#pragma clang fp contract(off)` (clang), so the
//!    compiler cannot fuse them whatever -ffp-contract says, and the AVX2 build is compiled
//!    without FMA. The CUDA kernels are compiled with `-fmad=false` for the same reason (see
//!    the top-level CMakeLists.txt): the rule is "no contraction anywhere". (Not covered:
//!    -ffast-math, which allows reassociation, and clang with -ffp-contract=fast.)
//!  - conversion instructions that differ from core/dtype.hpp on some inputs are used only
//!    with a fix-up of those lanes: VCVTNEPS2BF16 flushes subnormal inputs and always sets the
//!    quiet bit of a NaN; F16C's VCVTPS2PH/VCVTPH2PS quiet signalling NaNs. Lanes that hold
//!    such values (rare) take the integer path of the scalar conversion instead.
//!  - a tail shorter than a vector goes through the same vector code (on a zero-padded copy),
//!    so an element's result never depends on where it falls in a run.
//!
//! The wider builds use GCC vector extensions, compiled to the registers of the target the
//! dispatching function is built for (`[[gnu::target]]`); no intrinsics headers, so nothing
//! requires flags. Instructions the compiler cannot name without a target (square roots of
//! 256/512-bit vectors, the conversion instructions) are `asm` with GCC; clang, which checks
//! asm operand sizes against the enclosing function's target, uses 128-bit square roots and
//! the integer conversions instead (same results, somewhat slower).
//!
//! CUDA translation units (`__CUDACC__`), and any that defines `SHARDKIT_HOST_SCALAR_SIMD`,
//! compile only the one-lane build (kernels/host/simd_scalar.hpp): nvcc's front end cannot
//! parse GCC vector types. config.hpp puts the two kinds of build in distinct ABI namespaces.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/kernels/host/isa.hpp>
#include <shardkit/kernels/host/simd_scalar.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__CUDA_ARCH__) && \
    !defined(SHARDKIT_HOST_SCALAR_SIMD)
//! GCC on x86-64: instructions named in asm (the wide square roots and conversions).
#define SHARDKIT_DETAIL_HOST_ASM 1
#endif

//! The vector operations are host code; they are marked __host__ __device__ as well so that
//! the per-element math (kernels/math.hpp, __host__ __device__) may call them in CUDA
//! translation units without warnings. (They never run on a device.)
#define SHARDKIT_DETAIL_SIMD_FN SHARDKIT_HOST_DEVICE SHARDKIT_FORCEINLINE

SHARDKIT_NAMESPACE_BEGIN
namespace simd {

// ---- builds ------------------------------------------------------------------------------
//! The one-lane build (SHARDKIT_HOST_SCALAR_SIMD translation units, the scalar reference).
struct isa_scalar {
  static constexpr int width = 1;
  static constexpr bool f16c = false;      // F16C conversion instructions
  static constexpr bool bf16_cvt = false;  // VCVTNEPS2BF16
};
#if !defined(SHARDKIT_HOST_SCALAR_SIMD)
//! The translation unit's own flags: x86-64 baseline (SSE2), or any other architecture.
struct isa_baseline {
  static constexpr int width = 4;
  static constexpr bool f16c = false;
  static constexpr bool bf16_cvt = false;
};
#if defined(SHARDKIT_DETAIL_HOST_X86)
struct isa_avx2 {
  static constexpr int width = 8;
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  static constexpr bool f16c = true;
#else
  static constexpr bool f16c = false;
#endif
  static constexpr bool bf16_cvt = false;
};
struct isa_avx512 {
  static constexpr int width = 16;
  static constexpr bool f16c = isa_avx2::f16c;
  static constexpr bool bf16_cvt = false;
};
struct isa_avx512bf16 {
  static constexpr int width = 16;
  static constexpr bool f16c = isa_avx2::f16c;
  static constexpr bool bf16_cvt = isa_avx2::f16c;  // asm, as F16C
};
#endif
#endif

//! Lanes of this translation unit's own (baseline) build: 1 in the one-lane build, else 4.
//! The dispatched builds are wider (up to max_width).
#if defined(SHARDKIT_HOST_SCALAR_SIMD)
inline constexpr std::size_t width = 1;
#else
inline constexpr std::size_t width = 4;
#endif
//! The widest vector any build uses.
inline constexpr std::size_t max_width = 16;

// ---- storage -----------------------------------------------------------------------------
namespace impl {
#if !defined(SHARDKIT_HOST_SCALAR_SIMD)
// The vector types are 16-byte aligned in memory whatever their size: a vector type larger
// than the translation unit's registers then has one calling convention whatever the flags (it
// never crosses a call: everything is force-inlined into the dispatched loop).
template <>
struct storage<4> {
  typedef float f __attribute__((vector_size(16)));
  typedef std::uint32_t u __attribute__((vector_size(16)));
  typedef std::uint16_t h __attribute__((vector_size(8)));
};
template <>
struct storage<8> {
  typedef float f __attribute__((vector_size(32), aligned(16)));
  typedef std::uint32_t u __attribute__((vector_size(32), aligned(16)));
  typedef std::uint16_t h __attribute__((vector_size(16)));
};
template <>
struct storage<16> {
  typedef float f __attribute__((vector_size(64), aligned(16)));
  typedef std::uint32_t u __attribute__((vector_size(64), aligned(16)));
  typedef std::uint16_t h __attribute__((vector_size(32), aligned(16)));
};
#endif

}  // namespace impl

//! Keeps the compiler from fusing the product in `r` with a later addition (see the file
//! comment): with GCC, an empty asm that claims to modify r; clang does not contract across
//! statements (and its operators say `fp contract(off)`).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__CUDA_ARCH__)
#define SHARDKIT_DETAIL_NO_CONTRACT(r) __asm__("" : "+v"(r))
#else
#define SHARDKIT_DETAIL_NO_CONTRACT(r) (void)(r)
#endif

template <int W>
struct vu;

//! The mask of a lane-wise comparison `cmp` of W lanes: a vu<W> with all-ones lanes where it
//! holds. (A macro: a function taking the comparison's vector would pass a wide vector by
//! value.)
#define SHARDKIT_DETAIL_SIMD_MASK(W, cmp)                                    \
  [&]() SHARDKIT_DETAIL_ALWAYS_INLINE_LAMBDA {                               \
    if constexpr ((W) == 1) {                                                \
      return ::shardkit::simd::vu<(W)>{(cmp) ? ~0u : 0u};                    \
    } else {                                                                 \
      return ::shardkit::simd::vu<(W)>{                                      \
          __builtin_bit_cast(typename ::shardkit::simd::vu<(W)>::U, (cmp))}; \
    }                                                                        \
  }()

//! W fp32 lanes.
template <int W>
struct vf {
  using F = typename impl::storage<W>::f;
  static constexpr int width = W;
  F v;

  static SHARDKIT_DETAIL_SIMD_FN vf splat(float x) {
    if constexpr (W == 1) {
      return {x};
    } else {
      return {F{} + x};
    }
  }

  friend SHARDKIT_DETAIL_SIMD_FN vf operator+(vf a, vf b) { return {a.v + b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator-(vf a, vf b) { return {a.v - b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator/(vf a, vf b) { return {a.v / b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator+(vf a, float b) { return {a.v + b}; }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator-(vf a, float b) { return {a.v - b}; }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator/(vf a, float b) { return {a.v / b}; }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator+(float a, vf b) { return {a + b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator-(float a, vf b) { return {a - b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator/(float a, vf b) { return {a / b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator*(vf a, vf b) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    F r = a.v * b.v;
    SHARDKIT_DETAIL_NO_CONTRACT(r);
    return {r};
  }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator*(vf a, float b) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    F r = a.v * b;
    SHARDKIT_DETAIL_NO_CONTRACT(r);
    return {r};
  }
  friend SHARDKIT_DETAIL_SIMD_FN vf operator*(float a, vf b) {
    return b * a;
  }
  //! Correctly rounded square root of each lane (found by argument-dependent lookup).
  friend SHARDKIT_DETAIL_SIMD_FN vf sqrt(vf a) {
    return sqrt_lanes(a);
  }

  //! Lane-wise comparisons: all-ones lanes where they hold.
  friend SHARDKIT_DETAIL_SIMD_FN vu<W> operator<(vf a, vf b) {
    return SHARDKIT_DETAIL_SIMD_MASK(W, a.v < b.v);
  }
  friend SHARDKIT_DETAIL_SIMD_FN vu<W> operator>(vf a, vf b) {
    return SHARDKIT_DETAIL_SIMD_MASK(W, a.v > b.v);
  }
  //! Lanes that hold a NaN.
  friend SHARDKIT_DETAIL_SIMD_FN vu<W> isnan(vf a) {
    return SHARDKIT_DETAIL_SIMD_MASK(W, a.v != a.v);
  }

 private:
  static SHARDKIT_DETAIL_SIMD_FN vf sqrt_lanes(vf x) {
    vf r;
    if constexpr (W == 1) {
      r.v = std::sqrt(x.v);
    } else {
#if defined(SHARDKIT_DETAIL_HOST_X86) && defined(SHARDKIT_DETAIL_HOST_ASM)
      if constexpr (W == 4) {
        r.v = __builtin_ia32_sqrtps(x.v);
      } else {
        __asm__("vsqrtps %1, %0" : "=v"(r.v) : "v"(x.v));
      }
#elif defined(SHARDKIT_DETAIL_HOST_X86)
      using F4 =
          typename impl::storage<4>::f;  // 128-bit square roots (clang: see the file comment)
      for (int q = 0; q < W / 4; ++q) {
        F4 y;
        std::memcpy(&y, reinterpret_cast<const char*>(&x.v) + 16 * q, 16);
        y = __builtin_ia32_sqrtps(y);
        std::memcpy(reinterpret_cast<char*>(&r.v) + 16 * q, &y, 16);
      }
#else
      for (int i = 0; i < W; ++i) r.v[i] = std::sqrt(x.v[i]);
#endif
    }
    return r;
  }
};

//! W uint32 lanes; comparisons give masks (all-ones lanes where they hold).
template <int W>
struct vu {
  using U = typename impl::storage<W>::u;
  static constexpr int width = W;
  U v;

  static SHARDKIT_DETAIL_SIMD_FN vu splat(std::uint32_t x) {
    if constexpr (W == 1) {
      return {x};
    } else {
      return {U{} + x};
    }
  }

  friend SHARDKIT_DETAIL_SIMD_FN vu operator+(vu a, vu b) { return {a.v + b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator-(vu a, vu b) { return {a.v - b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator*(vu a, vu b) { return {a.v * b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator&(vu a, vu b) { return {a.v & b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator|(vu a, vu b) { return {a.v | b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator^(vu a, vu b) { return {a.v ^ b.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator+(vu a, std::uint32_t b) { return {a.v + b}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator-(vu a, std::uint32_t b) { return {a.v - b}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator&(vu a, std::uint32_t b) { return {a.v & b}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator|(vu a, std::uint32_t b) { return {a.v | b}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator~(vu a) { return {~a.v}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator<<(vu a, int s) { return {a.v << s}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator>>(vu a, int s) { return {a.v >> s}; }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator==(vu a, vu b) {
    return SHARDKIT_DETAIL_SIMD_MASK(W, a.v == b.v);
  }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator!=(vu a, vu b) {
    return SHARDKIT_DETAIL_SIMD_MASK(W, a.v != b.v);
  }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator<(vu a, vu b) {
    return SHARDKIT_DETAIL_SIMD_MASK(W, a.v < b.v);
  }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator>(vu a, vu b) {
    return SHARDKIT_DETAIL_SIMD_MASK(W, a.v > b.v);
  }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator>=(vu a, vu b) {
    return SHARDKIT_DETAIL_SIMD_MASK(W, a.v >= b.v);
  }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator==(vu a, std::uint32_t b) { return a == splat(b); }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator!=(vu a, std::uint32_t b) { return a != splat(b); }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator<(vu a, std::uint32_t b) { return a < splat(b); }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator>(vu a, std::uint32_t b) { return a > splat(b); }
  friend SHARDKIT_DETAIL_SIMD_FN vu operator>=(vu a, std::uint32_t b) { return a >= splat(b); }
};

template <int W>
SHARDKIT_DETAIL_SIMD_FN vu<W> bits(vf<W> x) {
  return {__builtin_bit_cast(typename vu<W>::U, x.v)};
}
template <int W>
SHARDKIT_DETAIL_SIMD_FN vf<W> from_bits(vu<W> x) {
  return {__builtin_bit_cast(typename vf<W>::F, x.v)};
}
//! m ? a : b, lane by lane (m a mask).
template <int W>
SHARDKIT_DETAIL_SIMD_FN vu<W> select(vu<W> m, vu<W> a, vu<W> b) {
  return {(a.v & m.v) | (b.v & ~m.v)};
}
template <int W>
SHARDKIT_DETAIL_SIMD_FN vf<W> select(vu<W> m, vf<W> a, vf<W> b) {
  return from_bits(select(m, bits(a), bits(b)));
}
//! True when any lane of the mask is set.
template <int W>
SHARDKIT_DETAIL_SIMD_FN bool any(vu<W> m) {
  if constexpr (W == 1) {
    return m.v != 0;
#if !defined(SHARDKIT_HOST_SCALAR_SIMD)  // (nvcc's front end need not parse these)
  } else if constexpr (W == 16) {        // fold the halves in registers rather than through memory
    using H = typename vu<W / 2>::U;     // dependent: the one-lane build has no 8-lane type
    const H lo = __builtin_shufflevector(m.v, m.v, 0, 1, 2, 3, 4, 5, 6, 7);
    const H hi = __builtin_shufflevector(m.v, m.v, 8, 9, 10, 11, 12, 13, 14, 15);
    return any(vu<W / 2>{lo | hi});
  } else if constexpr (W == 8) {
    using H = typename vu<W / 2>::U;
    const H lo = __builtin_shufflevector(m.v, m.v, 0, 1, 2, 3);
    const H hi = __builtin_shufflevector(m.v, m.v, 4, 5, 6, 7);
    return any(vu<W / 2>{lo | hi});
#endif
  } else {
    std::uint64_t q[W / 2];
    std::memcpy(q, &m.v, sizeof q);
    std::uint64_t o = 0;
    for (int i = 0; i < W / 2; ++i) o |= q[i];
    return o != 0;
  }
}
//! Number of set lanes of a mask.
template <int W>
SHARDKIT_DETAIL_SIMD_FN std::uint32_t count(vu<W> m) {
  if constexpr (W == 1) {
    return m.v & 1u;
  } else {
    std::uint32_t c = 0;
    for (int i = 0; i < W; ++i) c += m.v[i] & 1u;
    return c;
  }
}

// ---- 16-bit storage ------------------------------------------------------------------------
//! W 16-bit patterns (bf16 or fp16 storage), in a struct: passed by value like the others.
template <int W>
struct vh {
  typename impl::storage<W>::h v;
};

namespace impl {
template <int W>
SHARDKIT_DETAIL_SIMD_FN vh<W> load_h(const void* p) {
  vh<W> h;
  std::memcpy(&h.v, p, sizeof h.v);
  return h;
}
template <int W>
SHARDKIT_DETAIL_SIMD_FN void store_h(void* p, vh<W> h) {
  std::memcpy(p, &h.v, sizeof h.v);
}
template <int W>
SHARDKIT_DETAIL_SIMD_FN vu<W> widen(vh<W> h) {
  if constexpr (W == 1) {
    return {static_cast<std::uint32_t>(h.v)};
  } else {
    return {__builtin_convertvector(h.v, typename vu<W>::U)};
  }
}
//! The low 16 bits of each lane (every lane must be < 65536).
template <int W>
SHARDKIT_DETAIL_SIMD_FN vh<W> narrow(vu<W> u) {
  if constexpr (W == 1) {
    return {static_cast<std::uint16_t>(u.v)};
  } else {
    return {__builtin_convertvector(u.v, typename storage<W>::h)};
  }
}

//! float -> bf16 bits (low 16 bits of each lane), as float_to_bf16_bits, with integer ops.
template <int W>
SHARDKIT_DETAIL_SIMD_FN vu<W> bf16_round_int(vu<W> u) {
  const vu<W> rounded = (u + ((u >> 16) & 1u) + 0x7fffu) >> 16;
  const vu<W> hi = u >> 16;
  const vu<W> quiet = hi | (((hi & 0x7fu) == 0u) & 0x40u);
  return select((u & 0x7fffffffu) > 0x7f800000u, quiet, rounded);
}

//! float -> fp16 bits, as float_to_fp16_bits (integer ops; the FPU for subnormal results).
template <int W>
SHARDKIT_DETAIL_SIMD_FN vu<W> fp16_round_int(vf<W> f) {
  const vu<W> b = bits(f);
  const vu<W> sign = (b >> 16) & 0x8000u;
  const vu<W> u = b & 0x7fffffffu;
  const vu<W> mant_odd = (u >> 13) & 1u;
  vu<W> o = (u + mant_odd + ((static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu)) >> 13;
  const vu<W> small = u < 0x38800000u;
  if (any(small)) {
    const vu<W> s = bits(from_bits(u) + 0.5f) - 0x3f000000u;
    o = select(small, s, o);
  }
  const vu<W> big = u >= 0x47800000u;
  if (any(big)) {
    const vu<W> payload = (u >> 13) & 0x3ffu;
    const vu<W> nan = u > 0x7f800000u;
    const vu<W> nan_bits =
        vu<W>::splat(0x7c00u) | select(payload == 0u, vu<W>::splat(0x200u), payload);
    const vu<W> special = select(nan, nan_bits, vu<W>::splat(0x7c00u));
    o = select(big, special, o);
  }
  return o | sign;
}

//! fp16 bits (low 16 bits of each lane) -> float, as fp16_bits_to_float.
template <int W>
SHARDKIT_DETAIL_SIMD_FN vf<W> fp16_widen_int(vu<W> h) {
  constexpr std::uint32_t shifted_exp = 0x7c00u << 13;
  vu<W> o = (h & 0x7fffu) << 13;
  const vu<W> exp = o & shifted_exp;
  o = o + (static_cast<std::uint32_t>(127 - 15) << 23);
  o = o + ((exp == shifted_exp) & (static_cast<std::uint32_t>(128 - 16) << 23));
  const vu<W> denormal = exp == 0u;
  if (any(denormal)) {
    const vf<W> renorm = from_bits(o + (1u << 23)) - from_bits(vu<W>::splat(113u << 23));
    o = select(denormal, bits(renorm), o);
  }
  return from_bits(o | ((h & 0x8000u) << 16));
}

#if defined(SHARDKIT_DETAIL_HOST_ASM)
//! VCVTNEPS2BF16 (AVX512-BF16), 16 lanes.
template <int W>
SHARDKIT_DETAIL_SIMD_FN vh<W> bf16_cvt_hw(vf<W> f) {
  static_assert(W == 16);
  vh<W> h;
  __asm__("vcvtneps2bf16 %1, %0" : "=v"(h.v) : "v"(f.v));
  return h;
}
//! VCVTPS2PH (F16C / AVX-512F), round to nearest even.
template <int W>
SHARDKIT_DETAIL_SIMD_FN vh<W> fp16_cvt_hw(vf<W> f) {
  vh<W> h;
  __asm__("vcvtps2ph $0, %1, %0" : "=v"(h.v) : "v"(f.v));
  return h;
}
//! VCVTPH2PS (F16C / AVX-512F).
template <int W>
SHARDKIT_DETAIL_SIMD_FN vf<W> fp16_widen_hw(vh<W> h) {
  vf<W> f;
  __asm__("vcvtph2ps %1, %0" : "=v"(f.v) : "v"(h.v));
  return f;
}
#endif
}  // namespace impl

//! Rounds each lane to bf16 (round to nearest even; NaN stays NaN, as float_to_bf16_bits);
//! the 16-bit patterns.
template <class Isa>
SHARDKIT_DETAIL_SIMD_FN vh<Isa::width> to_bf16(vf<Isa::width> f) {
  [[maybe_unused]] constexpr int W = Isa::width;
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  if constexpr (Isa::bf16_cvt && W == 16) {
    vh<W> h = impl::bf16_cvt_hw<W>(f);
    const vu<W> a = bits(f) & 0x7fffffffu;
    // subnormal (flushed by the instruction) or NaN (always quieted by it)
    const vu<W> special = ((a - 1u) < 0x007fffffu) | (a > 0x7f800000u);
    if (any(special)) {
      const vu<W> r = impl::bf16_round_int(bits(f));
      h = impl::narrow(select(special, r, impl::widen<W>(h)));
    }
    return h;
  }
#endif
  return impl::narrow(impl::bf16_round_int(bits(f)));
}

//! Rounds each lane to fp16 (as float_to_fp16_bits); the 16-bit patterns.
template <class Isa>
SHARDKIT_DETAIL_SIMD_FN vh<Isa::width> to_fp16(vf<Isa::width> f) {
  [[maybe_unused]] constexpr int W = Isa::width;
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  if constexpr (Isa::f16c && W >= 8) {
    vh<W> h = impl::fp16_cvt_hw(f);
    const vu<W> nan = (bits(f) & 0x7fffffffu) > 0x7f800000u;  // F16C quiets signalling NaNs
    if (any(nan)) h = impl::narrow(select(nan, impl::fp16_round_int(f), impl::widen<W>(h)));
    return h;
  }
#endif
  return impl::narrow(impl::fp16_round_int(f));
}

//! Widens fp16 patterns to floats (exact, as fp16_bits_to_float).
template <class Isa>
SHARDKIT_DETAIL_SIMD_FN vf<Isa::width> from_fp16(vh<Isa::width> h) {
  [[maybe_unused]] constexpr int W = Isa::width;
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  if constexpr (Isa::f16c && W >= 8) {
    vf<W> f = impl::fp16_widen_hw<W>(h);
    const vu<W> u = impl::widen<W>(h);
    const vu<W> nan = (u & 0x7fffu) > 0x7c00u;  // F16C quiets signalling NaNs
    if (any(nan)) f = select(nan, impl::fp16_widen_int(u), f);
    return f;
  }
#endif
  return impl::fp16_widen_int(impl::widen<W>(h));
}

//! Loads Isa::width elements of fp32/bf16/fp16 storage as floats.
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN vf<Isa::width> load(const T* p) {
  constexpr int W = Isa::width;
  if constexpr (std::is_same_v<T, float>) {
    vf<W> x;
    std::memcpy(&x.v, p, sizeof x.v);
    return x;
  } else if constexpr (std::is_same_v<T, bf16>) {
    return from_bits(impl::widen<W>(impl::load_h<W>(p)) << 16);
  } else {
    static_assert(std::is_same_v<T, fp16>, "simd::load: element type must be float, bf16 or fp16");
    return from_fp16<Isa>(impl::load_h<W>(p));
  }
}

//! Stores Isa::width floats to fp32/bf16/fp16 storage (round to nearest even).
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN void store(T* p, vf<Isa::width> x) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &x.v, sizeof x.v);
  } else if constexpr (std::is_same_v<T, bf16>) {
    impl::store_h<Isa::width>(p, to_bf16<Isa>(x));
  } else {
    static_assert(std::is_same_v<T, fp16>, "simd::store: element type must be float, bf16 or fp16");
    impl::store_h<Isa::width>(p, to_fp16<Isa>(x));
  }
}

//! The value each lane has once stored as T (T(x) as a float), and the store itself.
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN vf<Isa::width> store_rounded(T* p, vf<Isa::width> x) {
  constexpr int W = Isa::width;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &x.v, sizeof x.v);
    return x;
  } else if constexpr (std::is_same_v<T, bf16>) {
    const vh<W> h = to_bf16<Isa>(x);
    impl::store_h<W>(p, h);
    return from_bits(impl::widen<W>(h) << 16);
  } else {
    const vh<W> h = to_fp16<Isa>(x);
    impl::store_h<W>(p, h);
    return from_fp16<Isa>(h);
  }
}

//! Loads the first n < Isa::width elements; the other lanes read as zero.
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN vf<Isa::width> load_partial(const T* p, std::size_t n) {
  T tmp[Isa::width] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return load<Isa>(tmp);
}

//! Stores the first n < Isa::width lanes.
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN void store_partial(T* p, vf<Isa::width> x, std::size_t n) {
  T tmp[Isa::width];
  store<Isa>(tmp, x);
  std::memcpy(p, tmp, n * sizeof(T));
}

template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN vf<Isa::width> store_rounded_partial(T* p, vf<Isa::width> x,
                                                             std::size_t n) {
  T tmp[Isa::width];
  const vf<Isa::width> r = store_rounded<Isa>(tmp, x);
  std::memcpy(p, tmp, n * sizeof(T));
  return r;
}

}  // namespace simd

// ---- dispatch ------------------------------------------------------------------------------
namespace detail {
#if defined(SHARDKIT_DETAIL_HOST_X86)
// One trampoline per build: `Kernel::run<Isa>` (force-inlined) is compiled for the build's
// target. The AVX2 target omits FMA (nothing may be contracted; see simd.hpp).
template <class Kernel, class... Args>
[[gnu::target("avx2,f16c,popcnt")]] void run_avx2(Args... args) {
  Kernel::template run<simd::isa_avx2>(args...);
}
template <class Kernel, class... Args>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,f16c,popcnt")]] void run_avx512(Args... args) {
  Kernel::template run<simd::isa_avx512>(args...);
}
template <class Kernel, class... Args>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,popcnt")]] void run_avx512bf16(
    Args... args) {
  Kernel::template run<simd::isa_avx512bf16>(args...);
}
#endif
}  // namespace detail

//! Runs `Kernel::run<Isa>(args...)`, a force-inlined loop over simd::vf<Isa::width>, in the
//! build host::active_isa() names (the best this CPU runs unless SHARDKIT_HOST_ISA or
//! host::scoped_isa says otherwise). Every build computes the same bits.
template <class Kernel, class... Args>
void dispatch(Args... args) {
#if defined(SHARDKIT_HOST_SCALAR_SIMD)
  Kernel::template run<simd::isa_scalar>(args...);
#elif defined(SHARDKIT_DETAIL_HOST_X86)
  switch (host::active_isa()) {
    case host::isa::avx512bf16:
      return detail::run_avx512bf16<Kernel>(args...);
    case host::isa::avx512:
      return detail::run_avx512<Kernel>(args...);
    case host::isa::avx2:
      return detail::run_avx2<Kernel>(args...);
    default:
      return Kernel::template run<simd::isa_baseline>(args...);
  }
#else
  Kernel::template run<simd::isa_baseline>(args...);
#endif
}

SHARDKIT_NAMESPACE_END
