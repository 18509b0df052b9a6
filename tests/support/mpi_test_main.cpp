// main() of the Catch2 test binaries that run under mpiexec: initialises MPI, opens the MPI
// world, runs the Catch2 session on every process, and makes every process exit with the same
// status (the largest failure count of any process). Process 0 reports on stdout; the others
// write to a temporary file that is shown only when that process saw a failure.
#define CATCH_CONFIG_RUNNER
#include <shardkit/comm/mpi.hpp>

#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <unistd.h>

int main(int argc, char** argv) {
  shardkit::mpi_session session(argc,
                                argv);  // MPI_THREAD_MULTIPLE: the progress-thread tests need it
  const int rank = session.rank();
  int failures = 0;
  std::string log;
  {
    test::mpi_world::open();
    Catch::Session catch_session;
    if (const int rc = catch_session.applyCommandLine(argc, argv); rc != 0) return rc;
    if (rank != 0) {
      log = "/tmp/shardkit_mpi_test_" + std::to_string(::getpid()) + "_rank" +
            std::to_string(rank) + ".log";
      catch_session.configData().outputFilename = log;
    }
    failures = catch_session.run();
    test::mpi_world::close();
  }
  int worst = 0;
  MPI_Allreduce(&failures, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!log.empty()) {
    if (failures != 0) {
      std::ifstream in(log);
      std::ostringstream text;
      text << in.rdbuf();
      std::cerr << "---- report of MPI rank " << rank << " (" << failures << " failure(s)) ----\n"
                << text.str() << "---- end of report of MPI rank " << rank << " ----\n";
    }
    std::remove(log.c_str());
  }
  if (rank == 0 && worst != failures) {
    std::cout << "another MPI rank saw " << worst << " failure(s); its report is on stderr\n";
  }
  return worst;
}
