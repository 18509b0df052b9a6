//! \file adapters/torch_tensor.hpp
//! torch::Tensor as a shardkit tensor, and torch tensors over shardkit's memory (part of the
//! LibTorch adapter, <shardkit/adapters/torch.hpp>; needs only ATen's core headers).
//!
//! - `tensor_traits<at::Tensor>` (torch::Tensor is at::Tensor): element type and device are read
//!   at run time; CPU tensors are host tensors, CUDA tensors report cuda memory (so the host
//!   engine rejects them by parameter name); data() requires a dense, contiguous tensor.
//! - `torch_view(view, shape)`: a torch tensor over shardkit memory (no copy).
//! - `torch_bind(param, view)` / `torch_unbind(param)`: make an existing tensor, typically an
//!   nn::Module parameter, alias shardkit memory. A second bind of a bound tensor swaps the data
//!   pointer of its storage in place, so every view of it, including the tensors autograd saved
//!   in forward, sees the new address: what ZeRO-3 needs, since a unit is gathered into a new
//!   buffer for its backward.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/tensor.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/from_blob.h>
#include <algorithm>
#include <c10/core/Storage.h>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

SHARDKIT_CORE_NAMESPACE_BEGIN

// ---- element types -------------------------------------------------------------------------

//! The shardkit element type of a torch scalar type. Raises invalid_argument for types shardkit
//! has no equivalent of (complex, bool, int8, int16, quantized).
inline dtype dtype_from_torch(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
      return dtype::f32;
    case c10::ScalarType::Double:
      return dtype::f64;
    case c10::ScalarType::BFloat16:
      return dtype::bf16;
    case c10::ScalarType::Half:
      return dtype::f16;
    case c10::ScalarType::Int:
      return dtype::i32;
    case c10::ScalarType::Long:
      return dtype::i64;
    case c10::ScalarType::Byte:
      return dtype::u8;
    default:
      core_detail::raise<invalid_argument>(
          "torch tensors of ", c10::toString(t),
          " elements have no shardkit element type (expected Float, BFloat16, Half, Double, Int, "
          "Long or Byte)");
  }
}

//! The torch scalar type of a shardkit element type. LibTorch has no uint32/uint64 tensors.
inline c10::ScalarType torch_scalar_type(dtype d) {
  switch (d) {
    case dtype::f32:
      return c10::ScalarType::Float;
    case dtype::f64:
      return c10::ScalarType::Double;
    case dtype::bf16:
      return c10::ScalarType::BFloat16;
    case dtype::f16:
      return c10::ScalarType::Half;
    case dtype::i32:
      return c10::ScalarType::Int;
    case dtype::i64:
      return c10::ScalarType::Long;
    case dtype::u8:
      return c10::ScalarType::Byte;
    default:
      core_detail::raise<invalid_argument>("shardkit ", name(d),
                                           " elements have no LibTorch scalar type");
  }
}

namespace core_detail {
template <class T>
constexpr c10::ScalarType torch_scalar_type_for() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) {
    return c10::ScalarType::Float;
  } else if constexpr (std::is_same_v<U, double>) {
    return c10::ScalarType::Double;
  } else if constexpr (std::is_same_v<U, bf16>) {
    return c10::ScalarType::BFloat16;
  } else if constexpr (std::is_same_v<U, fp16>) {
    return c10::ScalarType::Half;
  } else if constexpr (std::is_same_v<U, std::int32_t>) {
    return c10::ScalarType::Int;
  } else if constexpr (std::is_same_v<U, std::int64_t>) {
    return c10::ScalarType::Long;
  } else {
    static_assert(std::is_same_v<U, std::uint8_t>,
                  "shardkit: this element type has no LibTorch scalar type (LibTorch has no "
                  "uint32/uint64 tensors)");
    return c10::ScalarType::Byte;
  }
}
}  // namespace core_detail

//! The torch scalar type of a static element type (float -> Float, bf16 -> BFloat16, fp16 ->
//! Half, ...). shardkit::bf16 and fp16 have the bit layout of c10::BFloat16 and c10::Half.
template <element_type T>
inline constexpr c10::ScalarType torch_scalar_type_of = core_detail::torch_scalar_type_for<T>();

static_assert(sizeof(bf16) == sizeof(c10::BFloat16) && sizeof(fp16) == sizeof(c10::Half));

//! The memory a torch device's tensors live in: CPU -> host, CUDA -> cuda. Raises
//! invalid_argument for other devices (meta, MPS, XLA, ...).
inline memory_kind torch_memory_kind(c10::Device d) {
  if (d.is_cpu()) return memory_kind::host;
  if (d.is_cuda()) return memory_kind::cuda;
  core_detail::raise<invalid_argument>("a torch tensor on device '", d.str(),
                                       "': shardkit knows host (CPU) and cuda memory only");
}

namespace core_detail {

inline void require_defined_torch(const at::Tensor& t) {
  if (!t.defined()) {
    raise<invalid_argument>("an undefined torch::Tensor (no data) was handed to shardkit");
  }
}

// Dense, contiguous, with storage: what shardkit may read as a flat array.
inline void require_flat_torch(const at::Tensor& t) {
  require_defined_torch(t);
  if (t.layout() != c10::kStrided || !t.has_storage()) {
    raise<invalid_argument>("a torch tensor with layout ", t.layout(),
                            " was handed to shardkit; it reads dense (strided) tensors only");
  }
  if (!t.is_contiguous()) {
    raise<invalid_argument>("a torch tensor of shape ", t.sizes(), " with strides ", t.strides(),
                            " is not contiguous; shardkit reads tensors as flat arrays (call "
                            ".contiguous() first)");
  }
}

// Marks storages whose memory belongs to shardkit (never frees anything).
inline void torch_shardkit_memory(void*) noexcept {}

inline c10::DataPtr torch_data_ptr(void* p) {
  return c10::DataPtr(p, p, &torch_shardkit_memory, c10::Device(c10::kCPU));
}

// A CPU tensor of `sizes` and `type` over `p` (which may be null: memory not there yet).
inline at::Tensor torch_over(void* p, at::IntArrayRef sizes, c10::ScalarType type) {
  return at::for_blob(p, sizes)
      .context(p, &torch_shardkit_memory)
      .target_device(c10::Device(c10::kCPU))
      .options(at::TensorOptions().dtype(type))
      .make_tensor();
}

inline std::int64_t numel_of(at::IntArrayRef shape) {
  std::int64_t n = 1;
  for (auto s : shape) {
    if (s < 0) raise<invalid_argument>("torch_view: negative extent in shape ", shape);
    n *= s;
  }
  return n;
}

}  // namespace core_detail

// ---- torch::Tensor as a shardkit tensor -------------------------------------------------------

//! torch::Tensor (at::Tensor) is a shardkit tensor whose element type and memory are read at run
//! time. data() requires a defined, dense, contiguous tensor (invalid_argument otherwise, saying
//! to call .contiguous()); the engine's own checks reject CUDA tensors on the host path by
//! parameter name, and element types other than fp32/bf16/fp16 where it needs those.
template <>
struct tensor_traits<at::Tensor> {
  static memory_kind memory(const at::Tensor& t) {
    core_detail::require_defined_torch(t);
    return torch_memory_kind(t.device());
  }
  static shardkit::dtype dtype(const at::Tensor& t) {
    core_detail::require_defined_torch(t);
    return dtype_from_torch(t.scalar_type());
  }
  static void* data(at::Tensor& t) {
    core_detail::require_flat_torch(t);
    return t.data_ptr();
  }
  static const void* data(const at::Tensor& t) {
    core_detail::require_flat_torch(t);
    return t.data_ptr();
  }
  static std::size_t size(const at::Tensor& t) {
    return t.defined() ? static_cast<std::size_t>(t.numel()) : 0;
  }
  //! The tensor's sizes ({} for an undefined tensor, which has no elements).
  static std::vector<std::size_t> shape(const at::Tensor& t) {
    std::vector<std::size_t> s;
    if (!t.defined()) return {0};
    for (const auto d : t.sizes()) s.push_back(static_cast<std::size_t>(d));
    return s;
  }
};

// ---- torch tensors over shardkit memory ---------------------------------------------------------

//! True when `t` is a tensor made by torch_view/torch_bind/torch_unbind, whose storage is
//! shardkit's memory (or no memory, while unbound).
inline bool torch_is_bound(const at::Tensor& t) {
  return t.defined() && t.has_storage() &&
         t.storage().data_ptr().get_deleter() == &core_detail::torch_shardkit_memory;
}

//! A CPU torch tensor of `shape` over the elements of `v`, without a copy: writes through either
//! are seen by the other. The tensor does not own the memory: it must not be used after the
//! memory is freed (under ZeRO-3, after the unit's post_* hook). `shape` must hold v.size()
//! elements. bf16 and fp16 views become BFloat16 and Half tensors.
template <class T>
at::Tensor torch_view(tensor_view<T> v, at::IntArrayRef shape) {
  static_assert(!std::is_const_v<T>,
                "shardkit::torch_view: torch has no read-only tensors; pass a view of mutable "
                "elements (engine::param(i) on a non-const engine)");
  const std::int64_t n = core_detail::numel_of(shape);
  if (static_cast<std::size_t>(n) != v.size()) {
    core_detail::raise<invalid_argument>("torch_view: shape ", shape, " holds ", n,
                                         " elements, the view has ", v.size());
  }
  return core_detail::torch_over(v.data(), shape, torch_scalar_type_of<T>);
}

//! A 1-D torch tensor over all elements of `v` (see the other overload).
template <class T>
at::Tensor torch_view(tensor_view<T> v) {
  const std::int64_t n = static_cast<std::int64_t>(v.size());
  return torch_view(v, at::IntArrayRef(&n, 1));
}

//! Makes the existing CPU tensor `t` (an nn::Module parameter, say) alias `v`, keeping its shape
//! and its autograd identity (hooks, requires_grad). The first bind replaces t's storage
//! (Tensor::set_data, which frees the module's own copy; the element type becomes v's). A later
//! bind of a bound tensor of the same element type swaps the data pointer of its storage in
//! place: every view of t, and every tensor autograd saved from it in forward, then reads the new
//! address. That is how a ZeRO-3 unit's parameters follow the unit into the buffer it is gathered
//! into for backward; the values there must be the ones forward used (they are: ZeRO-3 gathers
//! the same shard values twice in a step). Requires t.numel() == v.size().
template <class T>
void torch_bind(const at::Tensor& t, tensor_view<T> v) {
  static_assert(!std::is_const_v<T>,
                "shardkit::torch_bind: torch has no read-only tensors; pass a view of mutable "
                "elements (engine::param(i) on a non-const engine)");
  core_detail::require_defined_torch(t);
  if (!t.device().is_cpu()) {
    core_detail::raise<invalid_argument>("torch_bind: the tensor is on ", t.device().str(),
                                         "; the host engine's memory can back CPU tensors only");
  }
  if (static_cast<std::size_t>(t.numel()) != v.size()) {
    core_detail::raise<invalid_argument>("torch_bind: a tensor of shape ", t.sizes(), " (",
                                         t.numel(), " elements) cannot alias a view of ", v.size(),
                                         " elements");
  }
  const c10::ScalarType type = torch_scalar_type_of<T>;
  if (torch_is_bound(t) && t.scalar_type() == type && t.is_contiguous() &&
      t.storage_offset() == 0) {
    t.storage().set_data_ptr_noswap(core_detail::torch_data_ptr(v.data()));
    return;
  }
  at::NoGradGuard no_grad;
  t.set_data(core_detail::torch_over(v.data(), t.sizes(), type));
}

//! Points a bound tensor's storage at no memory (a null data pointer), so that a use after the
//! memory is gone (a ZeRO-3 unit released) fails at once instead of reading freed bytes. A tensor
//! that is not bound drops its own storage the same way (torch frees it) and keeps its shape,
//! element type and autograd identity; torch_bind gives it memory again.
inline void torch_unbind(const at::Tensor& t) {
  core_detail::require_defined_torch(t);
  if (torch_is_bound(t) && t.is_contiguous() && t.storage_offset() == 0) {
    t.storage().set_data_ptr_noswap(core_detail::torch_data_ptr(nullptr));
    return;
  }
  at::NoGradGuard no_grad;
  t.set_data(core_detail::torch_over(nullptr, t.sizes(), t.scalar_type()));
}

SHARDKIT_CORE_NAMESPACE_END
