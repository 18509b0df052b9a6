//! \file adapters/torch_hooks.hpp
//! `torch_hooks<Engine>`: drives an engine's unit hooks from a LibTorch model's forward and from
//! autograd (part of the LibTorch adapter, <shardkit/adapters/torch.hpp>). See the class comment.
#pragma once

#include <shardkit/adapters/torch_tensor.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

SHARDKIT_CORE_NAMESPACE_BEGIN

// ---- driving the unit hooks from a torch model -------------------------------------------------

//! Connects an engine to a LibTorch model whose parameters are grouped in the engine's units
//! (one nn::Module block each, say). One object per rank; it must outlive every backward it
//! serves and be destroyed before the engine.
//!
//!     shardkit::torch_hooks<engine> hooks(eng, {block0->parameters(), block1->parameters()});
//!     for (each step) {
//!       at::Tensor x = input;
//!       for (std::size_t u = 0; u < eng.num_units(); ++u)
//!         x = hooks.forward(u, [&] { return blocks[u]->forward(x); });
//!       loss_of(x).backward();      // the hooks call pre_backward, grad_ready, post_backward
//!       hooks.finish_backward();
//!       eng.step();
//!     }
//!
//! Where the parameters live: at construction every parameter is bound (torch_bind) to the
//! engine's working parameters, so the module holds no copy of its own and step() updates it in
//! place. Under ZeRO-3 a parameter has memory only while its unit is gathered: forward() binds the
//! unit's parameters after pre_forward and unbinds them after post_forward; the backward rebinds
//! them after pre_backward (into the new gathered buffer) and unbinds them after post_backward.
//!
//! Why the backward order is right. forward() registers a hook on the unit's output y. Autograd
//! calls it when y's gradient is complete, before the node that produced y runs. Every node of
//! the unit's backward (every one that reads a parameter) lies between y and the unit's input,
//! so none can run before that hook: pre_backward (gather, then rebind) happens first. Each
//! parameter carries a hook that autograd calls with its finished gradient; it hands the gradient
//! to grad_ready, and the unit's last one calls post_backward, which reduce-scatters the unit's
//! gradients and frees its gathered parameters while autograd moves on to the units before it.
//!
//! Requirements: a unit's forward returns one tensor, the unit's parameters are used only inside
//! that forward, and the output is not modified in place later. Parameters used outside one
//! block's forward (tied weights: an embedding that is also the output projection; a final norm)
//! belong in a *root unit* (torch_hooks_options::root_units), driven by forward_root() around the
//! whole model's forward: see "Root units" below.
//! Frozen parameters (requires_grad false) get no hook; leave them out of the model_spec and of
//! these lists, so they stay torch's own (the engine would otherwise wait for their gradients, or,
//! with allow_missing_grads, still apply weight decay to them). LibTorch 1.13 has no
//! post-accumulate hook, so autograd still stores each gradient in the parameter's .grad after the
//! hook: the next hook (and finish_backward) drops it again, so at most one such gradient is held
//! at a time. The gradient tensor is handed to grad_ready, which copies (and converts) it into the
//! engine's buffers.
//!
//! Root units (tied weights). A root unit's parameters may be used anywhere in the forward, any
//! number of times: the token embedding that is also the output projection (GPT), the position
//! embedding, the final norm. forward_root(u, fn) runs the model's whole forward `fn` (which calls
//! forward() for the other units) with u gathered and bound. The unit stays gathered until the
//! end of the backward, as FSDP keeps its root module: under ZeRO-3 it must be declared with
//! unit_options{.reshard_after_forward = false} (or be small enough to persist), which the
//! constructor checks. Its parameters get no hook: autograd sums the gradients of every use into
//! each parameter's .grad (for a tied matrix: the embedding's and the projection's), and
//! finish_backward() hands those sums over (pre_backward, grad_ready, post_backward: one
//! reduce-scatter for the unit, after every other unit's), then drops them. Under no_grad
//! (evaluation), forward_root ends the unit's forward at once and unbinds it: no backward follows.
//! The cost: the root unit's full parameters and its full gradient are held for the whole step.
//!
//! Time in the engine: engine_seconds() adds up the time spent inside the engine's hooks
//! (pre_/post_forward, pre_/post_backward, grad_ready), which is where a rank waits for gathers
//! and copies its gradients out: the part of forward and backward that is not the model's compute.

//! Settings of torch_hooks.
struct torch_hooks_options {
  //! Units driven by forward_root (tied weights; see the class comment).
  std::vector<std::size_t> root_units;
};

template <class Engine>
class torch_hooks {
 public:
  //! `unit_params[u]` lists the parameters of engine unit u in the order they were added to the
  //! model_spec (nn::Module::parameters() order when the spec was built from it). Sizes must
  //! match the engine's parameters; each tensor must be a CPU leaf.
  torch_hooks(Engine& eng, std::vector<std::vector<at::Tensor>> unit_params,
              torch_hooks_options opts = {})
      : eng_(eng) {
    if (unit_params.size() != eng.num_units()) {
      core_detail::raise<invalid_argument>("torch_hooks: ", unit_params.size(),
                                           " lists of parameters for an engine of ",
                                           eng.num_units(), " units");
    }
    std::size_t index = 0;
    units_.resize(unit_params.size());
    for (std::size_t u = 0; u < unit_params.size(); ++u) {
      units_[u].first = index;
      for (auto& t : unit_params[u]) {
        if (index >= eng.num_params()) {
          core_detail::raise<invalid_argument>(
              "torch_hooks: more torch parameters than the engine's ", eng.num_params());
        }
        check_param(t, u, index);
        units_[u].params.push_back(t);
        units_[u].got.push_back(0);
        ++index;
      }
    }
    if (index != eng.num_params()) {
      core_detail::raise<invalid_argument>("torch_hooks: ", index,
                                           " torch parameters for the engine's ", eng.num_params());
    }
    for (const std::size_t u : opts.root_units) mark_root(u);
    // Give the module's parameters the engine's memory (ZeRO-3: none until a unit is gathered).
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if constexpr (Engine::shards_params) {
        for (auto& t : units_[u].params) {
          at::NoGradGuard no_grad;
          t.set_data(core_detail::torch_over(nullptr, t.sizes(), torch_scalar_type_of<working>));
        }
      } else {
        bind(u);
      }
    }
    // A hook per parameter that requires grad hands its gradient to the engine.
    for (std::size_t u = 0; u < units_.size(); ++u) {
      auto& x = units_[u];
      if (x.root) continue;  // autograd sums every use into .grad; finish_backward hands it on
      for (std::size_t k = 0; k < x.params.size(); ++k) {
        const at::Tensor& t = x.params[k];
        if (!t.requires_grad()) continue;
        const std::size_t i = x.first + k;
        x.hooks.push_back({k, t.register_hook([this, u, i, k](const at::Tensor& grad) {
                             on_param_grad(u, i, k, grad);
                           })});
        ++x.expected;
      }
    }
  }

  torch_hooks(const torch_hooks&) = delete;
  torch_hooks& operator=(const torch_hooks&) = delete;

  //! Removes the parameter hooks. Bound parameters keep aliasing the engine's memory.
  ~torch_hooks() {
    for (auto& x : units_) {
      for (const auto& h : x.hooks) {
        try {
          x.params[h.param].remove_hook(h.handle);
        } catch (...) {  // a destructor must not throw; the tensor may be gone already
        }
      }
    }
  }

  //! Runs unit u's forward `fn()` (returning the unit's output) between pre_forward(u) and
  //! post_forward(u), with the unit's parameters bound to its gathered values. When grad mode is
  //! on and the output requires grad, a hook on it starts the unit's backward.
  template <class F>
  at::Tensor forward(std::size_t u, F&& fn) {
    check_unit(u, "forward");
    if (units_[u].root) {
      core_detail::raise<usage_error>("torch_hooks::forward(", u, "): unit '", eng_.unit_name(u),
                                      "' is a root unit: run the model's forward inside "
                                      "forward_root(",
                                      u, ", ...)");
    }
    timed([&] { eng_.pre_forward(u); });
    if constexpr (Engine::shards_params) bind(u);
    at::Tensor y = std::forward<F>(fn)();
    timed([&] { eng_.post_forward(u); });
    if constexpr (Engine::shards_params) unbind(u);
    if (at::GradMode::is_enabled() && y.defined() && y.requires_grad()) {
      y.register_hook([this, u](const at::Tensor&) { on_output_grad(u); });
    }
    return y;
  }

  //! Runs the model's forward `fn()` with root unit u gathered and its parameters bound; `fn`
  //! calls forward() for the other units and may use u's parameters anywhere (tied weights).
  //! With grad mode on, u stays gathered and bound until finish_backward(), which hands its
  //! gradients over; under no_grad its forward ends here.
  template <class F>
  at::Tensor forward_root(std::size_t u, F&& fn) {
    check_unit(u, "forward_root");
    auto& x = units_[u];
    if (!x.root) {
      core_detail::raise<usage_error>("torch_hooks::forward_root(", u, "): unit '",
                                      eng_.unit_name(u),
                                      "' is not a root unit (torch_hooks_options::root_units)");
    }
    if (x.root_pending) {
      core_detail::raise<usage_error>("torch_hooks::forward_root(", u,
                                      "): the previous forward of "
                                      "root unit '",
                                      eng_.unit_name(u),
                                      "' has not been ended by finish_backward() (one forward, "
                                      "one backward, then finish_backward, per micro-batch)");
    }
    timed([&] { eng_.pre_forward(u); });
    if constexpr (Engine::shards_params) bind(u);
    const bool training = at::GradMode::is_enabled();
    at::Tensor y;
    try {
      y = std::forward<F>(fn)();
    } catch (...) {
      timed([&] { eng_.post_forward(u); });
      if constexpr (Engine::shards_params) unbind(u);
      throw;
    }
    timed([&] { eng_.post_forward(u); });  // kept gathered: reshard_after_forward = false
    if (training) {
      x.root_pending = true;
    } else if constexpr (Engine::shards_params) {
      unbind(u);
    }
    return y;
  }

  //! Call after each backward (each micro-batch): drops the gradient autograd kept in .grad,
  //! ends the backward of every unit whose gradients did not all arrive (the engine's
  //! post_backward then names the missing ones, usage_error, unless allow_missing_grads), and
  //! hands over the root units' gradients (their backward runs here, last).
  void finish_backward() {
    drop_kept_grad();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].in_backward) end_backward(u);
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].root_pending) finish_root(u);
    }
  }

  //! Seconds spent inside the engine's hooks since construction (or reset_engine_seconds).
  double engine_seconds() const noexcept { return engine_seconds_; }
  void reset_engine_seconds() noexcept { engine_seconds_ = 0.0; }

  //! The engine's parameter index of the k-th torch parameter of unit u.
  std::size_t param_index(std::size_t u, std::size_t k) const {
    check_unit(u, "param_index");
    if (k >= units_[u].params.size()) {
      core_detail::raise<invalid_argument>("torch_hooks::param_index: unit ", u, " has ",
                                           units_[u].params.size(), " parameters, asked for #", k);
    }
    return units_[u].first + k;
  }

 private:
  using working = typename Engine::working_type;

  struct hook {
    std::size_t param;  // index into unit::params
    unsigned handle;
  };
  struct unit {
    std::vector<at::Tensor> params;
    std::vector<hook> hooks;
    std::size_t first = 0;           // engine index of params[0]
    std::size_t expected = 0;        // parameters that require grad
    std::size_t arrived = 0;         // of them, handed over since pre_backward
    std::vector<unsigned char> got;  // per parameter: handed over since pre_backward
    bool in_backward = false;
    bool root = false;          // driven by forward_root / finish_backward
    bool root_pending = false;  // forward_root ran with grad mode on; finish_backward ends it
  };

  void check_param(const at::Tensor& t, std::size_t u, std::size_t i) const {
    const std::string& name = eng_.param_name(i);
    if (!t.defined() || !t.device().is_cpu()) {
      core_detail::raise<invalid_argument>(
          "torch_hooks: the torch parameter for '", name, "' is ",
          t.defined() ? "on " + t.device().str() : std::string("undefined"),
          "; the host engine needs CPU tensors");
    }
    if (!t.is_leaf()) {
      core_detail::raise<invalid_argument>(
          "torch_hooks: the torch tensor for '", name,
          "' is not a leaf (a parameter), it is computed by autograd");
    }
    if (eng_.unit_of(i) != u) {
      core_detail::raise<invalid_argument>("torch_hooks: the engine has parameter '", name,
                                           "' in unit ", eng_.unit_of(i),
                                           ", the torch lists in unit ", u);
    }
    const std::size_t n = eng_.layout().param(i).numel;
    if (static_cast<std::size_t>(t.numel()) != n) {
      core_detail::raise<invalid_argument>("torch_hooks: the torch parameter for '", name,
                                           "' has shape ", t.sizes(), " (", t.numel(),
                                           " elements), the engine's has ", n);
    }
  }

  void check_unit(std::size_t u, const char* what) const {
    if (u >= units_.size()) {
      core_detail::raise<invalid_argument>("torch_hooks::", what, ": unit ", u, " out of range (",
                                           units_.size(), " units)");
    }
  }

  void bind(std::size_t u) {
    auto& x = units_[u];
    for (std::size_t k = 0; k < x.params.size(); ++k)
      torch_bind(x.params[k], eng_.param(x.first + k));
  }
  void unbind(std::size_t u) {
    for (auto& t : units_[u].params) torch_unbind(t);
  }

  void on_output_grad(std::size_t u) {
    auto& x = units_[u];
    timed([&] { eng_.pre_backward(u); });
    if constexpr (Engine::shards_params) bind(u);
    x.in_backward = true;
    x.arrived = 0;
    std::fill(x.got.begin(), x.got.end(), 0);
    if (x.expected == 0) end_backward(u);
  }

  void on_param_grad(std::size_t u, std::size_t i, std::size_t k, const at::Tensor& grad) {
    drop_kept_grad();
    auto& x = units_[u];
    if (!x.in_backward) {
      core_detail::raise<usage_error>(
          "torch_hooks: the gradient of '", eng_.param_name(i),
          "' arrived outside the backward of unit ", u,
          ": its parameters must be used only inside torch_hooks::forward(", u,
          ", ...), whose output must reach the loss");
    }
    try {
      timed([&] { eng_.grad_ready(i, grad.contiguous()); });
    } catch (const usage_error& e) {
      // Typically: another unit still waits for a gradient that will never come, and holds the
      // staging buffer this one needs. Say which.
      const std::string waiting = waiting_for(u);
      if (waiting.empty()) throw;
      core_detail::raise<usage_error>(e.what(), ". torch_hooks: ", waiting);
    }
    kept_ = x.params[k];  // autograd stores `grad` in its .grad after this hook returns
    x.got[k] = 1;
    if (++x.arrived == x.expected) end_backward(u);
  }

  // Units other than u whose backward began but whose gradients did not all arrive.
  std::string waiting_for(std::size_t u) const {
    std::string s;
    for (std::size_t v = 0; v < units_.size(); ++v) {
      const auto& x = units_[v];
      if (v == u || !x.in_backward) continue;
      std::string names;
      for (std::size_t k = 0; k < x.params.size(); ++k) {
        if (x.params[k].requires_grad() && !x.got[k]) {
          names += (names.empty() ? "'" : ", '") + eng_.param_name(x.first + k) + "'";
        }
      }
      s += (s.empty() ? "" : "; ") + std::string("unit '") + eng_.unit_name(v) +
           "' still waits for the gradients of " + names;
    }
    if (!s.empty()) {
      s += " (parameters that require grad but got none in this backward: use them in the "
           "unit's forward, or, if they are frozen, leave them out of the model_spec and of "
           "torch_hooks' lists)";
    }
    return s;
  }

  void end_backward(std::size_t u) {
    units_[u].in_backward = false;
    timed([&] { eng_.post_backward(u); });
    if constexpr (Engine::shards_params) unbind(u);
  }

  void mark_root(std::size_t u) {
    check_unit(u, "root_units");
    if constexpr (Engine::shards_params) {
      if (!eng_.parameters().persistent(u) && eng_.parameters().reshard_after_forward(u)) {
        core_detail::raise<invalid_argument>(
            "torch_hooks: root unit '", eng_.unit_name(u),
            "' would be released after its forward, but its parameters are used until the end "
            "of the forward and its backward runs last: declare it with "
            "unit_options{.reshard_after_forward = false} (model_spec::begin_unit)");
      }
    }
    units_[u].root = true;
  }

  // The root unit's backward: every use's gradient has been summed into .grad by autograd.
  void finish_root(std::size_t u) {
    auto& x = units_[u];
    x.root_pending = false;
    timed([&] { eng_.pre_backward(u); });
    if constexpr (Engine::shards_params) bind(u);
    for (std::size_t k = 0; k < x.params.size(); ++k) {
      at::Tensor& t = x.params[k];
      if (!t.requires_grad()) continue;
      const at::Tensor g = t.grad();
      if (g.defined()) {
        timed([&] { eng_.grad_ready(x.first + k, g.contiguous()); });
        t.mutable_grad() = at::Tensor();
      }
    }
    timed([&] { eng_.post_backward(u); });  // names the parameters no use reached
    if constexpr (Engine::shards_params) unbind(u);
  }

  template <class F>
  void timed(F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      f();
    } catch (...) {
      engine_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      throw;
    }
    engine_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  void drop_kept_grad() {
    if (kept_.defined()) {
      kept_.mutable_grad() = at::Tensor();
      kept_ = at::Tensor();
    }
  }

  Engine& eng_;
  std::vector<unit> units_;
  at::Tensor kept_;  // the parameter whose .grad autograd filled last
  double engine_seconds_ = 0.0;
};

SHARDKIT_CORE_NAMESPACE_END
