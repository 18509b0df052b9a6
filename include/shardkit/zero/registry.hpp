//! \file zero/registry.hpp
//! `param_registry`: what the ZeRO components know of a model's parameters, taken once from a
//! model_spec: names, sizes, optimizer parameter groups and units. Components use it to name
//! parameters and units in their messages and to map parameters to units; it holds no tensor
//! and no initial value, so it can outlive the model_spec it was built from.
//!
//!     shardkit::param_registry reg(model);           // shared by the components of one model
//!     shardkit::shard_grads<shardkit::thread_comm, float> grads(comm, layout, comm.rank(), reg);
//!
//! A component keeps a reference to the registry it was given: the registry must outlive it.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/zero/model.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

class param_registry {
 public:
  param_registry() = default;

  //! Takes the parameters and units of `model`. Raises invalid_argument when the last unit
  //! declared with begin_unit() has no parameters.
  explicit param_registry(const model_spec& model)
      : unit_starts_(model.unit_starts()),
        unit_names_(model.unit_names()),
        unit_options_(model.units_options()) {
    const auto ps = model.params();
    names_.reserve(ps.size());
    for (const auto& p : ps) {
      names_.push_back(p.name);
      numels_.push_back(p.numel);
      groups_.push_back(p.param_group);
    }
    if (!numels_.empty() && unit_starts_.back() >= numels_.size()) {
      detail::raise("model_spec: the last unit declared with begin_unit() has no parameters");
    }
    unit_of_.resize(numels_.size());
    for (std::size_t u = 0; u < unit_starts_.size(); ++u) {
      for (std::size_t i = unit_begin(u); i < unit_end(u); ++i) unit_of_[i] = u;
    }
  }

  //! Parameters of the given sizes without a model_spec: named "param<i>", optimizer group 0,
  //! shape {size}, units starting at `unit_starts` (empty: one unit).
  explicit param_registry(std::span<const std::size_t> numels,
                          std::span<const std::size_t> unit_starts = {})
      : param_registry(spec_of(numels, unit_starts)) {}

  //! Parameters.
  std::size_t size() const noexcept { return names_.size(); }
  const std::string& name(std::size_t i) const { return names_.at(i); }
  std::size_t numel(std::size_t i) const { return numels_.at(i); }
  //! Optimizer parameter group of parameter i (model_spec::add's param_group).
  std::size_t param_group(std::size_t i) const { return groups_.at(i); }
  std::span<const std::size_t> numels() const noexcept { return numels_; }
  std::span<const std::size_t> param_groups() const noexcept { return groups_; }

  //! Units (at least one).
  std::size_t num_units() const noexcept { return unit_starts_.size(); }
  const std::string& unit_name(std::size_t u) const { return unit_names_.at(u); }
  const unit_options& options_of_unit(std::size_t u) const { return unit_options_.at(u); }
  std::size_t unit_of(std::size_t i) const { return unit_of_.at(i); }
  //! Parameters [unit_begin(u), unit_end(u)) form unit u.
  std::size_t unit_begin(std::size_t u) const { return unit_starts_.at(u); }
  std::size_t unit_end(std::size_t u) const {
    return u + 1 < unit_starts_.size() ? unit_starts_[u + 1] : names_.size();
  }
  //! Parameter index where each unit starts (the group starts of a unit layout).
  std::span<const std::size_t> unit_starts() const noexcept { return unit_starts_; }

  //! Raises invalid_argument naming `who` unless i is a parameter index.
  void check_param(std::size_t i, const char* who) const {
    if (i >= names_.size()) {
      detail::raise(who, ": parameter index ", i, " out of range (", names_.size(),
                    " parameters registered)");
    }
  }
  //! Raises invalid_argument naming `who` unless u is a unit index.
  void check_unit(std::size_t u, const char* who) const {
    if (u >= unit_starts_.size()) {
      detail::raise(who, ": unit ", u, " out of range (", unit_starts_.size(), " units declared)");
    }
  }

  //! Raises invalid_argument naming parameter i unless `g` can be its gradient: the
  //! parameter's size, fp32/bf16/fp16 elements, in memory `space`.
  void check_gradient(std::size_t i, const any_tensor_view& g, memory_kind space,
                      const char* who) const {
    check_param(i, who);
    if (g.numel != numels_[i]) {
      detail::raise(who, ": the gradient of parameter '", names_[i], "' (#", i, ") has ", g.numel,
                    " elements, expected ", numels_[i], " (the parameter's size)");
    }
    if (g.space != space) {
      detail::raise(who, ": the gradient of parameter '", names_[i], "' is in ",
                    shardkit::name(g.space), " memory, expected ", shardkit::name(space),
                    " memory");
    }
    if (g.type != dtype::f32 && g.type != dtype::bf16 && g.type != dtype::f16) {
      detail::raise(who, ": the gradient of parameter '", names_[i], "' has ",
                    shardkit::name(g.type), " elements, expected fp32, bf16 or fp16");
    }
  }

 private:
  static model_spec spec_of(std::span<const std::size_t> numels,
                            std::span<const std::size_t> unit_starts) {
    model_spec m;
    std::size_t next = 0;
    for (std::size_t i = 0; i < numels.size(); ++i) {
      if (next < unit_starts.size() && unit_starts[next] == i) {
        m.begin_unit("unit" + std::to_string(next));
        ++next;
      }
      m.add("param" + std::to_string(i), numels[i]);
    }
    if (next < unit_starts.size()) {
      detail::raise("param_registry: unit start ", unit_starts[next], " is not a parameter index ",
                    "below ", numels.size(), " in increasing order");
    }
    return m;
  }

  std::vector<std::string> names_;
  std::vector<std::size_t> numels_;
  std::vector<std::size_t> groups_;
  std::vector<std::size_t> unit_starts_{0};
  std::vector<std::string> unit_names_{"unit0"};
  std::vector<unit_options> unit_options_{unit_options{}};
  std::vector<std::size_t> unit_of_;
};

SHARDKIT_NAMESPACE_END
