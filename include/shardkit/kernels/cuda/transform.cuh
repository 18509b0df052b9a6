//! \file kernels/cuda/transform.cuh
//! The element-wise kernels on cub::DeviceTransform: the fused optimizer step of one run, casts
//! and fp32 accumulation. CUB picks the launch per architecture (on Hopper, bulk copies of the
//! inputs into shared memory) and handles alignment; shardkit supplies only the per-element
//! function, the one the hand-written kernels and the host loops call (the optimizer policy's
//! `update` from kernels/math.hpp with V = float, from_float/to_float from core/dtype.hpp). The
//! per-element operations are the same, so with -fmad=false the results equal the host's bit
//! for bit, whichever path runs.
//!
//! These are the default paths of gpu::fused_step, gpu::convert and gpu::accumulate. The
//! hand-written kernels stay selectable (SHARDKIT_GPU_HANDWRITTEN_ELEMENTWISE, or the
//! gpu::elementwise_path argument) until a GPU measurement decides between them, and where CUB
//! has no one-launch form: the multi-run step table (one DeviceTransform per run would be one
//! launch per run) and the device-side overflow skip (DeviceTransform writes every element).
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>

#include <cub/device/device_transform.cuh>
#include <cuda/std/tuple>
#include <cuda_runtime.h>
#include <thrust/iterator/zip_iterator.h>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

SHARDKIT_NAMESPACE_BEGIN
namespace gpu {

//! Which implementation an element-wise kernel runs: CUB's DeviceTransform (the default) or
//! shardkit's hand-written grid-stride kernel (16-byte packs, several loads in flight).
enum class elementwise_path { cub_transform, handwritten };

#if defined(SHARDKIT_GPU_HANDWRITTEN_ELEMENTWISE)
inline constexpr elementwise_path default_elementwise_path = elementwise_path::handwritten;
#else
inline constexpr elementwise_path default_elementwise_path = elementwise_path::cub_transform;
#endif

namespace detail {

//! Raises cuda_error naming `what` when a CUB call fails; clears an earlier call's error first
//! (see clear_error_before_launch), so it is not blamed on this one.
template <class F>
void cub_call(std::string_view what, std::size_t elements, F&& call) {
  ::shardkit::detail::clear_error_before_launch(what);
  const cudaError_t e = call();
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ::shardkit::detail::cuda_check(e,
                                   ::shardkit::detail::concat(what, " (", elements, " elements)"));
  }
}

//! out = D(float(in)): the cast of host::convert.
template <class S, class D>
struct cast_op {
  __device__ SHARDKIT_FORCEINLINE D operator()(S x) const { return from_float<D>(to_float(x)); }
};

//! acc + in in fp32, rounded once to D: host::accumulate's element.
template <class S, class D>
struct accumulate_op {
  __device__ SHARDKIT_FORCEINLINE D operator()(S x, D acc) const {
    return from_float<D>(to_float(acc) + to_float(x));
  }
};

//! The fused step's element: inputs (p, s_0 .. s_{S-1}, g), result the new p and states and,
//! with a working copy, its rounded value. Opt::update as the other paths call it.
template <class Opt, class G, class W, bool WriteOut, class Seq>
struct step_op;
template <class Opt, class G, class W, bool WriteOut, std::size_t... J>
struct step_op<Opt, G, W, WriteOut, std::index_sequence<J...>> {
  typename Opt::constants k;

  template <std::size_t>
  using f32 = float;

  __device__ SHARDKIT_FORCEINLINE auto operator()(float p, f32<J>... s_in, G g) const {
    float s[sizeof...(J) > 0 ? sizeof...(J) : 1] = {s_in...};
    Opt::update(p, s, to_float(g), k);
    if constexpr (WriteOut)
      return ::cuda::std::make_tuple(p, s[J]..., from_float<W>(p));
    else
      return ::cuda::std::make_tuple(p, s[J]...);
  }
};

template <class Opt, class G, class W, bool WriteOut, std::size_t... J>
void transform_step(const typename Opt::constants& k, float* params, float* const* state,
                    const G* grads, W* working_out, std::size_t n, cudaStream_t stream,
                    std::index_sequence<J...> seq) {
  using op = step_op<Opt, G, W, WriteOut, std::index_sequence<J...>>;
  auto inputs = ::cuda::std::make_tuple(static_cast<const float*>(params),
                                        static_cast<const float*>(state[J])..., grads);
  cub_call("gpu::fused_step (cub::DeviceTransform)", n, [&] {
    if constexpr (WriteOut) {
      return cub::DeviceTransform::Transform(
          inputs, thrust::make_zip_iterator(params, state[J]..., working_out),
          static_cast<std::int64_t>(n), op{k}, stream);
    } else {
      return cub::DeviceTransform::Transform(inputs, thrust::make_zip_iterator(params, state[J]...),
                                             static_cast<std::int64_t>(n), op{k}, stream);
    }
  });
  (void)seq;
}

}  // namespace detail

//! The fused step of one run on cub::DeviceTransform (gpu::fused_step's default path; the
//! contract of gpu::fused_step, without the device-side skip). Parameters and states are read
//! and written in place: each element's outputs depend on that element's inputs only.
template <class Opt, class G, class W>
void fused_step_transform(const typename Opt::constants& k, float* params, float* const* state,
                          const G* grads, W* working_out, std::size_t n, device_stream stream) {
  if (n == 0) return;
  constexpr auto seq = std::make_index_sequence<Opt::state_count>{};
  if (working_out != nullptr)
    detail::transform_step<Opt, G, W, true>(k, params, state, grads, working_out, n, stream, seq);
  else
    detail::transform_step<Opt, G, W, false>(k, params, state, grads, working_out, n, stream, seq);
}

//! out[i] = D(in[i]) on cub::DeviceTransform (gpu::convert's default path for S != D).
template <float_storage S, float_storage D>
void convert_transform(const S* in, D* out, std::size_t n, device_stream stream) {
  if (n == 0) return;
  detail::cub_call("gpu::convert (cub::DeviceTransform)", n, [&] {
    return cub::DeviceTransform::Transform(in, out, static_cast<std::int64_t>(n),
                                           detail::cast_op<S, D>{}, stream);
  });
}

//! acc[i] = acc[i] + in[i] in fp32, rounded once, on cub::DeviceTransform (gpu::accumulate's
//! default path; in place: the output is one of the inputs).
template <float_storage S, float_storage D>
void accumulate_transform(const S* in, D* acc, std::size_t n, device_stream stream) {
  if (n == 0) return;
  detail::cub_call("gpu::accumulate (cub::DeviceTransform)", n, [&] {
    return cub::DeviceTransform::Transform(::cuda::std::make_tuple(in, static_cast<const D*>(acc)),
                                           acc, static_cast<std::int64_t>(n),
                                           detail::accumulate_op<S, D>{}, stream);
  });
}

}  // namespace gpu
SHARDKIT_NAMESPACE_END
