// shardkit's main example on the GPU: the MLP of example 01 trained with ZeRO on one GPU, N
// ranks as threads each with its own CUDA stream (thread_cuda_comm), bf16 working parameters,
// fp32 master weights and AdamW moments on the device. The same training then runs on the host
// engine (host_reference.cpp), and the program compares the two: every step's loss and every
// final parameter, bit for bit.
//
//   shardkit_example_01_mlp_zero_cuda                        stage 2, 2 ranks, 20 steps
//   shardkit_example_01_mlp_zero_cuda --stage 3 --ranks 4 --steps 50 --layers 64,512,512,10
//   shardkit_example_01_mlp_zero_cuda --all-stages --json    stages 0-3, one JSON object
//
// Exit status: 0 when the GPU and the host agree bit for bit (and the loss fell), 1 when they
// do not, 2 on a usage or training error, 77 without a CUDA device.
#include <shardkit/comm/thread_cuda.cuh>
#include <shardkit/zero/engine_cuda.cuh>

#include "mlp_kernels.cuh"
#include "train.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <exception>
#include <iostream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace mlp_gpu {
namespace {

struct device_run {
  std::vector<rank_result> ranks;
  double seconds = 0;  // wall time of the steps, all ranks
};

template <class Policies>
device_run run_on_device(const options& o) {
  device_run out;
  const auto t0 = std::chrono::steady_clock::now();
  out.ranks =
      shardkit::run_ranks<shardkit::cuda_space>(o.ranks, [&](shardkit::thread_cuda_comm& comm) {
        rank_result r;
        try {
          const auto init = mlp::init_params(mlp::shape{o.layers}, o.seed);
          shardkit::cuda_stream stream;  // this rank's compute stream
          shardkit::engine_options eo = engine_options(o);
          eo.compute_stream = stream.get();
          device_backend be(mlp::shape{o.layers}, o.batch / static_cast<std::size_t>(o.ranks),
                            stream.get());
          shardkit::engine<shardkit::thread_cuda_comm, Policies, shardkit::bf16, shardkit::adamw>
              eng(comm, model(o, init), {.lr = o.lr, .weight_decay = o.weight_decay}, eo);
          r = train(eng, be, o, comm.rank(), comm.size());
          stream.synchronize();
        } catch (const std::exception& e) {
          r.error = e.what();
        }
        return r;
      });
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

device_run run_on_device_stage(const options& o) {
  switch (o.stage) {
    case 0:
      return run_on_device<shardkit::zero0>(o);
    case 1:
      return run_on_device<shardkit::zero1>(o);
    case 2:
      return run_on_device<shardkit::zero2>(o);
    default:
      return run_on_device<shardkit::zero3>(o);
  }
}

// The global mean loss per step: the ranks' sums added in rank order, over the global batch.
std::vector<double> mean_losses(const std::vector<rank_result>& ranks, const options& o) {
  std::vector<double> m(static_cast<std::size_t>(o.steps), 0.0);
  for (const auto& r : ranks) {
    for (std::size_t s = 0; s < m.size() && s < r.loss_sums.size(); ++s) m[s] += r.loss_sums[s];
  }
  for (auto& x : m) x /= static_cast<double>(o.batch);
  return m;
}

std::string first_error(const std::vector<rank_result>& ranks) {
  for (std::size_t q = 0; q < ranks.size(); ++q) {
    if (!ranks[q].error.empty()) return "rank " + std::to_string(q) + ": " + ranks[q].error;
  }
  return {};
}

// One stage on both sides; returns the verdict as JSON.
nlohmann::json compare_stage(const options& o) {
  const device_run dev = run_on_device_stage(o);
  const std::vector<rank_result> host = train_on_host(o);
  nlohmann::json j{{"stage", o.stage}, {"ranks", o.ranks}, {"steps", o.steps}};
  if (auto e = first_error(dev.ranks); !e.empty()) throw std::runtime_error("GPU run, " + e);
  if (auto e = first_error(host); !e.empty()) throw std::runtime_error("host run, " + e);
  const auto dl = mean_losses(dev.ranks, o), hl = mean_losses(host, o);
  int first_loss_diff = -1;
  for (std::size_t s = 0; s < dl.size(); ++s) {
    if (std::bit_cast<std::uint64_t>(dl[s]) != std::bit_cast<std::uint64_t>(hl[s])) {
      first_loss_diff = static_cast<int>(s);
      break;
    }
  }
  std::size_t params = 0, differing = 0;
  for (std::size_t q = 0; q < host.size(); ++q) {
    const auto& a = dev.ranks[q].param_bits;
    const auto& b = host[q].param_bits;
    params += b.size();
    if (a.size() != b.size()) {
      differing += b.size();
      continue;
    }
    for (std::size_t i = 0; i < a.size(); ++i) differing += a[i] != b[i] ? 1 : 0;
  }
  j["gpu_loss"] = dl;
  j["host_loss"] = hl;
  j["first_step_losses_differ"] = first_loss_diff;
  j["params_compared"] = params;
  j["params_differing"] = differing;
  j["gpu_seconds"] = dev.seconds;
  j["bit_identical"] = first_loss_diff < 0 && differing == 0;
  j["loss_fell"] = dl.size() >= 2 && dl.back() < dl.front();
  return j;
}

void print_stage(const nlohmann::json& j) {
  const auto& dl = j["gpu_loss"];
  const auto& hl = j["host_loss"];
  std::printf("stage %d, %d ranks on one GPU (thread_cuda_comm), bf16 working params:\n",
              j["stage"].get<int>(), j["ranks"].get<int>());
  std::printf("  step   loss on the GPU        loss on the host       same bits\n");
  for (std::size_t s = 0; s < dl.size(); ++s) {
    const double a = dl[s].get<double>(), b = hl[s].get<double>();
    std::printf("  %4zu   %.17g   %.17g   %s\n", s, a, b,
                std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b) ? "yes" : "NO");
  }
  std::printf("  final parameters: %zu of %zu differ; %.3f s on the GPU\n",
              j["params_differing"].get<std::size_t>(), j["params_compared"].get<std::size_t>(),
              j["gpu_seconds"].get<double>());
}

}  // namespace
}  // namespace mlp_gpu

int main(int argc, char** argv) {
  mlp_gpu::options o;
  bool all_stages = false, json = false;
  std::string layers = "64,256,10";
  CLI::App app{
      "shardkit's main example on the GPU: ZeRO on N thread ranks of one GPU, against "
      "the host engine bit for bit"};
  app.add_option("--stage", o.stage, "ZeRO stage")->check(CLI::Range(0, 3));
  app.add_flag("--all-stages", all_stages, "stages 0-3, one after another");
  app.add_option("--ranks", o.ranks, "ranks (threads sharing the GPU)")->check(CLI::Range(1, 64));
  app.add_option("--steps", o.steps, "training steps")->check(CLI::Range(1, 100000));
  app.add_option("--layers", layers, "layer widths, e.g. 64,256,10");
  app.add_option("--batch", o.batch, "global batch (a multiple of --ranks)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20));
  app.add_option("--lr", o.lr, "learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed, "data and initial weights");
  app.add_flag("--json", json, "one JSON object instead of the tables");
  CLI11_PARSE(app, argc, argv);
  try {
    o.layers.clear();
    std::size_t at = 0;
    while (at <= layers.size()) {
      const std::size_t comma = std::min(layers.find(',', at), layers.size());
      o.layers.push_back(std::stoul(layers.substr(at, comma - at)));
      if (o.layers.back() == 0) throw std::invalid_argument("a layer of width 0");
      at = comma + 1;
    }
    if (o.layers.size() < 2) throw std::invalid_argument("--layers needs at least two widths");
  } catch (const std::exception&) {
    std::fprintf(stderr, "--layers expects widths such as 64,256,10, got '%s'\n", layers.c_str());
    return 2;
  }
  if (o.batch % static_cast<std::size_t>(o.ranks) != 0) {
    std::fprintf(stderr, "--batch %zu must be a multiple of --ranks %d\n", o.batch, o.ranks);
    return 2;
  }
  if (shardkit::cuda_device_count() == 0) {
    std::printf("no CUDA device: nothing to train on the GPU\n");
    return 77;
  }
  try {
    nlohmann::json all = nlohmann::json::array();
    bool same = true, fell = true;
    std::vector<int> stages{o.stage};
    if (all_stages) stages = {0, 1, 2, 3};
    for (int s : stages) {
      o.stage = s;
      const auto j = mlp_gpu::compare_stage(o);
      same = same && j["bit_identical"].get<bool>();
      fell = fell && j["loss_fell"].get<bool>();
      if (!json) mlp_gpu::print_stage(j);
      all.push_back(j);
    }
    if (json) {
      std::cout
          << nlohmann::json{{"runs", all}, {"bit_identical", same}, {"loss_fell", fell}}.dump()
          << "\n";
    } else {
      std::printf("%s\n", same ? "the GPU and the host engine agree bit for bit"
                               : "the GPU and the host engine DIFFER");
    }
    return same && fell ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
