//! \file kernels/math.hpp
//! Per-element math, written once. The host loops (kernels/host/) call these functions with
//! `V = std::experimental::simd<float>`, the CUDA kernels (kernels/cuda/) with `V = float`, so
//! the CPU tests check the arithmetic the GPU runs.
//!
//! An optimizer is a policy type with:
//!   - `state_count`: fp32 values of state per parameter element (Adam: 2, SGD momentum: 1);
//!   - `options`: its hyper-parameters; `constants`: what one step needs, from `prepare()`;
//!   - `update(p, s, g, k)`: one element's step on fp32 parameter p, state s[state_count] and the
//!     raw gradient g (already in fp32; `k.grad_scale` unscales/averages/clips it).
//!   - optionally `validate(options)`: raises invalid_argument naming a hyper-parameter that is
//!     out of range (called once per parameter group when an optimizer is built; the learning
//!     rate is checked for every optimizer);
//!   - optionally `describe(options)`: the hyper-parameters by name, as checkpoint manifests
//!     record them (without it, only the learning rate is recorded).
//! Users can plug in their own optimizer by writing such a type.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>

SHARDKIT_NAMESPACE_BEGIN

namespace detail {
//! sqrt for float (host or device) and, through ADL, for simd types.
template <class V>
SHARDKIT_HOST_DEVICE SHARDKIT_FORCEINLINE V element_sqrt(V x) {
  using std::sqrt;
  return sqrt(x);
}
}  // namespace detail

namespace detail {
//! Weight decay must be finite, non-negative and lr·wd < 1.
inline void validate_weight_decay(const char* who, float lr, float wd) {
  if (!std::isfinite(wd) || wd < 0.0f) {
    raise(who, " weight_decay must be finite and non-negative, got ", wd);
  }
  if (static_cast<double>(lr) * static_cast<double>(wd) >= 1.0) {
    raise(who, " weight_decay ", wd, " with learning rate ", lr,
          " decays by lr * weight_decay = ", static_cast<double>(lr) * static_cast<double>(wd),
          " per step; it must be below 1 (each step would flip or blow up every parameter)");
  }
}
}  // namespace detail

//! Hyper-parameters of Adam and AdamW.
struct adam_options {
  float lr = 1e-3f;           //!< learning rate
  float beta1 = 0.9f;         //!< first-moment decay
  float beta2 = 0.999f;       //!< second-moment decay
  float eps = 1e-8f;          //!< added to sqrt(v̂)
  float weight_decay = 0.0f;  //!< L2 (Adam) or decoupled (AdamW) weight decay
};

//! What one Adam(W) step needs per element, computed once per step.
struct adam_constants {
  float lr;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float inv_bias_correction1;  //!< 1 / (1 - beta1^t)
  float inv_bias_correction2;  //!< 1 / (1 - beta2^t)
  float grad_scale;            //!< multiplies the raw gradient (averaging, unscaling, clipping)
};

//! Adam (`Decoupled = false`: weight decay added to the gradient) and AdamW (`true`: decoupled
//! weight decay), as docs/accounting.md states them:
//!     g = grad·grad_scale [+ wd·p]        m = β1·m + (1-β1)·g      v = β2·v + (1-β2)·g²
//!     p = p - lr·( (m/(1-β1^t)) / (sqrt(v/(1-β2^t)) + ε) [+ wd·p] )
template <bool Decoupled>
struct adam_family {
  static constexpr std::size_t state_count = 2;
  static constexpr const char* name = Decoupled ? "adamw" : "adam";
  using options = adam_options;
  using constants = adam_constants;

  //! Constants for step `t` (1-based), learning rate `lr` (a schedule may differ from
  //! options.lr) and gradient multiplier `grad_scale`.
  static constants prepare(const options& o, std::uint64_t t, float lr, float grad_scale) {
    const double td = static_cast<double>(t);
    const double bc1 = 1.0 - std::pow(static_cast<double>(o.beta1), td);
    const double bc2 = 1.0 - std::pow(static_cast<double>(o.beta2), td);
    return constants{lr,
                     o.beta1,
                     o.beta2,
                     1.0f - o.beta1,
                     1.0f - o.beta2,
                     o.eps,
                     o.weight_decay,
                     static_cast<float>(1.0 / bc1),
                     static_cast<float>(1.0 / bc2),
                     grad_scale};
  }

  //! The hyper-parameters by name.
  static std::array<std::pair<const char*, double>, 5> describe(const options& o) {
    return {{{"lr", o.lr},
             {"beta1", o.beta1},
             {"beta2", o.beta2},
             {"eps", o.eps},
             {"weight_decay", o.weight_decay}}};
  }

  //! Raises invalid_argument unless 0 <= beta1, beta2 < 1, eps is finite and positive, and the
  //! weight decay is finite, non-negative and small enough that one step's decay lr·wd is
  //! below 1 (a larger one flips the sign of every parameter, or overflows it).
  static void validate(const options& o) {
    if (!(o.beta1 >= 0.0f && o.beta1 < 1.0f) || !(o.beta2 >= 0.0f && o.beta2 < 1.0f)) {
      detail::raise("Adam betas must lie in [0, 1), got beta1 = ", o.beta1, ", beta2 = ", o.beta2);
    }
    if (!(o.eps > 0.0f) || !std::isfinite(o.eps)) {
      detail::raise("Adam eps must be positive and finite, got ", o.eps);
    }
    detail::validate_weight_decay("Adam", o.lr, o.weight_decay);
  }

  template <class V>
  SHARDKIT_HOST_DEVICE SHARDKIT_FORCEINLINE static void update(V& p, V* s, V g,
                                                               const constants& k) {
    g = g * k.grad_scale;
    if constexpr (!Decoupled) g = g + k.weight_decay * p;
    const V m = k.beta1 * s[0] + k.one_minus_beta1 * g;
    const V v = k.beta2 * s[1] + k.one_minus_beta2 * (g * g);
    s[0] = m;
    s[1] = v;
    const V m_hat = m * k.inv_bias_correction1;
    const V v_hat = v * k.inv_bias_correction2;
    V step = m_hat / (detail::element_sqrt(v_hat) + k.eps);
    if constexpr (Decoupled) step = step + k.weight_decay * p;
    p = p - k.lr * step;
  }
};

using adam = adam_family<false>;
using adamw = adam_family<true>;

//! Hyper-parameters of SGD with momentum.
struct sgd_options {
  float lr = 1e-2f;
  float momentum = 0.9f;
  float weight_decay = 0.0f;  //!< L2, added to the gradient
};

//! SGD with (heavy-ball) momentum: g = grad·grad_scale + wd·p; b = μ·b + g; p = p - lr·b.
//! One fp32 state per element (4 bytes), against Adam's two.
struct sgd_momentum {
  static constexpr std::size_t state_count = 1;
  static constexpr const char* name = "sgd_momentum";
  using options = sgd_options;
  struct constants {
    float lr;
    float momentum;
    float weight_decay;
    float grad_scale;
  };

  static constants prepare(const options& o, std::uint64_t, float lr, float grad_scale) {
    return constants{lr, o.momentum, o.weight_decay, grad_scale};
  }

  //! The hyper-parameters by name.
  static std::array<std::pair<const char*, double>, 3> describe(const options& o) {
    return {{{"lr", o.lr}, {"momentum", o.momentum}, {"weight_decay", o.weight_decay}}};
  }

  //! Raises invalid_argument unless 0 <= momentum < 1 and the weight decay is finite,
  //! non-negative and lr·wd < 1.
  static void validate(const options& o) {
    if (!(o.momentum >= 0.0f && o.momentum < 1.0f)) {
      detail::raise("SGD momentum must lie in [0, 1), got ", o.momentum);
    }
    detail::validate_weight_decay("SGD", o.lr, o.weight_decay);
  }

  template <class V>
  SHARDKIT_HOST_DEVICE SHARDKIT_FORCEINLINE static void update(V& p, V* s, V g,
                                                               const constants& k) {
    g = g * k.grad_scale + k.weight_decay * p;
    const V b = k.momentum * s[0] + g;
    s[0] = b;
    p = p - k.lr * b;
  }
};

//! The requirements of an optimizer policy (see the file comment).
template <class O>
concept optimizer_policy = requires(const typename O::options& o, float x) {
  { O::state_count } -> std::convertible_to<std::size_t>;
  { O::name } -> std::convertible_to<const char*>;
  { O::prepare(o, std::uint64_t{1}, x, x) } -> std::same_as<typename O::constants>;
  requires requires(float& p, float* s, const typename O::constants& k) {
    O::update(p, s, x, k);
  };
};

static_assert(optimizer_policy<adam> && optimizer_policy<adamw> && optimizer_policy<sgd_momentum>);

SHARDKIT_NAMESPACE_END
