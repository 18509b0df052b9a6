//! \file kernels/host/convert.hpp
//! Element-wise host loops over contiguous arrays: casts between fp32/bf16/fp16, accumulation
//! (acc += x, in fp32, rounded once), scaling, and the rank-ordered reduction that
//! communicators use (fp32 accumulation for 16-bit data, a fixed order for bit-identical
//! results).
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/kernels/host/simd.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN
namespace host {

namespace detail {
template <class S, class D>
struct convert_kernel {
  SHARDKIT_FORCEINLINE static void run(const S* in, D* out, std::size_t n) {
    constexpr std::size_t L = simd::width;
    std::size_t i = 0;
    for (; i + L <= n; i += L) simd::store(out + i, simd::load(in + i));
    if (i < n) simd::store_partial(out + i, simd::load_partial(in + i, n - i), n - i);
  }
};

#if defined(SHARDKIT_DETAIL_HOST_WIDE)
template <class T>
inline constexpr bool wide_type = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

//! fp32 <-> bf16 on 8-lane vectors, for the AVX2 build (see simd::wide).
template <class S, class D>
struct convert_wide_kernel {
  SHARDKIT_FORCEINLINE static void run(const S* in, D* out, std::size_t n) {
    namespace w = simd::wide;
    std::size_t i = 0;
    for (; i + w::width <= n; i += w::width) w::store(out + i, w::load(in + i));
    if (i < n) w::store_partial(out + i, w::load_partial(in + i, n - i), n - i);
  }
};
#endif

template <class S, class D>
struct accumulate_kernel {
  SHARDKIT_FORCEINLINE static void run(const S* in, D* acc, std::size_t n) {
    constexpr std::size_t L = simd::width;
    std::size_t i = 0;
    for (; i + L <= n; i += L) simd::store(acc + i, simd::load(acc + i) + simd::load(in + i));
    if (i < n) {
      const std::size_t r = n - i;
      simd::store_partial(acc + i, simd::load_partial(acc + i, r) + simd::load_partial(in + i, r),
                          r);
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
#if defined(SHARDKIT_DETAIL_HOST_WIDE)
    if constexpr (detail::wide_type<S> && detail::wide_type<D>) {
      if (::shardkit::detail::cpu_has_avx2_fma()) {
        ::shardkit::detail::run_avx2<detail::convert_wide_kernel<S, D>>(in, out, n);
        return;
      }
    }
#endif
    dispatch<detail::convert_kernel<S, D>>(in, out, n);
  }
}

//! acc[i] = acc[i] + in[i], computed in fp32 and rounded once to D.
template <float_storage S, float_storage D>
void accumulate(const S* in, D* acc, std::size_t n) {
  if (n == 0) return;
  dispatch<detail::accumulate_kernel<S, D>>(in, acc, n);
}

//! Converts between run-time element types (fp32, bf16, fp16).
inline void convert(const void* in, dtype in_type, void* out, dtype out_type, std::size_t n) {
  auto with_out = [&](const auto* src) {
    switch (out_type) {
      case dtype::f32:
        return convert(src, static_cast<float*>(out), n);
      case dtype::bf16:
        return convert(src, static_cast<bf16*>(out), n);
      case dtype::f16:
        return convert(src, static_cast<fp16*>(out), n);
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

//! acc[i] += in[i] for a run-time source element type (fp32, bf16, fp16).
template <float_storage D>
void accumulate(const void* in, dtype in_type, D* acc, std::size_t n) {
  switch (in_type) {
    case dtype::f32:
      return accumulate(static_cast<const float*>(in), acc, n);
    case dtype::bf16:
      return accumulate(static_cast<const bf16*>(in), acc, n);
    case dtype::f16:
      return accumulate(static_cast<const fp16*>(in), acc, n);
    default:
      ::shardkit::detail::raise("accumulate: unsupported source element type ", name(in_type),
                                " (expected fp32, bf16 or fp16)");
  }
}

}  // namespace host
SHARDKIT_NAMESPACE_END
