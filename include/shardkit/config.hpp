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

//! Everything lives in `shardkit::v0` (an inline namespace), so that binaries built against
//! different, ABI-incompatible releases fail to link instead of silently mixing layouts.
#define SHARDKIT_NAMESPACE_BEGIN \
  namespace shardkit {           \
  inline namespace v0 {
#define SHARDKIT_NAMESPACE_END \
  }                            \
  }

SHARDKIT_NAMESPACE_BEGIN
//! The library version as numbers, for run-time checks and reports.
struct version_info {
  int major;
  int minor;
  int patch;
};
inline constexpr version_info version{SHARDKIT_VERSION_MAJOR, SHARDKIT_VERSION_MINOR,
                                      SHARDKIT_VERSION_PATCH};
SHARDKIT_NAMESPACE_END
