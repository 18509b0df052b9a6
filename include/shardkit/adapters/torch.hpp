//! \file adapters/torch.hpp
//! LibTorch adapter: torch::Tensor as a shardkit tensor, torch tensors over shardkit's buffers,
//! and `torch_hooks`, which drives an engine's unit hooks from a torch model's forward and from
//! autograd. Include it only where LibTorch is available; it is not part of
//! <shardkit/shardkit.hpp>. It needs only ATen's core headers (no <torch/torch.h>), and links with
//! `torch` (CMake: `find_package(Torch)`, `target_link_libraries(t PRIVATE shardkit::shardkit
//! torch)`).
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
//! - `torch_hooks<Engine>`: pre/post_forward around each unit's forward, pre_backward from a
//!   hook on the unit's output gradient, grad_ready from a hook on each parameter, post_backward
//!   when the unit's last gradient arrives. See the class comment for why this order is correct.
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
//! that forward (no weight tying across units), and the output is not modified in place later.
//! Frozen parameters (requires_grad false) get no hook; leave them out of the model_spec and of
//! these lists, so they stay torch's own (the engine would otherwise wait for their gradients, or,
//! with allow_missing_grads, still apply weight decay to them). LibTorch 1.13 has no
//! post-accumulate hook, so autograd still stores each gradient in the parameter's .grad after the
//! hook: the next hook (and finish_backward) drops it again, so at most one such gradient is held
//! at a time. The gradient tensor is handed to grad_ready, which copies (and converts) it into the
//! engine's buffers.
template <class Engine>
class torch_hooks {
 public:
  //! `unit_params[u]` lists the parameters of engine unit u in the order they were added to the
  //! model_spec (nn::Module::parameters() order when the spec was built from it). Sizes must
  //! match the engine's parameters; each tensor must be a CPU leaf.
  torch_hooks(Engine& eng, std::vector<std::vector<at::Tensor>> unit_params) : eng_(eng) {
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
    eng_.pre_forward(u);
    if constexpr (Engine::shards_params) bind(u);
    at::Tensor y = std::forward<F>(fn)();
    eng_.post_forward(u);
    if constexpr (Engine::shards_params) unbind(u);
    if (at::GradMode::is_enabled() && y.defined() && y.requires_grad()) {
      y.register_hook([this, u](const at::Tensor&) { on_output_grad(u); });
    }
    return y;
  }

  //! Call after each backward (each micro-batch): drops the gradient autograd kept in .grad and
  //! ends the backward of every unit whose gradients did not all arrive. The engine's
  //! post_backward then names the missing ones (usage_error), unless allow_missing_grads.
  void finish_backward() {
    drop_kept_grad();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].in_backward) end_backward(u);
    }
  }

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
    eng_.pre_backward(u);
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
      eng_.grad_ready(i, grad.contiguous());
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
    eng_.post_backward(u);
    if constexpr (Engine::shards_params) unbind(u);
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
};

SHARDKIT_CORE_NAMESPACE_END
