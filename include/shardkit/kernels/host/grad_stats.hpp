//! \file kernels/host/grad_stats.hpp
//! Gradient statistics for clipping and overflow detection: the squared L2 norm, the largest
//! magnitude and the count of non-finite values, over any split of the gradient into pieces.
//!
//! The squared norm is accumulated *exactly* in integers: each element's float exponent selects
//! a bin, and the square of its mantissa (the top 16 significant bits: exact for bf16 and fp16,
//! truncated for fp32) is added to that bin. Integer sums do not depend on the order of the
//! additions, so the statistics of a gradient are the same bit for bit however it is sharded
//! (whatever the ZeRO stage or the number of ranks), and ranks combine their bins with an
//! integer all-reduce. norm_squared() turns the bins into a double in a fixed order.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/kernels/host/simd.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN
namespace host {

//! Exact, order-independent gradient statistics (see the file comment). A plain array of
//! uint64 words so that ranks can all-reduce it (sum) as one message; the largest magnitude is
//! kept apart because it combines with max.
struct grad_stats {
  static constexpr std::size_t bins = 256;  //!< one per float exponent field value
  //! words[e] = Σ (16-bit mantissa)² of finite elements with float exponent field e;
  //! words[bins] = number of non-finite elements.
  std::array<std::uint64_t, bins + 1> words{};
  //! Bit pattern of the largest finite |element| (non-negative floats order like their bits).
  std::uint32_t max_abs_bits = 0;

  std::uint64_t nonfinite() const noexcept { return words[bins]; }

  //! Σ element² (a double, computed from the bins in a fixed order).
  double norm_squared() const noexcept {
    double s = 0.0;
    for (std::size_t e = 0; e < bins - 1; ++e) {
      if (words[e] == 0) continue;
      // value = m · 2^(max(e,1) - 127 - 15) with m the 16-bit mantissa (implicit bit included)
      const int exp2 = 2 * (static_cast<int>(e == 0 ? 1 : e) - 127 - 15);
      s += std::ldexp(static_cast<double>(words[e]), exp2);
    }
    return s;
  }
  float max_abs() const noexcept {
    float f;
    std::memcpy(&f, &max_abs_bits, sizeof f);
    return f;
  }

  void merge(const grad_stats& o) noexcept {
    for (std::size_t i = 0; i < words.size(); ++i) words[i] += o.words[i];
    if (o.max_abs_bits > max_abs_bits) max_abs_bits = o.max_abs_bits;
  }
};

namespace detail {
template <class G>
SHARDKIT_FORCEINLINE std::uint32_t float_bits_of(G g) {
  if constexpr (std::is_same_v<G, bf16>)
    return static_cast<std::uint32_t>(g.bits) << 16;
  else if constexpr (std::is_same_v<G, fp16>)
    return ::shardkit::detail::float_bits(static_cast<float>(g));
  else
    return ::shardkit::detail::float_bits(g);
}
}  // namespace detail

//! Adds the statistics of g[0, n) to `s`. A scalar loop (the exponent binning is a scatter);
//! about 2 ns per element on one core of a current x86-64 CPU.
template <float_storage G>
void accumulate_stats(const G* g, std::size_t n, grad_stats& s) {
  // Four interleaved bin tables break the dependency between neighbouring elements that fall
  // into the same bin (8 KiB, L1-resident).
  std::uint64_t tab[4][grad_stats::bins] = {};
  std::uint64_t nonfinite = 0;
  std::uint32_t max_bits = s.max_abs_bits;
  std::size_t i = 0;
  auto one = [&](std::size_t lane, std::uint32_t u) SHARDKIT_DETAIL_ALWAYS_INLINE_LAMBDA {
    const std::uint32_t a = u & 0x7fffffffu;
    const std::uint32_t e = a >> 23;
    if (e == 0xffu) {
      ++nonfinite;
      return;
    }
    const std::uint32_t m = ((a & 0x7fffffu) | (e != 0 ? 0x800000u : 0u)) >> 8;
    tab[lane][e] += static_cast<std::uint64_t>(m) * m;
    max_bits = a > max_bits ? a : max_bits;
  };
  for (; i + 4 <= n; i += 4) {
    one(0, detail::float_bits_of(g[i]));
    one(1, detail::float_bits_of(g[i + 1]));
    one(2, detail::float_bits_of(g[i + 2]));
    one(3, detail::float_bits_of(g[i + 3]));
  }
  for (; i < n; ++i) one(0, detail::float_bits_of(g[i]));
  for (std::size_t e = 0; e < grad_stats::bins; ++e) {
    s.words[e] += tab[0][e] + tab[1][e] + tab[2][e] + tab[3][e];
  }
  s.words[grad_stats::bins] += nonfinite;
  s.max_abs_bits = max_bits;
}

namespace detail {
template <class G>
struct nonfinite_kernel {
  SHARDKIT_FORCEINLINE static void run(const G* g, std::size_t n, std::uint64_t* count) {
    constexpr std::size_t L = simd::width;
    std::uint64_t c = 0;
    std::size_t i = 0;
    for (; i + L <= n; i += L) {
      const simd::vu32 a = simd::as_bits(simd::load(g + i)) & 0x7fffffffu;
      c += static_cast<std::uint64_t>(simd::stdx::popcount(a >= 0x7f800000u));
    }
    if (i < n) {
      const simd::vu32 a = simd::as_bits(simd::load_partial(g + i, n - i)) & 0x7fffffffu;
      c += static_cast<std::uint64_t>(simd::stdx::popcount(a >= 0x7f800000u));
    }
    *count += c;
  }
};
}  // namespace detail

//! Number of infinities and NaNs in g[0, n) (vectorised; what an overflow check needs when no
//! norm is asked for).
template <float_storage G>
std::uint64_t count_nonfinite(const G* g, std::size_t n) {
  std::uint64_t c = 0;
  if (n != 0) dispatch<detail::nonfinite_kernel<G>>(g, n, &c);
  return c;
}

}  // namespace host
SHARDKIT_NAMESPACE_END
