//! \file kernels/host/simd.hpp
//! Portable host vectorisation: fp32 and uint32 vectors of 1, 4, 8 or 16 lanes with the
//! arithmetic the per-element math of kernels/math.hpp uses, for each build of the host loops
//! (kernels/host/isa.hpp): the x86-64 baseline (4 lanes), AVX2 (8), AVX-512 (16), AVX-512 with
//! the AVX512-BF16 conversion instruction, whatever flags the user compiles with. The exact
//! loads and stores of bf16/fp16/fp32 storage are in kernels/host/simd_storage.hpp, the
//! run-time choice of a build in kernels/host/dispatch.hpp.
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
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  } else if constexpr (W == 8) {  // VPTEST: one instruction and the flag (GCC folds the
    bool r;                       // halves, moves both quadwords out and ors them: six)
    __asm__("vptest %1, %1" : "=@ccnz"(r) : "x"(m.v));
    return r;
#endif
  } else if constexpr (W == 16) {     // fold the halves in registers rather than through memory
    using H = typename vu<W / 2>::U;  // dependent: the one-lane build has no 8-lane type
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

}  // namespace simd
SHARDKIT_NAMESPACE_END
