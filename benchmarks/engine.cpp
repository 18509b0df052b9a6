// One full training step of the ZeRO engine (zero/engine.hpp) on N in-process ranks (the
// thread communicator), for stages 0, 1, 2 and 3, with bf16 working parameters and AdamW: how
// the cost grows with the model (Ψ parameters) and with N.
//
//  engine/step/stage:S/ranks:N/params:P   per iteration, on every rank: the unit hooks of a
//                                 forward and a backward (ZeRO-3 gathers there), every gradient
//                                 handed over with grad_ready (ZeRO-2/3 reduce-scatter buckets
//                                 as they fill), then step() (reduce, fused optimizer on the
//                                 rank's part, gather). No model compute: this is the time
//                                 shardkit adds to a step (benchmarks/engine_model.hpp).
//  engine/step_fresh/stage:3/ranks:N/params:P   the same ZeRO-3 step with
//                                 engine_options::reuse_gathered_buffers off (every gather in
//                                 a buffer of its own, allocated and freed): the baseline of
//                                 the buffer reuse, for N >= 2 and Ψ >= 16M.
//  engine/step_kept/stage:3/ranks:N/params:P    the ZeRO-3 step with
//                                 engine_options::keep_gathered_buffers (the reused buffers
//                                 kept from one step to the next), for N >= 2 and Ψ <= 16M.
//
// The model: L units, each a d x d weight and a d bias. Sizes (--size):
//   tiny   Ψ = 8.3K and 33K, N = 1, 2 (the smoke test: seconds)
//   quick  Ψ = 1M, 4M, N = 1, 2, 4
//   full   Ψ = 1M, 4M, 16M, 64M, 128M (1.05M to 134M), N = 1, 2, 4, 8
// Stage 0 is the baseline the others are reported against. A combination whose host memory
// (all ranks together, engine_model.hpp's estimate) would pass 12 GiB is skipped; the skipped
// ones are printed on stderr and recorded in the JSON context ("engine_skipped"). Ψ ≥ 64M runs
// 3 repetitions of 1 step each whatever --benchmark_repetitions says (the full sweep then fits
// in about 8 minutes on 2 cores). N above the core count oversubscribes the cores (N = 8 on a
// 2-core machine): the ranks then take turns, and the time shows it. Counters: sent = data
// bytes rank 0 sent in the step (the engine's step_report); cores = hardware threads;
// fwd_ms, bwd_ms, step_call_ms = where rank 0's step went (the forward's hooks, the backward's
// hooks and grad_ready, the call to step(): engine_model.hpp's step_phases), per iteration;
// huge_pages = the share of the process's anonymous memory on transparent huge pages after
// the warm-up step.
#include <shardkit/comm/thread.hpp>
#include <shardkit/zero/engine.hpp>

#include "common.hpp"
#include "engine_model.hpp"

#include <cstddef>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr double memory_cap = 12.0 * (1u << 30);

// The model of the current Ψ and the gradients of its ranks, kept from one benchmark to the
// next (they run Ψ by Ψ): building them for 134M parameters takes seconds.
struct model_cache {
  std::unique_ptr<bench::model> m;
  std::vector<std::vector<std::vector<shardkit::bf16>>> grads;

  bench::model& get(bench::model_shape shape, int ranks) {
    if (!m || m->shape.d != shape.d || m->shape.layers != shape.layers) {
      grads.clear();
      m.reset();
      m = std::make_unique<bench::model>(shape);
    }
    while (grads.size() < static_cast<std::size_t>(ranks))
      grads.push_back(m->grads(static_cast<int>(grads.size())));
    return *m;
  }
};
model_cache cache;

template <int Stage, bool Reuse = true, bool Keep = false>
void bm_step(benchmark::State& state, bench::model_shape shape, int ranks) {
  using engine_t = shardkit::engine<shardkit::thread_comm, shardkit::stage<Stage>, shardkit::bf16,
                                    shardkit::adamw>;
  auto group = std::make_shared<shardkit::detail::thread_group_state>(
      ranks, shardkit::thread_comm_options{});
  std::vector<shardkit::thread_comm> comms;
  for (int r = 0; r < ranks; ++r) comms.emplace_back(group, r);
  bench::model& model = cache.get(shape, ranks);

  std::vector<std::optional<engine_t>> engines(static_cast<std::size_t>(ranks));
  std::vector<std::uint64_t> sent(static_cast<std::size_t>(ranks));
  bench::team team(ranks);
  // Built on the rank threads, as a framework's ranks would (each allocates its own buffers).
  team.run([&](int r) {
    shardkit::engine_options o;
    o.reuse_gathered_buffers = Reuse;
    o.keep_gathered_buffers = Keep;
    engines[static_cast<std::size_t>(r)].emplace(comms[static_cast<std::size_t>(r)], model.spec,
                                                 shardkit::adam_options{.lr = 1e-4f}, o);
  });
  bench::step_phases phases;  // rank 0's
  bool timed = false;
  const std::function<void(int)> step = [&](int r) {
    sent[static_cast<std::size_t>(r)] = bench::full_step(*engines[static_cast<std::size_t>(r)],
                                                         cache.grads[static_cast<std::size_t>(r)],
                                                         r == 0 && timed ? &phases : nullptr);
  };
  team.run(step);  // warm-up: ZeRO-3 learns its prefetch order in the first step
  const auto mem = bench::read_anon_memory();
  timed = true;
  for (auto _ : state) team.run(step);
  team.run([&](int r) { engines[static_cast<std::size_t>(r)].reset(); });
  state.counters["stage"] = Stage;
  state.counters["ranks"] = ranks;
  state.counters["params"] = static_cast<double>(shape.params());
  state.counters["sent"] = static_cast<double>(sent[0]);
  state.counters["cores"] = std::thread::hardware_concurrency();
  const auto per_iteration = [&](double s) {
    return benchmark::Counter(s * 1e3, benchmark::Counter::kAvgIterations);
  };
  state.counters["fwd_ms"] = per_iteration(phases.forward_s);
  state.counters["bwd_ms"] = per_iteration(phases.backward_s);
  state.counters["step_call_ms"] = per_iteration(phases.step_s);
  if (mem) state.counters["huge_pages"] = mem->huge_share();
}

void register_all(bench::size_set s) {
  std::vector<bench::model_shape> shapes;
  std::vector<int> ranks;
  const std::size_t mi = std::size_t{1} << 20;
  if (s == bench::size_set::tiny) {
    shapes = {{64, 2}, {128, 2}};
    ranks = {1, 2};
  } else if (s == bench::size_set::quick) {
    shapes = {bench::shape_for(mi), bench::shape_for(4 * mi)};
    ranks = {1, 2, 4};
  } else {
    for (const std::size_t psi : {mi, 4 * mi, 16 * mi, 64 * mi, 128 * mi})
      shapes.push_back(bench::shape_for(psi));
    ranks = {1, 2, 4, 8};
  }
  std::string skipped;
  for (const auto& shape : shapes) {
    const std::size_t P = shape.params();
    for (const int n : ranks) {
      auto reg = [&](int stage, auto fn, const char* what = "step") {
        const std::string name = std::string("engine/") + what + "/stage:" + std::to_string(stage) +
                                 "/ranks:" + std::to_string(n) + "/params:" + std::to_string(P);
        const double need = bench::run_bytes(P, stage, n);
        if (need > memory_cap) {
          char why[160];
          std::snprintf(why, sizeof why, "%s: needs about %.1f GiB of host memory (> %.0f GiB)",
                        name.c_str(), need / (1u << 30), memory_cap / (1u << 30));
          std::fprintf(stderr, "skipped %s\n", why);
          skipped += (skipped.empty() ? "" : "; ") + std::string(why);
          return;
        }
        auto* b = benchmark::RegisterBenchmark(name.c_str(), fn, shape, n)
                      ->UseRealTime()
                      ->Unit(benchmark::kMillisecond);
        if (P >= 64 * mi) b->Iterations(1)->Repetitions(3);
      };
      reg(0, bm_step<0>);
      reg(1, bm_step<1>);
      reg(2, bm_step<2>);
      reg(3, bm_step<3>);
      if (n >= 2 && P >= 16 * mi) reg(3, bm_step<3, false>, "step_fresh");
      if (n >= 2 && P <= 16 * mi) reg(3, bm_step<3, true, true>, "step_kept");
    }
  }
  if (!skipped.empty()) benchmark::AddCustomContext("engine_skipped", skipped);
}

}  // namespace

SHARDKIT_BENCH_MAIN(register_all)
