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
#include <shardkit/kernels/host/prefetch.hpp>
#include <shardkit/kernels/host/simd_storage.hpp>
#include <shardkit/kernels/host/streaming.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN
namespace host {

//! How far ahead the casts prefetch, in elements (2 KiB of fp32 input). Measured on an Intel
//! Xeon (AVX-512, one thread, against the loop without it): fp32 -> bf16 1.06x at 16Mi
//! elements and 1.22x at 64Mi, the flatten fp32 -> bf16 1.17x and 1.34x (benchmarks/README.md).
//! Whether they prefetch is host::software_prefetch(prefetch_loop::copy).
inline constexpr std::size_t convert_prefetch = 512;

namespace detail {
template <class S, class D>
struct convert_kernel {
  //! One vector's store: ordinary, or streaming (Stream).
  template <class Isa, bool Stream>
  SHARDKIT_FORCEINLINE static void put(D* p, simd::vf<Isa::width> x) {
    if constexpr (Stream) {
      simd::store_stream<Isa>(p, x);
    } else {
      simd::store<Isa>(p, x);
    }
  }

  //! Two vectors from element i: more loads in flight than one.
  template <class Isa, bool Stream = false>
  SHARDKIT_FORCEINLINE static void two(const S* in, D* out, std::size_t i) {
    constexpr std::size_t L = Isa::width;
    simd::vf<Isa::width> a, b;
    simd::load2<Isa>(in + i, a, b);
    if constexpr (Stream) {
      put<Isa, true>(out + i, a);
      put<Isa, true>(out + i + L, b);
    } else {
      simd::store2<Isa>(out + i, a, b);
    }
  }

  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(const S* in, D* out, std::size_t n, bool stream,
                                       bool prefetch) {
    // Without software prefetch (host::software_prefetch(prefetch_loop::copy)), the prefetching
    // loops below see fewer than `ahead` elements left from the start and do not run.
    const std::size_t ahead = prefetch ? convert_prefetch : n;
    if constexpr (simd::has_stream_stores<Isa>) {
      if (stream && reinterpret_cast<std::uintptr_t>(out) % sizeof(D) == 0) {
        return run_streaming<Isa>(in, out, n, ahead);
      }
    }
    run_cached<Isa>(in, out, n, ahead);
  }

  //! Whether run_cached takes four vectors at a time: the AVX2 build's fp32 -> bf16 cast,
  //! whose NaN test (simd::store4) then serves 32 elements. Measured on an AMD EPYC (AVX2), 1Mi
  //! elements in the cache: 1.16x the pairs (benchmarks/README.md).
  template <class Isa>
  static constexpr bool by_four() {
    return Isa::width == 8 && std::is_same_v<S, float> && std::is_same_v<D, bf16>;
  }

  //! Four vectors from element i, with a prefetch of each input line and the output line
  //! convert_prefetch elements ahead when `Prefetch`.
  template <class Isa, bool Prefetch>
  SHARDKIT_FORCEINLINE static void four(const S* in, D* out, std::size_t i) {
    constexpr std::size_t L = Isa::width;
    if constexpr (Prefetch) {
      constexpr std::size_t per_line = 64 / sizeof(S);
      for (std::size_t k = 0; k < 4 * L; k += per_line)
        simd::prefetch(in + i + convert_prefetch + k);
      simd::prefetch_for_write(out + i + convert_prefetch);
    }
    const auto a = simd::load<Isa>(in + i), b = simd::load<Isa>(in + i + L);
    const auto c = simd::load<Isa>(in + i + 2 * L), d = simd::load<Isa>(in + i + 3 * L);
    simd::store4<Isa>(out + i, a, b, c, d);
  }

  template <class Isa>
  SHARDKIT_FORCEINLINE static void run_cached(const S* in, D* out, std::size_t n,
                                              std::size_t ahead) {
    constexpr std::size_t L = Isa::width;
    std::size_t i = 0;
    if constexpr (by_four<Isa>()) {
      if (n > ahead) {
        for (; i + 4 * L <= n - ahead; i += 4 * L) four<Isa, true>(in, out, i);
      }
      for (; i + 4 * L <= n; i += 4 * L) four<Isa, false>(in, out, i);
    }
    // While convert_prefetch elements are left, each pair of vectors also asks for the input
    // line that far ahead, and for the output line with intent to write.
    if (n > ahead) {
      for (; i + 2 * L <= n - ahead; i += 2 * L) {
        simd::prefetch_at(i + convert_prefetch, in);
        simd::prefetch_for_write(out + i + convert_prefetch);
        two<Isa>(in, out, i);
      }
    }
    for (; i + 2 * L <= n; i += 2 * L) two<Isa>(in, out, i);
    for (; i + L <= n; i += L) simd::store<Isa>(out + i, simd::load<Isa>(in + i));
    tail<Isa>(in, out, i, n);
  }

  //! The same bits with streaming stores: the first elements, up to where a vector of output
  //! is aligned to its size, and the last ones, shorter than a vector, go through the
  //! partial-vector code (as every tail does); the whole vectors in between stream.
  template <class Isa>
  SHARDKIT_FORCEINLINE static void run_streaming(const S* in, D* out, std::size_t n,
                                                 std::size_t ahead) {
    constexpr std::size_t L = Isa::width;
    constexpr std::size_t vector_bytes = L * sizeof(D);
    const std::size_t misalign = reinterpret_cast<std::uintptr_t>(out) % vector_bytes;
    const std::size_t head = std::min(n, (vector_bytes - misalign) % vector_bytes / sizeof(D));
    tail<Isa>(in, out, 0, head);
    std::size_t i = head;
    if (n - i > ahead) {
      for (; i + 2 * L <= n - ahead; i += 2 * L) {
        simd::prefetch_at(i + convert_prefetch, in);
        two<Isa, true>(in, out, i);
      }
    }
    for (; i + 2 * L <= n; i += 2 * L) two<Isa, true>(in, out, i);
    for (; i + L <= n; i += L) put<Isa, true>(out + i, simd::load<Isa>(in + i));
    tail<Isa>(in, out, i, n);
    simd::stream_fence();
  }

  //! Elements i to n (fewer than a vector), through the partial-vector code.
  template <class Isa>
  SHARDKIT_FORCEINLINE static void tail(const S* in, D* out, std::size_t i, std::size_t n) {
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
//! overlap unless they are the same array of the same type. `how` says whether the output is
//! written with streaming stores (kernels/host/streaming.hpp); the bits are the same.
template <float_storage S, float_storage D>
void convert(const S* in, D* out, std::size_t n, stores how = stores::automatic) {
  if (n == 0) return;
  if constexpr (std::is_same_v<S, D>) {
    if (static_cast<const void*>(in) != static_cast<const void*>(out)) {
      std::memcpy(out, in, n * sizeof(S));
    }
  } else {
    dispatch<detail::convert_kernel<S, D>>(in, out, n, streams(how, n * (sizeof(S) + sizeof(D))),
                                           software_prefetch(prefetch_loop::copy));
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
//! With stores::automatic, the output streams when the bytes one thread reads and writes reach
//! host::streaming_threshold() (a CPU's share of the cache).
template <float_storage S, float_storage D>
void parallel_convert(executor* exec, const S* in, D* out, std::size_t n,
                      stores how = stores::automatic) {
  const std::size_t per_thread = pieces::of(exec, n, convert_grain).per;
  const stores each =
      streams(how, per_thread * (sizeof(S) + sizeof(D))) ? stores::streaming : stores::cached;
  parallel_for(exec, n, convert_grain,
               [&](std::size_t b, std::size_t e) { convert(in + b, out + b, e - b, each); });
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
                             dtype out_type, std::size_t n, stores how = stores::automatic) {
  auto with_out = [&](const auto* src) {
    switch (out_type) {
      case dtype::f32:
        return parallel_convert(exec, src, static_cast<float*>(out), n, how);
      case dtype::bf16:
        return parallel_convert(exec, src, static_cast<bf16*>(out), n, how);
      case dtype::f16:
        return parallel_convert(exec, src, static_cast<fp16*>(out), n, how);
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
inline void convert(const void* in, dtype in_type, void* out, dtype out_type, std::size_t n,
                    stores how = stores::automatic) {
  parallel_convert(nullptr, in, in_type, out, out_type, n, how);
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
