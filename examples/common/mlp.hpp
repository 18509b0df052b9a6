// A deliberately small "training framework" for shardkit's examples: an MLP with ReLU, softmax
// cross-entropy, hand-written layer-by-layer forward and backward, and a synthetic
// classification data set. It stands for the user's own framework; shardkit sees only its
// parameters (through views) and its gradients (handed over layer by layer).
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

//! Synthetic classification: sample j has a pseudo-random class and features = class centre +
//! noise.
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

//! Activations of one batch: acts[l] is batch x widths[l] (after ReLU for hidden layers).
struct batch {
  std::size_t size = 0;
  std::uint64_t first = 0;  // index of the first sample
  std::vector<std::vector<float>> acts;
  std::vector<float> delta;  // dLoss/d(output of the layer being back-propagated)
};

//! Loads samples [first, first + size) as the input activations.
inline void load(const shape& s, const dataset& d, std::uint64_t first, std::size_t size,
                 batch& b) {
  b.size = size;
  b.first = first;
  b.acts.assign(s.widths.size(), {});
  b.acts[0].resize(size * s.inputs());
  for (std::size_t i = 0; i < size; ++i) d.features(first + i, &b.acts[0][i * s.inputs()]);
}

//! Forward of layer l with weights W (out x in) and bias of any float storage type.
template <class T>
void forward_layer(const shape& s, std::size_t l, shardkit::tensor_view<const T> W,
                   shardkit::tensor_view<const T> bias, batch& b) {
  const std::size_t in = s.widths[l], out = s.widths[l + 1];
  std::vector<float> w(W.size()), bb(bias.size());
  for (std::size_t k = 0; k < w.size(); ++k) w[k] = static_cast<float>(W[k]);
  for (std::size_t k = 0; k < bb.size(); ++k) bb[k] = static_cast<float>(bias[k]);
  auto& y = b.acts[l + 1];
  y.assign(b.size * out, 0.0f);
  const bool relu = l + 1 < s.layers();
  for (std::size_t i = 0; i < b.size; ++i) {
    const float* x = &b.acts[l][i * in];
    for (std::size_t o = 0; o < out; ++o) {
      float z = bb[o];
      const float* wr = &w[o * in];
      for (std::size_t k = 0; k < in; ++k) z += wr[k] * x[k];
      y[i * out + o] = relu ? std::max(z, 0.0f) : z;
    }
  }
}

//! Softmax cross-entropy of the last layer's outputs: returns the summed loss and sets
//! b.delta = dLoss_mean/dlogits (scaled by 1/size).
inline double loss_and_delta(const shape& s, const dataset& d, batch& b) {
  const std::size_t C = s.classes();
  const auto& logits = b.acts.back();
  b.delta.assign(b.size * C, 0.0f);
  double loss = 0.0;
  for (std::size_t i = 0; i < b.size; ++i) {
    const float* z = &logits[i * C];
    const float mx = *std::max_element(z, z + C);
    double sum = 0.0;
    for (std::size_t c = 0; c < C; ++c) sum += std::exp(static_cast<double>(z[c] - mx));
    const std::size_t y = d.label(b.first + i);
    loss += std::log(sum) - static_cast<double>(z[y] - mx);
    for (std::size_t c = 0; c < C; ++c) {
      const double p = std::exp(static_cast<double>(z[c] - mx)) / sum;
      b.delta[i * C + c] =
          static_cast<float>((p - (c == y ? 1.0 : 0.0)) / static_cast<double>(b.size));
    }
  }
  return loss;
}

//! Backward of layer l: writes dLoss/dW (out x in) and dLoss/dbias (fp32) and replaces b.delta
//! by dLoss/d(input of layer l) (through the previous layer's ReLU).
template <class T>
void backward_layer(const shape& s, std::size_t l, shardkit::tensor_view<const T> W, batch& b,
                    std::vector<float>& gW, std::vector<float>& gb) {
  const std::size_t in = s.widths[l], out = s.widths[l + 1];
  gW.assign(out * in, 0.0f);
  gb.assign(out, 0.0f);
  const auto& x = b.acts[l];
  for (std::size_t i = 0; i < b.size; ++i) {
    const float* dy = &b.delta[i * out];
    const float* xi = &x[i * in];
    for (std::size_t o = 0; o < out; ++o) {
      gb[o] += dy[o];
      float* g = &gW[o * in];
      for (std::size_t k = 0; k < in; ++k) g[k] += dy[o] * xi[k];
    }
  }
  if (l == 0) return;
  std::vector<float> dx(b.size * in, 0.0f);
  for (std::size_t i = 0; i < b.size; ++i) {
    for (std::size_t o = 0; o < out; ++o) {
      const float dy = b.delta[i * out + o];
      for (std::size_t k = 0; k < in; ++k) dx[i * in + k] += static_cast<float>(W[o * in + k]) * dy;
    }
    for (std::size_t k = 0; k < in; ++k) {
      if (x[i * in + k] <= 0.0f) dx[i * in + k] = 0.0f;  // ReLU of the layer below
    }
  }
  b.delta.swap(dx);
}

}  // namespace mlp
