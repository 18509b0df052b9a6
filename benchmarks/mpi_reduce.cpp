// What shardkit's fixed-order reductions cost over MPI's own (float, sum):
//   reduce-scatter: mpi_comm::reduce_scatter (all-to-all + rank-order host reduction)
//                   vs MPI_Reduce_scatter_block
//   all-reduce:     mpi_comm::all_reduce (that reduce-scatter + all-gather)
//                   vs MPI_Allreduce
// for full buffers of 4 KiB to 64 MiB per rank. Each timing is the slowest rank's time per call
// (a collective is done when its last rank is), the median of several repetitions.
//
//   mpiexec -np 4 shardkit_bench_mpi_reduce [--reps 7] [--max-bytes 67108864]
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

std::string human(std::size_t bytes) {
  if (bytes >= (1u << 20)) return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes >> 10) + " KiB";
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 7;
  std::size_t max_bytes = std::size_t{64} << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::max(1, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--max-bytes") == 0)
      max_bytes = std::strtoull(argv[i + 1], nullptr, 10);
  }
  return shardkit::mpi_main(argc, argv, [&](shardkit::mpi_comm& comm) {
    const int N = comm.size();
    const MPI_Comm raw = comm.native();
    if (comm.rank() == 0) {
      std::printf(
          "shardkit fixed-order reductions vs MPI's own, float sum, %d processes, median of "
          "%d repetitions, slowest rank per call\n\n",
          N, reps);
      std::printf("%-9s | %12s %12s %7s | %12s %12s %7s\n", "buffer", "RS MPI us", "RS shardkit",
                  "ratio", "AR MPI us", "AR shardkit", "ratio");
    }
    for (std::size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
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
    return 0;
  });
}
