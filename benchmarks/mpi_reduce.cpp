// What shardkit's fixed-order reductions cost over MPI's own (float, sum):
//   reduce-scatter: mpi_comm::reduce_scatter (all-to-all + rank-order host reduction)
//                   vs MPI_Reduce_scatter_block
//   all-reduce:     mpi_comm::all_reduce (that reduce-scatter + all-gather)
//                   vs MPI_Allreduce
// for full buffers of 4 KiB to 64 MiB per rank. Each timing is the slowest rank's time per call
// (a collective is done when its last rank is), the median of several repetitions.
//
// Then what divergence detection costs (mpi_comm_options::detect_divergence, on by default:
// each collective also sends its 48-byte signature to every other rank): barrier, all-reduce
// and reduce-scatter of 4 KiB to 1 MiB with it off (the baseline) and on, and their ratio.
// Small collectives show the cost best; it is a fixed few messages per call.
//
//   mpiexec -np 4 shardkit_bench_mpi_reduce [--reps 7] [--max-bytes 67108864] [--divergence-only]
//
// A standalone program rather than Google Benchmark: every rank must run the same number of
// iterations in lock step, which Google Benchmark's per-process timing loop does not do.
#include <shardkit/comm/mpi.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

// Median over `reps` repetitions of the slowest rank's seconds per call of `op`.
double time_per_call(MPI_Comm comm, int reps, int iters, const std::function<void()>& op) {
  op();  // warm-up: first-touch of buffers, MPI's connection setup
  std::vector<double> t;
  for (int rep = 0; rep < reps; ++rep) {
    MPI_Barrier(comm);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) op();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
    MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, comm);
    t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Baseline and variant timed alternately, `reps` times (so both see the same machine load):
// the fastest slowest-rank time per call of each, and the median of the per-repetition ratios.
struct paired {
  double base, variant, ratio;
};
paired time_pair(MPI_Comm comm, int reps, int iters, const std::function<void()>& base,
                 const std::function<void()>& variant) {
  std::vector<double> b, v, r;
  for (int rep = 0; rep < reps; ++rep) {
    b.push_back(time_per_call(comm, 1, iters, base));
    v.push_back(time_per_call(comm, 1, iters, variant));
    r.push_back(v.back() / b.back());
  }
  std::sort(r.begin(), r.end());
  return {*std::min_element(b.begin(), b.end()), *std::min_element(v.begin(), v.end()),
          r[r.size() / 2]};
}

std::string human(std::size_t bytes) {
  if (bytes >= (1u << 20)) return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes >> 10) + " KiB";
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 7;
  std::size_t max_bytes = std::size_t{64} << 20;
  bool divergence_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--divergence-only") == 0) divergence_only = true;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::max(1, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--max-bytes") == 0)
      max_bytes = std::strtoull(argv[i + 1], nullptr, 10);
  }
  return shardkit::mpi_main(argc, argv, [&](shardkit::mpi_comm& comm) {
    const int N = comm.size();
    const MPI_Comm raw = comm.native();
    if (comm.rank() == 0 && !divergence_only) {
      std::printf(
          "shardkit fixed-order reductions vs MPI's own, float sum, %d processes, median of "
          "%d repetitions, slowest rank per call\n\n",
          N, reps);
      std::printf("%-9s | %12s %12s %7s | %12s %12s %7s\n", "buffer", "RS MPI us", "RS shardkit",
                  "ratio", "AR MPI us", "AR shardkit", "ratio");
    }
    for (std::size_t bytes = 4096; !divergence_only && bytes <= max_bytes; bytes *= 4) {
      const std::size_t n = bytes / sizeof(float);  // full buffer per rank
      const std::size_t count = n / static_cast<std::size_t>(N);
      std::vector<float> in(n), out(n);
      for (std::size_t i = 0; i < n; ++i)
        in[i] = static_cast<float>((i * 7 + comm.rank()) % 101) * 0.01f;
      // About 0.1 s per repetition for large buffers, at least 3 calls.
      const int iters =
          static_cast<int>(std::clamp<std::size_t>((std::size_t{256} << 20) / bytes / 16, 3, 2000));
      const double rs_mpi = time_per_call(raw, reps, iters, [&] {
        MPI_Reduce_scatter_block(in.data(), out.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                                 raw);
      });
      const double rs_sk = time_per_call(raw, reps, iters, [&] {
        comm.reduce_scatter(in.data(), out.data(), count, shardkit::reduce_op::sum);
      });
      const double ar_mpi = time_per_call(raw, reps, iters, [&] {
        MPI_Allreduce(in.data(), out.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, raw);
      });
      const double ar_sk = time_per_call(raw, reps, iters, [&] {
        comm.all_reduce(in.data(), out.data(), n, shardkit::reduce_op::sum);
      });
      if (comm.rank() == 0) {
        std::printf("%-9s | %12.1f %12.1f %6.2fx | %12.1f %12.1f %6.2fx\n", human(bytes).c_str(),
                    rs_mpi * 1e6, rs_sk * 1e6, rs_sk / rs_mpi, ar_mpi * 1e6, ar_sk * 1e6,
                    ar_sk / ar_mpi);
        std::fflush(stdout);
      }
    }
    // detect_divergence off (baseline) vs on, same calls, interleaved per size.
    auto with = [&](bool detect) {
      auto o = comm.options();
      o.detect_divergence = detect;
      o.check_matching = false;
      return shardkit::mpi_comm::duplicate(raw, o);
    };
    auto off = with(false), on = with(true);
    if (comm.rank() == 0) {
      std::printf(
          "\ndetect_divergence: the same collective without (baseline) and with the signature "
          "exchange, %d processes, %d alternating repetitions: fastest slowest-rank time per "
          "call, median ratio\n\n",
          N, 3 * reps);
      std::printf("%-34s %10s %10s %7s\n", "collective", "off us", "on us", "ratio");
    }
    auto row = [&](const std::string& what, const paired& p) {
      if (comm.rank() != 0) return;
      std::printf("%-34s %10.2f %10.2f %6.2fx\n", what.c_str(), p.base * 1e6, p.variant * 1e6,
                  p.ratio);
      std::fflush(stdout);
    };
    row("divergence barrier",
        time_pair(
            raw, 3 * reps, 500, [&] { off.barrier(); }, [&] { on.barrier(); }));
    for (std::size_t bytes = 4096; bytes <= std::min<std::size_t>(max_bytes, 1u << 20);
         bytes *= 16) {
      const std::size_t n = bytes / sizeof(float);
      const std::size_t count = n / static_cast<std::size_t>(N);
      std::vector<float> in(n, 0.5f), out(n);
      const int iters =
          static_cast<int>(std::clamp<std::size_t>((std::size_t{32} << 20) / bytes, 20, 500));
      row("divergence all_reduce " + human(bytes),
          time_pair(
              raw, 3 * reps, iters,
              [&] { off.all_reduce(in.data(), out.data(), n, shardkit::reduce_op::sum); },
              [&] { on.all_reduce(in.data(), out.data(), n, shardkit::reduce_op::sum); }));
      row("divergence reduce_scatter " + human(bytes),
          time_pair(
              raw, 3 * reps, iters,
              [&] { off.reduce_scatter(in.data(), out.data(), count, shardkit::reduce_op::sum); },
              [&] { on.reduce_scatter(in.data(), out.data(), count, shardkit::reduce_op::sum); }));
    }
    return 0;
  });
}
