//! \file kernels/host/simd_scalar.hpp
//! A one-lane stand-in for the part of std::experimental::simd that shardkit's host loops use.
//!
//! nvcc's front end cannot parse libstdc++'s <experimental/simd> (it rejects conversions between
//! GCC vector types), so a CUDA translation unit that includes a host-kernel header (the thread
//! communicator, the engine) compiles the host loops against this shim instead: `simd<T>` holds
//! one T, masks are plain `bool`. Every operation is the scalar operation the vector lanes do, so
//! the results are bit-identical to host::fused_step_scalar and to the baseline (non-FMA) build.
//! kernels/host/simd.hpp selects it under `__CUDACC__`, or anywhere when
//! `SHARDKIT_HOST_SCALAR_SIMD` is defined (which is how the CPU tests check the shim itself).
#pragma once

#include <shardkit/config.hpp>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN
namespace simd::scalar_shim {

//! Tag of the element-aligned load and store forms (as stdx::element_aligned).
struct element_aligned_tag {};
inline constexpr element_aligned_tag element_aligned{};

//! One lane of T with value semantics: converts to and from T, so every arithmetic, bitwise
//! and comparison operator is T's own (comparisons give `bool`, the one-lane mask).
template <class T>
class simd {
 public:
  using value_type = T;
  static constexpr std::size_t size() noexcept { return 1; }

  simd() = default;
  SHARDKIT_HOST_DEVICE constexpr simd(T v) noexcept
      : v_(v) {}  // NOLINT(google-explicit-constructor): broadcast
  //! Converting load of one element (as the stdx load constructor).
  template <class U>
  SHARDKIT_HOST_DEVICE simd(const U* p, element_aligned_tag) noexcept : v_(static_cast<T>(*p)) {}
  //! Converting store of one element (as stdx copy_to).
  template <class U>
  SHARDKIT_HOST_DEVICE void copy_to(U* p, element_aligned_tag) const noexcept {
    *p = static_cast<U>(v_);
  }
  SHARDKIT_HOST_DEVICE constexpr operator T() const noexcept {
    return v_;
  }  // NOLINT(google-explicit-constructor)

  SHARDKIT_HOST_DEVICE constexpr simd& operator+=(T x) noexcept {
    return v_ = static_cast<T>(v_ + x), *this;
  }
  SHARDKIT_HOST_DEVICE constexpr simd& operator-=(T x) noexcept {
    return v_ = static_cast<T>(v_ - x), *this;
  }
  SHARDKIT_HOST_DEVICE constexpr simd& operator*=(T x) noexcept {
    return v_ = static_cast<T>(v_ * x), *this;
  }
  SHARDKIT_HOST_DEVICE constexpr simd& operator/=(T x) noexcept {
    return v_ = static_cast<T>(v_ / x), *this;
  }
  SHARDKIT_HOST_DEVICE constexpr simd& operator&=(T x) noexcept requires std::is_integral_v<T> {
    return v_ = static_cast<T>(v_ & x), *this;
  }
  SHARDKIT_HOST_DEVICE constexpr simd& operator|=(T x) noexcept requires std::is_integral_v<T> {
    return v_ = static_cast<T>(v_ | x), *this;
  }

 private:
  T v_;
};

//! sqrt of the lane (found by argument-dependent lookup, as stdx::sqrt is).
template <class T>
SHARDKIT_HOST_DEVICE simd<T> sqrt(simd<T> x) noexcept {
  return simd<T>(std::sqrt(static_cast<T>(x)));
}

constexpr bool any_of(bool m) noexcept {
  return m;
}
constexpr int popcount(bool m) noexcept {
  return m ? 1 : 0;
}
template <class T>
bool isnan(simd<T> x) noexcept {
  return std::isnan(static_cast<T>(x));
}

//! `where(mask, v) = x` and `where(mask, v) += x`: assign only where the mask holds.
template <class T>
class where_expression {
 public:
  constexpr where_expression(bool m, simd<T>& v) noexcept : m_(m), v_(v) {}
  constexpr void operator=(T x) && noexcept {
    if (m_) v_ = x;
  }
  constexpr void operator+=(T x) && noexcept {
    if (m_) v_ += x;
  }

 private:
  bool m_;
  simd<T>& v_;
};

template <class T>
constexpr where_expression<T> where(bool m, simd<T>& v) noexcept {
  return {m, v};
}

//! Reinterprets the bits of a lane (as stdx::__proposed::simd_bit_cast).
template <class To, class From>
To simd_bit_cast(const From& x) noexcept {
  static_assert(sizeof(typename To::value_type) == sizeof(typename From::value_type));
  const typename From::value_type v = x;
  typename To::value_type r;
  std::memcpy(&r, &v, sizeof r);
  return To(r);
}

}  // namespace simd::scalar_shim
SHARDKIT_NAMESPACE_END
