// bf16 / fp16: exhaustive round trips, rounding against an independent reference, known values.
#include <shardkit/core/dtype.hpp>

#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

using namespace shardkit;

namespace {

bool is_nan16(std::uint16_t b, int exp_bits) {
  const int mant_bits = 15 - exp_bits;
  const std::uint16_t exp_mask = static_cast<std::uint16_t>(((1u << exp_bits) - 1) << mant_bits);
  return (b & exp_mask) == exp_mask && (b & ((1u << mant_bits) - 1)) != 0;
}

// Independent reference: the nearest value with `bits` significant bits (ties to even), with
// gradual underflow below 2^min_exp and overflow to infinity above max.
double round_reference(double x, int bits, int min_exp, double max_finite) {
  if (std::isnan(x) || std::isinf(x) || x == 0.0) return x;
  int e = 0;
  std::frexp(x, &e);  // x = f * 2^e, 0.5 <= |f| < 1
  e = std::max(e, min_exp + 1);
  const double scaled = std::ldexp(x, bits - e);
  const double r = std::nearbyint(scaled);  // default rounding mode: to nearest, ties to even
  const double y = std::ldexp(r, e - bits);
  // Overflow: values at or above max + half an ulp round to infinity.
  const double half_ulp = std::ldexp(1.0, static_cast<int>(std::ilogb(max_finite)) - bits);
  if (std::fabs(x) >= max_finite + half_ulp) return std::copysign(INFINITY, x);
  return y;
}

double bf16_reference(float f) {
  return round_reference(f, 8, -126, 3.3895313892515355e38);
}
double fp16_reference(float f) {
  return round_reference(f, 11, -14, 65504.0);
}

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

TEST_CASE("bf16: all 65,536 bit patterns survive a round trip through float", "[dtype][bf16]") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float f = bf16_bits_to_float(h);
    if (is_nan16(h, 8)) REQUIRE(std::isnan(f));
    REQUIRE(float_to_bf16_bits(f) == h);
  }
}

TEST_CASE("fp16: all 65,536 bit patterns survive a round trip through float", "[dtype][fp16]") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float f = fp16_bits_to_float(h);
    if (is_nan16(h, 5)) REQUIRE(std::isnan(f));
    REQUIRE(float_to_fp16_bits(f) == h);
  }
}

TEST_CASE("fp16 -> float is exact against the reference decoding", "[dtype][fp16]") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const int sign = (h >> 15) ? -1 : 1;
    const int exp = (h >> 10) & 0x1f;
    const int mant = h & 0x3ff;
    const float f = fp16_bits_to_float(h);
    if (exp == 31) {
      REQUIRE((mant == 0 ? std::isinf(f) : std::isnan(f)));
      continue;
    }
    const double expect =
        exp == 0 ? sign * std::ldexp(mant, -24) : sign * std::ldexp(1024 + mant, exp - 25);
    REQUIRE(static_cast<double>(f) == expect);
    REQUIRE(std::signbit(f) == (sign < 0));
  }
}

TEST_CASE("rounding to bf16 and fp16 is round-to-nearest-even", "[dtype]") {
  // Every half-way point between neighbouring 16-bit values, and its neighbours in float.
  SECTION("bf16 ties and near-ties") {
    for (std::uint32_t b = 0; b < 0x7f80; ++b) {
      const std::uint32_t base = b << 16;
      for (std::uint32_t low : {0x7fffu, 0x8000u, 0x8001u, 0x0001u, 0xffffu}) {
        float f = std::bit_cast<float>(base | low);
        REQUIRE(static_cast<double>(bf16_bits_to_float(float_to_bf16_bits(f))) ==
                bf16_reference(f));
        f = -f;
        REQUIRE(static_cast<double>(bf16_bits_to_float(float_to_bf16_bits(f))) ==
                bf16_reference(f));
      }
    }
  }
  SECTION("fp16 ties and near-ties, subnormals and overflow") {
    for (std::uint32_t b = 0; b < 0x7c00; ++b) {
      const double lo = fp16_bits_to_float(static_cast<std::uint16_t>(b));
      const double hi = fp16_bits_to_float(static_cast<std::uint16_t>(b + 1));
      const float mid = static_cast<float>((lo + hi) / 2);  // exact in float
      for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
        REQUIRE(static_cast<double>(fp16_bits_to_float(float_to_fp16_bits(f))) ==
                fp16_reference(f));
        REQUIRE(static_cast<double>(fp16_bits_to_float(float_to_fp16_bits(-f))) ==
                fp16_reference(-f));
      }
    }
  }
  SECTION("random floats over the whole range") {
    std::uint64_t s = 12345;
    for (int i = 0; i < 2'000'000; ++i) {
      const auto u = static_cast<std::uint32_t>(splitmix(s));
      const float f = std::bit_cast<float>(u);
      if (std::isnan(f)) continue;
      REQUIRE(static_cast<double>(bf16_bits_to_float(float_to_bf16_bits(f))) == bf16_reference(f));
      REQUIRE(static_cast<double>(fp16_bits_to_float(float_to_fp16_bits(f))) == fp16_reference(f));
    }
  }
}

#if defined(__FLT16_MAX__) && !defined(__clang__)
TEST_CASE("fp16 conversion agrees with the compiler's _Float16", "[dtype][fp16]") {
  std::uint64_t s = 99;
  for (int i = 0; i < 1'000'000; ++i) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(splitmix(s)));
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    std::uint16_t bits;
    std::memcpy(&bits, &h, 2);
    REQUIRE(float_to_fp16_bits(f) == bits);
  }
}
#endif

TEST_CASE("known values, infinities and NaNs", "[dtype]") {
  CHECK(float_to_bf16_bits(1.0f) == 0x3f80);
  CHECK(float_to_bf16_bits(-2.0f) == 0xc000);
  CHECK(float_to_bf16_bits(3.140625f) == 0x4049);
  CHECK(float_to_bf16_bits(1.00390625f) == 0x3f80);  // tie, to even (down)
  CHECK(float_to_bf16_bits(1.01171875f) == 0x3f82);  // tie, to even (up)
  CHECK(float_to_bf16_bits(INFINITY) == 0x7f80);
  CHECK(float_to_bf16_bits(-INFINITY) == 0xff80);
  CHECK(float_to_bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);  // rounds to inf
  CHECK(float_to_bf16_bits(-0.0f) == 0x8000);
  CHECK(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
  // A NaN whose payload lives only in the low 16 bits stays a NaN.
  CHECK(std::isnan(bf16_bits_to_float(float_to_bf16_bits(std::bit_cast<float>(0x7f800001u)))));

  CHECK(float_to_fp16_bits(1.0f) == 0x3c00);
  CHECK(float_to_fp16_bits(-2.0f) == 0xc000);
  CHECK(float_to_fp16_bits(65504.0f) == 0x7bff);
  CHECK(float_to_fp16_bits(65519.99f) == 0x7bff);
  CHECK(float_to_fp16_bits(65520.0f) == 0x7c00);  // tie at max rounds to infinity (even)
  CHECK(float_to_fp16_bits(1e10f) == 0x7c00);
  CHECK(float_to_fp16_bits(-INFINITY) == 0xfc00);
  CHECK(float_to_fp16_bits(5.9604644775390625e-08f) == 0x0001);   // smallest subnormal
  CHECK(float_to_fp16_bits(2.98023223876953125e-08f) == 0x0000);  // half of it: tie to even
  CHECK(float_to_fp16_bits(3.0e-08f) == 0x0001);
  CHECK(float_to_fp16_bits(6.103515625e-05f) == 0x0400);  // smallest normal
  CHECK(std::isnan(fp16_bits_to_float(float_to_fp16_bits(NAN))));
  CHECK(std::isnan(fp16_bits_to_float(float_to_fp16_bits(std::bit_cast<float>(0x7f800001u)))));

  CHECK(static_cast<float>(bf16(0.5f)) == 0.5f);
  CHECK(static_cast<float>(fp16(0.1f)) == fp16_bits_to_float(0x2e66));
  STATIC_REQUIRE(float_to_bf16_bits(1.0f) == 0x3f80);  // constexpr
  STATIC_REQUIRE(float_to_fp16_bits(1.0f) == 0x3c00);
}

TEST_CASE("dtype tags", "[dtype]") {
  STATIC_REQUIRE(dtype_of<float> == dtype::f32);
  STATIC_REQUIRE(dtype_of<bf16> == dtype::bf16);
  STATIC_REQUIRE(dtype_of<const fp16> == dtype::f16);
  STATIC_REQUIRE(size_of(dtype::bf16) == 2);
  STATIC_REQUIRE(size_of(dtype::f64) == 8);
  CHECK(std::string(name(dtype::bf16)) == "bf16");
  STATIC_REQUIRE(float_storage<bf16> && float_storage<float> && !float_storage<double>);
}
