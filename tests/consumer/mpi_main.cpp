// A minimal MPI user of shardkit (run without mpirun: a one-process MPI job).
#include <shardkit/comm/mpi.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  return shardkit::mpi_main(argc, argv, [](shardkit::mpi_comm& comm) {
    float x = 1.0f;
    comm.all_reduce(&x, &x, 1);
    std::printf("consumer mpi ok: %g on %d rank(s)\n", static_cast<double>(x), comm.size());
    return x == static_cast<float>(comm.size()) ? 0 : 1;
  });
}
