//! \file core/tensor.hpp
//! The Tensor concept: how shardkit sees a framework's tensors. shardkit needs four facts about a
//! tensor: where its memory lives, its element type, a pointer to its first element, and its
//! number of elements (tensors are dense and contiguous; shapes stay the framework's business).
//!
//! Adapting a framework's tensor type is one specialisation of `shardkit::tensor_traits`:
//!
//!     template <> struct shardkit::tensor_traits<my::Tensor> {
//!       using memory_space = shardkit::host_space;
//!       using value_type = float;                       // static element type, or instead:
//!       // static shardkit::dtype dtype(const my::Tensor& t);   (element type known at run time)
//!       static float* data(my::Tensor& t) { return t.ptr(); }
//!       static const float* data(const my::Tensor& t) { return t.ptr(); }
//!       static std::size_t size(const my::Tensor& t) { return t.numel(); }
//!     };
//!
//! An optional `static std::vector<std::size_t> shape(const my::Tensor& t)` gives the tensor's
//! shape (its product must be size()); without it a tensor is one-dimensional. Checkpoints and
//! safetensors exports record the shapes a model was registered with.
//!
//! Frameworks whose tensors carry their device at run time (LibTorch's torch::Tensor, for one)
//! replace `memory_space` by `static shardkit::memory_kind memory(const my::Tensor& t);`. The
//! engine then checks the memory of every tensor it is handed at run time, and its error names
//! the parameter, instead of the adapter having to claim one static space and fail inside data().
//!
//! Contiguous standard ranges of element types (std::vector<float>, std::span<bf16>,
//! std::array<fp16, N>) are host tensors out of the box.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>

#include <cstddef>
#include <cstdint>
#include <ranges>
#include <span>
#include <type_traits>
#include <vector>

SHARDKIT_CORE_NAMESPACE_BEGIN

//! Run-time name of a memory space.
enum class memory_kind : std::uint8_t { host, cuda };

template <memory_space Space>
inline constexpr memory_kind memory_kind_of =
    std::is_same_v<Space, cuda_space> ? memory_kind::cuda : memory_kind::host;

constexpr const char* name(memory_kind k) noexcept {
  return k == memory_kind::cuda ? "cuda" : "host";
}

//! Customisation point: specialise for a tensor type (see the file comment). The primary
//! template is empty, so unadapted types are not tensors.
template <class T>
struct tensor_traits {};

//! Contiguous, sized standard ranges of element types are host tensors.
template <class R>
requires std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    element_type<std::ranges::range_value_t<R>>
struct tensor_traits<R> {
  using memory_space = host_space;
  using value_type = std::ranges::range_value_t<R>;
  template <class U>
  static auto* data(U& r) {
    return std::ranges::data(r);
  }
  static std::size_t size(const R& r) { return static_cast<std::size_t>(std::ranges::size(r)); }
};

namespace core_detail {
template <class T>
using traits_of = tensor_traits<std::remove_cvref_t<T>>;

template <class T>
concept has_static_dtype = requires {
  typename traits_of<T>::value_type;
}
&&element_type<typename traits_of<T>::value_type>;

template <class T>
concept has_dynamic_dtype = requires(const std::remove_cvref_t<T>& t) {
  { traits_of<T>::dtype(t) } -> std::same_as<dtype>;
};

template <class T>
concept has_static_space = requires {
  typename traits_of<T>::memory_space;
}
&&memory_space<typename traits_of<T>::memory_space>;

template <class T>
concept has_dynamic_space = requires(const std::remove_cvref_t<T>& t) {
  { traits_of<T>::memory(t) } -> std::same_as<memory_kind>;
};

template <class T>
concept has_space = has_static_space<T> || has_dynamic_space<T>;

template <class T>
concept has_element_type = has_static_dtype<T> || has_dynamic_dtype<T>;
}  // namespace core_detail

//! A type adapted through tensor_traits: a memory space (static `memory_space`, or run-time
//! `memory(t)`, which decides when both are given), an element type (static `value_type`, or
//! run-time `dtype(t)`), data() and size().
template <class T>
concept tensor = core_detail::has_space<T> && core_detail::has_element_type<T> &&
    requires(T& t, const std::remove_cvref_t<T>& ct) {
  {core_detail::traits_of<T>::data(t)};
  requires std::is_pointer_v<decltype(core_detail::traits_of<T>::data(t))>;
  { core_detail::traits_of<T>::size(ct) } -> std::convertible_to<std::size_t>;
};

//! A tensor whose element type and memory space are known at compile time.
template <class T>
concept typed_tensor =
    tensor<T> && core_detail::has_static_dtype<T> && core_detail::has_static_space<T>;

//! The memory space of a tensor type (one with a static memory space).
template <tensor T>
requires core_detail::has_static_space<T>
using tensor_space_t = typename core_detail::traits_of<T>::memory_space;

//! Pointer to the first element.
template <tensor T>
auto* tensor_data(T& t) {
  return core_detail::traits_of<T>::data(t);
}

//! Number of elements.
template <tensor T>
std::size_t tensor_numel(const T& t) {
  return static_cast<std::size_t>(core_detail::traits_of<T>::size(t));
}

//! The tensor's shape: tensor_traits::shape(t) when the adapter gives one, else {size}.
template <tensor T>
std::vector<std::size_t> tensor_shape(const T& t) {
  if constexpr (requires { core_detail::traits_of<T>::shape(t); }) {
    auto s = core_detail::traits_of<T>::shape(t);
    return std::vector<std::size_t>(s.begin(), s.end());
  } else {
    return {tensor_numel(t)};
  }
}

//! Memory the tensor's elements live in, known statically or read from the tensor.
template <tensor T>
memory_kind tensor_memory(const T& t) {
  if constexpr (core_detail::has_dynamic_space<T>) {
    return core_detail::traits_of<T>::memory(t);
  } else {
    (void)t;
    return memory_kind_of<tensor_space_t<T>>;
  }
}

//! Element type, known statically or read from the tensor.
template <tensor T>
dtype tensor_dtype(const T& t) {
  if constexpr (core_detail::has_static_dtype<T>) {
    (void)t;
    return dtype_of<typename core_detail::traits_of<T>::value_type>;
  } else {
    return core_detail::traits_of<T>::dtype(t);
  }
}

//! A non-owning, typed, contiguous view: `size` elements of `T` at `data` in `Space`.
//! It is itself a tensor.
template <class T, memory_space Space = host_space>
class tensor_view {
 public:
  using value_type = T;
  using memory_space = Space;

  constexpr tensor_view() = default;
  constexpr tensor_view(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  //! A view of const elements from a view of mutable ones.
  template <class U>
  requires std::is_same_v<const U, T>
  constexpr tensor_view(tensor_view<U, Space> o) noexcept : data_(o.data()), size_(o.size()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  constexpr bool empty() const noexcept { return size_ == 0; }

  constexpr T& operator[](std::size_t i) const noexcept requires host_accessible<Space> {
    return data_[i];
  }
  constexpr T* begin() const noexcept requires host_accessible<Space> { return data_; }
  constexpr T* end() const noexcept requires host_accessible<Space> { return data_ + size_; }
  std::span<T> span() const noexcept requires host_accessible<Space> { return {data_, size_}; }

  //! Elements [offset, offset + count).
  constexpr tensor_view subview(std::size_t offset, std::size_t count) const {
    if (offset > size_ || count > size_ - offset) {
      core_detail::raise<invalid_argument>("tensor_view::subview: range [", offset, ", ",
                                           offset + count, ") exceeds the view's ", size_,
                                           " elements");
    }
    return {data_ + offset, count};
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

template <class T, memory_space Space>
struct tensor_traits<tensor_view<T, Space>> {
  using memory_space = Space;
  using value_type = std::remove_const_t<T>;
  static T* data(const tensor_view<T, Space>& v) { return v.data(); }
  static std::size_t size(const tensor_view<T, Space>& v) { return v.size(); }
};

//! A type-erased view of any tensor: pointer, element type, count, memory kind. Used where a
//! framework hands shardkit tensors whose element type is known only at run time.
struct any_tensor_view {
  void* data = nullptr;
  dtype type = dtype::f32;
  std::size_t numel = 0;
  memory_kind space = memory_kind::host;
  bool read_only = false;

  //! Typed view; throws invalid_argument when the element type or memory space differ.
  template <class T, memory_space Space = host_space>
  tensor_view<T, Space> as() const {
    if (type != dtype_of<std::remove_const_t<T>>) {
      core_detail::raise<invalid_argument>("tensor of ", name(type), " elements viewed as ",
                                           name(dtype_of<std::remove_const_t<T>>));
    }
    if (space != memory_kind_of<Space>) {
      core_detail::raise<invalid_argument>("tensor in ", name(space), " memory viewed as ",
                                           Space::name, " memory");
    }
    if (read_only && !std::is_const_v<T>) {
      core_detail::raise<invalid_argument>("read-only tensor viewed as writable");
    }
    return {static_cast<T*>(data), numel};
  }
};

//! Erases the static type of a tensor. The memory kind and element type are read before data(),
//! so an adapter can leave device and dtype errors to the caller's checks.
template <tensor T>
any_tensor_view erase(T& t) {
  const memory_kind space = tensor_memory(t);
  const dtype type = tensor_dtype(t);
  auto* p = tensor_data(t);
  using P = std::remove_pointer_t<decltype(p)>;
  return any_tensor_view{const_cast<std::remove_const_t<P>*>(p), type, tensor_numel(t), space,
                         std::is_const_v<P>};
}

//! A typed view of a tensor whose element type is static.
template <typed_tensor T>
auto view(T& t) {
  auto* p = tensor_data(t);
  using P = std::remove_pointer_t<decltype(p)>;
  return tensor_view<P, tensor_space_t<T>>(p, tensor_numel(t));
}

SHARDKIT_CORE_NAMESPACE_END
