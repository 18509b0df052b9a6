// An MPI program built on shardkit::mpi_main, run under mpiexec by ctest (mpi_job_check.cmake)
// to show what happens to the whole job when one rank fails. Usage: test_mpi_job <mode>
//   ok       every rank works and returns 0: the job exits with 0
//   throw    rank 2 throws while the others wait in a barrier: mpi_main prints the rank and the
//            error and calls MPI_Abort, the job ends at once with a non-zero status
//   die      rank 1 exits without MPI_Finalize while the others wait: the launcher ends the job
//   stall    rank 3 skips a collective and returns: the others time out (2 s), their
//            comm_timeout leaves fn, mpi_main aborts the job
#include <shardkit/comm/mpi.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "ok";
  shardkit::mpi_comm_options opts;
  if (mode == "stall") opts.timeout = std::chrono::seconds(2);
  return shardkit::mpi_main(
      argc, argv,
      [&](shardkit::mpi_comm& comm) {
        const int r = comm.rank();
        float x = 1.0f;
        comm.all_reduce(&x, &x, 1);
        comm.barrier();
        if (mode == "throw" && r == 2) throw std::runtime_error("rank 2 fails on purpose");
        if (mode == "die" && r == 1) std::_Exit(3);
        if (mode == "stall" && r == 3) return 0;
        comm.barrier();  // without mpi_main's abort, ranks would wait here forever
        comm.all_reduce(&x, &x, 1);
        if (r == 0) std::printf("mpi job ok: %g\n", static_cast<double>(x));
        return x == static_cast<float>(comm.size() * comm.size()) ? 0 : 1;
      },
      opts);
}
