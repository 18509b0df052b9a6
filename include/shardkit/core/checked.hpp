//! \file core/checked.hpp
//! Size arithmetic that cannot wrap: every element count, byte count and offset the library
//! computes from a user's sizes goes through these, so a model too large for the address space
//! is a named error rather than a buffer of the wrong size.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <concepts>
#include <cstddef>

SHARDKIT_CORE_NAMESPACE_BEGIN

//! Raised when a size computed from a user's sizes does not fit in std::size_t.
class size_overflow : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

namespace core_detail {
[[noreturn]] inline void raise_overflow(const char* what, const char* op, unsigned long long a,
                                        unsigned long long b) {
  raise<size_overflow>(what, ": ", a, op, b, " overflows a 64-bit size (the model or the ",
                       "requested sizes are too large)");
}
}  // namespace core_detail

//! a + b, or size_overflow naming `what` and both operands.
template <std::unsigned_integral T>
constexpr T checked_add(T a, T b, const char* what) {
  T r = 0;
  if (__builtin_add_overflow(a, b, &r)) core_detail::raise_overflow(what, " + ", a, b);
  return r;
}

//! a * b, or size_overflow naming `what` and both operands.
template <std::unsigned_integral T>
constexpr T checked_mul(T a, T b, const char* what) {
  T r = 0;
  if (__builtin_mul_overflow(a, b, &r)) core_detail::raise_overflow(what, " * ", a, b);
  return r;
}

//! v rounded up to a multiple of a (a >= 1), or size_overflow naming `what`.
template <std::unsigned_integral T>
constexpr T checked_round_up(T v, T a, const char* what) {
  const T rem = v % a;
  return rem == 0 ? v : checked_add<T>(v, a - rem, what);
}

//! ceil(v / d) for d >= 1 (never overflows).
template <std::unsigned_integral T>
constexpr T ceil_div(T v, T d) noexcept {
  return v / d + (v % d != 0 ? 1 : 0);
}

SHARDKIT_CORE_NAMESPACE_END
