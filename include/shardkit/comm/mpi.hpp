//! \file comm/mpi.hpp
//! `mpi_comm`: the Communicator over MPI (ranks in separate processes, on one node or many), and
//! `mpi_main` / `mpi_session` to start and end an MPI program so that a failing rank never leaves
//! the others waiting. This is the only shardkit header that includes <mpi.h>; link the CMake
//! target `shardkit::mpi`.
//!
//!     int main(int argc, char** argv) {
//!       return shardkit::mpi_main(argc, argv, [](shardkit::mpi_comm& comm) {
//!         std::vector<float> x(8, float(comm.rank()));
//!         comm.all_reduce(x.data(), x.data(), x.size(), shardkit::reduce_op::sum);
//!       });
//!     }
//!
//! **Bit-identical to thread_comm.** MPI only moves bytes; shardkit reduces, in rank order
//! 0..N-1 with host::reduce_ordered (fp32 accumulation for bf16/fp16), so every result equals
//! the thread communicator's for the same inputs, bit for bit, whatever MPI's own algorithms:
//!  - reduce_scatter(count c): an all-to-all hands each rank every rank's c elements of its own
//!    slice (into scratch), which it then reduces in rank order into `out`.
//!  - all_reduce(n): the same over the chunks of comm/volume.hpp (rank r owns chunk_size(n, N, r)
//!    elements; MPI_Ialltoallv for uneven chunks), then an all-gather (MPI_Iallgatherv, in place)
//!    of the reduced chunks. Each rank sends n - n_r + (N-1)·n_r elements, which sums over the
//!    ranks to exactly the ring volume 2(N-1)·n, and equals the per-rank ring volume when N
//!    divides n.
//!  - all_gather, all_to_all, broadcast, barrier: MPI's own (no arithmetic involved).
//!  16-bit types travel as raw 16-bit words (MPI has no bf16). `traffic()` records the ring byte
//!  counts of comm/volume.hpp for every collective (barrier: one call, 0 bytes), exactly as
//!  thread_comm does, so an engine's ledger reads the same on either communicator.
//!
//! **Progress of asynchronous collectives.** Every collective is an MPI non-blocking collective
//! (MPI_Ialltoallv, MPI_Iallgather, ...), started when it is called; its local reduction (and,
//! for all_reduce, the start of its all-gather) happens when its MPI part completes. Open MPI and
//! MPICH move non-blocking collectives forward only inside MPI calls, so something must call MPI
//! while the rank computes. `mpi_comm_options::progress` chooses who:
//!  - `mpi_progress::on_call` (default): progress happens inside shardkit's calls on this
//!    communicator — every test() and wait(), and every collective issued later (issuing bucket
//!    k+1's reduce-scatter drives bucket k's). No extra thread, any MPI thread level that fits
//!    how your threads call MPI. A rank that computes for a long time without touching the
//!    communicator delays its part until its next call; the other ranks then wait for it.
//!  - `mpi_progress::thread`: a progress thread per communicator calls MPI_Test (and runs the
//!    reductions) every `progress_interval` while asynchronous collectives are pending, so they
//!    finish while the rank computes. Needs MPI initialised with MPI_THREAD_MULTIPLE (mpi_main
//!    and mpi_session request it; the constructor checks and says so), and costs a little CPU.
//!  The default is on_call because a polling thread needs MPI_THREAD_MULTIPLE (which makes every
//!  MPI call of the process take locks in Open MPI 4) and competes for the cores the overlap is
//!  meant to use; choose `thread` when compute and communication really run side by side.
//!  Either way collectives complete in the order they were issued. A rank that waits spins on
//!  MPI_Test (yielding the core) for the first millisecond, as MPI_Wait does, then tests every
//!  100 µs, so that ranks waiting for a late one leave the cores to the ranks that compute.
//!
//! **Failure.** MPI cannot cancel a collective, so shardkit turns every way a job could hang into
//! the end of the job:
//!  - A rank that throws out of `mpi_main`'s function prints "shardkit: rank R of N failed: ..."
//!    and calls MPI_Abort, which ends every rank of the job at once with a non-zero status.
//!  - A rank that dies (crash, kill, exit without MPI_Finalize) is detected by the launcher
//!    (mpirun/mpiexec), which ends the job.
//!  - A collective that waits longer than `mpi_comm_options::timeout` (a rank stalls, or issued
//!    fewer collectives) throws comm_timeout; with `check_matching`, ranks that issue different
//!    collectives get collective_mismatch on every rank instead of a hang or a wrong answer.
//!    After comm_timeout the communicator is unusable (its later collectives throw comm_aborted)
//!    because the MPI operation cannot be withdrawn: end the job — mpi_main does it when the
//!    exception leaves your function. The abandoned operation's scratch memory and MPI
//!    communicators are deliberately never freed; the caller's buffers of that operation must not
//!    be freed either until the job ends (mpi_main's MPI_Abort ends it right after unwinding).
//!  - An MPI error code becomes comm_error naming the collective, the rank and MPI's error
//!    string. This needs the MPI_ERRORS_RETURN error handler, which shardkit sets on the
//!    communicators it owns (duplicate(), world(), split()); a borrowed communicator keeps its
//!    own handler (MPI's default MPI_ERRORS_ARE_FATAL ends the job with MPI's message). Open MPI
//!    4 reports errors it finds while a non-blocking collective progresses (for example a
//!    message truncated because ranks passed different counts) through MPI_COMM_WORLD's handler,
//!    which ends the job unless the program changed it: never a hang either way.
//!
//! **Large counts.** MPI counts are `int`; a collective larger than
//! `mpi_comm_options::max_call_elems` elements per peer is carried by several MPI calls (strided
//! derived datatypes for the per-peer blocks). The result and the recorded bytes do not change.
//!
//! **Memory.** reduce_scatter and all_reduce receive every rank's contribution to this rank's
//! slice before reducing it: a transient scratch of N·count (reduce_scatter) or about n
//! (all_reduce) elements per collective in flight, freed when it completes.
//!
//! One endpoint is used by one thread at a time (besides its own progress thread).
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/host/reduce.hpp>

// shardkit uses MPI's C API; keep the deprecated C++ bindings out.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Who moves an mpi_comm's asynchronous collectives forward (see the file comment).
enum class mpi_progress : std::uint8_t {
  on_call,  //!< inside test(), wait() and later collectives of the communicator
  thread,   //!< a progress thread per communicator (needs MPI_THREAD_MULTIPLE)
};

//! Settings of an mpi_comm; communicators made by split() inherit them.
struct mpi_comm_options {
  //! How long a collective may wait for the other ranks before it fails with comm_timeout
  //! (zero: wait forever). Long by default: a rank may legitimately wait while another one
  //! saves a checkpoint.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  //! Before each collective, compare kind, element type, count, operation and root across the
  //! ranks (one small MPI_Iallgather) and throw collective_mismatch on every rank when they
  //! differ. Off by default: it adds a latency-bound exchange to every collective and makes
  //! issuing an asynchronous collective wait until every rank has issued it.
  bool check_matching = false;
  //! See mpi_progress.
  mpi_progress progress = mpi_progress::on_call;
  //! How often the progress thread polls MPI while collectives are pending.
  std::chrono::microseconds progress_interval{50};
  //! Most elements one MPI call carries per peer, in [1, 2^30]; larger collectives are split
  //! into several calls. The default keeps every message under 1 GiB.
  std::size_t max_call_elems = std::size_t{1} << 27;
};

class mpi_comm;

namespace detail {

//! MPI's type for moving elements of `t` (never used for arithmetic).
inline MPI_Datatype mpi_datatype(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return MPI_FLOAT;
    case dtype::f64:
      return MPI_DOUBLE;
    case dtype::bf16:
    case dtype::f16:
      return MPI_UINT16_T;  // raw 16-bit words
    case dtype::i32:
      return MPI_INT32_T;
    case dtype::i64:
      return MPI_INT64_T;
    case dtype::u8:
      return MPI_UINT8_T;
    case dtype::u32:
      return MPI_UINT32_T;
    case dtype::u64:
      return MPI_UINT64_T;
  }
  return MPI_DATATYPE_NULL;
}

//! MPI's text for an error code ("MPI_ERR_COUNT: invalid count argument").
inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return concat("MPI error code ", code);
  return std::string(text, static_cast<std::size_t>(len));
}

//! Throws comm_error when an MPI call did not return MPI_SUCCESS.
inline void mpi_check(int rc, const char* mpi_function, const std::string& what, int rank,
                      int size) {
  if (rc == MPI_SUCCESS) return;
  throw comm_error(concat("mpi_comm: ", what, " failed on rank ", rank, " of ", size, ": ",
                          mpi_function, " returned ", mpi_error_text(rc)));
}

//! Throws usage_error unless MPI is initialised and not yet finalised.
inline void require_mpi_running(const char* who) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) {
    raise<usage_error>(who, ": MPI is ", fin ? "already finalised" : "not initialised",
                       "; create communicators between MPI_Init_thread and MPI_Finalize (or "
                       "inside shardkit::mpi_main / while a shardkit::mpi_session lives)");
  }
}

inline bool mpi_finalized() noexcept {
  int fin = 0;
  MPI_Finalized(&fin);
  return fin != 0;
}

//! A committed derived datatype, freed with its holder (MPI keeps it alive for operations that
//! already use it).
struct mpi_type_holder {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  mpi_type_holder() = default;
  mpi_type_holder(const mpi_type_holder&) = delete;
  mpi_type_holder& operator=(const mpi_type_holder&) = delete;
  ~mpi_type_holder() {
    if (type != MPI_DATATYPE_NULL && !mpi_finalized()) MPI_Type_free(&type);
  }
};

//! One asynchronous collective of an mpi_comm.
struct mpi_op {
  //! One MPI call's share: elements [begin, begin + len) of each per-peer block (or of the
  //! array, for all_reduce and broadcast), its scratch offset in bytes, and the count and
  //! displacement arrays MPI reads until the call completes.
  struct part {
    std::size_t begin = 0;
    std::size_t len = 0;
    std::size_t scratch = 0;
    std::vector<int> counts, displs, recv_counts, recv_displs;
  };

  collective_desc desc;
  std::uint64_t call = 0;
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
  std::vector<part> parts;
  std::unique_ptr<std::byte[]> scratch;
  std::vector<MPI_Request> requests;
  int stage = 0;  // 0: first MPI calls in flight, 1: all_reduce's all-gather in flight, 2: done
  std::exception_ptr error;

  bool done() const noexcept { return stage == 2; }
  std::string what() const { return concat(describe(desc), " (call #", call, ")"); }
};

//! Shared state of one mpi_comm endpoint: its MPI communicators, the queue of collectives in
//! flight (completed strictly in issue order), the progress thread, and the traffic ledger.
//! `mu` guards everything but `traffic` and is held around every MPI call on `comm`/`phase2`.
class mpi_state {
 public:
  mpi_state(MPI_Comm comm, MPI_Comm phase2, bool owns_comm, mpi_comm_options opts)
      : comm_(comm), phase2_(phase2), owns_comm_(owns_comm), opts_(opts) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  mpi_state(const mpi_state&) = delete;
  mpi_state& operator=(const mpi_state&) = delete;
  ~mpi_state() { close(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native() const noexcept { return comm_; }
  const mpi_comm_options& options() const noexcept { return opts_; }
  traffic_ledger& traffic() noexcept { return traffic_; }

  //! Starts a collective (after the matching check, when enabled) and queues it.
  std::shared_ptr<mpi_op> issue(std::unique_lock<std::mutex>& lk, const collective_desc& d,
                                const void* in, void* out) {
    throw_if_broken([&] { return describe(d); });
    const std::uint64_t call = ++calls_;
    if (opts_.check_matching) check_matching(lk, d, false, call);
    auto op = std::make_shared<mpi_op>();
    op->desc = d;
    op->call = call;
    op->in = static_cast<const std::byte*>(in);
    op->out = static_cast<std::byte*>(out);
    // Queued before it starts: if starting fails half-way, the parts already started keep their
    // scratch (a failed communicator's queue is never freed, see close()).
    queue_.push_back(op);
    try {
      start(*op);
    } catch (...) {
      broken_ = concat(op->what(), " could not be started on rank ", rank_);
      throw;
    }
    return op;
  }

  //! Drives the queue until `op` is done; rethrows its error.
  void wait(std::unique_lock<std::mutex>& lk, const mpi_op& op) {
    poll(
        lk, [&] { return op.done(); }, [&] { return op.what(); });
    if (op.error) std::rethrow_exception(op.error);
  }

  //! One step of progress; true when `op` is done.
  bool test(const mpi_op& op) {
    if (!op.done() && broken_.empty()) drive();
    return op.done();
  }

  //! Waits for every queued collective (used before split() and when closing).
  void drain(std::unique_lock<std::mutex>& lk) {
    poll(
        lk, [&] { return queue_.empty(); }, [] { return std::string("pending collectives"); });
  }

  //! Collective: MPI_Comm_split of this communicator (after draining it), plus the second
  //! communicator of the new one. Returns the new state.
  std::shared_ptr<mpi_state> split(std::unique_lock<std::mutex>& lk, int color, int key) {
    collective_desc d;
    d.color = color;
    d.key = key;
    throw_if_broken([] { return std::string("split"); });
    drain(lk);
    const std::uint64_t call = ++calls_;
    if (opts_.check_matching) check_matching(lk, d, true, call);
    const std::string what = concat("split(color ", color, ", key ", key, ") (call #", call, ")");
    MPI_Comm a = MPI_COMM_NULL, b = MPI_COMM_NULL;
    mpi_check(MPI_Comm_split(comm_, color, key, &a), "MPI_Comm_split", what, rank_, size_);
    MPI_Comm_set_errhandler(a, MPI_ERRORS_RETURN);
    const int rc = MPI_Comm_dup(a, &b);
    if (rc != MPI_SUCCESS) MPI_Comm_free(&a);
    mpi_check(rc, "MPI_Comm_dup", what, rank_, size_);
    return std::make_shared<mpi_state>(a, b, true, opts_);
  }

  //! Checks the thread level the progress mode needs.
  void check_thread_level() const {
    if (opts_.progress != mpi_progress::thread) return;
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE) {
      raise<usage_error>(
          "mpi_comm: mpi_progress::thread needs MPI initialised with MPI_THREAD_MULTIPLE, but "
          "MPI provides thread level ",
          provided, " (MPI_THREAD_MULTIPLE is ", MPI_THREAD_MULTIPLE,
          "); initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) (as "
          "shardkit::mpi_main does) or use mpi_progress::on_call");
    }
  }

  //! Starts the progress thread if the options ask for one and it is not running yet.
  void ensure_progress_thread() {
    if (opts_.progress != mpi_progress::thread || progress_thread_.joinable()) return;
    progress_thread_ = std::thread([this] { progress_loop(); });
  }

  void notify() { cv_.notify_all(); }

  //! Waits for what is queued (unless broken), stops the progress thread and frees the MPI
  //! communicators this endpoint owns. Never throws. Idempotent.
  void close() noexcept {
    std::unique_lock lk(mu_);
    if (closed_) return;
    closed_ = true;
    if (!mpi_finalized()) {
      try {
        if (broken_.empty()) drain(lk);
      } catch (...) {
        // The job is failing; the caller learns it from the collective's own wait().
      }
    }
    stop_ = true;
    lk.unlock();
    cv_.notify_all();
    if (progress_thread_.joinable()) progress_thread_.join();
    lk.lock();
    if (!broken_.empty()) {
      // Abandoned MPI operations may still use these buffers and communicators (Open MPI keeps
      // progressing them even on a freed communicator): never free them.
      new std::deque<std::shared_ptr<mpi_op>>(std::move(queue_));
      new std::vector<std::shared_ptr<mpi_op>>(std::move(failed_));
      new std::vector<std::int64_t>(std::move(check_buffer_));
      queue_.clear();
      return;
    }
    if (!mpi_finalized()) {
      if (phase2_ != MPI_COMM_NULL) MPI_Comm_free(&phase2_);
      if (owns_comm_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    }
  }

  std::mutex& mutex() noexcept { return mu_; }

 private:
  // Drives the queue until done(); throws comm_aborted when the communicator has failed and
  // comm_timeout (marking it failed) after opts_.timeout. `waited()` names what the caller waits
  // for; the message names the oldest pending collective, which is the one that is stuck.
  template <class Done, class Waited>
  void poll(std::unique_lock<std::mutex>& lk, Done done, Waited waited) {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      if (broken_.empty()) drive();
      if (done()) return;
      if (!broken_.empty()) {
        throw comm_aborted(concat("mpi_comm: rank ", rank_, " of ", size_,
                                  ": the communicator is unusable: ", broken_));
      }
      const auto waited_for = std::chrono::steady_clock::now() - t0;
      if (opts_.timeout.count() > 0 && waited_for > opts_.timeout) {
        std::string what = waited();
        if (!queue_.empty() && queue_.front()->what() != what) {
          what = concat(queue_.front()->what(), " (waiting for ", what, ")");
        }
        broken_ = concat(what, " timed out after ", opts_.timeout.count(), " ms on rank ", rank_);
        throw comm_timeout(concat(
            "mpi_comm: ", what, " timed out after ", opts_.timeout.count(), " ms on rank ", rank_,
            " of ", size_,
            ": not every rank reached it (a rank died, hangs, or issued fewer or different "
            "collectives); MPI cannot withdraw it, so this communicator is unusable now: end the "
            "job (shardkit::mpi_main calls MPI_Abort when this exception leaves your function)"));
      }
      lk.unlock();
      if (waited_for < std::chrono::milliseconds(1)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      lk.lock();
    }
  }

  // Completes what can be completed, strictly in issue order.
  void drive() {
    while (!queue_.empty()) {
      auto& op = queue_.front();
      if (!advance(*op)) return;
      if (op->error) failed_.push_back(op);  // other parts of it may still be in flight
      queue_.pop_front();
    }
  }

  // Moves `op` forward; true when it is done (successfully or with an error).
  bool advance(mpi_op& op) {
    try {
      while (!op.done()) {
        if (!requests_done(op)) return false;
        if (op.stage == 0) {
          finish_first_stage(op);
        } else {
          op.stage = 2;
        }
      }
      traffic_.record(
          op.desc.kind,
          ring_bytes_sent(op.desc.kind, op.desc.count, size_of(op.desc.type),
                          static_cast<std::size_t>(size_), static_cast<std::size_t>(rank_),
                          static_cast<std::size_t>(op.desc.root)));
    } catch (...) {
      op.error = std::current_exception();
      op.stage = 2;
      broken_ = concat(op.what(), " failed on rank ", rank_);
    }
    return true;
  }

  bool requests_done(mpi_op& op) {
    for (auto& req : op.requests) {
      if (req == MPI_REQUEST_NULL) continue;
      int flag = 0;
      check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test", op);
      if (!flag) return false;
    }
    op.requests.clear();
    return true;
  }

  // The MPI part of stage 0 is complete: reduce what arrived, start all_reduce's all-gather.
  void finish_first_stage(mpi_op& op) {
    const collective_desc& d = op.desc;
    const std::size_t e = size_of(d.type);
    const auto N = static_cast<std::size_t>(size_);
    const auto r = static_cast<std::size_t>(rank_);
    std::vector<const void*> src(N);
    if (d.kind == collective::reduce_scatter) {
      for (const auto& p : op.parts) {
        for (std::size_t q = 0; q < N; ++q) src[q] = op.scratch.get() + p.scratch + q * p.len * e;
        host::reduce_ordered(d.type, src.data(), N, op.out + p.begin * e, p.len, d.op);
      }
    } else if (d.kind == collective::all_reduce) {
      for (const auto& p : op.parts) {
        const std::size_t mine = chunk_size(p.len, N, r);
        for (std::size_t q = 0; q < N; ++q) src[q] = op.scratch.get() + p.scratch + q * mine * e;
        host::reduce_ordered(d.type, src.data(), N,
                             op.out + (p.begin + chunk_begin(p.len, N, r)) * e, mine, d.op);
      }
      op.scratch.reset();
      const MPI_Datatype t = mpi_datatype(d.type);
      for (auto& p : op.parts) {
        MPI_Request req = MPI_REQUEST_NULL;
        check(MPI_Iallgatherv(MPI_IN_PLACE, 0, t, op.out + p.begin * e, p.counts.data(),
                              p.displs.data(), t, phase2_, &req),
              "MPI_Iallgatherv", op);
        op.requests.push_back(req);
      }
      op.stage = 1;
      return;
    }
    op.scratch.reset();
    op.stage = 2;
  }

  // A datatype of `len` elements of `t` whose extent is `stride_bytes`: one per-peer block of a
  // collective that is split into several MPI calls.
  void make_strided(mpi_type_holder& h, MPI_Datatype t, std::size_t len, std::size_t stride_bytes,
                    const mpi_op& op) const {
    MPI_Datatype contiguous = MPI_DATATYPE_NULL;
    check(MPI_Type_contiguous(static_cast<int>(len), t, &contiguous), "MPI_Type_contiguous", op);
    const int rc =
        MPI_Type_create_resized(contiguous, 0, static_cast<MPI_Aint>(stride_bytes), &h.type);
    MPI_Type_free(&contiguous);
    check(rc, "MPI_Type_create_resized", op);
    check(MPI_Type_commit(&h.type), "MPI_Type_commit", op);
  }

  // Starts the first MPI stage of `op`.
  void start(mpi_op& op) {
    const collective_desc& d = op.desc;
    const std::size_t e = size_of(d.type);
    const MPI_Datatype t = mpi_datatype(d.type);
    const auto N = static_cast<std::size_t>(size_);
    const auto r = static_cast<std::size_t>(rank_);
    const std::size_t L = opts_.max_call_elems;
    const std::size_t c = d.count;
    MPI_Request req = MPI_REQUEST_NULL;
    // Called as issued(MPI_Ixxx(..., &req), "MPI_Ixxx"): reads `req` after the call filled it.
    auto issued = [&](int rc, const char* fn) {
      check(rc, fn, op);
      op.requests.push_back(req);
      req = MPI_REQUEST_NULL;
    };
    // Pieces [begin, begin + len) of length <= L covering [0, n).
    auto pieces = [&](std::size_t n) {
      for (std::size_t b = 0; b < n; b += L)
        op.parts.push_back({b, std::min(L, n - b), 0, {}, {}, {}, {}});
    };
    switch (d.kind) {
      case collective::barrier:
        issued(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
        break;
      case collective::broadcast:
        pieces(c);
        for (const auto& p : op.parts) {
          issued(MPI_Ibcast(op.out + p.begin * e, static_cast<int>(p.len), t, d.root, comm_, &req),
                 "MPI_Ibcast");
        }
        break;
      case collective::all_gather: {
        pieces(c);
        const bool in_place = op.in == op.out + r * c * e;
        for (const auto& p : op.parts) {
          const void* send =
              in_place ? MPI_IN_PLACE : static_cast<const void*>(op.in + p.begin * e);
          if (p.len == c) {
            issued(MPI_Iallgather(send, static_cast<int>(c), t, op.out, static_cast<int>(c), t,
                                  comm_, &req),
                   "MPI_Iallgather");
          } else {
            mpi_type_holder block;
            make_strided(block, t, p.len, c * e, op);
            issued(MPI_Iallgather(send, static_cast<int>(p.len), t, op.out + p.begin * e, 1,
                                  block.type, comm_, &req),
                   "MPI_Iallgather");
          }
        }
        break;
      }
      case collective::all_to_all: {
        pieces(c);
        for (const auto& p : op.parts) {
          if (p.len == c) {
            issued(MPI_Ialltoall(op.in, static_cast<int>(c), t, op.out, static_cast<int>(c), t,
                                 comm_, &req),
                   "MPI_Ialltoall");
          } else {
            mpi_type_holder block;
            make_strided(block, t, p.len, c * e, op);
            issued(MPI_Ialltoall(op.in + p.begin * e, 1, block.type, op.out + p.begin * e, 1,
                                 block.type, comm_, &req),
                   "MPI_Ialltoall");
          }
        }
        break;
      }
      case collective::reduce_scatter: {
        pieces(c);
        if (c != 0) op.scratch.reset(new std::byte[N * c * e]);
        for (auto& p : op.parts) {
          p.scratch = N * p.begin * e;
          std::byte* recv = op.scratch.get() + p.scratch;
          if (p.len == c) {
            issued(MPI_Ialltoall(op.in, static_cast<int>(c), t, recv, static_cast<int>(c), t, comm_,
                                 &req),
                   "MPI_Ialltoall");
          } else {
            mpi_type_holder block;
            make_strided(block, t, p.len, c * e, op);
            issued(MPI_Ialltoall(op.in + p.begin * e, 1, block.type, recv, static_cast<int>(p.len),
                                 t, comm_, &req),
                   "MPI_Ialltoall");
          }
        }
        break;
      }
      case collective::all_reduce: {
        pieces(c);
        std::size_t scratch_bytes = 0;
        for (auto& p : op.parts) {
          const std::size_t mine = chunk_size(p.len, N, r);
          p.counts.resize(N);
          p.displs.resize(N);
          p.recv_counts.assign(N, static_cast<int>(mine));
          p.recv_displs.resize(N);
          for (std::size_t q = 0; q < N; ++q) {
            p.counts[q] = static_cast<int>(chunk_size(p.len, N, q));
            p.displs[q] = static_cast<int>(chunk_begin(p.len, N, q));
            p.recv_displs[q] = static_cast<int>(q * mine);
          }
          p.scratch = scratch_bytes;
          scratch_bytes += N * mine * e;
        }
        if (scratch_bytes != 0) op.scratch.reset(new std::byte[scratch_bytes]);
        for (auto& p : op.parts) {
          issued(MPI_Ialltoallv(op.in + p.begin * e, p.counts.data(), p.displs.data(), t,
                                op.scratch.get() + p.scratch, p.recv_counts.data(),
                                p.recv_displs.data(), t, comm_, &req),
                 "MPI_Ialltoallv");
        }
        break;
      }
    }
  }

  // Compares what every rank is about to call; throws collective_mismatch on every rank.
  void check_matching(std::unique_lock<std::mutex>& lk, const collective_desc& d, bool is_split,
                      std::uint64_t call) {
    constexpr int fields = 6;
    const auto N = static_cast<std::size_t>(size_);
    // This rank's fields after everyone's. Kept in the state: if the exchange times out, MPI may
    // still use the buffer later (close() then never frees it).
    check_buffer_.assign((N + 1) * fields, 0);
    std::int64_t* mine = check_buffer_.data() + N * fields;
    mine[0] = static_cast<std::int64_t>(d.kind);
    mine[1] = static_cast<std::int64_t>(d.type);
    mine[2] = static_cast<std::int64_t>(d.count);
    mine[3] = static_cast<std::int64_t>(d.op);
    mine[4] = static_cast<std::int64_t>(d.root);
    mine[5] = is_split ? 1 : 0;
    MPI_Request req = MPI_REQUEST_NULL;
    const std::string what = concat(describe(d, is_split), " (call #", call, ", matching check)");
    mpi_check(MPI_Iallgather(mine, fields, MPI_INT64_T, check_buffer_.data(), fields, MPI_INT64_T,
                             comm_, &req),
              "MPI_Iallgather", what, rank_, size_);
    poll(
        lk,
        [&] {
          int flag = 0;
          mpi_check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test", what, rank_, size_);
          return flag != 0;
        },
        [&] { return what; });
    auto desc_of = [&](std::size_t q, bool& split) {
      const std::int64_t* f = check_buffer_.data() + q * fields;
      collective_desc x;
      x.kind = static_cast<collective>(f[0]);
      x.type = static_cast<dtype>(f[1]);
      x.count = static_cast<std::size_t>(f[2]);
      x.op = static_cast<reduce_op>(f[3]);
      x.root = static_cast<int>(f[4]);
      split = f[5] != 0;
      return x;
    };
    bool split0 = false;
    const collective_desc d0 = desc_of(0, split0);
    for (std::size_t q = 1; q < N; ++q) {
      bool split_q = false;
      const collective_desc dq = desc_of(q, split_q);
      if (split_q != split0 || (!split0 && !dq.matches(d0))) {
        throw collective_mismatch(
            concat("collective mismatch at call #", call, ": rank 0 called ", describe(d0, split0),
                   " but rank ", q, " called ", describe(dq, split_q),
                   " (every rank must issue the same collectives in the same order; seen on rank ",
                   rank_, ")"));
      }
    }
  }

  template <class What>
  void throw_if_broken(What what) const {
    if (!broken_.empty()) {
      throw comm_aborted(concat("mpi_comm: ", what(), " on rank ", rank_, " of ", size_,
                                ": the communicator is unusable: ", broken_));
    }
  }

  // Throws comm_error naming `op` when an MPI call failed (the message is built only then).
  void check(int rc, const char* mpi_function, const mpi_op& op) const {
    if (rc != MPI_SUCCESS) mpi_check(rc, mpi_function, op.what(), rank_, size_);
  }

  void progress_loop() {
    std::unique_lock lk(mu_);
    while (!stop_) {
      if (queue_.empty() || !broken_.empty()) {
        cv_.wait(lk, [&] { return stop_ || (!queue_.empty() && broken_.empty()); });
        continue;
      }
      drive();
      if (!queue_.empty()) {
        lk.unlock();
        std::this_thread::sleep_for(opts_.progress_interval);
        lk.lock();
      }
    }
  }

  MPI_Comm comm_;    // first stage of every collective; the user's communicator when borrowed
  MPI_Comm phase2_;  // all_reduce's all-gathers, started in completion (= issue) order
  bool owns_comm_;
  mpi_comm_options opts_;
  int rank_ = 0;
  int size_ = 1;
  traffic_ledger traffic_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<mpi_op>> queue_;
  std::vector<std::shared_ptr<mpi_op>> failed_;  // kept: MPI may still use their buffers
  std::vector<std::int64_t> check_buffer_;
  std::uint64_t calls_ = 0;
  std::string broken_;  // why the communicator is unusable; empty while it is fine
  bool closed_ = false;
  bool stop_ = false;
  std::thread progress_thread_;
};

}  // namespace detail

//! Handle to an asynchronous collective of an mpi_comm. wait() drives it to completion and
//! rethrows its error; test() makes one step of progress and says whether it is done. The
//! destructor waits too (without throwing), so a dropped handle never leaves MPI writing into
//! buffers the caller believes are free — unless the communicator has already failed (see the
//! file comment on comm_timeout).
class mpi_work {
 public:
  mpi_work() = default;
  mpi_work(std::shared_ptr<detail::mpi_state> state, std::shared_ptr<detail::mpi_op> op)
      : state_(std::move(state)), op_(std::move(op)) {}
  mpi_work(mpi_work&&) noexcept = default;
  mpi_work& operator=(mpi_work&& o) noexcept {
    if (this != &o) {
      drain();
      state_ = std::move(o.state_);
      op_ = std::move(o.op_);
    }
    return *this;
  }
  mpi_work(const mpi_work&) = delete;
  mpi_work& operator=(const mpi_work&) = delete;
  ~mpi_work() { drain(); }

  //! Blocks until the collective is done; rethrows its error (comm_error, comm_timeout, ...).
  //! Calling it again is a no-op.
  void wait() {
    if (!op_) return;
    auto op = std::move(op_);
    auto state = std::move(state_);
    std::unique_lock lk(state->mutex());
    state->wait(lk, *op);
  }

  //! True when the collective is done (or the handle is empty); makes progress otherwise.
  bool test() {
    if (!op_) return true;
    std::unique_lock lk(state_->mutex());
    return state_->test(*op_);
  }

 private:
  void drain() noexcept {
    if (!op_) return;
    try {
      wait();
    } catch (...) {
      // Reported by wait() to whoever waits; a destructor must not throw.
    }
    op_.reset();
    state_.reset();
  }
  std::shared_ptr<detail::mpi_state> state_;
  std::shared_ptr<detail::mpi_op> op_;
};

//! One rank's endpoint of an MPI communicator (host memory). Construction, split() and every
//! collective are collective over the underlying MPI communicator.
class mpi_comm {
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

  //! Every rank gets op over all ranks' n elements (see comm/communicator.hpp).
  template <element_type T>
  void all_reduce(const T* in, T* out, std::size_t n, reduce_op op = reduce_op::sum) {
    run(make(collective::all_reduce, dtype_of<T>, n, op), in, out);
  }
  //! `in` holds size()·count elements; rank r gets op over all ranks of its slice r.
  template <element_type T>
  void reduce_scatter(const T* in, T* out, std::size_t count, reduce_op op = reduce_op::sum) {
    run(make(collective::reduce_scatter, dtype_of<T>, count, op), in, out);
  }
  //! `out` holds size()·count elements, rank q's `in` at out[q·count].
  template <element_type T>
  void all_gather(const T* in, T* out, std::size_t count) {
    run(make(collective::all_gather, dtype_of<T>, count), in, out);
  }
  //! Every rank gets root's n elements.
  template <element_type T>
  void broadcast(T* buf, std::size_t n, int root) {
    run(broadcast_desc(dtype_of<T>, n, root), buf, buf);
  }
  //! out[q·count, (q+1)·count) receives rank q's in[rank()·count, (rank()+1)·count); `in` and
  //! `out` must not overlap.
  template <element_type T>
  void all_to_all(const T* in, T* out, std::size_t count) {
    check_separate(in, out, count);
    run(make(collective::all_to_all, dtype_of<T>, count), in, out);
  }
  //! Returns once every rank has entered it.
  void barrier() { run(make(collective::barrier, dtype::u8, 0), nullptr, nullptr); }

  template <element_type T>
  [[nodiscard]] mpi_work all_reduce_async(const T* in, T* out, std::size_t n,
                                          reduce_op op = reduce_op::sum) {
    return start(make(collective::all_reduce, dtype_of<T>, n, op), in, out);
  }
  template <element_type T>
  [[nodiscard]] mpi_work reduce_scatter_async(const T* in, T* out, std::size_t count,
                                              reduce_op op = reduce_op::sum) {
    return start(make(collective::reduce_scatter, dtype_of<T>, count, op), in, out);
  }
  template <element_type T>
  [[nodiscard]] mpi_work all_gather_async(const T* in, T* out, std::size_t count) {
    return start(make(collective::all_gather, dtype_of<T>, count), in, out);
  }
  template <element_type T>
  [[nodiscard]] mpi_work broadcast_async(T* buf, std::size_t n, int root) {
    return start(broadcast_desc(dtype_of<T>, n, root), buf, buf);
  }
  template <element_type T>
  [[nodiscard]] mpi_work all_to_all_async(const T* in, T* out, std::size_t count) {
    check_separate(in, out, count);
    return start(make(collective::all_to_all, dtype_of<T>, count), in, out);
  }
  [[nodiscard]] mpi_work barrier_async() {
    return start(make(collective::barrier, dtype::u8, 0), nullptr, nullptr);
  }

  //! Collective: ranks with the same `color` (>= 0) form a new communicator, ordered by
  //! (key, rank), with the same options. Waits for this communicator's pending collectives.
  mpi_comm split(int color, int key) {
    if (color < 0) detail::raise("split: color must be non-negative, got ", color);
    std::unique_lock lk(state_->mutex());
    auto child = state_->split(lk, color, key);
    lk.unlock();
    child->check_thread_level();
    return mpi_comm(std::move(child));
  }

  //! Bytes this rank sent per collective (ring volumes, see comm/volume.hpp).
  const traffic_ledger& traffic() const noexcept { return state_->traffic(); }
  void reset_traffic() noexcept { state_->traffic().reset(); }

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

  static detail::collective_desc make(collective k, dtype t, std::size_t n,
                                      reduce_op op = reduce_op::sum) {
    detail::collective_desc d;
    d.kind = k;
    d.type = t;
    d.count = n;
    d.op = op;
    return d;
  }

  template <class T>
  void check_separate(const T* in, const T* out, std::size_t count) const {
    const std::size_t n = static_cast<std::size_t>(size()) * count;
    if (n != 0 && in < out + n && out < in + n) {
      detail::raise("all_to_all: `in` and `out` overlap; they must be separate buffers of ", n,
                    " elements each (size() x count)");
    }
  }

  detail::collective_desc broadcast_desc(dtype t, std::size_t n, int root) const {
    if (root < 0 || root >= size()) {
      detail::raise("broadcast: root ", root, " is not a rank of this communicator (size ", size(),
                    ")");
    }
    auto d = make(collective::broadcast, t, n);
    d.root = root;
    return d;
  }

  void run(const detail::collective_desc& d, const void* in, void* out) {
    std::unique_lock lk(state_->mutex());
    auto op = state_->issue(lk, d, in, out);
    state_->wait(lk, *op);
  }

  mpi_work start(const detail::collective_desc& d, const void* in, void* out) {
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
