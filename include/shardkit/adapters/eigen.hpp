//! \file adapters/eigen.hpp
//! Eigen adapter: Eigen's dense matrices and arrays as shardkit tensors, and Eigen::Map views of
//! an engine's parameters. Include it only where Eigen 3.4 is available; it is not part of
//! <shardkit/shardkit.hpp>. CMake: `find_package(Eigen3 3.4 NO_MODULE)`, link `Eigen3::Eigen`.
//!
//!     Eigen::MatrixXf w = ...;                    // initial values
//!     model.add("fc.weight", w);                  // a tensor through tensor_traits
//!     auto W = shardkit::eigen_map(eng.param(0), rows, cols);   // no copy
//!     Eigen::MatrixXf dW = dY * X.transpose();
//!     eng.grad_ready(0, dW);
//!
//! Storage order is the framework's choice: eigen_map is column-major (Eigen's default) unless
//! asked for Eigen::RowMajor; gradients handed over must use the order the parameters use.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/tensor.hpp>

#include <Eigen/Core>
#include <cstddef>
#include <ranges>
#include <type_traits>
#include <vector>

SHARDKIT_CORE_NAMESPACE_BEGIN

namespace core_detail {
// Eigen::Matrix and Eigen::Array: they own one contiguous block.
template <class T>
concept eigen_plain = requires {
  typename T::Scalar;
  typename T::PlainObject;
}
&&std::is_same_v<T, typename T::PlainObject>&& std::is_base_of_v<Eigen::DenseBase<T>, T>;

template <class T>
struct is_contiguous_eigen_map : std::false_type {};
// A Map with the default stride (Stride<0, 0>) of a plain type views one contiguous block.
template <class P, int Options>
struct is_contiguous_eigen_map<Eigen::Map<P, Options, Eigen::Stride<0, 0>>>
    : std::bool_constant<eigen_plain<std::remove_const_t<P>>> {};

template <class T>
concept eigen_contiguous =
    (eigen_plain<T> || is_contiguous_eigen_map<T>::value) && element_type<typename T::Scalar> &&
    !(std::ranges::contiguous_range<T> && std::ranges::sized_range<T>);
}  // namespace core_detail

//! Eigen dense objects whose elements form one contiguous block (Matrix, Array, and Map with the
//! default stride, of an element type shardkit knows) are host tensors with a static element
//! type. A Map of const elements is read-only. Blocks, Refs and strided Maps are not tensors:
//! copy them into a Matrix (`Eigen::MatrixXf m = expr;`) first.
template <class T>
requires core_detail::eigen_contiguous<T>
struct tensor_traits<T> {
  using memory_space = host_space;
  using value_type = typename T::Scalar;
  template <class U>
  static auto* data(U& m) {
    return m.data();
  }
  static std::size_t size(const T& m) { return static_cast<std::size_t>(m.size()); }
  //! {rows, cols} (Eigen's logical shape; the storage order is the matrix's own).
  static std::vector<std::size_t> shape(const T& m) {
    return {static_cast<std::size_t>(m.rows()), static_cast<std::size_t>(m.cols())};
  }
};

//! An Eigen::Map of the elements of `v` as a rows x cols matrix, without a copy: writes through
//! either are seen by the other. Column-major unless `Order` is Eigen::RowMajor. A view of const
//! elements gives a Map of a const matrix. Requires rows * cols == v.size().
//! Eigen has no arithmetic on shardkit's bf16/fp16: train with float working parameters, or copy
//! 16-bit ones out with engine::copy_param_to into an Eigen::MatrixXf.
template <int Order = Eigen::ColMajor, class T>
auto eigen_map(tensor_view<T> v, Eigen::Index rows, Eigen::Index cols) {
  using U = std::remove_const_t<T>;
  static_assert(!std::is_same_v<U, bf16> && !std::is_same_v<U, fp16>,
                "shardkit::eigen_map: Eigen has no arithmetic on shardkit::bf16/fp16; use float "
                "working parameters, or engine::copy_param_to(i, an Eigen::MatrixXf)");
  static_assert(Order == Eigen::ColMajor || Order == Eigen::RowMajor,
                "shardkit::eigen_map: Order is Eigen::ColMajor or Eigen::RowMajor");
  if (rows < 0 || cols < 0 ||
      static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) != v.size()) {
    core_detail::raise<invalid_argument>("eigen_map: a ", rows, " x ", cols,
                                         " matrix does not cover the view's ", v.size(),
                                         " elements");
  }
  using matrix = Eigen::Matrix<U, Eigen::Dynamic, Eigen::Dynamic, Order>;
  using mapped = std::conditional_t<std::is_const_v<T>, const matrix, matrix>;
  return Eigen::Map<mapped>(v.data(), rows, cols);
}

//! An Eigen::Map of all elements of `v` as a column vector (see the matrix overload).
template <class T>
auto eigen_map(tensor_view<T> v) {
  using U = std::remove_const_t<T>;
  static_assert(!std::is_same_v<U, bf16> && !std::is_same_v<U, fp16>,
                "shardkit::eigen_map: Eigen has no arithmetic on shardkit::bf16/fp16; use float "
                "working parameters, or engine::copy_param_to(i, an Eigen::VectorXf)");
  using vector = Eigen::Matrix<U, Eigen::Dynamic, 1>;
  using mapped = std::conditional_t<std::is_const_v<T>, const vector, vector>;
  return Eigen::Map<mapped>(v.data(), static_cast<Eigen::Index>(v.size()));
}

SHARDKIT_CORE_NAMESPACE_END
