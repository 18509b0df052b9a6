//! \file kernels/host/convert.hpp
//! Element-wise host loops over contiguous arrays: casts between fp32/bf16/fp16, accumulation
//! (acc += x, in fp32, rounded once), scaling, and the rank-ordered reduction that
//! communicators use (fp32 accumulation for 16-bit data, a fixed order for bit-identical
//! results).
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/kernels/host/dispatch.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/host/simd_storage.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN
namespace host {

//! How far ahead the casts prefetch, in elements (2 KiB of fp32 input). Measured on an Intel
//! Xeon (AVX-512, one thread, against the loop without it): fp32 -> bf16 1.06x at 16Mi
//! elements and 1.22x at 64Mi, the flatten fp32 -> bf16 1.17x and 1.34x (benchmarks/README.md).
inline constexpr std::size_t convert_prefetch = 512;

namespace detail {
template <class S, class D>
struct convert_kernel {
  //! Two vectors from element i: more loads in flight than one.
  template <class Isa>
  SHARDKIT_FORCEINLINE static void two(const S* in, D* out, std::size_t i) {
    constexpr std::size_t L = Isa::width;
    const auto a = simd::load<Isa>(in + i);
    const auto b = simd::load<Isa>(in + i + L);
    simd::store<Isa>(out + i, a);
    simd::store<Isa>(out + i + L, b);
  }

  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(const S* in, D* out, std::size_t n) {
    constexpr std::size_t L = Isa::width;
    std::size_t i = 0;
    // While convert_prefetch elements are left, each pair of vectors also asks for the input
    // line that far ahead, and for the output line with intent to write.
    if (n > convert_prefetch) {
      for (; i + 2 * L <= n - convert_prefetch; i += 2 * L) {
        simd::prefetch_at(i + convert_prefetch, in);
        simd::prefetch_for_write(out + i + convert_prefetch);
        two<Isa>(in, out, i);
      }
    }
    for (; i + 2 * L <= n; i += 2 * L) two<Isa>(in, out, i);
    for (; i + L <= n; i += L) simd::store<Isa>(out + i, simd::load<Isa>(in + i));
    if (i < n) {
      simd::store_partial<Isa>(out + i, simd::load_partial<Isa>(in + i, n - i), n - i);
    }
  }
};

template <class S, class D>
struct accumulate_kernel {
  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(const S* in, D* acc, std::size_t n) {
    constexpr std::size_t L = Isa::width;
    std::size_t i = 0;
    for (; i + L <= n; i += L) {
      simd::store<Isa>(acc + i, simd::load<Isa>(acc + i) + simd::load<Isa>(in + i));
    }
    if (i < n) {
      const std::size_t r = n - i;
      simd::store_partial<Isa>(
          acc + i, simd::load_partial<Isa>(acc + i, r) + simd::load_partial<Isa>(in + i, r), r);
    }
  }
};
}  // namespace detail

//! out[i] = in[i] converted (exact widening, or round to nearest even). `in` and `out` must not
//! overlap unless they are the same array of the same type.
template <float_storage S, float_storage D>
void convert(const S* in, D* out, std::size_t n) {
  if (n == 0) return;
  if constexpr (std::is_same_v<S, D>) {
    if (static_cast<const void*>(in) != static_cast<const void*>(out)) {
      std::memcpy(out, in, n * sizeof(S));
    }
  } else {
    dispatch<detail::convert_kernel<S, D>>(in, out, n);
  }
}

//! acc[i] = acc[i] + in[i], computed in fp32 and rounded once to D.
template <float_storage S, float_storage D>
void accumulate(const S* in, D* acc, std::size_t n) {
  if (n == 0) return;
  dispatch<detail::accumulate_kernel<S, D>>(in, acc, n);
}

//! Elements per thread below which the parallel casts use fewer threads.
inline constexpr std::size_t convert_grain = 65536;

//! convert on the threads of `exec` (nullptr: the caller's only); the same bits.
template <float_storage S, float_storage D>
void parallel_convert(executor* exec, const S* in, D* out, std::size_t n) {
  parallel_for(exec, n, convert_grain,
               [&](std::size_t b, std::size_t e) { convert(in + b, out + b, e - b); });
}

//! accumulate on the threads of `exec` (nullptr: the caller's only); the same bits.
template <float_storage S, float_storage D>
void parallel_accumulate(executor* exec, const S* in, D* acc, std::size_t n) {
  parallel_for(exec, n, convert_grain,
               [&](std::size_t b, std::size_t e) { accumulate(in + b, acc + b, e - b); });
}

//! Converts between run-time element types (fp32, bf16, fp16), on the threads of `exec`
//! (nullptr: the caller's only).
inline void parallel_convert(executor* exec, const void* in, dtype in_type, void* out,
                             dtype out_type, std::size_t n) {
  auto with_out = [&](const auto* src) {
    switch (out_type) {
      case dtype::f32:
        return parallel_convert(exec, src, static_cast<float*>(out), n);
      case dtype::bf16:
        return parallel_convert(exec, src, static_cast<bf16*>(out), n);
      case dtype::f16:
        return parallel_convert(exec, src, static_cast<fp16*>(out), n);
      default:
        ::shardkit::detail::raise("convert: unsupported destination element type ", name(out_type),
                                  " (expected fp32, bf16 or fp16)");
    }
  };
  switch (in_type) {
    case dtype::f32:
      return with_out(static_cast<const float*>(in));
    case dtype::bf16:
      return with_out(static_cast<const bf16*>(in));
    case dtype::f16:
      return with_out(static_cast<const fp16*>(in));
    default:
      ::shardkit::detail::raise("convert: unsupported source element type ", name(in_type),
                                " (expected fp32, bf16 or fp16)");
  }
}

//! Converts between run-time element types (fp32, bf16, fp16).
inline void convert(const void* in, dtype in_type, void* out, dtype out_type, std::size_t n) {
  parallel_convert(nullptr, in, in_type, out, out_type, n);
}

//! acc[i] += in[i] for a run-time source element type (fp32, bf16, fp16), on the threads of
//! `exec` (nullptr: the caller's only).
template <float_storage D>
void parallel_accumulate(executor* exec, const void* in, dtype in_type, D* acc, std::size_t n) {
  switch (in_type) {
    case dtype::f32:
      return parallel_accumulate(exec, static_cast<const float*>(in), acc, n);
    case dtype::bf16:
      return parallel_accumulate(exec, static_cast<const bf16*>(in), acc, n);
    case dtype::f16:
      return parallel_accumulate(exec, static_cast<const fp16*>(in), acc, n);
    default:
      ::shardkit::detail::raise("accumulate: unsupported source element type ", name(in_type),
                                " (expected fp32, bf16 or fp16)");
  }
}

//! acc[i] += in[i] for a run-time source element type (fp32, bf16, fp16).
template <float_storage D>
void accumulate(const void* in, dtype in_type, D* acc, std::size_t n) {
  parallel_accumulate(nullptr, in, in_type, acc, n);
}

}  // namespace host
SHARDKIT_NAMESPACE_END
