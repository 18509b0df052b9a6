// The model the engine benchmarks step (benchmarks/engine.cpp on thread ranks,
// benchmarks/engine_mpi.cpp on MPI processes): L units, each a d x d weight and a d bias, with
// bf16 gradients a framework would hand over, and one full step on one rank (the unit hooks of a
// forward and a backward, grad_ready of every gradient in backward order, step()). No model
// compute: the time measured is the time shardkit adds to a step.
#pragma once

#include <shardkit/core/dtype.hpp>
#include <shardkit/zero/model.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace bench {

struct model_shape {
  std::size_t d;
  std::size_t layers;
  std::size_t params() const { return layers * (d * d + d); }
};

//! The shape of about `psi` parameters (Ψ = 1M, 4M, 16M, 64M, 128M: 1.05M to 134M, powers of
//! two in d and L; other values: d = 1024 and the nearest L).
inline model_shape shape_for(std::size_t psi) {
  const std::size_t mi = std::size_t{1} << 20;
  if (psi <= mi) return {512, 4};
  if (psi <= 4 * mi) return {1024, 4};
  if (psi <= 16 * mi) return {1024, 16};
  if (psi <= 64 * mi) return {2048, 16};
  if (psi <= 128 * mi) return {2048, 32};
  return {1024, (psi + 1024 * 1024 / 2) / (1024 * 1024)};
}

//! The label of a parameter count: "1M", "4M", ... (multiples of 2^20, rounded), else the count.
inline std::string psi_label(std::size_t psi) {
  const std::size_t mi = std::size_t{1} << 20;
  if (psi >= mi) return std::to_string((psi + mi / 2) / mi) + "M";
  return std::to_string(psi);
}

//! The model's initial values and its model_spec (which keeps views of them: keep this alive
//! while an engine is built from it).
struct model {
  model_shape shape;
  std::vector<std::vector<float>> init;
  shardkit::model_spec spec;

  explicit model(model_shape s) : shape(s) {
    for (std::size_t l = 0; l < s.layers; ++l) {
      init.emplace_back(s.d * s.d);
      for (std::size_t k = 0; k < init.back().size(); ++k) {
        init.back()[k] = 1e-2f * (static_cast<float>(k % 101) - 50.0f) / 50.0f;
      }
      init.emplace_back(s.d, 0.0f);
    }
    for (std::size_t l = 0; l < s.layers; ++l) {
      spec.begin_unit("layer" + std::to_string(l));
      spec.add("layer" + std::to_string(l) + ".weight", init[2 * l]);
      spec.add("layer" + std::to_string(l) + ".bias", init[2 * l + 1]);
    }
  }
  model(const model&) = delete;
  model& operator=(const model&) = delete;

  //! The gradients of every parameter as rank `rank` would hand them over (bf16; they differ
  //! between ranks).
  std::vector<std::vector<shardkit::bf16>> grads(int rank) const {
    std::vector<std::vector<shardkit::bf16>> g;
    for (const auto& p : init) {
      g.emplace_back(p.size());
      auto& x = g.back();
      for (std::size_t k = 0; k < x.size(); ++k) {
        x[k] = shardkit::bf16(
            1e-3f * (static_cast<float>((k + 7 * static_cast<std::size_t>(rank)) % 89) - 44.0f));
      }
    }
    return g;
  }
};

//! Where one rank's step spent its time, in seconds: the forward's unit hooks (ZeRO-3 gathers
//! there), the backward (hooks and grad_ready: ZeRO-0/1 copy the gradients into their flat
//! buffer, ZeRO-2/3 also reduce-scatter each bucket as it fills, ZeRO-3 gathers again), and
//! step() (the stage's remaining reduction, the optimizer on the rank's part, ZeRO-1/2's
//! all-gather). The bench has no model compute, so these are shardkit's own costs.
struct step_phases {
  double forward_s = 0;
  double backward_s = 0;
  double step_s = 0;  //!< the call to step()

  step_phases& operator+=(const step_phases& o) {
    forward_s += o.forward_s;
    backward_s += o.backward_s;
    step_s += o.step_s;
    return *this;
  }
};

//! One full step of engine `e` with gradients `g` (model::grads): the unit hooks of a forward,
//! then backward unit by unit (pre_backward, grad_ready of the unit's bias and weight,
//! post_backward), then step(). Returns step()'s report; adds the time of each part to
//! `*phases` when given (three more clock reads per step).
template <class Engine>
auto full_step_report(Engine& e, const std::vector<std::vector<shardkit::bf16>>& g,
                      step_phases* phases = nullptr) {
  using clock = std::chrono::steady_clock;
  const auto since = [](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  const auto t0 = phases ? clock::now() : clock::time_point{};
  const std::size_t units = e.num_units();
  for (std::size_t u = 0; u < units; ++u) {
    e.pre_forward(u);
    e.post_forward(u);
  }
  const auto t1 = phases ? clock::now() : clock::time_point{};
  for (std::size_t u = units; u-- > 0;) {
    e.pre_backward(u);
    e.grad_ready(2 * u + 1, g[2 * u + 1]);
    e.grad_ready(2 * u, g[2 * u]);
    e.post_backward(u);
  }
  const auto t2 = phases ? clock::now() : clock::time_point{};
  auto report = e.step();
  if (phases) {
    const auto t3 = clock::now();
    *phases += step_phases{since(t0, t1), since(t1, t2), since(t2, t3)};
  }
  return report;
}

//! full_step_report(e, g, phases), the data bytes this rank sent in the step.
template <class Engine>
std::uint64_t full_step(Engine& e, const std::vector<std::vector<shardkit::bf16>>& g,
                        step_phases* phases = nullptr) {
  return full_step_report(e, g, phases).bytes_sent;
}

//! Bytes per parameter one rank holds at `stage` on `ranks` ranks with bf16 working parameters
//! and AdamW (docs/accounting.md: working 2, gradients 2, master 4, m 4, v 4 bytes; sharded ones
//! divided by N), plus 2 bytes of buckets and gathered units, plus the 2 bytes of the framework
//! gradients the benchmark hands over.
inline double bytes_per_param(int stage, int ranks) {
  const double n = ranks;
  switch (stage) {
    case 0:
      return 16 + 2 + 2;
    case 1:
      return 4 + 12 / n + 2 + 2;
    case 2:
      return 2 + 14 / n + 2 + 2;
    default:
      return 16 / n + 2 + 2;
  }
}

//! The host memory a run of N ranks at `stage` needs for a model of `params` parameters, all
//! ranks together, plus the model's fp32 initial values.
inline double run_bytes(std::size_t params, int stage, int ranks) {
  return static_cast<double>(params) * (ranks * bytes_per_param(stage, ranks) + 4);
}

//! The process's anonymous memory and how much of it is on transparent huge pages, from
//! /proc/self/smaps_rollup (Linux; nothing elsewhere). The engine's long-lived buffers ask for
//! huge pages (core/memory.hpp); whether a run got them changes its speed, so the benches say.
struct anon_memory {
  double anonymous_mib = 0;
  double huge_mib = 0;
  double huge_share() const { return anonymous_mib > 0 ? huge_mib / anonymous_mib : 0; }
};
inline std::optional<anon_memory> read_anon_memory() {
  std::FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return std::nullopt;
  anon_memory m;
  bool found = false;
  char line[256];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long kb = 0;
    if (std::sscanf(line, "Anonymous: %llu kB", &kb) == 1) {
      m.anonymous_mib = static_cast<double>(kb) / 1024;
      found = true;
    } else if (std::sscanf(line, "AnonHugePages: %llu kB", &kb) == 1) {
      m.huge_mib = static_cast<double>(kb) / 1024;
    }
  }
  std::fclose(f);
  if (!found) return std::nullopt;
  return m;
}

}  // namespace bench
