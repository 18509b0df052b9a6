// One full training step of the ZeRO engine (zero/engine.hpp) at N = 4 in-process ranks (the
// thread communicator), for stages 0, 1, 2 and 3, with bf16 working parameters and AdamW.
//
//  engine/step/stage:S/params:P   per iteration, on every rank: the unit hooks of a forward
//                                 and a backward (ZeRO-3 gathers there), every gradient handed
//                                 over with grad_ready (ZeRO-2/3 reduce-scatter buckets as they
//                                 fill), then step() (reduce, fused optimizer on the rank's
//                                 part, gather). No model compute: this is the time shardkit
//                                 adds to a step.
//
// The fixed model: L units, each a d x d weight and a d bias (d = 1024, L = 8 in the full run:
// 8.4M parameters). Stage 0 is the baseline the others are reported against. Counters:
// sent = data bytes rank 0 sent in the step (the engine's step_report).
#include <shardkit/comm/thread.hpp>
#include <shardkit/zero/engine.hpp>

#include "common.hpp"

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int ranks = 4;

struct model_shape {
  std::size_t d;
  std::size_t layers;
  std::size_t params() const { return layers * (d * d + d); }
};

template <int Stage>
void bm_step(benchmark::State& state, model_shape shape) {
  using engine_t = shardkit::engine<shardkit::thread_comm, shardkit::stage<Stage>, shardkit::bf16,
                                    shardkit::adamw>;
  auto group = std::make_shared<shardkit::detail::thread_group_state>(
      ranks, shardkit::thread_comm_options{});
  std::vector<shardkit::thread_comm> comms;
  for (int r = 0; r < ranks; ++r) comms.emplace_back(group, r);

  shardkit::model_spec model;
  std::vector<std::vector<float>> init;
  for (std::size_t l = 0; l < shape.layers; ++l) {
    init.emplace_back(shape.d * shape.d);
    for (std::size_t k = 0; k < init.back().size(); ++k) {
      init.back()[k] = 1e-2f * (static_cast<float>(k % 101) - 50.0f) / 50.0f;
    }
    init.emplace_back(shape.d, 0.0f);
  }
  for (std::size_t l = 0; l < shape.layers; ++l) {
    model.begin_unit("layer" + std::to_string(l));
    model.add("layer" + std::to_string(l) + ".weight", init[2 * l]);
    model.add("layer" + std::to_string(l) + ".bias", init[2 * l + 1]);
  }
  // Per rank, the gradients a framework would hand over (bf16, different on every rank).
  std::vector<std::vector<std::vector<shardkit::bf16>>> grads(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (const auto& p : init) {
      grads[static_cast<std::size_t>(r)].emplace_back(p.size());
      auto& g = grads[static_cast<std::size_t>(r)].back();
      for (std::size_t k = 0; k < g.size(); ++k) {
        g[k] = shardkit::bf16(
            1e-3f * (static_cast<float>((k + 7 * static_cast<std::size_t>(r)) % 89) - 44.0f));
      }
    }
  }

  std::vector<std::optional<engine_t>> engines(ranks);
  std::vector<std::uint64_t> sent(ranks);
  bench::team team(ranks);
  team.run([&](int r) {
    engines[static_cast<std::size_t>(r)].emplace(comms[static_cast<std::size_t>(r)], model,
                                                 shardkit::adam_options{.lr = 1e-4f});
  });
  const std::function<void(int)> step = [&](int r) {
    engine_t& e = *engines[static_cast<std::size_t>(r)];
    const auto& g = grads[static_cast<std::size_t>(r)];
    const std::size_t units = e.num_units();
    for (std::size_t u = 0; u < units; ++u) {
      e.pre_forward(u);
      e.post_forward(u);
    }
    for (std::size_t u = units; u-- > 0;) {
      e.pre_backward(u);
      e.grad_ready(2 * u + 1, g[2 * u + 1]);
      e.grad_ready(2 * u, g[2 * u]);
      e.post_backward(u);
    }
    sent[static_cast<std::size_t>(r)] = e.step().bytes_sent;
  };
  team.run(step);  // warm-up: ZeRO-3 learns its prefetch order in the first step
  for (auto _ : state) team.run(step);
  team.run([&](int r) { engines[static_cast<std::size_t>(r)].reset(); });
  state.counters["stage"] = Stage;
  state.counters["ranks"] = ranks;
  state.counters["params"] = static_cast<double>(shape.params());
  state.counters["sent"] = static_cast<double>(sent[0]);
}

void register_all(bench::size_set s) {
  const model_shape shape = s == bench::size_set::tiny    ? model_shape{64, 2}
                            : s == bench::size_set::quick ? model_shape{512, 8}
                                                          : model_shape{1024, 8};
  const std::string tail = "/params:" + std::to_string(shape.params());
  auto reg = [&](int stage, auto fn) {
    benchmark::RegisterBenchmark(("engine/step/stage:" + std::to_string(stage) + tail).c_str(), fn,
                                 shape)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  reg(0, bm_step<0>);
  reg(1, bm_step<1>);
  reg(2, bm_step<2>);
  reg(3, bm_step<3>);
}

}  // namespace

SHARDKIT_BENCH_MAIN(register_all)
