// The body of both probes (included once by each translation unit, after shardkit).
#pragma once

#include <shardkit/comm/thread.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/zero/engine.hpp>

#include "odr/odr_probe.hpp"

#include <cstring>
#include <typeinfo>

namespace odr {
// Internal linkage: each translation unit keeps its own copy (an ordinary inline function would
// be one entity with two different definitions, which is the very fault this test looks for).
namespace {

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline probe run_probe() {
  probe out;
  out.comm_type = typeid(shardkit::thread_comm).name();
  out.lanes = shardkit::simd::width;
  // The fused step over 1,003 elements (not a multiple of any vector width).
  constexpr std::size_t n = 1003;
  std::vector<float> p(n), m(n), v(n), g(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = 0.25f + 0.001f * static_cast<float>(i);
    g[i] = 0.5f - 0.0007f * static_cast<float>(i);
  }
  float* state[2] = {m.data(), v.data()};
  // Taking the address makes the translation unit emit this instantiation as a symbol.
  auto* step = &shardkit::host::fused_step<shardkit::adamw, float, float>;
  const auto k = shardkit::adamw::prepare(shardkit::adam_options{.lr = 1e-2f, .weight_decay = 0.1f},
                                          1, 1e-2f, 1.0f);
  for (int t = 0; t < 3; ++t) step(k, p.data(), state, g.data(), nullptr, n);
  for (float x : p) out.fused_bits.push_back(bits_of(x));
  // A ZeRO-2 engine over thread ranks: the communicator's reduction and the engine's step.
  auto per_rank = shardkit::run_ranks(3, [](shardkit::thread_comm& c) {
    std::vector<std::vector<float>> init{std::vector<float>(37, 0.5f),
                                         std::vector<float>(5, -1.0f)};
    shardkit::model_spec model;
    model.add("w", init[0]);
    model.add("b", init[1]);
    shardkit::engine<shardkit::thread_comm, shardkit::zero2, shardkit::bf16, shardkit::adamw> e(
        c, model, shardkit::adam_options{.lr = 1e-2f});
    for (int s = 1; s <= 3; ++s) {
      for (std::size_t i = 2; i-- > 0;) {
        std::vector<float> grad(e.param(i).size());
        for (std::size_t q = 0; q < grad.size(); ++q) {
          grad[q] = static_cast<float>((c.rank() + 1) * s) * 0.01f * static_cast<float>(q + 1);
        }
        e.grad_ready(i, grad);
      }
      e.step();
    }
    std::vector<std::uint32_t> b;
    for (std::size_t i = 0; i < 2; ++i)
      for (auto x : e.param(i)) b.push_back(x.bits);
    return b;
  });
  out.engine_bits = per_rank[0];
  return out;
}

}  // namespace
}  // namespace odr
