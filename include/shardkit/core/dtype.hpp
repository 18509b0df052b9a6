//! \file core/dtype.hpp
//! Element types: host `bf16` and `fp16` with round-to-nearest-even conversion, and the `dtype`
//! tag that describes an element type at run time.
//!
//! Conversions keep infinities, and keep NaNs as NaNs with their sign and payload (a float NaN
//! whose payload does not fit in 16 bits becomes a quiet NaN). So every one of the 65,536 bit
//! patterns of each 16-bit type survives a round trip through `float` unchanged.
#pragma once

#include <shardkit/config.hpp>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <type_traits>

SHARDKIT_CORE_NAMESPACE_BEGIN

namespace core_detail {
SHARDKIT_HOST_DEVICE constexpr std::uint32_t float_bits(float f) noexcept {
  return __builtin_bit_cast(std::uint32_t, f);
}
SHARDKIT_HOST_DEVICE constexpr float bits_float(std::uint32_t u) noexcept {
  return __builtin_bit_cast(float, u);
}
}  // namespace core_detail

//! float -> bfloat16 bits, round to nearest even; NaN keeps sign and the payload's top bits.
SHARDKIT_HOST_DEVICE constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t u = core_detail::float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: truncate, stay NaN
    const auto hi = static_cast<std::uint16_t>(u >> 16);
    return static_cast<std::uint16_t>((hi & 0x7fu) != 0 ? hi : (hi | 0x40u));
  }
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

//! bfloat16 bits -> float (exact).
SHARDKIT_HOST_DEVICE constexpr float bf16_bits_to_float(std::uint16_t h) noexcept {
  return core_detail::bits_float(static_cast<std::uint32_t>(h) << 16);
}

//! float -> IEEE binary16 bits, round to nearest even, with subnormals, overflow to infinity,
//! and NaN payloads kept where they fit.
SHARDKIT_HOST_DEVICE constexpr std::uint16_t float_to_fp16_bits(float f) noexcept {
  std::uint32_t u = core_detail::float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  std::uint32_t o = 0;
  if (u >= 0x47800000u) {  // |f| >= 65536: infinity, NaN, or overflow
    if (u > 0x7f800000u) {
      const std::uint32_t payload = (u >> 13) & 0x3ffu;
      o = 0x7c00u | (payload != 0 ? payload : 0x200u);
    } else {
      o = 0x7c00u;
    }
  } else if (u < 0x38800000u) {  // result is subnormal or zero: let the FPU round
    // Adding 0.5f aligns the 10 result mantissa bits at the bottom of the float, rounding to
    // nearest even; subtracting the bias bits leaves the fp16 encoding.
    const float aligned = core_detail::bits_float(u) + 0.5f;
    o = core_detail::float_bits(aligned) - 0x3f000000u;
  } else {  // normal: rebias the exponent and round the mantissa to nearest even
    const std::uint32_t mant_odd = (u >> 13) & 1u;
    u += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu;
    u += mant_odd;
    o = u >> 13;
  }
  return static_cast<std::uint16_t>(o | sign);
}

//! IEEE binary16 bits -> float (exact, including subnormals, infinities and NaN payloads).
SHARDKIT_HOST_DEVICE constexpr float fp16_bits_to_float(std::uint16_t h) noexcept {
  constexpr std::uint32_t shifted_exp = 0x7c00u << 13;
  std::uint32_t o = (static_cast<std::uint32_t>(h) & 0x7fffu) << 13;
  const std::uint32_t exp = shifted_exp & o;
  o += static_cast<std::uint32_t>(127 - 15) << 23;
  if (exp == shifted_exp) {  // infinity or NaN
    o += static_cast<std::uint32_t>(128 - 16) << 23;
  } else if (exp == 0) {  // zero or subnormal: renormalise through the FPU
    o += 1u << 23;
    o = core_detail::float_bits(core_detail::bits_float(o) - core_detail::bits_float(113u << 23));
  }
  return core_detail::bits_float(o | ((static_cast<std::uint32_t>(h) & 0x8000u) << 16));
}

//! Brain floating point: 1 sign, 8 exponent, 7 mantissa bits. A storage type: arithmetic
//! happens in float.
struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  SHARDKIT_HOST_DEVICE constexpr explicit bf16(float f) noexcept : bits(float_to_bf16_bits(f)) {}
  SHARDKIT_HOST_DEVICE constexpr operator float() const noexcept {  // widening is exact
    return bf16_bits_to_float(bits);
  }
  SHARDKIT_HOST_DEVICE static constexpr bf16 from_bits(std::uint16_t b) noexcept {
    bf16 r;
    r.bits = b;
    return r;
  }
};

//! IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits. A storage type: arithmetic
//! happens in float.
struct fp16 {
  std::uint16_t bits;

  fp16() = default;
  SHARDKIT_HOST_DEVICE constexpr explicit fp16(float f) noexcept : bits(float_to_fp16_bits(f)) {}
  SHARDKIT_HOST_DEVICE constexpr operator float() const noexcept {  // widening is exact
    return fp16_bits_to_float(bits);
  }
  SHARDKIT_HOST_DEVICE static constexpr fp16 from_bits(std::uint16_t b) noexcept {
    fp16 r;
    r.bits = b;
    return r;
  }
};

static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);
static_assert(sizeof(fp16) == 2 && std::is_trivially_copyable_v<fp16>);

//! Run-time description of an element type.
enum class dtype : std::uint8_t { f32, f64, bf16, f16, i32, i64, u8, u32, u64 };

//! Bytes per element.
constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::f64:
    case dtype::i64:
    case dtype::u64:
      return 8;
    case dtype::f32:
    case dtype::i32:
    case dtype::u32:
      return 4;
    case dtype::bf16:
    case dtype::f16:
      return 2;
    case dtype::u8:
      return 1;
  }
  return 0;
}

//! Short name, as used in reports and error messages ("fp32", "bf16", ...).
constexpr const char* name(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return "fp32";
    case dtype::f64:
      return "fp64";
    case dtype::bf16:
      return "bf16";
    case dtype::f16:
      return "fp16";
    case dtype::i32:
      return "int32";
    case dtype::i64:
      return "int64";
    case dtype::u8:
      return "uint8";
    case dtype::u32:
      return "uint32";
    case dtype::u64:
      return "uint64";
  }
  return "unknown";
}

inline std::ostream& operator<<(std::ostream& os, dtype t) {
  return os << name(t);
}

namespace core_detail {
template <class T>
struct dtype_of_impl;
template <>
struct dtype_of_impl<float> : std::integral_constant<dtype, dtype::f32> {};
template <>
struct dtype_of_impl<double> : std::integral_constant<dtype, dtype::f64> {};
template <>
struct dtype_of_impl<bf16> : std::integral_constant<dtype, dtype::bf16> {};
template <>
struct dtype_of_impl<fp16> : std::integral_constant<dtype, dtype::f16> {};
template <>
struct dtype_of_impl<std::int32_t> : std::integral_constant<dtype, dtype::i32> {};
template <>
struct dtype_of_impl<std::int64_t> : std::integral_constant<dtype, dtype::i64> {};
template <>
struct dtype_of_impl<std::uint8_t> : std::integral_constant<dtype, dtype::u8> {};
template <>
struct dtype_of_impl<std::uint32_t> : std::integral_constant<dtype, dtype::u32> {};
template <>
struct dtype_of_impl<std::uint64_t> : std::integral_constant<dtype, dtype::u64> {};

template <class T>
concept has_dtype = requires {
  dtype_of_impl<std::remove_cv_t<T>>::value;
};
}  // namespace core_detail

//! An element type shardkit can describe with a `dtype`.
template <class T>
concept element_type = core_detail::has_dtype<T>;

//! The run-time tag of a static element type.
template <element_type T>
inline constexpr dtype dtype_of = core_detail::dtype_of_impl<std::remove_cv_t<T>>::value;

//! A floating-point storage type that shardkit trains with: float, bf16 or fp16.
template <class T>
concept float_storage = std::is_same_v < std::remove_cv_t<T>,
float > || std::is_same_v<std::remove_cv_t<T>, bf16> || std::is_same_v<std::remove_cv_t<T>, fp16>;

//! True for the 16-bit floating-point storage types.
template <class T>
inline constexpr bool is_16bit_float =
    std::is_same_v<std::remove_cv_t<T>, bf16> || std::is_same_v<std::remove_cv_t<T>, fp16>;

//! Converts a float to any float_storage type (round to nearest even for 16-bit types).
template <float_storage T>
SHARDKIT_HOST_DEVICE constexpr T from_float(float f) noexcept {
  return T(f);
}

//! Widens any float_storage value to float (exact).
template <float_storage T>
SHARDKIT_HOST_DEVICE constexpr float to_float(T v) noexcept {
  return static_cast<float>(v);
}

SHARDKIT_CORE_NAMESPACE_END
