// The training run of the device-engine tests ([engine] in test_cuda_engine.cu), shared by the
// device engine (test_cuda_engine.cu, nvcc) and its host reference (test_cuda_engine_host.cpp, g++
// with the one-lane host kernels, which compute what the baseline host build computes). The
// driver reaches memory only through an `io` object, so both sides do the same calls in the
// same order: same initial values, gradients, micro-batches, hooks and step() calls.
#pragma once

#include <shardkit/comm/thread.hpp>
#include <shardkit/zero/engine.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace test {

//! What one rank ends with, as bits.
struct engine_run {
  std::string failure;
  std::vector<std::uint32_t> params;   // every working element, parameter by parameter
  std::vector<std::uint32_t> master;   // this rank's master shard (16-bit training)
  std::vector<std::uint32_t> states;   // this rank's optimizer states, one after the other
  std::vector<std::uint32_t> reports;  // per step: skipped, grad_norm, clip_coef bits
  std::vector<std::uint64_t> ledger;   // current bytes per memory category
};

struct engine_case {
  std::vector<std::size_t> sizes{5, 0, 13, 1, 300, 3, 0, 77, 1029};
  std::vector<std::size_t> units{0, 2, 4, 7};  // where units (ZeRO-3) start
  int steps = 3;
  int micro_batches = 1;
  int inject_inf_step = 0;  // rank 0 hands over an infinite gradient in this step (0: never)
  shardkit::engine_options options{};
};

//! The host engine's results for the same case (test_cuda_engine_host.cpp): stage 0-3,
//! bf16 or fp32 working parameters, on `ranks` ranks of thread_comm.
std::vector<engine_run> host_engine_reference(int stage, bool bf16_working, int ranks,
                                              const engine_case& ec);

inline std::uint64_t engine_mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline float engine_init_value(std::size_t i, std::size_t k) {
  const std::uint64_t z = engine_mix(i * 7919 + k);
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-53 - 0.5) *
         (1.0f + static_cast<float>(i % 3));
}

// Gradients of very different magnitudes, so that rounding, the statistics' bins and the
// clipping all matter.
inline float engine_grad_value(int rank, int step, int micro, std::size_t i, std::size_t k) {
  const std::uint64_t z = engine_mix((static_cast<std::uint64_t>(rank) << 52) ^
                                     (static_cast<std::uint64_t>(step * 4 + micro) << 44) ^
                                     (static_cast<std::uint64_t>(i) << 32) ^ k);
  const double u = static_cast<double>(z >> 11) * 0x1.0p-53 - 0.5;
  return static_cast<float>(std::ldexp(u, static_cast<int>(z % 17) - 10));
}

template <class T>
std::uint32_t engine_bits(T x) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(x);
  else
    return x.bits;
}

//! One rank of a training run. Parameters with an even index receive fp32 gradients, odd ones
//! bf16, handed over last parameter first inside each unit's backward (the hooks are no-ops
//! before ZeRO-3). `io` supplies: stream() (the compute stream, nullptr on the host),
//! grad_ready(eng, i, host_vector) (hand the values over as a tensor of the engine's space),
//! bits(view) (host copy of a view, as bits), sync() (wait for the compute stream).
template <class Policies, class W, class Comm, class IO>
engine_run train_engine(Comm& c, const engine_case& ec, IO& io) {
  using namespace shardkit;
  using engine_t = engine<Comm, Policies, W, adamw>;
  engine_run out;
  const std::size_t P = ec.sizes.size();
  std::vector<std::vector<float>> init(P);
  model_spec model;
  std::size_t next_unit = 0;
  for (std::size_t i = 0; i < P; ++i) {
    for (std::size_t k = 0; k < ec.sizes[i]; ++k) init[i].push_back(engine_init_value(i, k));
    if (next_unit < ec.units.size() && ec.units[next_unit] == i) {
      model.begin_unit("u" + std::to_string(next_unit));
      ++next_unit;
    }
    model.add("p" + std::to_string(i), init[i], i % 2);
  }
  engine_options eo = ec.options;
  eo.compute_stream = io.stream();
  adam_options decay{
      .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.05f};
  adam_options no_decay = decay;
  no_decay.weight_decay = 0.0f;
  no_decay.lr = 2e-2f;
  engine_t eng(c, model, param_groups<adam_options>({decay, no_decay}), eo);

  std::vector<float> g32;
  std::vector<bf16> g16;
  auto hand_over = [&](std::size_t i, int step, int micro) {
    const std::size_t n = ec.sizes[i];
    g32.assign(n, 0.0f);
    for (std::size_t k = 0; k < n; ++k) {
      g32[k] = engine_grad_value(c.rank(), step, micro, i, k);
      if (step == ec.inject_inf_step && c.rank() == 0 && i == 4 && k == 0) g32[k] = INFINITY;
    }
    if (i % 2 == 0) {
      io.grad_ready(eng, i, g32);
    } else {
      g16.assign(n, bf16{});
      for (std::size_t k = 0; k < n; ++k) g16[k] = bf16(g32[k]);
      io.grad_ready(eng, i, g16);
    }
  };
  const std::size_t U = eng.num_units();
  auto unit_begin = [&](std::size_t u) { return ec.units.empty() ? std::size_t{0} : ec.units[u]; };
  auto unit_end = [&](std::size_t u) { return u + 1 < U ? ec.units[u + 1] : P; };
  for (int step = 1; step <= ec.steps; ++step) {
    for (int m = 0; m < ec.micro_batches; ++m) {
      if (ec.micro_batches > 1) eng.begin_micro_batch(m + 1 == ec.micro_batches);
      for (std::size_t u = 0; u < U; ++u) {
        eng.pre_forward(u);
        eng.post_forward(u);
      }
      for (std::size_t u = U; u-- > 0;) {
        eng.pre_backward(u);
        for (std::size_t i = unit_end(u); i-- > unit_begin(u);) hand_over(i, step, m);
        eng.post_backward(u);
      }
    }
    const step_report rep = eng.step();
    out.reports.push_back(rep.skipped ? 1u : 0u);
    out.reports.push_back(std::bit_cast<std::uint32_t>(rep.grad_norm));
    out.reports.push_back(std::bit_cast<std::uint32_t>(rep.clip_coef));
  }
  io.sync();
  for (std::size_t u = 0; u < U; ++u) {
    eng.pre_forward(u);
    io.sync();
    for (std::size_t i = unit_begin(u); i < unit_end(u); ++i) {
      const auto b = io.bits(eng.param(i));
      out.params.insert(out.params.end(), b.begin(), b.end());
    }
    eng.post_forward(u);
  }
  if constexpr (!std::is_same_v<W, float>) out.master = io.bits(eng.master_shard());
  for (std::size_t s = 0; s < adamw::state_count; ++s) {
    const auto b = io.bits(eng.optimizer_state(s));
    out.states.insert(out.states.end(), b.begin(), b.end());
  }
  for (std::size_t k = 0; k < memory_category_count; ++k) {
    out.ledger.push_back(eng.memory().current(static_cast<memory_category>(k)));
  }
  if (!(eng.measured_state_bytes() == eng.expected_state_bytes())) {
    out.failure = "rank " + std::to_string(c.rank()) +
                  ": the ledger's model-state bytes differ from plan/formulas.hpp";
  }
  return out;
}

}  // namespace test
