// shardkit example 02: ZeRO-3 on a deeper stack, with the prefetch timeline.
//
// A 12-layer MLP is trained with ZeRO-3 on N in-process ranks, one unit per layer. The example
// records the engine's timeline (engine_options::trace) and prints, for rank 0's last step, when
// each unit's all-gather was issued and completed, when its compute started and ended, and how
// long the framework waited for parameters. It does so without prefetch and with prefetch, so
// the difference is visible, and prints the peak of gathered parameter bytes against the bound
// (1 + prefetch) x the largest unit.
//
// Reading the timeline: a collective completes only when every rank has issued it, so when the
// ranks run at different speeds (more ranks than cores, as on a small machine), part of the
// waiting is for the slowest rank to arrive, with or without prefetch. The prefetched rows show
// the gather issued while the previous unit was still computing.
//
//   shardkit_example_02_zero3_prefetch [--ranks 4] [--layers 12] [--width 256] [--prefetch 1]
#include <shardkit/shardkit.hpp>

#include "../common/mlp.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

struct options {
  int ranks = 4;
  std::size_t layers = 12;
  std::size_t width = 256;
  std::size_t prefetch = 1;
  std::size_t batch = 32;
  int steps = 3;
};

struct result {
  std::vector<shardkit::trace_event> trace;  // rank 0, last step
  std::chrono::steady_clock::time_point step_start;
  double step_ms = 0;
  double waited_ms = 0;  // framework blocked in pre_* hooks during the last step
  std::size_t peak = 0;
  std::uint64_t bound = 0;
  std::vector<std::string> unit_names;
};

using engine_t = shardkit::engine<shardkit::thread_comm, shardkit::zero3, shardkit::bf16>;

result run(const options& o, std::size_t prefetch) {
  std::vector<std::size_t> widths(o.layers + 1, o.width);
  widths.back() = 10;
  const mlp::shape shape{widths};
  const mlp::dataset data{shape, 7};
  auto per_rank = shardkit::run_ranks(o.ranks, [&](shardkit::thread_comm& comm) {
    auto init = mlp::init_params(shape, 7);
    shardkit::model_spec model;
    for (std::size_t l = 0; l < shape.layers(); ++l) {
      model.begin_unit("layer" + std::to_string(l));
      model.add("layer" + std::to_string(l) + ".weight", init[2 * l]);
      model.add("layer" + std::to_string(l) + ".bias", init[2 * l + 1]);
    }
    shardkit::engine_options eo;
    eo.prefetch = prefetch;
    eo.trace = true;
    engine_t eng(comm, model, {.lr = 1e-3f}, eo);
    result r;
    mlp::batch b;
    std::vector<float> gW, gb;
    for (int step = 0; step < o.steps; ++step) {
      eng.clear_trace();
      comm.barrier();
      r.step_start = std::chrono::steady_clock::now();
      double waited = 0;
      auto timed = [&](auto&& hook) {
        const auto t0 = std::chrono::steady_clock::now();
        hook();
        waited += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                      .count();
      };
      mlp::load(shape, data, static_cast<std::uint64_t>(step * o.ranks + comm.rank()) * o.batch,
                o.batch, b);
      for (std::size_t l = 0; l < shape.layers(); ++l) {
        timed([&] { eng.pre_forward(l); });
        mlp::forward_layer<shardkit::bf16>(shape, l, eng.param(2 * l), eng.param(2 * l + 1), b);
        eng.post_forward(l);
      }
      mlp::loss_and_delta(shape, data, b);
      for (std::size_t l = shape.layers(); l-- > 0;) {
        timed([&] { eng.pre_backward(l); });
        mlp::backward_layer<shardkit::bf16>(shape, l, eng.param(2 * l), b, gW, gb);
        eng.grad_ready(2 * l + 1, gb);
        eng.grad_ready(2 * l, gW);
        eng.post_backward(l);
      }
      eng.step();
      r.step_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - r.step_start)
              .count();
      r.waited_ms = waited;
    }
    r.trace = eng.trace();
    r.peak = eng.memory().peak(shardkit::memory_category::gathered_params);
    r.bound = eng.gathered_bytes_bound();
    for (std::size_t u = 0; u < eng.num_units(); ++u) r.unit_names.push_back(eng.unit_name(u));
    return r;
  });
  return per_rank.front();
}

void print(const result& r, std::size_t prefetch) {
  using K = shardkit::trace_event::kind;
  auto ms = [&](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(t - r.step_start).count();
  };
  std::printf(
      "\nprefetch %zu: last step %.1f ms, of which %.2f ms waiting for parameters in "
      "pre_* hooks (rank 0)\n",
      prefetch, r.step_ms, r.waited_ms);
  std::printf("  %-9s %-8s %10s %10s %10s %10s   (ms since the step started)\n", "unit", "phase",
              "gather", "gathered", "compute", "done");
  for (int phase = 0; phase < 2; ++phase) {
    const bool bwd = phase == 1;
    const std::size_t U = r.unit_names.size();
    for (std::size_t k = 0; k < U; ++k) {
      const std::size_t u = bwd ? U - 1 - k : k;
      double t[4] = {-1, -1, -1, -1};
      for (const auto& ev : r.trace) {
        if (ev.unit != u || ev.backward != bwd) continue;
        const int col = ev.what == K::gather_issued      ? 0
                        : ev.what == K::gather_completed ? 1
                        : ev.what == K::compute_started  ? 2
                        : ev.what == K::compute_ended    ? 3
                                                         : -1;
        if (col >= 0 && t[col] < 0) t[col] = ms(ev.time);
      }
      std::printf("  %-9s %-8s %10.3f %10.3f %10.3f %10.3f%s\n", r.unit_names[u].c_str(),
                  bwd ? "backward" : "forward", t[0], t[1], t[2], t[3],
                  t[1] >= 0 && t[1] <= t[2] && k > 0 && t[0] < t[2] - 0.001 && prefetch > 0
                      ? "   <- gathered before it was needed"
                      : "");
    }
  }
  std::printf("  peak gathered parameter bytes: %zu, bound (1 + %zu) x largest unit: %llu  %s\n",
              r.peak, prefetch, static_cast<unsigned long long>(r.bound),
              r.peak <= r.bound ? "(within)" : "(EXCEEDED)");
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const long v = std::strtol(argv[i + 1], nullptr, 10);
    if (v < 0 || (v == 0 && a != "--prefetch")) {
      std::fprintf(stderr, "error: %s needs a positive integer\n", a.c_str());
      return 2;
    }
    if (a == "--ranks")
      o.ranks = static_cast<int>(v);
    else if (a == "--layers")
      o.layers = static_cast<std::size_t>(v);
    else if (a == "--width")
      o.width = static_cast<std::size_t>(v);
    else if (a == "--prefetch")
      o.prefetch = static_cast<std::size_t>(v);
    else if (a == "--batch")
      o.batch = static_cast<std::size_t>(v);
    else {
      std::fprintf(stderr,
                   "usage: %s [--ranks N] [--layers L] [--width W] [--prefetch D] "
                   "[--batch B]\n",
                   argv[0]);
      return 2;
    }
  }
  try {
    std::printf("shardkit example 02: ZeRO-3, %zu layers of width %zu (one unit each), %d ranks\n",
                o.layers, o.width, o.ranks);
    const result without = run(o, 0);
    print(without, 0);
    const result with = run(o, o.prefetch == 0 ? 1 : o.prefetch);
    print(with, o.prefetch == 0 ? 1 : o.prefetch);
    return with.peak <= with.bound && without.peak <= without.bound ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
