// Host kernels, in every build of the host loops this CPU runs (kernels/host/isa.hpp): vector
// conversions equal the scalar ones bit for bit, the fused optimizer step equals the scalar
// reference bit for bit and matches an independent double-precision reference, the
// rank-ordered reduction is exactly a sequential fp32 sum, and writing it to several outputs in
// one pass (reduce_ordered_to) gives its bytes, streaming or not, in place or not.
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/reduce.hpp>
#include <shardkit/kernels/math.hpp>

#include "kernels/support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

using namespace shardkit;
using namespace kernel_test;

namespace {
// The widest vector of any build, for "every tail" loops.
constexpr std::size_t L = simd::max_width;
}  // namespace

TEST_CASE("host kernels report their build", "[kernels]") {
  const std::string isa = host_isa();
  std::string all;
  for (host::isa i : host::available_isas()) all += std::string(" ") + host::name(i);
  WARN("host kernels run the " << isa << " build, software prefetch "
                               << host::software_prefetch_name() << "; this CPU runs:" << all);
#if defined(SHARDKIT_HOST_SCALAR_SIMD)
  REQUIRE(isa == "scalar");
#else
  REQUIRE((isa == "baseline" || isa == "avx2" || isa == "avx512" || isa == "avx512bf16"));
#endif
  bool listed = false;
  for (host::isa i : host::available_isas()) listed = listed || i == host::active_isa();
  REQUIRE(listed);
}

TEST_CASE("vector 16-bit conversions are bit-identical to the scalar ones", "[kernels][convert]") {
  in_every_build([] {
    DYNAMIC_SECTION("every bf16 and fp16 pattern widens identically"
                    << " (" << build_name() << ")") {
      std::vector<bf16> b(65536);
      std::vector<fp16> h(65536);
      for (std::uint32_t i = 0; i < 65536; ++i) {
        b[i] = bf16::from_bits(static_cast<std::uint16_t>(i));
        h[i] = fp16::from_bits(static_cast<std::uint16_t>(i));
      }
      std::vector<float> fb(65536), fh(65536);
      host::convert(b.data(), fb.data(), b.size());
      host::convert(h.data(), fh.data(), h.size());
      for (std::uint32_t i = 0; i < 65536; ++i) {
        REQUIRE(std::bit_cast<std::uint32_t>(fb[i]) ==
                std::bit_cast<std::uint32_t>(bf16_bits_to_float(static_cast<std::uint16_t>(i))));
        REQUIRE(std::bit_cast<std::uint32_t>(fh[i]) ==
                std::bit_cast<std::uint32_t>(fp16_bits_to_float(static_cast<std::uint16_t>(i))));
      }
    }
    DYNAMIC_SECTION(
        "random floats (including NaN payloads, infinities, subnormals) narrow identically"
        << " (" << build_name() << ")") {
      std::uint64_t s = 7;
      std::vector<float> f(1 << 20);
      for (auto& x : f) x = std::bit_cast<float>(static_cast<std::uint32_t>(splitmix(s)));
      // values near fp16's interesting boundaries
      for (std::size_t i = 0; i < 4096; ++i)
        f[i] = std::ldexp(random_float(s), -30 + static_cast<int>(i % 50));
      std::vector<bf16> b(f.size());
      std::vector<fp16> h(f.size());
      host::convert(f.data(), b.data(), f.size());
      host::convert(f.data(), h.data(), f.size());
      for (std::size_t i = 0; i < f.size(); ++i) {
        REQUIRE(b[i].bits == float_to_bf16_bits(f[i]));
        REQUIRE(h[i].bits == float_to_fp16_bits(f[i]));
      }
    }
    DYNAMIC_SECTION("every length, so every tail, converts correctly"
                    << " (" << build_name() << ")") {
      std::uint64_t s = 3;
      // Every short length (past the loops that take four vectors at a time, then two, then
      // one), and every length around where the prefetching loops hand over to the plain ones
      // (host::convert_prefetch elements before the end).
      std::vector<std::size_t> lengths;
      for (std::size_t n = 0; n < 5 * L + 2; ++n) lengths.push_back(n);
      for (std::size_t n = 0; n < 5 * L + 2; ++n) lengths.push_back(host::convert_prefetch + n);
      for (const std::size_t n : lengths) {
        std::vector<float> f(n);
        for (auto& x : f) x = random_float(s, 100.0f);
        std::vector<bf16> b(n + 1, bf16::from_bits(0xabcd));  // sentinel after the end
        std::vector<fp16> h(n + 1, fp16::from_bits(0xabcd));
        host::convert(f.data(), b.data(), n);
        host::convert(f.data(), h.data(), n);
        for (std::size_t i = 0; i < n; ++i) REQUIRE(b[i].bits == float_to_bf16_bits(f[i]));
        for (std::size_t i = 0; i < n; ++i) REQUIRE(h[i].bits == float_to_fp16_bits(f[i]));
        REQUIRE(b[n].bits == 0xabcd);
        REQUIRE(h[n].bits == 0xabcd);
      }
    }
    DYNAMIC_SECTION("bf16 <-> fp16 go through fp32 exactly"
                    << " (" << build_name() << ")") {
      std::vector<fp16> h(65536);
      for (std::uint32_t i = 0; i < 65536; ++i)
        h[i] = fp16::from_bits(static_cast<std::uint16_t>(i));
      std::vector<bf16> b(h.size());
      host::convert(h.data(), b.data(), h.size());
      for (std::uint32_t i = 0; i < 65536; ++i) {
        REQUIRE(b[i].bits == float_to_bf16_bits(fp16_bits_to_float(static_cast<std::uint16_t>(i))));
      }
    }
  });
}

TEST_CASE("accumulate adds in fp32 and rounds once", "[kernels][convert]") {
  in_every_build([] {
    std::uint64_t s = 11;
    std::vector<bf16> acc(1000), in(1000);
    std::vector<float> expect(1000);
    for (std::size_t i = 0; i < acc.size(); ++i) {
      acc[i] = bf16(random_float(s, 10.0f));
      in[i] = bf16(random_float(s, 10.0f));
      expect[i] = static_cast<float>(acc[i]) + static_cast<float>(in[i]);
    }
    host::accumulate(in.data(), acc.data(), acc.size());
    for (std::size_t i = 0; i < acc.size(); ++i) REQUIRE(acc[i].bits == bf16(expect[i]).bits);
  });
}

namespace {
// Independent reference: the textbook Adam(W) (bias-corrected moments; AdamW's decay decoupled), in
// double, one element.
struct ref_adam {
  double p, m = 0, v = 0;
  void step(double g, int t, const adam_options& o, bool decoupled, double scale) {
    g *= scale;
    if (!decoupled) g += o.weight_decay * p;
    m = o.beta1 * m + (1 - o.beta1) * g;
    v = o.beta2 * v + (1 - o.beta2) * g * g;
    const double mh = m / (1 - std::pow(static_cast<double>(o.beta1), t));
    const double vh = v / (1 - std::pow(static_cast<double>(o.beta2), t));
    double upd = mh / (std::sqrt(vh) + o.eps);
    if (decoupled) upd += o.weight_decay * p;
    p -= o.lr * upd;
  }
};

template <class Opt, class G, class W = bf16>
void check_fused_step(bool decoupled) {
  const adam_options o{
      .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f};
  const std::size_t n = 1003;  // several vectors and a tail
  std::uint64_t s = 5;
  std::vector<float> p(n), m(n), v(n), p2, m2, v2;
  std::vector<ref_adam> ref;
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = random_float(s);
    ref.push_back({p[i]});
  }
  p2 = p;
  m2 = m;
  v2 = v;
  std::vector<W> out(n), out2(n);
  for (int t = 1; t <= 5; ++t) {
    std::vector<G> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = G(random_float(s, 3.0f));
    const auto k = Opt::prepare(o, static_cast<std::uint64_t>(t), o.lr, 0.5f);
    float* st[2] = {m.data(), v.data()};
    float* st2[2] = {m2.data(), v2.data()};
    host::fused_step<Opt, G, W>(k, p.data(), st, g.data(), out.data(), n);
    host::fused_step_scalar<Opt, G, W>(k, p2.data(), st2, g.data(), out2.data(), n);
    for (std::size_t i = 0; i < n; ++i) ref[i].step(static_cast<float>(g[i]), t, o, decoupled, 0.5);
  }
  for (std::size_t i = 0; i < n; ++i) {
    // vector build vs the scalar reference: the same bits (no FMA contraction anywhere)
    REQUIRE(std::bit_cast<std::uint32_t>(p[i]) == std::bit_cast<std::uint32_t>(p2[i]));
    REQUIRE(std::bit_cast<std::uint32_t>(m[i]) == std::bit_cast<std::uint32_t>(m2[i]));
    REQUIRE(std::bit_cast<std::uint32_t>(v[i]) == std::bit_cast<std::uint32_t>(v2[i]));
    REQUIRE(pattern(out[i]) == pattern(out2[i]));
    // against the independent double-precision reference
    REQUIRE(p[i] == Approx(ref[i].p).epsilon(1e-5).margin(1e-6));
    // the working copy is the master rounded to nearest even
    REQUIRE(pattern(out[i]) == pattern(from_float<W>(p[i])));
  }
}
//! NaN, infinite and huge gradients here and there (in the prefetching loop, which takes two
//! vectors at a time in the AVX2 build, and after it): parameters, moments and the working copy
//! (NaN payloads included) equal the scalar reference bit for bit.
template <class G, class W>
void check_fused_step_specials() {
  const std::size_t n = 3 * host::prefetch_distance + 37;
  std::uint64_t s = 17;
  std::vector<float> p(n), m(n), v(n);
  for (auto& x : p) x = random_float(s);
  auto p2 = p, m2 = m, v2 = v;
  std::vector<W> out(n), out2(n);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 3e38f, -3e38f,
                            // NaNs whose payloads carry when rounded as numbers would be
                            std::bit_cast<float>(0x7fffffffu), std::bit_cast<float>(0xffbfffffu)};
  for (int t = 1; t <= 3; ++t) {
    std::vector<G> g(n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t r = splitmix(s);
      g[i] = G(r % 97 == 0 ? specials[(r >> 8) % std::size(specials)] : random_float(s, 3.0f));
    }
    const auto k = adamw::prepare({.lr = 1e-2f, .weight_decay = 0.1f},
                                  static_cast<std::uint64_t>(t), 1e-2f, 0.5f);
    float* st[2] = {m.data(), v.data()};
    float* st2[2] = {m2.data(), v2.data()};
    host::fused_step<adamw, G, W>(k, p.data(), st, g.data(), out.data(), n);
    host::fused_step_scalar<adamw, G, W>(k, p2.data(), st2, g.data(), out2.data(), n);
  }
  std::size_t nan_out = 0;
  for (std::size_t i = 0; i < n; ++i) {
    REQUIRE(std::bit_cast<std::uint32_t>(p[i]) == std::bit_cast<std::uint32_t>(p2[i]));
    REQUIRE(std::bit_cast<std::uint32_t>(m[i]) == std::bit_cast<std::uint32_t>(m2[i]));
    REQUIRE(std::bit_cast<std::uint32_t>(v[i]) == std::bit_cast<std::uint32_t>(v2[i]));
    REQUIRE(pattern(out[i]) == pattern(out2[i]));
    nan_out += std::isnan(p[i]) ? 1 : 0;
  }
  REQUIRE(nan_out > 10);  // the specials did reach the working copy
  REQUIRE(nan_out < n / 2);
}
}  // namespace

TEST_CASE("fused Adam/AdamW step equals the scalar reference and matches a double reference",
          "[kernels][optimizer]") {
  in_every_build([] {
    check_fused_step<adamw, bf16>(true);
    check_fused_step<adamw, float>(true);
    check_fused_step<adam, fp16>(false);
    check_fused_step<adamw, fp16, fp16>(true);
    check_fused_step<adam, bf16, float>(false);
  });
}

TEST_CASE("fused step: NaN and infinite values give the scalar reference's bits",
          "[kernels][optimizer]") {
  in_every_build([] {
    check_fused_step_specials<bf16, bf16>();
    check_fused_step_specials<float, bf16>();
    check_fused_step_specials<float, fp16>();
    check_fused_step_specials<fp16, float>();
  });
}

TEST_CASE("an element's result does not depend on its position in the run",
          "[kernels][optimizer]") {
  // Bit-identity across ZeRO stages rests on this: a shard boundary may put an element in a
  // vector body in one stage and in a tail in another.
  in_every_build([] {
    const auto k = adamw::prepare({.lr = 1e-3f, .weight_decay = 0.01f}, 3, 1e-3f, 0.25f);
    std::uint64_t s = 9;
    std::vector<float> p0(4 * L), m0(4 * L), v0(4 * L);
    std::vector<bf16> g0(4 * L);
    for (std::size_t i = 0; i < p0.size(); ++i) {
      p0[i] = random_float(s);
      m0[i] = random_float(s, 0.1f);
      v0[i] = std::fabs(random_float(s, 0.01f));
      g0[i] = bf16(random_float(s));
    }
    for (std::size_t off = 0; off < L; off += 3) {
      for (std::size_t len = 1; off + len <= p0.size(); len += 5) {
        auto p = p0, m = m0, v = v0;
        float* st[2] = {m.data() + off, v.data() + off};
        host::fused_step<adamw>(k, p.data() + off, st, g0.data() + off, static_cast<bf16*>(nullptr),
                                len);
        auto pa = p0, ma = m0, va = v0;
        float* sta[2] = {ma.data(), va.data()};
        host::fused_step<adamw>(k, pa.data(), sta, g0.data(), static_cast<bf16*>(nullptr),
                                pa.size());
        for (std::size_t i = off; i < off + len; ++i) {
          REQUIRE(std::bit_cast<std::uint32_t>(p[i]) == std::bit_cast<std::uint32_t>(pa[i]));
          REQUIRE(std::bit_cast<std::uint32_t>(v[i]) == std::bit_cast<std::uint32_t>(va[i]));
        }
      }
    }
  });
}

//! The parameters (and each other array) at every float offset within a cache line, past the
//! prefetch distance: the first elements, up to the parameters' next line, take the
//! partial-vector code; every bit equals the scalar reference.
template <class G>
void check_fused_step_offsets() {
  const std::size_t n = 2 * host::prefetch_distance + 21;
  const std::size_t lane = 64 / sizeof(float);
  const auto k = adamw::prepare({.lr = 1e-3f, .weight_decay = 0.01f}, 2, 1e-3f, 0.5f);
  for (std::size_t off = 0; off < lane; ++off) {
    // storage with room for any offset; the other arrays sit at other offsets than p
    std::vector<float> pb(n + 2 * lane), mb(n + 2 * lane), vb(n + 2 * lane);
    std::vector<G> gb(n + 2 * lane);
    std::vector<bf16> ob(n + 2 * lane);
    auto at = [&](auto& vec, std::size_t o) {
      auto* base = vec.data();
      const std::size_t mis = reinterpret_cast<std::uintptr_t>(base) % 64 / sizeof(*base);
      return base + (lane - mis) % lane + o % lane;
    };
    float* p = at(pb, off);
    float* m = at(mb, off + 3);
    float* v = at(vb, off + 7);
    G* g = at(gb, off + 5);
    bf16* out = at(ob, off + 1);
    REQUIRE(reinterpret_cast<std::uintptr_t>(p) % 64 == off * sizeof(float));
    std::uint64_t s = 41 + off;
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = random_float(s);
      m[i] = random_float(s, 0.1f);
      v[i] = std::fabs(random_float(s, 0.01f));
      g[i] = G(random_float(s));
    }
    std::vector<float> p2(p, p + n), m2(m, m + n), v2(v, v + n);
    std::vector<bf16> out2(n);
    float* st[2] = {m, v};
    float* st2[2] = {m2.data(), v2.data()};
    host::fused_step<adamw, G, bf16>(k, p, st, g, out, n);
    host::fused_step_scalar<adamw, G, bf16>(k, p2.data(), st2, g, out2.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(std::bit_cast<std::uint32_t>(p[i]) == std::bit_cast<std::uint32_t>(p2[i]));
      REQUIRE(std::bit_cast<std::uint32_t>(m[i]) == std::bit_cast<std::uint32_t>(m2[i]));
      REQUIRE(std::bit_cast<std::uint32_t>(v[i]) == std::bit_cast<std::uint32_t>(v2[i]));
      REQUIRE(pattern(out[i]) == pattern(out2[i]));
    }
  }
}

TEST_CASE("the fused step gives the same bits wherever its arrays start in a cache line",
          "[kernels][optimizer]") {
  in_every_build([] {
    check_fused_step_offsets<float>();
    check_fused_step_offsets<bf16>();
  });
}

TEST_CASE("SGD with momentum is a pluggable optimizer policy", "[kernels][optimizer]") {
  const sgd_options o{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.0f};
  std::vector<float> p{1.0f, -1.0f, 0.5f}, b(3);
  const std::vector<float> g{1.0f, 2.0f, -4.0f};
  float* st[1] = {b.data()};
  for (int t = 1; t <= 2; ++t) {
    host::fused_step<sgd_momentum, float, float>(sgd_momentum::prepare(o, t, o.lr, 1.0f), p.data(),
                                                 st, g.data(), nullptr, 3);
  }
  // b1 = g, p1 = p - 0.1 g; b2 = 1.9 g, p2 = p1 - 0.19 g = p - 0.29 g
  REQUIRE(p[0] == Approx(1.0f - 0.29f));
  REQUIRE(p[1] == Approx(-1.0f - 0.58f));
  REQUIRE(p[2] == Approx(0.5f + 1.16f));
}

namespace {
template <class T>
void check_reduce(std::size_t k, std::size_t n, reduce_op op) {
  std::uint64_t s = 17 + k * 1000 + n;
  std::vector<std::vector<T>> in(k, std::vector<T>(n));
  for (auto& v : in)
    for (auto& x : v) x = T(random_float(s, 8.0f));
  std::vector<const T*> ptrs;
  for (auto& v : in) ptrs.push_back(v.data());
  std::vector<T> out(n);
  host::reduce_ordered(ptrs.data(), k, out.data(), n, op);
  for (std::size_t i = 0; i < n; ++i) {
    float acc = static_cast<float>(in[0][i]);  // sequential fp32, rank order
    for (std::size_t q = 1; q < k; ++q) {
      const float x = static_cast<float>(in[q][i]);
      switch (op) {
        case reduce_op::sum:
        case reduce_op::avg:
          acc = acc + x;
          break;
        case reduce_op::max:
          acc = x > acc ? x : acc;
          break;
        case reduce_op::min:
          acc = x < acc ? x : acc;
          break;
      }
    }
    if (op == reduce_op::avg) acc = acc / static_cast<float>(k);
    REQUIRE(std::bit_cast<std::uint32_t>(static_cast<float>(out[i])) ==
            std::bit_cast<std::uint32_t>(static_cast<float>(T(acc))));
  }
  // In place: out aliases input j, the first, a middle or the last one (mpi_comm reduces a
  // rank's own block where it lies, in place).
  for (const std::size_t j : {std::size_t{0}, k / 2, k - 1}) {
    if (k == 0) break;
    CAPTURE(j);
    std::vector<T> mine = in[j];
    for (std::size_t q = 0; q < k; ++q) ptrs[q] = q == j ? mine.data() : in[q].data();
    host::reduce_ordered(ptrs.data(), k, mine.data(), n, op);
    for (std::size_t i = 0; i < n; ++i)
      REQUIRE(std::bit_cast<std::uint32_t>(static_cast<float>(mine[i])) ==
              std::bit_cast<std::uint32_t>(static_cast<float>(out[i])));
  }
}
}  // namespace

TEST_CASE("rank-ordered reduction equals a sequential fp32 sum bit for bit", "[kernels][reduce]") {
  in_every_build([] {
    for (std::size_t k : {1u, 2u, 3u, 8u}) {
      for (std::size_t n : {0u, 1u, 7u, 17u, 64u, 1001u}) {
        for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
          CAPTURE(k, n, op);
          check_reduce<bf16>(k, n, op);
          check_reduce<fp16>(k, n, op);
          check_reduce<float>(k, n, op);
        }
      }
    }
  });
}

TEST_CASE("reductions propagate NaN and infinity", "[kernels][reduce]") {
  in_every_build([] {
    std::vector<float> a{1.0f, INFINITY, 3.0f}, b{NAN, 1.0f, -INFINITY};
    const float* p[2] = {a.data(), b.data()};
    std::vector<float> out(3);
    host::reduce_ordered(p, 2, out.data(), 3, reduce_op::sum);
    REQUIRE(std::isnan(out[0]));
    REQUIRE(std::isinf(out[1]));
    REQUIRE(std::isinf(out[2]));
    host::reduce_ordered(p, 2, out.data(), 3, reduce_op::max);
    REQUIRE(std::isnan(out[0]));
    std::vector<std::int64_t> i1{1, -5}, i2{2, 7};
    const std::int64_t* pi[2] = {i1.data(), i2.data()};
    std::vector<std::int64_t> oi(2);
    host::reduce_ordered(pi, 2, oi.data(), 2, reduce_op::max);
    REQUIRE(oi == std::vector<std::int64_t>{2, 7});
  });
}

namespace {
//! A pointer into `v` whose address is `offset` bytes past a 64-byte boundary, with at least
//! `pad` elements of `v` before it.
template <class T>
T* placed(std::vector<T>& v, std::size_t offset, std::size_t pad) {
  auto* p = v.data() + pad;
  while (reinterpret_cast<std::uintptr_t>(p) % 64 != offset) ++p;
  return p;
}

template <class T>
T random_element(std::uint64_t& s) {
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(splitmix(s));
  else
    return T(random_float(s, 8.0f));
}

//! reduce_ordered_to over k inputs into m outputs, each output at its own offset within a
//! cache line, against reduce_ordered into one array: the same bytes in every output, nothing
//! written around them; then in place, with output q the input q.
template <class T>
void check_reduce_to(std::size_t k, std::size_t m, std::size_t n, reduce_op op, host::stores how,
                     bool same_offsets) {
  std::uint64_t s = 29 + k * 100 + m * 10 + n;
  std::vector<std::vector<T>> in(k, std::vector<T>(n));
  for (auto& v : in)
    for (auto& x : v) x = random_element<T>(s);
  std::vector<const T*> ptrs;
  for (auto& v : in) ptrs.push_back(v.data());
  std::vector<T> want(n);
  host::reduce_ordered(ptrs.data(), k, want.data(), n, op);

  constexpr std::size_t pad = 64 / sizeof(T) + 1;
  const T fill = random_element<T>(s);
  std::vector<std::vector<T>> store(m, std::vector<T>(n + 4 * pad, fill));
  std::vector<T*> out;
  for (std::size_t p = 0; p < m; ++p) {
    const std::size_t offset = same_offsets ? 2 * sizeof(T) : (p * 3 * sizeof(T)) % 64;
    out.push_back(placed(store[p], offset, pad));
  }
  host::reduce_ordered_to(ptrs.data(), k, out.data(), m, n, op, how);
  for (std::size_t p = 0; p < m; ++p) {
    CAPTURE(p);
    REQUIRE(std::memcmp(out[p], want.data(), n * sizeof(T)) == 0);
    for (T* q = store[p].data(); q < out[p]; ++q) REQUIRE(std::memcmp(q, &fill, sizeof(T)) == 0);
    for (T* q = out[p] + n; q < store[p].data() + store[p].size(); ++q)
      REQUIRE(std::memcmp(q, &fill, sizeof(T)) == 0);
  }

  // In place: output q is input q (the thread communicator's in-place all-reduce).
  std::vector<std::vector<T>> both = in;
  std::vector<const T*> both_in;
  std::vector<T*> both_out;
  for (auto& v : both) both_in.push_back(v.data());
  for (std::size_t p = 0; p < std::min(k, m); ++p) both_out.push_back(both[p].data());
  host::reduce_ordered_to(both_in.data(), k, both_out.data(), both_out.size(), n, op, how);
  for (std::size_t p = 0; p < both_out.size(); ++p)
    REQUIRE(std::memcmp(both[p].data(), want.data(), n * sizeof(T)) == 0);
  for (std::size_t q = both_out.size(); q < k; ++q) REQUIRE(both[q] == in[q]);
}
}  // namespace

TEST_CASE("reduce_ordered_to writes reduce_ordered's bits to every output, in place or not",
          "[kernels][reduce]") {
  in_every_build([] {
    for (host::stores how : {host::stores::cached, host::stores::streaming}) {
      for (bool same : {true, false}) {
        for (std::size_t k : {1u, 2u, 3u}) {
          for (std::size_t m : {1u, 2u, 4u}) {
            for (std::size_t n : {std::size_t{0}, std::size_t{1}, L - 1, 2 * L + 3, 1001 + L}) {
              for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
                CAPTURE(how == host::stores::streaming, same, k, m, n, op);
                check_reduce_to<float>(k, m, n, op, how, same);
                check_reduce_to<bf16>(k, m, n, op, how, same);
                check_reduce_to<fp16>(k, m, n, op, how, same);
                check_reduce_to<double>(k, m, n, op, how, same);
                check_reduce_to<std::int32_t>(k, m, n, op, how, same);
              }
            }
          }
        }
      }
    }
  });
  // The run-time element type.
  std::vector<float> a{1, 2, 3}, b{10, 20, 30}, x(3), y(3);
  const void* in[2] = {a.data(), b.data()};
  void* out[2] = {x.data(), y.data()};
  host::reduce_ordered_to(dtype::f32, in, 2, out, 2, 3, reduce_op::sum);
  REQUIRE(x == std::vector<float>{11, 22, 33});
  REQUIRE(y == x);
}
