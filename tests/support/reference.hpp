// The independent, unsharded reference every engine test is checked against: Adam/AdamW in
// double precision written from the algorithms' definitions (not from the library's kernels), an
// independent round-to-nearest-even, deterministic gradients and initial values, and
// docs/accounting.md's formulas.
#pragma once

#include <shardkit/core/dtype.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ref {

inline std::uint64_t hash(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

//! Initial value of element k of parameter i: any float in [-1, 1).
inline float init_value(std::size_t i, std::size_t k) {
  return static_cast<float>(static_cast<double>(hash(i * 1'000'003 + k) >> 11) * 0x1.0p-52 - 1.0);
}

//! Gradient of element k of parameter i on rank r in micro-batch `micro` of step t: a multiple
//! of 1/64 in [-2, 2], exactly representable in bf16 and fp16, and sums of up to 8 of them are
//! exact in fp32. Never zero (so Adam's update is never 0/0-like).
inline float grad_value(std::uint64_t t, int r, std::size_t i, std::size_t k, int micro = 0) {
  const std::uint64_t h = hash((t << 48) ^ (static_cast<std::uint64_t>(r) << 40) ^
                               (static_cast<std::uint64_t>(micro) << 36) ^ (i << 24) ^ k);
  int v = static_cast<int>(h % 257) - 128;
  if (v == 0) v = 1;
  return static_cast<float>(v) / 64.0f;
}

//! Round to nearest even with `bits` significant bits (11 for fp16, 8 for bf16, 24 for fp32).
inline double round_bits(double x, int bits) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(x, &e);
  return std::ldexp(std::nearbyint(std::ldexp(x, bits - e)), e - bits);
}

template <class W>
double round_to(double x) {
  if constexpr (std::is_same_v<W, shardkit::bf16>)
    return round_bits(x, 8);
  else if constexpr (std::is_same_v<W, shardkit::fp16>)
    return round_bits(x, 11);
  else
    return round_bits(x, 24);
}

//! Adam(W) as defined (bias-corrected moments; AdamW's decay decoupled), unsharded, in double.
struct adam {
  struct hyper {
    double lr, beta1, beta2, eps, weight_decay;
  };
  std::vector<hyper> groups;       // per parameter group
  std::vector<std::size_t> group;  // per element
  bool decoupled;
  std::vector<double> p, m, v;
  int t = 0;

  //! One step with gradient g_in; every group's lr is scaled by lr_scale.
  void step(const std::vector<double>& g_in, double lr_scale = 1.0) {
    ++t;
    for (std::size_t k = 0; k < p.size(); ++k) {
      const hyper& h = groups[group[k]];
      const double bc1 = 1 - std::pow(h.beta1, t), bc2 = 1 - std::pow(h.beta2, t);
      double g = g_in[k];
      if (!decoupled) g += h.weight_decay * p[k];
      m[k] = h.beta1 * m[k] + (1 - h.beta1) * g;
      v[k] = h.beta2 * v[k] + (1 - h.beta2) * g * g;
      double upd = (m[k] / bc1) / (std::sqrt(v[k] / bc2) + h.eps);
      if (decoupled) upd += h.weight_decay * p[k];
      p[k] -= h.lr * lr_scale * upd;
    }
  }
};

//! Global L2 norm and largest magnitude of a gradient.
inline double l2_norm(const std::vector<double>& g) {
  double s = 0;
  for (double x : g) s += x * x;
  return std::sqrt(s);
}
inline double inf_norm(const std::vector<double>& g) {
  double s = 0;
  for (double x : g) s = std::max(s, std::fabs(x));
  return s;
}

//! docs/accounting.md: bytes of model state per rank, with S the padded shard and N·S the padded
//! full buffer. w: bytes per working parameter and gradient; master: 4 or 0; k: optimizer state.
struct state_bytes {
  std::uint64_t working, grads, master, moments;
};
//! As below, with g bytes per gradient element (the gradient type need not be the working type:
//! bf16 working parameters with fp32 gradients have w = 2, g = 4).
inline state_bytes facts_bytes(int stage, std::uint64_t psi, std::uint64_t n, std::uint64_t s,
                               std::uint64_t w, std::uint64_t g, std::uint64_t master,
                               std::uint64_t k) {
  switch (stage) {
    case 0:
      return {w * psi, g * psi, master * psi, k * psi};
    case 1:
      return {w * n * s, g * n * s, master * s, k * s};
    case 2:
      return {w * n * s, g * s, master * s, k * s};
    default:
      return {w * s, g * s, master * s, k * s};
  }
}
inline state_bytes facts_bytes(int stage, std::uint64_t psi, std::uint64_t n, std::uint64_t s,
                               std::uint64_t w, std::uint64_t master, std::uint64_t k) {
  return facts_bytes(stage, psi, n, s, w, w, master, k);
}

//! Bytes rank r of `ranks` sends in a ring all-reduce of n elements of w bytes (chunks
//! ⌊(q+1)n/N⌋ - ⌊qn/N⌋; every chunk but its own in each of the two phases).
inline std::uint64_t all_reduce_bytes(std::uint64_t n, std::uint64_t ranks, std::uint64_t r,
                                      std::uint64_t w) {
  if (ranks <= 1) return 0;
  auto chunk = [&](std::uint64_t q) { return (q + 1) * n / ranks - q * n / ranks; };
  return (2 * n - chunk(r) - chunk((r + 1) % ranks)) * w;
}

//! docs/accounting.md: bytes rank r sends per step. Stage 0 all-reduces Ψ elements with the ring
//! algorithm's chunks (2(N-1)/N·wΨ when N divides Ψ); stages 1 and 2 reduce-scatter and
//! all-gather N·S elements.
inline std::uint64_t facts_step_bytes(int stage, std::uint64_t psi, std::uint64_t n,
                                      std::uint64_t s, std::uint64_t w, std::uint64_t r) {
  if (n == 1) return 0;
  if (stage == 0) {
    auto chunk = [&](std::uint64_t q) { return (q + 1) * psi / n - q * psi / n; };
    return (2 * psi - chunk(r) - chunk((r + 1) % n)) * w;
  }
  return (stage == 3 ? 3 : 2) * (n - 1) * s * w;
}

//! docs/accounting.md: bytes a rank sends per step in stages 1-3 (groups sharded over n ranks,
//! shard S) when gradients and working parameters differ in size: the reduce-scatters carry
//! g-byte gradients, the all-gathers w-byte working parameters (stage 3 gathers twice). Equals
//! facts_step_bytes above when g = w.
inline std::uint64_t facts_step_bytes(int stage, std::uint64_t n, std::uint64_t s, std::uint64_t w,
                                      std::uint64_t g) {
  if (n == 1) return 0;
  return (n - 1) * s * g + (stage == 3 ? 2 : 1) * (n - 1) * s * w;
}

}  // namespace ref
