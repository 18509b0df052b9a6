//! \file comm/mpi/main.hpp
//! Starting and ending an MPI program so that a failing rank never leaves the others waiting:
//! `mpi_main` (runs the program's body, MPI_Abort when it throws), `mpi_session` (MPI for the
//! lifetime of an object) and `launched_by_mpi` (one binary for threads and for mpiexec).
#pragma once

#include <shardkit/comm/mpi/communicator.hpp>
#include <shardkit/comm/mpi/support.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <thread>
#include <type_traits>

SHARDKIT_NAMESPACE_BEGIN

//! True when this process was started by an MPI launcher (mpirun/mpiexec of Open MPI, MPICH or
//! a PMIx/PMI system such as srun): lets one binary use MPI under mpirun and threads otherwise.
inline bool launched_by_mpi() noexcept {
  for (const char* var :
       {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

//! MPI for the lifetime of the object: initialises it (MPI_Init_thread, asking for
//! `required`) unless it already is, and finalises it in the destructor if it initialised it.
class mpi_session {
 public:
  explicit mpi_session(int& argc, char**& argv, int required = MPI_THREAD_MULTIPLE) {
    init(&argc, &argv, required);
  }
  explicit mpi_session(int required = MPI_THREAD_MULTIPLE) { init(nullptr, nullptr, required); }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
  ~mpi_session() {
    if (owns_ && !detail::mpi_finalized()) MPI_Finalize();
  }

  //! The thread level MPI provides (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
  int thread_level() const noexcept { return provided_; }
  //! Rank and size in MPI_COMM_WORLD.
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }

 private:
  void init(int* argc, char*** argv, int required) {
    int done = 0;
    MPI_Initialized(&done);
    if (!done) {
      if (detail::mpi_finalized()) {
        detail::raise<usage_error>("mpi_session: MPI was already finalised in this process");
      }
      const int rc = MPI_Init_thread(argc, argv, required, &provided_);
      if (rc != MPI_SUCCESS) {
        detail::raise<comm_error>("mpi_session: MPI_Init_thread failed: ",
                                  detail::mpi_error_text(rc));
      }
      owns_ = true;
    } else {
      MPI_Query_thread(&provided_);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  bool owns_ = false;
  int provided_ = MPI_THREAD_SINGLE;
  int rank_ = 0;
  int size_ = 1;
};

namespace detail {

//! Waits, without a time limit and without spinning, until every process has entered the
//! barrier on `comm` (used by mpi_main before MPI_Finalize).
inline void quiet_barrier(MPI_Comm comm) {
  MPI_Request req = MPI_REQUEST_NULL;
  mpi_check(MPI_Ibarrier(comm, &req), "MPI_Ibarrier", "mpi_main's final barrier", 0, 0);
  for (int flag = 0;;) {
    mpi_check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test", "mpi_main's final barrier", 0,
              0);
    if (flag) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

[[noreturn]] inline void abort_job(int rank, int size, const char* what) noexcept {
  std::fprintf(stderr,
               "shardkit: rank %d of %d failed: %s\n"
               "shardkit: aborting the MPI job (MPI_Abort) so that no rank waits for rank %d\n",
               rank, size, what, rank);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return
}
}  // namespace detail

//! Runs an MPI program's body safely: initialises MPI (MPI_THREAD_MULTIPLE requested), calls
//! `fn(comm)` with an mpi_comm over every process (or `fn()`), and finalises MPI. Returns fn's
//! int result (0 for void).
//!  - If fn throws, prints "shardkit: rank R of N failed: <what>" to stderr and calls
//!    MPI_Abort(MPI_COMM_WORLD, 1): every process of the job ends promptly and the launcher
//!    exits with a non-zero status, instead of the other ranks waiting forever in their next
//!    collective (or until their comm_timeout, which then aborts the job the same way).
//!  - When fn returns, the rank waits (sleeping, without a time limit) until every rank has
//!    returned, and only then finalises MPI: a rank that finishes early is still there to be
//!    ended by another rank's MPI_Abort. (Open MPI 4.1's mpiexec can hang when one process is
//!    inside MPI_Finalize while another aborts.)
template <class F>
int mpi_main(int& argc, char**& argv, F&& fn, mpi_comm_options opts = {}) {
  std::optional<mpi_session> session;
  try {
    session.emplace(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardkit: %s\n", e.what());
    return 1;
  }
  // The session outlives the handler below: MPI_Abort needs MPI still initialised.
  try {
    int rc = 0;
    // Private to mpi_main: the final barrier never matches a collective of the program.
    MPI_Comm finish = MPI_COMM_NULL;
    detail::mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &finish), "MPI_Comm_dup", "mpi_main",
                      session->rank(), session->size());
    struct free_finish {
      MPI_Comm& c;
      ~free_finish() {
        if (c != MPI_COMM_NULL && !detail::mpi_finalized()) MPI_Comm_free(&c);
      }
    } free_finish_guard{finish};
    auto comm = mpi_comm::world(opts);
    if constexpr (std::is_invocable_v<F&, mpi_comm&>) {
      if constexpr (std::is_void_v<std::invoke_result_t<F&, mpi_comm&>>) {
        fn(comm);
      } else {
        rc = static_cast<int>(fn(comm));
      }
    } else {
      static_assert(std::is_invocable_v<F&>,
                    "mpi_main: fn must be callable as fn(shardkit::mpi_comm&) or fn()");
      if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
        fn();
      } else {
        rc = static_cast<int>(fn());
      }
    }
    detail::quiet_barrier(finish);
    return rc;
  } catch (const std::exception& e) {
    detail::abort_job(session->rank(), session->size(), e.what());
  } catch (...) {
    detail::abort_job(session->rank(), session->size(),
                      "an exception not derived from std::exception");
  }
}

SHARDKIT_NAMESPACE_END
