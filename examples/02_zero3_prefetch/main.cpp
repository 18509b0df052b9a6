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
// waiting is for the slowest rank to arrive, with or without prefetch. A row marked "issued
// early" is a prefetch: its all-gather was issued before the previous unit's compute ended;
// the "waited" column says how long the unit's pre_* hook still blocked (0 when the gather had
// finished by then). The example exits 1 if the gathered bytes exceed their bound or if, with
// prefetch, no gather was issued early.
//
//   shardkit_example_02_zero3_prefetch [--ranks 4] [--layers 12] [--width 256] [--prefetch 1]
//                                      [--batch GLOBAL_BATCH]
#include <shardkit/shardkit.hpp>

#include "../common/args.hpp"
#include "../common/mlp.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct options {
  int ranks = 4;
  std::size_t layers = 12;
  std::size_t width = 256;
  std::size_t prefetch = 1;
  std::size_t batch = 128;  // global batch: the samples of one step over all ranks
  int steps = 3;
};

struct result {
  std::vector<shardkit::trace_event> trace;  // rank 0, last step
  std::chrono::steady_clock::time_point step_start;
  double step_ms = 0;
  double waited_ms = 0;                // framework blocked in pre_* hooks during the last step
  std::vector<double> waited_unit[2];  // per unit, forward and backward, in the last step (ms)
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
    const std::size_t local = o.batch / static_cast<std::size_t>(o.ranks);
    for (int step = 0; step < o.steps; ++step) {
      r.waited_unit[0].assign(shape.layers(), 0.0);
      r.waited_unit[1].assign(shape.layers(), 0.0);
      eng.clear_trace();
      comm.barrier();
      r.step_start = std::chrono::steady_clock::now();
      double waited = 0;
      auto timed = [&](double& unit_wait, auto&& hook) {
        const auto t0 = std::chrono::steady_clock::now();
        hook();
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        waited += ms;
        unit_wait = ms;
      };
      mlp::load(shape, data,
                static_cast<std::uint64_t>(step) * o.batch +
                    static_cast<std::uint64_t>(comm.rank()) * local,
                local, b);
      for (std::size_t l = 0; l < shape.layers(); ++l) {
        timed(r.waited_unit[0][l], [&] { eng.pre_forward(l); });
        mlp::forward_layer<shardkit::bf16>(shape, l, eng.param(2 * l), eng.param(2 * l + 1), b);
        eng.post_forward(l);
      }
      mlp::loss_and_delta(shape, data, b);
      for (std::size_t l = shape.layers(); l-- > 0;) {
        timed(r.waited_unit[1][l], [&] { eng.pre_backward(l); });
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

// Prints the timeline; returns how many units' gathers were issued early (before the previous
// unit's compute ended, in the same phase).
std::size_t print(const result& r, std::size_t prefetch) {
  using K = shardkit::trace_event::kind;
  auto ms = [&](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(t - r.step_start).count();
  };
  std::printf(
      "\nprefetch %zu: last step %.1f ms, of which %.2f ms waiting for parameters in "
      "pre_* hooks (rank 0)\n",
      prefetch, r.step_ms, r.waited_ms);
  std::printf("  %-9s %-8s %10s %10s %10s %10s %10s   (ms since the step started)\n", "unit",
              "phase", "gather", "gathered", "compute", "done", "waited");
  // The first event of a kind for (unit, phase): its time and its position in the timeline.
  auto find = [&](K what, std::size_t u, bool bwd, double& t) -> std::size_t {
    for (std::size_t i = 0; i < r.trace.size(); ++i) {
      const auto& ev = r.trace[i];
      if (ev.what == what && ev.unit == u && ev.backward == bwd) {
        t = ms(ev.time);
        return i;
      }
    }
    t = -1;
    return r.trace.size();
  };
  std::size_t early = 0;
  for (int phase = 0; phase < 2; ++phase) {
    const bool bwd = phase == 1;
    const std::size_t U = r.unit_names.size();
    for (std::size_t k = 0; k < U; ++k) {
      const std::size_t u = bwd ? U - 1 - k : k;
      double t[4], prev_done = -1;
      const std::size_t issued = find(K::gather_issued, u, bwd, t[0]);
      find(K::gather_completed, u, bwd, t[1]);
      find(K::compute_started, u, bwd, t[2]);
      find(K::compute_ended, u, bwd, t[3]);
      // Issued early: before the previous unit of this phase finished computing.
      const bool is_early = k > 0 && issued < r.trace.size() &&
                            issued < find(K::compute_ended, bwd ? u + 1 : u - 1, bwd, prev_done);
      if (is_early) ++early;
      std::printf("  %-9s %-8s %10.3f %10.3f %10.3f %10.3f %10.3f%s\n", r.unit_names[u].c_str(),
                  bwd ? "backward" : "forward", t[0], t[1], t[2], t[3], r.waited_unit[phase][u],
                  is_early ? "   <- issued early" : "");
    }
  }
  std::printf("  peak gathered parameter bytes: %zu, bound (1 + %zu) x largest unit: %llu  %s\n",
              r.peak, prefetch, static_cast<unsigned long long>(r.bound),
              r.peak <= r.bound ? "(within)" : "(EXCEEDED)");
  return early;
}

constexpr const char* usage_text =
    "usage: shardkit_example_02_zero3_prefetch [--ranks N] [--layers L] [--width W]\n"
    "         [--prefetch D] [--batch GLOBAL_BATCH] [--help]\n"
    "  --batch is the global batch (default 128), a multiple of --ranks, split evenly\n";

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "error: " << why << "\n" << usage_text;
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage_text, stdout);
      return 0;
    }
    if (a != "--ranks" && a != "--layers" && a != "--width" && a != "--prefetch" && a != "--batch")
      usage("unknown argument '" + a + "'");
    if (i + 1 >= argc) usage(a + " needs a value");
    const long v = examples::parse_int(a, argv[++i], a == "--prefetch" ? 0 : 1,
                                       a == "--ranks" ? 64 : 1 << 20, usage);
    if (a == "--ranks")
      o.ranks = static_cast<int>(v);
    else if (a == "--layers")
      o.layers = static_cast<std::size_t>(v);
    else if (a == "--width")
      o.width = static_cast<std::size_t>(v);
    else if (a == "--prefetch")
      o.prefetch = static_cast<std::size_t>(v);
    else
      o.batch = static_cast<std::size_t>(v);
  }
  if (o.batch % static_cast<std::size_t>(o.ranks) != 0)
    usage("--batch " + std::to_string(o.batch) + " must be a multiple of --ranks " +
          std::to_string(o.ranks) + " (it is the global batch, split evenly)");
  try {
    std::printf("shardkit example 02: ZeRO-3, %zu layers of width %zu (one unit each), %d ranks\n",
                o.layers, o.width, o.ranks);
    const result without = run(o, 0);
    print(without, 0);
    const result with = run(o, o.prefetch == 0 ? 1 : o.prefetch);
    const std::size_t early = print(with, o.prefetch == 0 ? 1 : o.prefetch);
    if (with.peak > with.bound || without.peak > without.bound) {
      std::fprintf(stderr, "FAIL: the gathered parameter bytes exceeded their bound\n");
      return 1;
    }
    if (early == 0) {
      std::fprintf(stderr, "FAIL: with prefetch, no unit's gather was issued early\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
