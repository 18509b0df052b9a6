// One full engine step (benchmarks/engine_model.hpp: unit hooks, grad_ready of every gradient,
// step()) over the MPI communicator, one process per rank, for stages 0, 1, 2 and 3, bf16
// working parameters and AdamW, at a few model sizes Ψ. With one core per process the ranks do
// not share cores (unlike N thread ranks on fewer cores), so the ratio to stage 0 is what
// sharding itself costs. Targets (the host-speed issue): stages 1 and 2 ≤ 1.05× stage 0,
// stage 3 ≤ 1.2×.
//
//   mpiexec -np 2 shardkit_bench_engine_mpi [--params 4M,16M,64M] [--reps 7] [--json FILE]
//                                           [--size=tiny]
//
// For each Ψ five engines (one duplicated communicator each) are built together and stepped in
// turn, `reps` rounds: stages 0 to 3, and stage 3 with engine_options::keep_gathered_buffers
// ("3 kept": no gathered buffer allocated per step). Each timing is the slowest rank's time per
// step (a step is done when its last rank is) over enough steps for about 50 ms; printed are
// the median per stage and the median over rounds of the ratio to that round's stage 0, and
// where the step's time goes: the forward's hooks, the backward (hooks and grad_ready) and the
// call to step(), each the time of the rank slowest in that part (engine_model.hpp's
// step_phases).
// --size=tiny: two small models, 3 rounds (the smoke test). A Ψ whose engines would need
// more than 12 GiB of host memory on all processes together is skipped and says so. --json
// writes the results for scripts/bench_report.py.
//
// A standalone program rather than Google Benchmark: every rank must run the same number of
// steps in lock step, which Google Benchmark's per-process timing loop does not do.
#include <shardkit/comm/mpi.hpp>
#include <shardkit/zero/engine.hpp>

#include "engine_model.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr double memory_cap = 12.0 * (1u << 30);

std::vector<std::size_t> parse_params(const std::string& list) {
  std::vector<std::size_t> v;
  std::size_t at = 0;
  while (at < list.size()) {
    const std::size_t end = std::min(list.find(',', at), list.size());
    std::string item = list.substr(at, end - at);
    std::size_t scale = 1;
    if (!item.empty() && (item.back() == 'M' || item.back() == 'm')) {
      scale = std::size_t{1} << 20;
      item.pop_back();
    }
    char* rest = nullptr;
    const unsigned long long x = std::strtoull(item.c_str(), &rest, 10);
    if (item.empty() || *rest != '\0' || x == 0)
      throw std::invalid_argument("--params: '" + list + "' is not a list like 4M,16M,64M");
    v.push_back(static_cast<std::size_t>(x) * scale);
    at = end + 1;
  }
  return v;
}

struct result {
  std::size_t params;
  int stage;
  double median_s, min_s, ratio;
  std::uint64_t sent;
  int steps;
  bool kept;                  // engine_options::keep_gathered_buffers
  double huge_share;          // lowest over ranks; -1: not known
  bench::step_phases phases;  // medians over rounds of each part's slowest rank, per step
};

// One engine of stage S, type-erased: what a round needs.
struct stage_runner {
  int stage;
  bool kept;                   // engine_options::keep_gathered_buffers
  std::shared_ptr<void> keep;  // the communicator and the engine
  std::function<std::uint64_t(bench::step_phases*)> step;
};

template <int S>
stage_runner make_runner(shardkit::mpi_comm& world, const bench::model& m,
                         const std::vector<std::vector<shardkit::bf16>>& grads,
                         shardkit::engine_options o = {}) {
  using engine_t =
      shardkit::engine<shardkit::mpi_comm, shardkit::stage<S>, shardkit::bf16, shardkit::adamw>;
  struct both {
    shardkit::mpi_comm comm;
    engine_t e;
    both(shardkit::mpi_comm c, const bench::model& m, const shardkit::engine_options& o)
        : comm(std::move(c)), e(comm, m.spec, shardkit::adam_options{.lr = 1e-4f}, o) {}
  };
  auto b =
      std::make_shared<both>(shardkit::mpi_comm::duplicate(world.native(), world.options()), m, o);
  engine_t* e = &b->e;
  return {S, o.keep_gathered_buffers, b,
          [e, &grads](bench::step_phases* ph) { return bench::full_step(*e, grads, ph); }};
}

// Seconds per step of the slowest rank, over `steps` steps; `*phases` (when given): each
// part's time per step on the rank slowest in that part.
double time_steps(MPI_Comm comm, int steps, const stage_runner& run,
                  bench::step_phases* phases = nullptr) {
  bench::step_phases ph;
  MPI_Barrier(comm);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) run.step(phases ? &ph : nullptr);
  double s[4] = {
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps,
      ph.forward_s / steps, ph.backward_s / steps, ph.step_s / steps};
  MPI_Allreduce(MPI_IN_PLACE, s, 4, MPI_DOUBLE, MPI_MAX, comm);
  if (phases) *phases = {s[1], s[2], s[3]};
  return s[0];
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 7;
  std::string params = "4M,16M,64M", json;
  bool tiny = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--size=tiny") {
      tiny = true;
    } else if (a.rfind("--size=", 0) == 0) {  // quick and full: the --params given
    } else if (i + 1 < argc && a == "--reps") {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (i + 1 < argc && a == "--params") {
      params = argv[++i];
    } else if (i + 1 < argc && a == "--json") {
      json = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: shardkit_bench_engine_mpi [--params 4M,16M,64M] [--reps 7] "
                   "[--json FILE] [--size=tiny]\n");
      return 2;
    }
  }
  std::vector<bench::model_shape> shapes;
  if (tiny) {
    shapes = {{64, 2}, {128, 2}};
    reps = std::min(reps, 3);
  } else {
    for (const std::size_t p : parse_params(params)) shapes.push_back(bench::shape_for(p));
  }
  return shardkit::mpi_main(argc, argv, [&](shardkit::mpi_comm& comm) {
    const int N = comm.size();
    const MPI_Comm raw = comm.native();
    const bool root = comm.rank() == 0;
    if (root) {
      std::printf(
          "engine step over mpi_comm, %d processes, bf16 + AdamW, stages 0-3 stepped in turn; "
          "median of %d rounds of the slowest rank's time per step; where it goes (fwd: the "
          "forward's hooks, bwd: the backward's hooks and grad_ready, step(): the call), each "
          "part's slowest rank\n\n",
          N, reps);
      std::printf("%-8s %12s %6s %10s %10s %8s %14s %8s %8s %8s\n", "params", "elements", "stage",
                  "step ms", "min ms", "/stage0", "sent by rank 0", "fwd ms", "bwd ms", "step()");
      std::fflush(stdout);
    }
    std::vector<result> results;
    std::vector<std::string> skipped;
    for (const auto& shape : shapes) {
      const std::size_t P = shape.params();
      double need = 0;
      for (int s : {0, 1, 2, 3, 3})
        need += bench::run_bytes(P, s, N) - 4.0 * static_cast<double>(P);
      need += 4.0 * N * static_cast<double>(P);
      if (need > memory_cap) {
        char why[160];
        std::snprintf(why, sizeof why,
                      "%zu parameters: the five engines need about %.1f GiB of host memory "
                      "(> %.0f GiB)",
                      P, need / (1u << 30), memory_cap / (1u << 30));
        if (root) std::printf("skipped %s\n", why);
        skipped.push_back(why);
        continue;
      }
      const bench::model m(shape);
      const auto grads = m.grads(comm.rank());
      std::vector<stage_runner> run;
      run.push_back(make_runner<0>(comm, m, grads));
      run.push_back(make_runner<1>(comm, m, grads));
      run.push_back(make_runner<2>(comm, m, grads));
      run.push_back(make_runner<3>(comm, m, grads));
      shardkit::engine_options kept;
      kept.keep_gathered_buffers = true;
      run.push_back(make_runner<3>(comm, m, grads, kept));
      const int E = static_cast<int>(run.size());
      std::vector<std::uint64_t> sent(E);
      // Warm-up (ZeRO-3 learns its prefetch order in the first step), then enough steps per
      // timing for about 50 ms.
      std::vector<double> first(E);
      for (int s = 0; s < E; ++s) {
        sent[s] = run[s].step(nullptr);
        first[s] = time_steps(raw, 1, run[s]);
      }
      // How much of each rank's anonymous memory the kernel put on huge pages, after warm-up.
      const auto mem = bench::read_anon_memory();
      double lowest = mem ? mem->huge_share() : -1.0;
      MPI_Allreduce(MPI_IN_PLACE, &lowest, 1, MPI_DOUBLE, MPI_MIN, raw);
      int steps = static_cast<int>(
          std::clamp(0.05 / *std::max_element(first.begin(), first.end()), 1.0, 50.0));
      MPI_Bcast(&steps, 1, MPI_INT, 0, raw);
      std::vector<std::vector<double>> t(E), q(E), fwd(E), bwd(E), call(E);
      for (int rep = 0; rep < reps; ++rep) {
        for (int s = 0; s < E; ++s) {
          bench::step_phases ph;
          t[s].push_back(time_steps(raw, steps, run[s], &ph));
          fwd[s].push_back(ph.forward_s);
          bwd[s].push_back(ph.backward_s);
          call[s].push_back(ph.step_s);
        }
        for (int s = 0; s < E; ++s) q[s].push_back(t[s].back() / t[0].back());
      }
      if (root && mem && lowest >= 0) {
        std::printf(
            "%-8s huge pages: %.0f%% of rank 0's %.0f MiB of anonymous memory (lowest "
            "rank: %.0f%%)\n",
            bench::psi_label(P).c_str(), 100 * mem->huge_share(), mem->anonymous_mib, 100 * lowest);
      }
      for (int s = 0; s < E; ++s) {
        results.push_back({P,
                           run[s].stage,
                           median(t[s]),
                           *std::min_element(t[s].begin(), t[s].end()),
                           median(q[s]),
                           sent[s],
                           steps,
                           run[s].kept,
                           lowest,
                           {median(fwd[s]), median(bwd[s]), median(call[s])}});
        if (root) {
          const auto& r = results.back();
          std::printf("%-8s %12zu %6s %10.3f %10.3f %7.3fx %14llu %8.2f %8.2f %8.2f\n",
                      bench::psi_label(P).c_str(), P,
                      r.kept ? "3 kept" : std::to_string(r.stage).c_str(), r.median_s * 1e3,
                      r.min_s * 1e3, r.ratio, static_cast<unsigned long long>(r.sent),
                      r.phases.forward_s * 1e3, r.phases.backward_s * 1e3, r.phases.step_s * 1e3);
          std::fflush(stdout);
        }
      }
    }
    if (root && !json.empty()) {
      FILE* f = std::fopen(json.c_str(), "w");
      if (f == nullptr) throw std::runtime_error("cannot write " + json);
      std::fprintf(f, "{\"suite\": \"engine_mpi\", \"processes\": %d, \"reps\": %d,\n", N, reps);
      std::fprintf(f, " \"skipped\": [");
      for (std::size_t i = 0; i < skipped.size(); ++i)
        std::fprintf(f, "%s\"%s\"", i ? ", " : "", skipped[i].c_str());
      std::fprintf(f, "],\n \"results\": [\n");
      for (std::size_t i = 0; i < results.size(); ++i) {
        const auto& r = results[i];
        std::fprintf(f,
                     "  {\"params\": %zu, \"stage\": %d, \"kept_gathered_buffers\": %s, "
                     "\"median_s\": %.9g, \"min_s\": %.9g, "
                     "\"ratio\": %.6g, \"sent\": %llu, \"steps_per_timing\": %d, "
                     "\"huge_page_share\": %.4g, \"forward_s\": %.9g, \"backward_s\": %.9g, "
                     "\"step_call_s\": %.9g}%s\n",
                     r.params, r.stage, r.kept ? "true" : "false", r.median_s, r.min_s, r.ratio,
                     static_cast<unsigned long long>(r.sent), r.steps, r.huge_share,
                     r.phases.forward_s, r.phases.backward_s, r.phases.step_s,
                     i + 1 < results.size() ? "," : "");
      }
      std::fprintf(f, " ]}\n");
      std::fclose(f);
    }
    return 0;
  });
}
