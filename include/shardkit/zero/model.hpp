//! \file zero/model.hpp
//! `model_spec`: what a framework registers with an engine. Each parameter has a name, a size
//! and (usually) a tensor with its initial values; parameters may be grouped into units (one
//! layer or block each) that ZeRO-3 gathers and releases together and that ZeRO-2 may use as
//! gradient buckets.
//!
//!     shardkit::model_spec model;
//!     model.begin_unit("layer0");
//!     model.add("layer0.weight", w0);   // any tensor type adapted through tensor_traits
//!     model.add("layer0.bias", b0);
//!     model.begin_unit("layer1");
//!     ...
//!
//! The spec keeps views of the initial-value tensors; they must stay alive until the engine
//! has been constructed (the engine copies them).
//!
//! A model too large for one rank is registered by shape, with an initialiser that fills any
//! element range of a parameter (sharded initialisation: each rank fills only what it holds,
//! so the same initialiser gives the same model at every N, and under ZeRO-3 no rank ever holds
//! more than its shard plus one staging block):
//!
//!     model.add("wte", {vocab, d_model}, [](std::size_t offset, std::span<float> out) {
//!       for (std::size_t k = 0; k < out.size(); ++k) out[k] = my_init(offset + k);
//!     });
//!
//! io/safetensors.hpp gives an initialiser that reads a parameter's ranges from a file.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/tensor.hpp>

#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Per-unit settings (ZeRO-3).
struct unit_options {
  //! Release the unit's gathered parameters after its forward (true), or keep them until its
  //! backward (false: one all-gather fewer per step, the unit's full parameters stay in memory
  //! between forward and backward).
  bool reshard_after_forward = true;
};

//! Fills elements [offset, offset + out.size()) of one parameter (in its flat, row-major order)
//! with their initial values. Called once per block of what a rank holds; it must give the
//! same value for the same element whatever the blocks.
using param_initializer = std::function<void(std::size_t offset, std::span<float> out)>;

//! Elements of a tensor of `shape` (the product; 1 for a scalar's empty shape). Raises
//! invalid_argument naming `what` when the product overflows std::size_t.
inline std::size_t shape_numel(std::span<const std::size_t> shape, const std::string& what) {
  std::size_t n = 1;
  for (const std::size_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) {
      detail::raise("model_spec: the shape of parameter '", what,
                    "' has more elements than std::size_t can count");
    }
  }
  return n;
}

class model_spec {
 public:
  struct param {
    std::string name;
    std::size_t numel = 0;
    std::vector<std::size_t> shape;          //!< dimensions (row-major); their product is numel
    std::optional<any_tensor_view> initial;  //!< initial values (host memory), or
    param_initializer init;                  //!< an initialiser of any range; neither = zeros
    std::size_t param_group = 0;             //!< optimizer parameter group
  };

  //! Registers a parameter whose initial values are those of `initial` (fp32, bf16 or fp16, in
  //! host memory). Returns the parameter's index.
  template <tensor T>
  std::size_t add(std::string name, T& initial, std::size_t param_group = 0) {
    any_tensor_view v = erase(initial);
    if (v.type != dtype::f32 && v.type != dtype::bf16 && v.type != dtype::f16) {
      detail::raise("model_spec::add: parameter '", name, "' has ", shardkit::name(v.type),
                    " elements; initial values must be fp32, bf16 or fp16");
    }
    if (v.space != memory_kind::host) {
      detail::raise("model_spec::add: parameter '", name, "' lives in ", shardkit::name(v.space),
                    " memory; initial values must be in host memory");
    }
    return push(std::move(name), v.numel, tensor_shape(initial), v, {}, param_group);
  }

  //! Registers a zero-initialised parameter of `numel` elements (shape {numel}).
  std::size_t add(std::string name, std::size_t numel, std::size_t param_group = 0) {
    return push(std::move(name), numel, {numel}, std::nullopt, {}, param_group);
  }

  //! Registers a zero-initialised parameter of `shape`.
  std::size_t add(std::string name, std::vector<std::size_t> shape, std::size_t param_group = 0) {
    const std::size_t n = shape_numel(shape, name);
    return push(std::move(name), n, std::move(shape), std::nullopt, {}, param_group);
  }

  //! Registers a parameter of `shape` whose initial values `init` computes, range by range
  //! (see the file comment).
  std::size_t add(std::string name, std::vector<std::size_t> shape, param_initializer init,
                  std::size_t param_group = 0) {
    if (!init) detail::raise("model_spec::add: parameter '", name, "' has an empty initialiser");
    const std::size_t n = shape_numel(shape, name);
    return push(std::move(name), n, std::move(shape), std::nullopt, std::move(init), param_group);
  }

  //! The next parameter added starts a new unit (ZeRO-3 gathers and releases per unit).
  //! Without any call, the whole model is one unit.
  model_spec& begin_unit(std::string name = {}, unit_options options = {}) {
    if (!unit_starts_.empty() && unit_starts_.back() == params_.size()) {
      if (params_.empty() && unit_starts_.size() == 1) {  // naming the first unit
        if (!name.empty()) unit_names_.back() = std::move(name);
        unit_options_.back() = options;
        return *this;
      }
      detail::raise("model_spec::begin_unit: unit '", unit_names_.back(),
                    "' has no parameters; every unit needs at least one");
    }
    unit_starts_.push_back(params_.size());
    unit_names_.push_back(name.empty() ? "unit" + std::to_string(unit_names_.size()) : name);
    unit_options_.push_back(options);
    return *this;
  }

  std::size_t size() const noexcept { return params_.size(); }
  std::span<const param> params() const noexcept { return params_; }
  const param& operator[](std::size_t i) const { return params_.at(i); }

  //! Parameter index where each unit starts (always at least one unit; the first starts at 0).
  std::vector<std::size_t> unit_starts() const {
    if (unit_starts_.empty()) return {0};
    return unit_starts_;
  }
  std::vector<std::string> unit_names() const {
    if (unit_names_.empty()) return {"unit0"};
    return unit_names_;
  }
  std::vector<unit_options> units_options() const {
    if (unit_options_.empty()) return {unit_options{}};
    return unit_options_;
  }
  std::size_t num_units() const noexcept { return unit_starts_.empty() ? 1 : unit_starts_.size(); }
  bool has_units() const noexcept { return unit_starts_.size() > 1; }

  //! Sizes of all parameters, in registration order.
  std::vector<std::size_t> numels() const {
    std::vector<std::size_t> n;
    n.reserve(params_.size());
    for (const auto& p : params_) n.push_back(p.numel);
    return n;
  }

  //! Total elements Ψ. Raises invalid_argument when it overflows std::size_t.
  std::size_t numel() const {
    std::size_t t = 0;
    for (const auto& p : params_) {
      if (__builtin_add_overflow(t, p.numel, &t)) {
        detail::raise("model_spec: the model has more elements than std::size_t can count");
      }
    }
    return t;
  }

 private:
  std::size_t push(std::string name, std::size_t numel, std::vector<std::size_t> shape,
                   std::optional<any_tensor_view> v, param_initializer init,
                   std::size_t param_group) {
    if (name.empty()) name = "param" + std::to_string(params_.size());
    if (shape_numel(shape, name) != numel) {
      detail::raise("model_spec::add: parameter '", name, "' has ", numel,
                    " elements but its shape holds ", shape_numel(shape, name));
    }
    if (!unit_starts_.empty() && unit_starts_.back() > params_.size()) {
      detail::raise("model_spec: internal unit bookkeeping error");
    }
    if (unit_starts_.empty()) {
      unit_starts_.push_back(0);
      unit_names_.push_back("unit0");
      unit_options_.push_back({});
    }
    params_.push_back(
        param{std::move(name), numel, std::move(shape), v, std::move(init), param_group});
    return params_.size() - 1;
  }

  std::vector<param> params_;
  std::vector<std::size_t> unit_starts_;
  std::vector<std::string> unit_names_;
  std::vector<unit_options> unit_options_;
};

SHARDKIT_NAMESPACE_END
