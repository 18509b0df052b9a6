//! \file kernels/host/simd.hpp
//! Portable host vectorisation: fp32 SIMD vectors (std::experimental::simd, the future
//! std::simd) with exact loads and stores of bf16/fp16/fp32 storage, and run-time dispatch to
//! an AVX2+FMA build of a loop on x86-64 CPUs that have it, whatever flags the user compiles
//! with. The 16-bit conversions are branch-free and bit-identical to the scalar ones in
//! core/dtype.hpp.
//!
//! CUDA translation units (`__CUDACC__`) compile these loops against a one-lane stand-in
//! (kernels/host/simd_scalar.hpp), because nvcc cannot parse <experimental/simd>; so does any
//! translation unit that defines `SHARDKIT_HOST_SCALAR_SIMD`. The one-lane build computes what
//! the baseline build computes, bit for bit, and never dispatches to AVX2. (config.hpp makes that
//! choice and puts the two builds in distinct ABI namespaces, simd_native and simd_scalar.)
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(SHARDKIT_HOST_SCALAR_SIMD)
#include <shardkit/kernels/host/simd_scalar.hpp>
#else
#include <experimental/simd>
#endif

SHARDKIT_NAMESPACE_BEGIN
namespace simd {

#if defined(SHARDKIT_HOST_SCALAR_SIMD)
namespace stdx = scalar_shim;
//! One fp32 lane (see kernels/host/simd_scalar.hpp).
using vfloat = stdx::simd<float>;
//! One uint32 lane.
using vu32 = stdx::simd<std::uint32_t>;
#else
namespace stdx = std::experimental;
//! fp32 vector of the widest width the translation unit's flags allow.
using vfloat = stdx::native_simd<float>;
//! uint32 vector with the same number of lanes.
using vu32 = stdx::rebind_simd_t<std::uint32_t, vfloat>;
#endif
inline constexpr std::size_t width = vfloat::size();

SHARDKIT_FORCEINLINE vfloat as_float(const vu32& u) {
#if defined(SHARDKIT_HOST_SCALAR_SIMD)
  return stdx::simd_bit_cast<vfloat>(u);
#else
  return stdx::__proposed::simd_bit_cast<vfloat>(u);
#endif
}
SHARDKIT_FORCEINLINE vu32 as_bits(const vfloat& f) {
#if defined(SHARDKIT_HOST_SCALAR_SIMD)
  return stdx::simd_bit_cast<vu32>(f);
#else
  return stdx::__proposed::simd_bit_cast<vu32>(f);
#endif
}

//! Widens 16-bit bfloat16 bit patterns to float (exact).
SHARDKIT_FORCEINLINE vfloat bf16_to_float(const vu32& h) {
  return as_float(h << 16);
}

//! Rounds floats to bfloat16 bit patterns (in the low 16 bits), as float_to_bf16_bits.
SHARDKIT_FORCEINLINE vu32 float_to_bf16(const vfloat& f) {
  const vu32 u = as_bits(f);
  vu32 r = (u + (0x7fffu + ((u >> 16) & 1u))) >> 16;
  const auto nan = (u & 0x7fffffffu) > 0x7f800000u;
  if (stdx::any_of(nan)) {
    const vu32 hi = u >> 16;
    vu32 q = hi;
    stdx::where((hi & 0x7fu) == 0u, q) = hi | 0x40u;
    stdx::where(nan, r) = q;
  }
  return r;
}

//! Widens IEEE binary16 bit patterns to float (exact), as fp16_bits_to_float.
SHARDKIT_FORCEINLINE vfloat fp16_to_float(const vu32& h) {
  constexpr std::uint32_t shifted_exp = 0x7c00u << 13;
  vu32 o = (h & 0x7fffu) << 13;
  const vu32 exp = o & shifted_exp;
  o += static_cast<std::uint32_t>(127 - 15) << 23;
  stdx::where(exp == shifted_exp, o) += static_cast<std::uint32_t>(128 - 16) << 23;
  const auto denormal = exp == 0u;
  if (stdx::any_of(denormal)) {
    const vfloat renorm = as_float(o + (1u << 23)) - as_float(vu32(113u << 23));
    stdx::where(denormal, o) = as_bits(renorm);
  }
  return as_float(o | ((h & 0x8000u) << 16));
}

//! Rounds floats to IEEE binary16 bit patterns (in the low 16 bits), as float_to_fp16_bits.
SHARDKIT_FORCEINLINE vu32 float_to_fp16(const vfloat& f) {
  const vu32 bits = as_bits(f);
  const vu32 sign = (bits >> 16) & 0x8000u;
  const vu32 u = bits & 0x7fffffffu;
  // normal range
  const vu32 mant_odd = (u >> 13) & 1u;
  vu32 o = (u + ((static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu) + mant_odd) >> 13;
  // subnormal or zero
  const auto small = u < 0x38800000u;
  if (stdx::any_of(small)) {
    const vu32 s = as_bits(as_float(u) + 0.5f) - 0x3f000000u;
    stdx::where(small, o) = s;
  }
  // overflow, infinity, NaN
  const auto big = u >= 0x47800000u;
  if (stdx::any_of(big)) {
    const vu32 payload = (u >> 13) & 0x3ffu;
    vu32 special(0x7c00u);
    const auto nan = u > 0x7f800000u;
    stdx::where(nan, special) = 0x7c00u | payload;
    stdx::where(nan && payload == 0u, special) = 0x7e00u;
    stdx::where(big, o) = special;
  }
  return o | sign;
}

//! Loads `width` elements of fp32/bf16/fp16 storage as floats.
template <class T>
SHARDKIT_FORCEINLINE vfloat load(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return vfloat(p, stdx::element_aligned);
  } else {
    static_assert(is_16bit_float<T>, "simd::load: element type must be float, bf16 or fp16");
    const vu32 h(reinterpret_cast<const std::uint16_t*>(p), stdx::element_aligned);
    if constexpr (std::is_same_v<T, bf16>)
      return bf16_to_float(h);
    else
      return fp16_to_float(h);
  }
}

//! Stores `width` floats to fp32/bf16/fp16 storage (round to nearest even).
template <class T>
SHARDKIT_FORCEINLINE void store(T* p, const vfloat& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.copy_to(p, stdx::element_aligned);
  } else {
    static_assert(is_16bit_float<T>, "simd::store: element type must be float, bf16 or fp16");
    const vu32 h = std::is_same_v<T, bf16> ? float_to_bf16(v) : float_to_fp16(v);
    h.copy_to(reinterpret_cast<std::uint16_t*>(p), stdx::element_aligned);
  }
}

//! Loads the first n < width elements; the other lanes read as zero.
template <class T>
SHARDKIT_FORCEINLINE vfloat load_partial(const T* p, std::size_t n) {
  T tmp[width] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return load(tmp);
}

//! Stores the first n < width lanes.
template <class T>
SHARDKIT_FORCEINLINE void store_partial(T* p, const vfloat& v, std::size_t n) {
  T tmp[width];
  store(tmp, v);
  std::memcpy(p, tmp, n * sizeof(T));
}

}  // namespace simd

namespace detail {
//! True when the CPU runs AVX2 and FMA code (checked once). Setting the environment variable
//! SHARDKIT_HOST_ISA=baseline forces the baseline build (to test or compare it).
inline bool cpu_has_avx2_fma() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool has = [] {
    if (const char* e = std::getenv("SHARDKIT_HOST_ISA");
        e != nullptr && std::strcmp(e, "baseline") == 0) {
      return false;
    }
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
#else
  return false;
#endif
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__AVX2__) && \
    !defined(SHARDKIT_HOST_SCALAR_SIMD)
#define SHARDKIT_DETAIL_HOST_DISPATCH 1
//! `Kernel::run` compiled for AVX2+FMA (Kernel::run must be force-inlined).
template <class Kernel, class... Args>
[[gnu::target("avx2,fma")]] void run_avx2(Args... args) {
  Kernel::run(args...);
}
#endif
}  // namespace detail

#if defined(SHARDKIT_DETAIL_HOST_DISPATCH)
#define SHARDKIT_DETAIL_HOST_WIDE 1
//! 256-bit fp32 vectors for the AVX2 build of the fused optimizer step. native_simd takes its
//! width from the translation unit's flags (4 lanes below AVX), so inside run_avx2 it stays at
//! 128 bits; these are plain GCC/Clang vector types, which compile to the 256-bit registers of
//! the function they are inlined into. No intrinsics: the code has no target of its own.
namespace simd::wide {
inline constexpr std::size_t width = 8;
using f32x8 = float __attribute__((vector_size(32)));
//! The same vector, 16-byte aligned in memory: vfloat is passed by value like an SSE type, so it
//! has one calling convention whatever the flags (it never crosses a call: all is inlined).
typedef float f32x8_a16 __attribute__((vector_size(32), aligned(16)));
using u32x8 = std::uint32_t __attribute__((vector_size(32)));
using u16x8 = std::uint16_t __attribute__((vector_size(16)));
using f32x4 = float __attribute__((vector_size(16)));

//! An 8-lane fp32 value with the arithmetic the optimizer policies of kernels/math.hpp use.
struct vfloat {
  f32x8_a16 v;
  friend SHARDKIT_FORCEINLINE vfloat operator+(vfloat a, vfloat b) { return {a.v + b.v}; }
  friend SHARDKIT_FORCEINLINE vfloat operator-(vfloat a, vfloat b) { return {a.v - b.v}; }
  friend SHARDKIT_FORCEINLINE vfloat operator*(vfloat a, vfloat b) { return {a.v * b.v}; }
  friend SHARDKIT_FORCEINLINE vfloat operator/(vfloat a, vfloat b) { return {a.v / b.v}; }
  friend SHARDKIT_FORCEINLINE vfloat operator+(vfloat a, float b) { return {a.v + b}; }
  friend SHARDKIT_FORCEINLINE vfloat operator-(vfloat a, float b) { return {a.v - b}; }
  friend SHARDKIT_FORCEINLINE vfloat operator*(vfloat a, float b) { return {a.v * b}; }
  friend SHARDKIT_FORCEINLINE vfloat operator/(vfloat a, float b) { return {a.v / b}; }
  friend SHARDKIT_FORCEINLINE vfloat operator+(float a, vfloat b) { return {a + b.v}; }
  friend SHARDKIT_FORCEINLINE vfloat operator-(float a, vfloat b) { return {a - b.v}; }
  friend SHARDKIT_FORCEINLINE vfloat operator*(float a, vfloat b) { return {a * b.v}; }
  friend SHARDKIT_FORCEINLINE vfloat operator/(float a, vfloat b) { return {a / b.v}; }
  //! IEEE square root of each lane (two 128-bit halves: SSE is all a target-less function may
  //! name; the halves cost what one 256-bit square root does on current cores).
  friend SHARDKIT_FORCEINLINE vfloat sqrt(vfloat a) {
    const f32x4 lo = __builtin_shufflevector(a.v, a.v, 0, 1, 2, 3);
    const f32x4 hi = __builtin_shufflevector(a.v, a.v, 4, 5, 6, 7);
    const f32x4 rl = __builtin_ia32_sqrtps(lo);
    const f32x4 rh = __builtin_ia32_sqrtps(hi);
    return {__builtin_shufflevector(rl, rh, 0, 1, 2, 3, 4, 5, 6, 7)};
  }
};

template <class T>
SHARDKIT_FORCEINLINE vfloat load(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    f32x8 v;
    std::memcpy(&v, p, sizeof v);
    return {v};
  } else {
    static_assert(std::is_same_v<T, bf16>, "simd::wide::load: float or bf16");
    u16x8 h;
    std::memcpy(&h, p, sizeof h);
    const u32x8 u = __builtin_convertvector(h, u32x8) << 16;
    return {__builtin_bit_cast(f32x8, u)};
  }
}

//! Stores 8 floats to fp32 or bf16 (round to nearest even; NaN stays a quiet NaN), bit for bit
//! as simd::store and float_to_bf16_bits.
template <class T>
SHARDKIT_FORCEINLINE void store(T* p, vfloat x) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &x.v, sizeof x.v);
  } else {
    static_assert(std::is_same_v<T, bf16>, "simd::wide::store: float or bf16");
    const u32x8 u = __builtin_bit_cast(u32x8, x.v);
    const u32x8 rounded = (u + (0x7fffu + ((u >> 16) & 1u))) >> 16;
    const u32x8 hi = u >> 16;
    const u32x8 quiet = hi | (__builtin_bit_cast(u32x8, (hi & 0x7fu) == 0u) & 0x40u);
    const u32x8 nan = __builtin_bit_cast(u32x8, (u & 0x7fffffffu) > 0x7f800000u);
    const u32x8 r = (rounded & ~nan) | (quiet & nan);
    const u16x8 h = __builtin_convertvector(r, u16x8);
    std::memcpy(p, &h, sizeof h);
  }
}

//! The first n < 8 elements; the other lanes read as zero.
template <class T>
SHARDKIT_FORCEINLINE vfloat load_partial(const T* p, std::size_t n) {
  T tmp[width] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return load(tmp);
}

template <class T>
SHARDKIT_FORCEINLINE void store_partial(T* p, vfloat x, std::size_t n) {
  T tmp[width];
  store(tmp, x);
  std::memcpy(p, tmp, n * sizeof(T));
}
}  // namespace simd::wide
#endif

//! Name of the build dispatch() runs on this CPU: "avx2" or "baseline". (Translation units
//! built with the one-lane stand-in, SHARDKIT_HOST_SCALAR_SIMD, run that whatever this says.)
inline const char* host_isa() noexcept {
  return detail::cpu_has_avx2_fma() ? "avx2" : "baseline";
}

//! Runs `Kernel::run(args...)`, a force-inlined loop over simd::vfloat, in the best build for
//! this CPU: AVX2+FMA on x86-64 CPUs that have them (whatever flags the user compiles with),
//! the translation unit's baseline otherwise. Both builds compute identical results except for
//! fused multiply-adds, which the AVX2 build may contract.
template <class Kernel, class... Args>
void dispatch(Args... args) {
#if defined(SHARDKIT_DETAIL_HOST_DISPATCH)
  if (detail::cpu_has_avx2_fma()) {
    detail::run_avx2<Kernel>(args...);
    return;
  }
#endif
  Kernel::run(args...);
}

SHARDKIT_NAMESPACE_END
