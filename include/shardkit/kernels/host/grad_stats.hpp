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
#include <shardkit/kernels/host/dispatch.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/host/simd_storage.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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

//! Statistics being gathered: the bins in 8 interleaved tables (neighbouring elements that fall
//! into the same bin then do not wait for each other's update), the non-finite count and the
//! largest magnitude. 16 KiB: one per thread, kept across the runs of a pass and added into a
//! grad_stats at the end (add_to). Every split of the elements over accumulators, calls and
//! threads gives the same grad_stats: the bins are integer sums.
struct stats_accumulator {
  static constexpr std::size_t tables = 8;
  alignas(64) std::uint64_t tab[grad_stats::bins][tables] = {};
  std::uint64_t nonfinite = 0;
  std::uint32_t max_bits = 0;

  //! Adds the statistics of g[0, n) (vectorised; see accumulate_stats).
  template <float_storage G>
  void add(const G* g, std::size_t n);

  void add_to(grad_stats& s) const noexcept {
    for (std::size_t e = 0; e < grad_stats::bins; ++e) {
      std::uint64_t w = 0;
      for (std::size_t t = 0; t < tables; ++t) w += tab[e][t];
      s.words[e] += w;
    }
    s.words[grad_stats::bins] += nonfinite;
    if (max_bits > s.max_abs_bits) s.max_abs_bits = max_bits;
  }
};

namespace detail {
//! The per-vector part of the statistics, kept in registers over a loop: the largest finite
//! magnitude and the non-finite count per lane.
template <int W>
struct stats_lanes {
  simd::vu<W> max_abs = simd::vu<W>::splat(0u);
  simd::vu<W> nonfinite = simd::vu<W>::splat(0u);
  stats_accumulator* acc;

  //! Adds the W values of x; `i` (the index of the first) picks the tables.
  SHARDKIT_FORCEINLINE void add(simd::vf<W> x, std::size_t i) {
    using U = simd::vu<W>;
    const U a = simd::bits(x) & 0x7fffffffu;
    const U e = a >> 23;
    const U finite = e != 0xffu;
    nonfinite = nonfinite + (~finite & 1u);
    const U implicit = simd::select(e != 0u, U::splat(0x800000u), U::splat(0u));
    const U m = ((a & 0x7fffffu) | implicit) >> 8;  // the top 16 significant bits
    const U m2 = (m * m) & finite;                  // exact: m < 2^16
    max_abs = simd::select((a > max_abs) & finite, a, max_abs);
    std::uint32_t es[W], ms[W];
    std::memcpy(es, &e.v, sizeof es);
    std::memcpy(ms, &m2.v, sizeof ms);
    for (int j = 0; j < W; ++j) {
      acc->tab[es[j]][(i + static_cast<std::size_t>(j)) % stats_accumulator::tables] += ms[j];
    }
  }
  //! Folds the register part into the accumulator.
  SHARDKIT_FORCEINLINE void finish() {
    std::uint32_t mx[W], nf[W];
    std::memcpy(mx, &max_abs.v, sizeof mx);
    std::memcpy(nf, &nonfinite.v, sizeof nf);
    for (int j = 0; j < W; ++j) {
      acc->max_bits = mx[j] > acc->max_bits ? mx[j] : acc->max_bits;
      acc->nonfinite += nf[j];
    }
  }
};

template <class G>
struct stats_kernel {
  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(const G* g, std::size_t n, stats_accumulator* acc) {
    constexpr std::size_t L = Isa::width;
    stats_lanes<Isa::width> st{.acc = acc};
    std::size_t i = 0;
    for (; i + L <= n; i += L) st.add(simd::load<Isa>(g + i), i);
    if (i < n) st.add(simd::load_partial<Isa>(g + i, n - i), i);  // zeros add nothing
    st.finish();
  }
};
}  // namespace detail

template <float_storage G>
void stats_accumulator::add(const G* g, std::size_t n) {
  if (n != 0) dispatch<detail::stats_kernel<G>>(g, n, this);
}

//! Adds the statistics of g[0, n) to `s`: vectorised (exponent, mantissa square and the
//! largest magnitude in vectors, then one scalar bin update per element into interleaved
//! tables), in every build of kernels/host/isa.hpp, with the same result.
template <float_storage G>
void accumulate_stats(const G* g, std::size_t n, grad_stats& s) {
  if (n == 0) return;
  stats_accumulator acc;
  acc.add(g, n);
  acc.add_to(s);
}

//! accumulate_stats on the threads of `exec` (nullptr: the caller's only): one accumulator per
//! piece, added together (integer sums: the same result for any number of threads).
template <float_storage G>
void parallel_accumulate_stats(executor* exec, const G* g, std::size_t n, grad_stats& s) {
  constexpr std::size_t grain = 262144;
  if (exec == nullptr || exec->concurrency() == 1 || n < 2 * grain) {
    return accumulate_stats(g, n, s);
  }
  std::vector<grad_stats> parts(pieces::of(exec, n, grain).count);
  parallel_pieces(exec, n, grain, [&](std::size_t t, std::size_t b, std::size_t e) {
    accumulate_stats(g + b, e - b, parts[t]);
  });
  for (const auto& p : parts) s.merge(p);
}

namespace detail {
template <class G>
struct nonfinite_kernel {
  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(const G* g, std::size_t n, std::uint64_t* count) {
    using U = simd::vu<Isa::width>;
    constexpr std::size_t L = Isa::width;
    U c = U::splat(0u);
    std::size_t i = 0;
    for (; i + L <= n; i += L) {
      const U a = simd::bits(simd::load<Isa>(g + i)) & 0x7fffffffu;
      c = c + ((a >= 0x7f800000u) & 1u);
    }
    if (i < n) {
      const U a = simd::bits(simd::load_partial<Isa>(g + i, n - i)) & 0x7fffffffu;
      c = c + ((a >= 0x7f800000u) & 1u);
    }
    std::uint32_t lanes[Isa::width];
    std::memcpy(lanes, &c.v, sizeof lanes);
    std::uint64_t total = 0;
    for (std::uint32_t x : lanes) total += x;
    *count += total;
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
