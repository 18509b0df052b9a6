// shardkit — header-only ZeRO sharding primitives for C++ training frameworks.
//! \file config.hpp
//! Version, portability macros and the ABI namespace. Every other header includes this one.
#pragma once

#define SHARDKIT_VERSION_MAJOR 0
#define SHARDKIT_VERSION_MINOR 1
#define SHARDKIT_VERSION_PATCH 0
#define SHARDKIT_VERSION_STRING "0.1.0"

//! Marks functions usable from host and CUDA device code (empty in host-only builds).
#if defined(__CUDACC__)
#define SHARDKIT_HOST_DEVICE __host__ __device__
#else
#define SHARDKIT_HOST_DEVICE
#endif

//! Forces inlining of small hot helpers (the per-element math) into their callers.
#if defined(__CUDACC__)
#define SHARDKIT_FORCEINLINE __forceinline__
#elif defined(__GNUC__) || defined(__clang__)
#define SHARDKIT_FORCEINLINE inline __attribute__((always_inline))
#else
#define SHARDKIT_FORCEINLINE inline
#endif

//! Forces inlining of a lambda into its caller (host code).
#if defined(__GNUC__) || defined(__clang__)
#define SHARDKIT_DETAIL_ALWAYS_INLINE_LAMBDA __attribute__((always_inline))
#else
#define SHARDKIT_DETAIL_ALWAYS_INLINE_LAMBDA
#endif

//! The host-loop build of this translation unit. nvcc cannot parse <experimental/simd>, so
//! CUDA translation units (and any that defines SHARDKIT_HOST_SCALAR_SIMD before including
//! shardkit) compile the host loops against a one-lane stand-in (kernels/host/simd_scalar.hpp).
#if defined(__CUDACC__) && !defined(SHARDKIT_HOST_SCALAR_SIMD)
#define SHARDKIT_HOST_SCALAR_SIMD 1
#endif

//! The ABI namespaces. Everything lives in `shardkit::v0` (an inline namespace), so that binaries
//! built against different, ABI-incompatible releases fail to link instead of silently mixing
//! layouts. Inside it:
//!  - core/ (exception types, dtypes, memory spaces and buffers, layouts, ledgers, tensors, the
//!    device memory registry) is shared by every translation unit of a program:
//!    SHARDKIT_CORE_NAMESPACE_BEGIN opens `shardkit::v0`;
//!  - everything above core/ (host loops, communicators, components, engine, planner) lives in
//!    a further inline namespace named after the host-loop build, `simd_native` or
//!    `simd_scalar`: SHARDKIT_NAMESPACE_BEGIN. Their inline functions and templates call the
//!    host loops, so a .cu and a .cpp of one program would otherwise define the same entity
//!    twice, differently (an ODR violation the linker resolves at random). With the namespaces
//!    distinct each translation unit keeps its own build; passing such a type from a .cpp to a
//!    .cu is a link error ("undefined reference to ...simd_scalar::..."), never a silent mix.
//!    A .cpp that must share those types with CUDA code defines SHARDKIT_HOST_SCALAR_SIMD.
#if defined(SHARDKIT_HOST_SCALAR_SIMD)
#define SHARDKIT_HOST_BUILD_NAMESPACE simd_scalar
#else
#define SHARDKIT_HOST_BUILD_NAMESPACE simd_native
#endif
#define SHARDKIT_CORE_NAMESPACE_BEGIN \
  namespace shardkit {                \
  inline namespace v0 {
#define SHARDKIT_CORE_NAMESPACE_END \
  }                                 \
  }
#define SHARDKIT_NAMESPACE_BEGIN \
  namespace shardkit {           \
  inline namespace v0 {          \
  inline namespace SHARDKIT_HOST_BUILD_NAMESPACE {
#define SHARDKIT_NAMESPACE_END \
  }                            \
  }                            \
  }

// core/'s private helpers live in `core_detail`; the layers above see them through their own
// `detail` (qualified lookup of detail::x continues into the namespace a using-directive names).
SHARDKIT_CORE_NAMESPACE_BEGIN
namespace core_detail {}
SHARDKIT_CORE_NAMESPACE_END
SHARDKIT_NAMESPACE_BEGIN
namespace detail {
using namespace ::shardkit::v0::core_detail;
}  // namespace detail
SHARDKIT_NAMESPACE_END

SHARDKIT_CORE_NAMESPACE_BEGIN
//! The library version as numbers, for run-time checks and reports.
struct version_info {
  int major;
  int minor;
  int patch;
};
inline constexpr version_info version{SHARDKIT_VERSION_MAJOR, SHARDKIT_VERSION_MINOR,
                                      SHARDKIT_VERSION_PATCH};
SHARDKIT_CORE_NAMESPACE_END
