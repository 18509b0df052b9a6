// A minimal MPI user of shardkit (run without mpirun: a one-process MPI job).
#include <shardkit/comm/mpi.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  return shardkit::mpi_main(argc, argv, [](shardkit::mpi_comm& comm) {
    float x = 1.0f;
    comm.all_reduce(&x, &x, 1);
    const bool ok = x == static_cast<float>(comm.size());
    std::printf("consumer mpi %s: %g on %d rank(s)\n", ok ? "ok" : "FAILED", static_cast<double>(x),
                comm.size());
    return ok ? 0 : 1;
  });
}
