// What a checkpoint costs a training step (include/shardkit/io/checkpoint.hpp): one engine step
// at N = 2 in-process ranks, ZeRO-2, bf16 working parameters and AdamW, alone and followed by a
// save of the whole state (fp32 values and both Adam moments: 12 bytes per parameter, split
// between the ranks), synchronous or asynchronous.
//
//  checkpoint/step/none          the step alone: the baseline
//  checkpoint/step/save:sync     the step, then io::save (returns when the checkpoint is in place)
//  checkpoint/step/save:async    io::save_async (copies the shard and returns), the step while a
//                                thread writes, then wait(): what the save adds to the step when
//                                it overlaps training
//
// Counters: written = checkpoint bytes per iteration (all ranks). The checkpoint goes to the
// system's temporary directory (TMPDIR), so what it measures includes that file system.
#include <shardkit/comm/thread.hpp>
#include <shardkit/io/checkpoint.hpp>
#include <shardkit/zero/engine.hpp>

#include "common.hpp"

#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int ranks = 2;

enum class mode { none, sync, async };

void bm_save(benchmark::State& state, std::size_t d, std::size_t layers, mode m) {
  using engine_t =
      shardkit::engine<shardkit::thread_comm, shardkit::zero2, shardkit::bf16, shardkit::adamw>;
  auto group = std::make_shared<shardkit::detail::thread_group_state>(
      ranks, shardkit::thread_comm_options{});
  std::vector<shardkit::thread_comm> comms;
  for (int r = 0; r < ranks; ++r) comms.emplace_back(group, r);
  shardkit::model_spec model;
  for (std::size_t l = 0; l < layers; ++l) {
    model.begin_unit("layer" + std::to_string(l));
    model.add("layer" + std::to_string(l) + ".weight", {d, d},
              [](std::size_t off, std::span<float> out) {
                for (std::size_t k = 0; k < out.size(); ++k) {
                  out[k] = 1e-3f * static_cast<float>((off + k) % 97);
                }
              });
  }
  std::vector<shardkit::bf16> grad(d * d);
  for (std::size_t k = 0; k < grad.size(); ++k)
    grad[k] = shardkit::bf16(1e-3f * static_cast<float>(k % 89));
  const std::string dir =
      (std::filesystem::temp_directory_path() / "shardkit-bench-checkpoint").string();
  std::vector<std::optional<engine_t>> engines(ranks);
  bench::team team(ranks);
  team.run([&](int r) {
    engines[static_cast<std::size_t>(r)].emplace(comms[static_cast<std::size_t>(r)], model,
                                                 shardkit::adam_options{.lr = 1e-4f});
  });
  auto step = [&](engine_t& e) {
    for (std::size_t u = e.num_units(); u-- > 0;) e.grad_ready(u, grad);
    e.step();
  };
  const std::function<void(int)> iteration = [&](int r) {
    engine_t& e = *engines[static_cast<std::size_t>(r)];
    if (m == mode::none) {
      step(e);
    } else if (m == mode::sync) {
      step(e);
      shardkit::io::save(e, dir);
    } else {
      auto pending = shardkit::io::save_async(e, dir);
      step(e);
      pending.wait();
    }
  };
  team.run(iteration);  // warm-up
  for (auto _ : state) team.run(iteration);
  team.run([&](int r) { engines[static_cast<std::size_t>(r)].reset(); });
  std::filesystem::remove_all(dir);
  state.counters["params"] = static_cast<double>(d * d * layers);
  state.counters["written"] = m == mode::none ? 0.0 : 12.0 * static_cast<double>(d * d * layers);
}

void register_all(bench::size_set s) {
  const std::size_t d = s == bench::size_set::tiny ? 64 : s == bench::size_set::quick ? 512 : 1024;
  const std::size_t layers = s == bench::size_set::tiny ? 2 : 8;
  const std::string tail = "/params:" + std::to_string(d * d * layers);
  auto reg = [&](const char* name, mode m) {
    benchmark::RegisterBenchmark((std::string("checkpoint/step/") + name + tail).c_str(), bm_save,
                                 d, layers, m)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  reg("none", mode::none);
  reg("save:sync", mode::sync);
  reg("save:async", mode::async);
}

}  // namespace

SHARDKIT_BENCH_MAIN(register_all)
