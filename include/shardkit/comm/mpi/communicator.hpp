//! \file comm/mpi/communicator.hpp
//! `mpi_comm`: one rank's endpoint of an MPI communicator (comm/mpi.hpp has the overview). The
//! typed calls come from comm/detail/frontend.hpp, the transport is detail::mpi_state
//! (comm/mpi/state.hpp).
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/frontend.hpp>
#include <shardkit/comm/detail/work.hpp>
#include <shardkit/comm/mpi/state.hpp>
#include <shardkit/comm/mpi/support.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

SHARDKIT_NAMESPACE_BEGIN

namespace detail {
//! The MPI transport's side of a work handle (comm/detail/work.hpp).
struct mpi_handle {
  std::shared_ptr<mpi_state> state;
  std::shared_ptr<mpi_op> op;

  void wait() {
    auto s = std::move(state);
    auto o = std::move(op);
    std::unique_lock lk(s->mutex());
    s->wait(lk, *o);
  }
  bool test() {
    std::unique_lock lk(state->mutex());
    return state->test(*op);
  }
  void settle() noexcept {
    try {
      wait();
    } catch (...) {
      // Reported by wait() to whoever waits; a destructor must not throw.
    }
  }
};
}  // namespace detail

//! Handle to an asynchronous collective of an mpi_comm. wait() drives it to completion and
//! rethrows its error; test() makes one step of progress and says whether it is done. The
//! destructor waits too (without throwing), so a dropped handle never leaves MPI writing into
//! buffers the caller believes are free — unless the communicator has already failed (see the
//! file comment on comm_timeout).
class mpi_work : public detail::basic_work<detail::mpi_handle> {
 public:
  mpi_work() = default;
  mpi_work(std::shared_ptr<detail::mpi_state> state, std::shared_ptr<detail::mpi_op> op)
      : basic_work(detail::mpi_handle{std::move(state), std::move(op)}) {}
};

//! One rank's endpoint of an MPI communicator (host memory). Construction, split() and every
//! collective are collective over the underlying MPI communicator.
class mpi_comm : public detail::comm_frontend<mpi_comm> {
 public:
  using memory_space = host_space;
  using work_type = mpi_work;

  //! Borrows `comm` (for example MPI_COMM_WORLD): shardkit runs its collectives on it, never
  //! frees it and leaves its error handler alone; it duplicates it once for the second stage of
  //! all_reduce (freed by the destructor). Collective over `comm`.
  explicit mpi_comm(MPI_Comm comm, mpi_comm_options opts = {}) {
    detail::require_mpi_running("mpi_comm");
    validate(opts);
    int r = 0, n = 0;
    MPI_Comm_rank(comm, &r);
    MPI_Comm_size(comm, &n);
    MPI_Comm phase2 = MPI_COMM_NULL;
    detail::mpi_check(MPI_Comm_dup(comm, &phase2), "MPI_Comm_dup", "mpi_comm construction", r, n);
    MPI_Comm_set_errhandler(phase2, MPI_ERRORS_RETURN);
    state_ = std::make_shared<detail::mpi_state>(comm, phase2, false, opts);
    state_->check_thread_level();
  }

  //! Duplicates `comm` (MPI_Comm_dup) and owns the duplicate, whose errors become comm_error.
  //! Collective over `comm`.
  static mpi_comm duplicate(MPI_Comm comm, mpi_comm_options opts = {}) {
    detail::require_mpi_running("mpi_comm::duplicate");
    validate(opts);
    int r = 0, n = 0;
    MPI_Comm_rank(comm, &r);
    MPI_Comm_size(comm, &n);
    MPI_Comm a = MPI_COMM_NULL, b = MPI_COMM_NULL;
    detail::mpi_check(MPI_Comm_dup(comm, &a), "MPI_Comm_dup", "mpi_comm::duplicate", r, n);
    MPI_Comm_set_errhandler(a, MPI_ERRORS_RETURN);
    const int rc = MPI_Comm_dup(a, &b);
    if (rc != MPI_SUCCESS) MPI_Comm_free(&a);
    detail::mpi_check(rc, "MPI_Comm_dup", "mpi_comm::duplicate", r, n);
    mpi_comm c(std::make_shared<detail::mpi_state>(a, b, true, opts));
    c.state_->check_thread_level();
    return c;
  }

  //! Every process of the job: a duplicate of MPI_COMM_WORLD that this object owns.
  static mpi_comm world(mpi_comm_options opts = {}) { return duplicate(MPI_COMM_WORLD, opts); }

  mpi_comm(mpi_comm&&) noexcept = default;
  mpi_comm& operator=(mpi_comm&& o) noexcept {
    if (this != &o) {
      if (state_) state_->close();
      state_ = std::move(o.state_);
    }
    return *this;
  }
  mpi_comm(const mpi_comm&) = delete;
  mpi_comm& operator=(const mpi_comm&) = delete;
  //! Waits for pending collectives (unless the communicator has failed), stops the progress
  //! thread and frees the MPI communicators it owns.
  ~mpi_comm() {
    if (state_) state_->close();
  }

  int rank() const noexcept { return state_->rank(); }
  int size() const noexcept { return state_->size(); }
  //! The MPI communicator the collectives run on (borrowed or owned by this object).
  MPI_Comm native() const noexcept { return state_->native(); }
  const mpi_comm_options& options() const noexcept { return state_->options(); }

  //! Collective: ranks with the same `color` (>= 0) form a new communicator, ordered by
  //! (key, rank), with the same options. Waits for this communicator's pending collectives.
  mpi_comm split(int color, int key) {
    detail::check_split_color(color);
    std::unique_lock lk(state_->mutex());
    auto child = state_->split(lk, color, key);
    lk.unlock();
    child->check_thread_level();
    return mpi_comm(std::move(child));
  }

  //! Ends the whole MPI job (MPI_Abort on this communicator) after printing `reason` with this
  //! rank to stderr. For failures a rank cannot recover from.
  [[noreturn]] void abort(const std::string& reason) {
    std::fprintf(stderr, "shardkit: rank %d of %d aborts the MPI job: %s\n", rank(), size(),
                 reason.c_str());
    std::fflush(stderr);
    MPI_Abort(native(), 1);
    std::abort();
  }

 private:
  explicit mpi_comm(std::shared_ptr<detail::mpi_state> s) : state_(std::move(s)) {}

  static void validate(const mpi_comm_options& o) {
    if (o.max_call_elems == 0 || o.max_call_elems > (std::size_t{1} << 30)) {
      detail::raise("mpi_comm_options::max_call_elems must be in [1, 2^30], got ",
                    o.max_call_elems);
    }
    if (o.timeout.count() < 0) {
      detail::raise("mpi_comm_options::timeout must not be negative, got ", o.timeout.count(),
                    " ms");
    }
  }

  friend class detail::comm_frontend<mpi_comm>;

  // The transport interface of comm/detail/frontend.hpp.
  traffic_ledger& ledger() noexcept { return state_->traffic(); }
  const traffic_ledger& ledger() const noexcept { return state_->traffic(); }

  template <class T>
  void run(const detail::collective_desc& d, const T* in, T* out) {
    std::unique_lock lk(state_->mutex());
    auto op = state_->issue(lk, d, in, out);
    state_->wait(lk, *op);
  }

  template <class T>
  mpi_work start(const detail::collective_desc& d, const T* in, T* out) {
    std::unique_lock lk(state_->mutex());
    auto op = state_->issue(lk, d, in, out);
    state_->ensure_progress_thread();
    lk.unlock();
    state_->notify();
    return mpi_work(state_, std::move(op));
  }

  std::shared_ptr<detail::mpi_state> state_;
};

static_assert(communicator<mpi_comm>);

SHARDKIT_NAMESPACE_END
