//! \file kernels/host/simd_scalar.hpp
//! The one-lane storage of the host vector types (kernels/host/simd.hpp): `simd::vf<1>` holds
//! one float, `simd::vu<1>` one uint32. It is all a translation unit built with
//! `SHARDKIT_HOST_SCALAR_SIMD` (CUDA's: nvcc's front end cannot parse the GCC vector types of
//! the wider builds) compiles its host loops with, and what the scalar reference
//! (host::fused_step_scalar) computes with everywhere. Every operation is the scalar operation
//! a vector lane does, with the same no-contraction rule, so the results are bit-identical to
//! every vector build.
#pragma once

#include <shardkit/config.hpp>

#include <cstdint>

SHARDKIT_NAMESPACE_BEGIN
namespace simd::impl {

//! Element storage of a W-lane vector (specialised for 4, 8 and 16 lanes in simd.hpp).
template <int W>
struct storage;

template <>
struct storage<1> {
  using f = float;
  using u = std::uint32_t;
  using h = std::uint16_t;
};

}  // namespace simd::impl
SHARDKIT_NAMESPACE_END
