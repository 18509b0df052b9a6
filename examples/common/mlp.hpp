// A deliberately small "training framework" for shardkit's examples: an MLP with ReLU, softmax
// cross-entropy, hand-written backward, and a synthetic classification data set. It stands for
// the user's own framework; shardkit sees only its parameters and gradients.
#pragma once

#include <shardkit/core/dtype.hpp>
#include <shardkit/core/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace mlp {

//! Counter-based random numbers: the value for (seed, index) never depends on call order, so
//! every rank and the single-rank reference see the same data and initial weights.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline float uniform(std::uint64_t seed, std::uint64_t i) {  // [-1, 1)
  return static_cast<float>(
      static_cast<double>(mix(seed * 0x100000001b3ull + i) >> 11) * 0x1.0p-52 - 1.0);
}
inline float normal(std::uint64_t seed, std::uint64_t i) {  // Box-Muller
  const double u1 = (static_cast<double>(mix(seed ^ (2 * i)) >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(mix(seed ^ (2 * i + 1)) >> 11) * 0x1.0p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

//! Layer sizes, e.g. {64, 256, 10}: Linear(64, 256) + ReLU + Linear(256, 10).
struct shape {
  std::vector<std::size_t> widths;
  std::size_t layers() const { return widths.size() - 1; }
  std::size_t inputs() const { return widths.front(); }
  std::size_t classes() const { return widths.back(); }
  //! Parameter sizes in registration order: W0 (out x in), b0, W1, b1, ...
  std::vector<std::size_t> param_sizes() const {
    std::vector<std::size_t> s;
    for (std::size_t l = 0; l < layers(); ++l) {
      s.push_back(widths[l + 1] * widths[l]);
      s.push_back(widths[l + 1]);
    }
    return s;
  }
  std::size_t num_params() const {
    std::size_t t = 0;
    for (auto n : param_sizes()) t += n;
    return t;
  }
};

//! Initial weights: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)); biases zero.
inline std::vector<std::vector<float>> init_params(const shape& s, std::uint64_t seed) {
  std::vector<std::vector<float>> p;
  std::uint64_t counter = 0;
  for (std::size_t l = 0; l < s.layers(); ++l) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(s.widths[l]));
    std::vector<float> w(s.widths[l + 1] * s.widths[l]);
    for (auto& x : w) x = bound * uniform(seed, counter++);
    p.push_back(std::move(w));
    p.emplace_back(s.widths[l + 1], 0.0f);
  }
  return p;
}

//! Synthetic classification: sample j has class j mod C and features = class centre + noise.
struct dataset {
  shape s;
  std::uint64_t seed;
  float noise = 2.0f;
  std::size_t label(std::uint64_t j) const {
    return static_cast<std::size_t>(mix(seed + j) % s.classes());
  }
  void features(std::uint64_t j, float* x) const {
    const std::size_t c = label(j);
    for (std::size_t k = 0; k < s.inputs(); ++k) {
      x[k] = normal(seed + 77, c * s.inputs() + k) + noise * normal(seed + 1000003 + j, k);
    }
  }
};

//! One forward + backward pass over samples [first, first + count) with fp32 compute.
//! `params` are the current parameter values (any float storage type); returns the summed
//! loss and writes dLoss_mean/dparam into `grads` (fp32, scaled by 1/count).
template <class T>
double forward_backward(const shape& s, const dataset& data,
                        std::span<const shardkit::tensor_view<const T>> params, std::uint64_t first,
                        std::size_t count, std::vector<std::vector<float>>& grads) {
  const std::size_t L = s.layers();
  std::vector<std::vector<float>> p(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    p[i].resize(params[i].size());
    for (std::size_t k = 0; k < params[i].size(); ++k) p[i][k] = static_cast<float>(params[i][k]);
  }
  grads.assign(params.size(), {});
  for (std::size_t i = 0; i < params.size(); ++i) grads[i].assign(params[i].size(), 0.0f);

  double loss = 0.0;
  std::vector<std::vector<float>> act(L + 1);
  for (std::size_t l = 0; l <= L; ++l) act[l].resize(s.widths[l]);
  std::vector<float> delta, prev_delta;
  const float inv = 1.0f / static_cast<float>(count);
  for (std::size_t b = 0; b < count; ++b) {
    data.features(first + b, act[0].data());
    for (std::size_t l = 0; l < L; ++l) {
      const auto& W = p[2 * l];
      const auto& bias = p[2 * l + 1];
      const std::size_t in = s.widths[l], out = s.widths[l + 1];
      for (std::size_t o = 0; o < out; ++o) {
        float z = bias[o];
        for (std::size_t k = 0; k < in; ++k) z += W[o * in + k] * act[l][k];
        act[l + 1][o] = (l + 1 < L) ? std::max(z, 0.0f) : z;
      }
    }
    // softmax cross-entropy
    const auto& logits = act[L];
    const float mx = *std::max_element(logits.begin(), logits.end());
    double z = 0.0;
    for (float v : logits) z += std::exp(static_cast<double>(v - mx));
    const std::size_t y = data.label(first + b);
    loss += std::log(z) - static_cast<double>(logits[y] - mx);
    delta.assign(s.classes(), 0.0f);
    for (std::size_t c = 0; c < s.classes(); ++c) {
      delta[c] = static_cast<float>(std::exp(static_cast<double>(logits[c] - mx)) / z) -
                 (c == y ? 1.0f : 0.0f);
    }
    for (std::size_t l = L; l-- > 0;) {
      const std::size_t in = s.widths[l], out = s.widths[l + 1];
      auto& gW = grads[2 * l];
      auto& gb = grads[2 * l + 1];
      for (std::size_t o = 0; o < out; ++o) {
        gb[o] += inv * delta[o];
        for (std::size_t k = 0; k < in; ++k) gW[o * in + k] += inv * delta[o] * act[l][k];
      }
      if (l == 0) break;
      prev_delta.assign(in, 0.0f);
      const auto& W = p[2 * l];
      for (std::size_t o = 0; o < out; ++o) {
        for (std::size_t k = 0; k < in; ++k) prev_delta[k] += W[o * in + k] * delta[o];
      }
      for (std::size_t k = 0; k < in; ++k) {
        if (act[l][k] <= 0.0f) prev_delta[k] = 0.0f;  // ReLU
      }
      delta.swap(prev_delta);
    }
  }
  return loss;
}

}  // namespace mlp
