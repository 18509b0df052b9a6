//! \file kernels/host/simd_storage.hpp
//! Exact loads and stores of bf16/fp16/fp32 storage for the host vectors of
//! kernels/host/simd.hpp: the 16-bit patterns, their rounding and widening (in integer
//! arithmetic, or with the conversion instructions and a fix-up of the lanes where those differ
//! from core/dtype.hpp), and whole and partial vector loads and stores.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/kernels/host/simd.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN
namespace simd {

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
#if defined(SHARDKIT_DETAIL_HOST_ASM)
    if constexpr (W == 8) {
      // One VPMOVZXWD: GCC widens 8 lanes for a target without AVX-512 in four instructions
      // (two 128-bit extensions, a shift and an insert).
      vu<W> u;
      __asm__("vpmovzxwd %1, %0" : "=x"(u.v) : "x"(h.v));
      return u;
    }
#endif
    return {__builtin_convertvector(h.v, typename vu<W>::U)};
  }
}
//! The low 16 bits of each lane (every lane must be < 65536).
template <int W>
SHARDKIT_DETAIL_SIMD_FN vh<W> narrow(vu<W> u) {
  if constexpr (W == 1) {
    return {static_cast<std::uint16_t>(u.v)};
  } else {
#if defined(SHARDKIT_DETAIL_HOST_ASM)
    if constexpr (W == 8) {
      // The upper half extracted and the two packed (VPACKUSDW saturates, which changes no
      // lane below 65536): two instructions where the conversion takes a mask, a pack and a
      // cross-lane permute.
      vh<W> h;
      __asm__("vextracti128 $1, %1, %0\n\tvpackusdw %0, %x1, %0" : "=&x"(h.v) : "x"(u.v));
      return h;
    }
#endif
    return {__builtin_convertvector(u.v, typename storage<W>::h)};
  }
}

//! Lanes whose bits are a NaN (exponent all ones, mantissa not zero), in integer arithmetic:
//! no floating-point flag is raised, whatever the input.
template <int W>
SHARDKIT_DETAIL_SIMD_FN vu<W> nan_bits(vu<W> u) {
#if !defined(SHARDKIT_HOST_SCALAR_SIMD)  // (nvcc's front end need not parse these)
  if constexpr (W > 1) {
    // both sides are non-negative as signed integers, so the signed compare (one instruction;
    // the unsigned one has none before AVX-512) gives the same answer
    typedef std::int32_t I __attribute__((vector_size(sizeof(typename vu<W>::U))));
    const I a = __builtin_bit_cast(I, (u & 0x7fffffffu).v);
    return SHARDKIT_DETAIL_SIMD_MASK(W, a > 0x7f800000);
  } else
#endif
  {
    return {(u.v & 0x7fffffffu) > 0x7f800000u ? ~0u : 0u};
  }
}

//! float bits -> bf16 bits (low 16 bits of each lane), round to nearest even, for lanes that
//! are not NaN (a NaN lane may carry into its neighbour's bits: bf16_round_int handles them).
template <int W>
SHARDKIT_DETAIL_SIMD_FN vu<W> bf16_round_finite(vu<W> u) {
  const vu<W> odd = (u & 0x10000u) == 0x10000u;  // all ones where the kept bit is odd
  return (u + 0x7fffu - odd) >> 16;              // + 0x7fff, + 1 more where odd
}

//! float -> bf16 bits (low 16 bits of each lane), as float_to_bf16_bits, with integer ops.
template <int W>
SHARDKIT_DETAIL_SIMD_FN vu<W> bf16_round_int(vu<W> u) {
  const vu<W> hi = u >> 16;
  const vu<W> quiet = hi | (((hi & 0x7fu) == 0u) & 0x40u);
  return select(nan_bits(u), quiet, bf16_round_finite(u));
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
//! Whether any lane of a 16-lane vector is of one of the classes `Classes` names
//! (VFPCLASSPS, AVX-512DQ: 0x01 quiet NaN, 0x20 subnormal, 0x80 signalling NaN, ...), tested
//! in a mask register: one instruction and a flag test per vector, where the same test in
//! vector compares costs two compares, two mask moves, an or and a fold. VFPCLASSPS reads the
//! raw bits (MXCSR's DAZ does not apply) and raises no exception.
template <int Classes, int W>
SHARDKIT_DETAIL_SIMD_FN bool any_class(vf<W> f) {
  static_assert(W == 16);
  bool r;
  __asm__("vfpclassps %2, %1, %%k1\n\tkortestw %%k1, %%k1"
          : "=@ccnz"(r)
          : "v"(f.v), "i"(Classes)
          : "k1");
  return r;
}
inline constexpr int class_nan = 0x81;        //!< quiet or signalling NaN
inline constexpr int class_subnormal = 0x20;  //!< subnormal (denormal)
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
    // subnormal (flushed by the instruction) or NaN (always quieted by it)
    if (impl::any_class<impl::class_nan | impl::class_subnormal>(f)) {
      const vu<W> a = bits(f) & 0x7fffffffu;
      const vu<W> special = ((a - 1u) < 0x007fffffu) | (a > 0x7f800000u);
      const vu<W> r = impl::bf16_round_int(bits(f));
      h = impl::narrow(select(special, r, impl::widen<W>(h)));
    }
    return h;
  }
#endif
  if constexpr (W == 4 || W == 8) {
    // NaN lanes are rare: the rounding of the others, and the whole integer path only for a
    // vector that holds one (the same bits either way)
    const vu<W> u = bits(f);
    if (!any(impl::nan_bits(u))) return impl::narrow(impl::bf16_round_finite(u));
  }
  return impl::narrow(impl::bf16_round_int(bits(f)));
}

//! Rounds each lane to fp16 (as float_to_fp16_bits); the 16-bit patterns.
template <class Isa>
SHARDKIT_DETAIL_SIMD_FN vh<Isa::width> to_fp16(vf<Isa::width> f) {
  [[maybe_unused]] constexpr int W = Isa::width;
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  if constexpr (Isa::f16c && W >= 8) {
    vh<W> h = impl::fp16_cvt_hw(f);
    // F16C quiets signalling NaNs
    if constexpr (W == 16) {
      if (!impl::any_class<impl::class_nan>(f)) return h;
    }
    const vu<W> nan = impl::nan_bits(bits(f));
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
    // a lane of f is NaN exactly where h held one
    if constexpr (W == 16) {
      if (!impl::any_class<impl::class_nan>(f)) return f;
    }
    // F16C quiets signalling NaNs; the NaN lanes of f are found without widening h (the
    // compare is quiet: every NaN of f is quiet)
    if (any(isnan(f))) {
      const vu<W> u = impl::widen<W>(h);
      f = select((u & 0x7fffu) > 0x7c00u, impl::fp16_widen_int(u), f);
    }
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

//! A vector in its stored form in T: the floats themselves (fp32) or their 16-bit patterns
//! (to_bf16, to_fp16). A value stored to several places is converted once (stored()) and
//! written with store_stored or store_stored_stream, the bits store() writes.
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN auto stored(vf<Isa::width> x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, bf16>) {
    return to_bf16<Isa>(x);
  } else {
    static_assert(std::is_same_v<T, fp16>,
                  "simd::stored: element type must be float, bf16 or fp16");
    return to_fp16<Isa>(x);
  }
}

//! Writes a vector in its stored form (stored<Isa, T>) to `p`.
template <class S>
SHARDKIT_DETAIL_SIMD_FN void store_stored(void* p, S s) {
  std::memcpy(p, &s.v, sizeof s.v);
}

//! Stores Isa::width floats to fp32/bf16/fp16 storage (round to nearest even).
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN void store(T* p, vf<Isa::width> x) {
  store_stored(p, stored<Isa, T>(x));
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

#if defined(SHARDKIT_DETAIL_HOST_ASM)
namespace impl {
//! Lanes where a or b is a NaN (VCMPUNORDPS, a quiet compare: it raises the invalid flag for a
//! signalling NaN only, and changes no value).
template <int W>
SHARDKIT_DETAIL_SIMD_FN vu<W> unordered(vf<W> a, vf<W> b) {
  vu<W> m;
  __asm__("vcmpunordps %2, %1, %0" : "=x"(m.v) : "x"(a.v), "x"(b.v));
  return m;
}
}  // namespace impl
#endif

//! Loads 2 * Isa::width elements of fp32/bf16/fp16 storage as two vectors: the same bits as
//! two load() calls. The AVX2 build tests the fp16 widenings of both for NaN at once.
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN void load2(const T* p, vf<Isa::width>& a, vf<Isa::width>& b) {
  constexpr int W = Isa::width;
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  if constexpr (W == 8 && Isa::f16c && std::is_same_v<T, fp16>) {
    const vh<W> ha = impl::load_h<W>(p), hb = impl::load_h<W>(p + W);
    a = impl::fp16_widen_hw<W>(ha);
    b = impl::fp16_widen_hw<W>(hb);
    if (!any(impl::unordered(a, b))) return;
  }
#endif
  a = load<Isa>(p);
  b = load<Isa>(p + W);
}

#if defined(SHARDKIT_DETAIL_HOST_ASM)
namespace impl {
//! Rounds two 8-lane vectors without NaN lanes to bf16 and stores them (a, then b): one pack
//! of the two roundings. VPACKUSDW packs within 128-bit halves (a0-3 b0-3 a4-7 b4-7); VPERMQ
//! puts them in order.
SHARDKIT_DETAIL_SIMD_FN void store_bf16_finite2(bf16* p, vf<8> a, vf<8> b) {
  typename storage<16>::h h;
  __asm__("vpackusdw %2, %1, %0\n\tvpermq $0xd8, %0, %0"
          : "=x"(h)
          : "x"(bf16_round_finite(bits(a)).v), "x"(bf16_round_finite(bits(b)).v));
  std::memcpy(p, &h, sizeof h);
}
}  // namespace impl
#endif

//! Stores two vectors (a, then b) to 2 * Isa::width elements of fp32/bf16/fp16 storage: the
//! same bits as two store() calls. The AVX2 build tests both for NaN with one compare
//! (VCMPUNORDPS: a signalling NaN raises the invalid flag, as F16C's conversions do; no value
//! changes) and rounds both to bf16 with one pack, or converts both to fp16.
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN void store2(T* p, vf<Isa::width> a, vf<Isa::width> b) {
  constexpr int W = Isa::width;
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  if constexpr (W == 8 && std::is_same_v<T, bf16>) {
    if (!any(impl::unordered(a, b))) {
      impl::store_bf16_finite2(p, a, b);
      return;
    }
  } else if constexpr (W == 8 && Isa::f16c && std::is_same_v<T, fp16>) {
    if (!any(impl::unordered(a, b))) {
      impl::store_h<W>(p, impl::fp16_cvt_hw(a));
      impl::store_h<W>(p + W, impl::fp16_cvt_hw(b));
      return;
    }
  }
#endif
  store<Isa>(p, a);
  store<Isa>(p + W, b);
}

//! Stores four vectors (a, b, c, d) to 4 * Isa::width elements of fp32/bf16/fp16 storage: the
//! same bits as four store() calls. The AVX2 build tests the four for bf16 NaN lanes at once:
//! two compares and an OR per 32 elements (the integer test it replaces took five instructions
//! per 16, the cast's largest cost after the rounding's ten).
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN void store4(T* p, vf<Isa::width> a, vf<Isa::width> b, vf<Isa::width> c,
                                    vf<Isa::width> d) {
  constexpr int W = Isa::width;
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  if constexpr (W == 8 && std::is_same_v<T, bf16>) {
    if (!any(impl::unordered(a, b) | impl::unordered(c, d))) {
      impl::store_bf16_finite2(p, a, b);
      impl::store_bf16_finite2(p + 2 * W, c, d);
      return;
    }
  }
#endif
  store2<Isa>(p, a, b);
  store2<Isa>(p + 2 * W, c, d);
}

//! Whether the build `Isa` has streaming stores (store_stream): the AVX2 and AVX-512 builds
//! with GCC on x86-64 (the instructions are named in asm, as the conversions are).
template <class Isa>
inline constexpr bool has_stream_stores =
#if defined(SHARDKIT_DETAIL_HOST_ASM)
    Isa::width >= 8;
#else
    false;
#endif

//! Writes a vector in its stored form (stored<Isa, T>) to `p` with a streaming (non-temporal)
//! store: the line goes to memory without being read first and without displacing the cache.
//! `p` must be aligned to the stored vector's size. Only in builds with has_stream_stores<Isa>;
//! the stores are weakly ordered until stream_fence().
template <class Isa, class S>
SHARDKIT_DETAIL_SIMD_FN void store_stored_stream(void* p, S s) {
  static_assert(has_stream_stores<Isa>, "simd::store_stored_stream: not in this build");
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  if constexpr (std::is_same_v<S, vf<Isa::width>>) {
    __asm__ volatile("vmovntps %1, (%0)" : : "r"(p), "v"(s.v) : "memory");
  } else {
    __asm__ volatile("vmovntdq %1, (%0)" : : "r"(p), "v"(s.v) : "memory");
  }
#else
  (void)p;
  (void)s;
#endif
}

//! Stores Isa::width floats to fp32/bf16/fp16 storage as store() does (the same bits), with a
//! streaming store (store_stored_stream). `p` must be aligned to the vector's size in storage
//! (Isa::width * sizeof(T) bytes).
template <class Isa, class T>
SHARDKIT_DETAIL_SIMD_FN void store_stream(T* p, vf<Isa::width> x) {
  store_stored_stream<Isa>(p, stored<Isa, T>(x));
}

//! Orders the streaming stores issued so far before any later store of this thread (SFENCE),
//! so that a thread that sees a later flag also sees them.
SHARDKIT_FORCEINLINE void stream_fence() {
#if defined(SHARDKIT_DETAIL_HOST_ASM)
  __asm__ volatile("sfence" : : : "memory");
#endif
}

//! Asks the CPU to bring the cache line holding `p` towards its first-level cache before a loop
//! reads it: a hint that never faults and never changes a result.
SHARDKIT_FORCEINLINE void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

//! The same for a line the loop will write (with intent to write: the line arrives owned,
//! and the store does not wait for it).
SHARDKIT_FORCEINLINE void prefetch_for_write(void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 1, 3);
#else
  (void)p;
#endif
}

//! prefetch() of element `i` of every array given.
template <class... T>
SHARDKIT_FORCEINLINE void prefetch_at(std::size_t i, const T*... arrays) {
  (prefetch(arrays + i), ...);
}

}  // namespace simd
SHARDKIT_NAMESPACE_END
