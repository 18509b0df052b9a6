//! \file comm/mpi/state.hpp
//! `detail::mpi_state`: the transport of one mpi_comm endpoint (comm/mpi.hpp has the overview).
//! It starts every collective as MPI non-blocking calls (comm/mpi/stages.hpp), keeps them in a
//! queue completed strictly in issue order, moves each to its next stage (the rank-ordered
//! reduction) when its MPI part completes, drives progress (on call or from a progress thread),
//! turns a collective that waits longer than the timeout into comm_timeout (the communicator is
//! unusable after, since MPI cannot withdraw an operation), and runs the optional matching check
//! before each collective.
//!
//! Ranks are named by their rank in this communicator and, when it is not MPI_COMM_WORLD, their
//! world rank; a timeout names the ranks that did not issue the collective, found by a roll
//! call (comm/mpi/signatures.hpp).
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/frontend.hpp>
#include <shardkit/comm/detail/scratch_cache.hpp>
#include <shardkit/comm/mpi/signatures.hpp>
#include <shardkit/comm/mpi/stages.hpp>
#include <shardkit/comm/mpi/support.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace detail {

//! Shared state of one mpi_comm endpoint: its MPI communicators, the queue of collectives in
//! flight (completed strictly in issue order), the progress thread, and the traffic ledger.
//! `mu` guards everything but `traffic` and is held around every MPI call on `comm`/`phase2`.
class mpi_state {
 public:
  mpi_state(MPI_Comm comm, MPI_Comm phase2, bool owns_comm, mpi_comm_options opts)
      : comm_(comm),
        phase2_(phase2),
        owns_comm_(owns_comm),
        opts_(opts),
        scratch_(opts.scratch_cache_bytes, opts.ledger) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    names_ = mpi_names(comm_);
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
      if (opts_.detect_divergence && !opts_.check_matching) start_signature_exchange(*op);
      stages().start(*op);
    } catch (...) {
      broken_ = concat(op->what(), " could not be started on ", me());
      throw;
    }
    scratch_.trim();
    return op;
  }

  //! Drives the queue until `op` is done; rethrows its error.
  void wait(std::unique_lock<std::mutex>& lk, const mpi_op& op) {
    poll(
        lk, [&] { return op.done(); }, [&] { return op.what(); });
    scratch_.trim();
    if (op.error) std::rethrow_exception(op.error);
  }

  //! One step of progress; true when `op` is done.
  bool test(const mpi_op& op) {
    if (!op.done() && broken_.empty()) drive();
    scratch_.trim();
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
    if (opts_.check_matching || opts_.detect_divergence) check_matching(lk, d, true, call);
    const std::string what = concat("split(color ", color, ", key ", key, ") (call #", call, ")");
    MPI_Comm a = MPI_COMM_NULL, b = MPI_COMM_NULL;
    mpi_check(MPI_Comm_split(comm_, color, key, &a), "MPI_Comm_split", what, rank_, size_,
              world_arg());
    MPI_Comm_set_errhandler(a, MPI_ERRORS_RETURN);
    const int rc = MPI_Comm_dup(a, &b);
    if (rc != MPI_SUCCESS) MPI_Comm_free(&a);
    mpi_check(rc, "MPI_Comm_dup", what, rank_, size_, world_arg());
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
      new mpi_roll_call(std::move(roll_));
      queue_.clear();
      return;
    }
    if (!mpi_finalized()) {
      if (!roll_.settled()) new mpi_roll_call(std::move(roll_));  // MPI still reads its buffers
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
        throw comm_aborted(concat("mpi_comm: ", me(), ": the communicator is unusable: ", broken_));
      }
      const auto waited_for = std::chrono::steady_clock::now() - t0;
      if (opts_.timeout.count() > 0 && waited_for > opts_.timeout) {
        std::string what = waited();
        if (!queue_.empty() && queue_.front()->what() != what) {
          what = concat(queue_.front()->what(), " (waiting for ", what, ")");
        }
        const std::string missing = missing_ranks();
        broken_ = concat(what, " timed out after ", opts_.timeout.count(), " ms on ", me());
        throw comm_timeout(concat(
            "mpi_comm: ", what, " timed out after ", opts_.timeout.count(), " ms on ", me(),
            ": not every rank reached it (a rank died, hangs, or issued fewer or different "
            "collectives): ",
            missing,
            "; MPI cannot withdraw it, so this communicator is unusable now: end the "
            "job (shardkit::mpi_main calls MPI_Abort when this exception leaves your function)"));
      }
      // Waiting long: answer a timed-out rank's roll call (signatures.hpp).
      if (waited_for >= std::chrono::milliseconds(1)) roll_.answer(phase2_, names_, calls_);
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

  // Moves `op` forward; true when it is done (successfully or with an error). With
  // check_matching, it is done only once every rank's signature arrived and matched.
  bool advance(mpi_op& op) {
    try {
      if (!op.signatures_compared) {
        int flag = 0;
        check(MPI_Test(&op.signature_request, &flag, MPI_STATUS_IGNORE), "MPI_Test", op);
        if (!flag) return false;
        op.signatures_compared = true;
        compare_signatures(op.signatures.data(), op.call, names_);
      }
      while (!op.done()) {
        if (!requests_done(op)) return false;
        if (op.stage == 0) {
          stages().finish_first_stage(op);
        } else {
          op.stage = 2;
        }
      }
      record(traffic_, op.desc, rank_, size_);
    } catch (...) {
      op.error = std::current_exception();
      op.stage = 2;
      broken_ = concat(op.what(), " failed on ", me());
      if (!settle()) {
        broken_ +=
            "; parts of it, or of the collectives issued after it, are still in flight "
            "and MPI may still write into their buffers";
      }
    }
    return true;
  }

  // A collective failed, and its wait() (and that of every collective queued behind it) throws
  // now, so the callers free their buffers. MPI cannot withdraw the parts still in flight and
  // would write into those buffers later (a rank whose signature mismatch is found first still
  // has its data receive pending). Gives them a bounded time to complete or fail; true when
  // none is left. With a size mismatch one rank's receive fails with MPI_ERR_TRUNCATE, which
  // Open MPI reports to MPI_COMM_WORLD's error handler (fatal by default) rather than to this
  // communicator's, so that handler returns errors while this runs.
  bool settle() noexcept {
    std::vector<MPI_Request*> pending;
    auto collect = [&](mpi_op& op) {
      for (auto& req : op.requests) {
        if (req != MPI_REQUEST_NULL) pending.push_back(&req);
      }
    };
    for (auto& op : failed_) collect(*op);
    for (auto& op : queue_) collect(*op);
    if (pending.empty()) return true;
    MPI_Errhandler previous = MPI_ERRHANDLER_NULL;
    if (MPI_Comm_get_errhandler(MPI_COMM_WORLD, &previous) != MPI_SUCCESS) return false;
    if (MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN) != MPI_SUCCESS) {
      MPI_Errhandler_free(&previous);
      return false;
    }
    const auto limit = opts_.timeout.count() > 0
                           ? std::min<std::chrono::milliseconds>(opts_.timeout, settle_limit)
                           : settle_limit;
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      std::size_t left = 0;
      for (MPI_Request* req : pending) {
        if (*req == MPI_REQUEST_NULL) continue;
        int flag = 0;
        if (MPI_Test(req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
          *req = MPI_REQUEST_NULL;  // it failed, and MPI is done with it
        } else if (!flag) {
          ++left;
        }
      }
      if (left == 0 || std::chrono::steady_clock::now() - t0 > limit) {
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, previous);
        MPI_Errhandler_free(&previous);
        return left == 0;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  static constexpr std::chrono::milliseconds settle_limit{2000};

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

  //! The MPI calls of this endpoint's collectives (comm/mpi/stages.hpp).
  mpi_stages stages() noexcept {
    return {comm_, phase2_, rank_, size_, world_arg(), opts_.max_call_elems, &scratch_};
  }

  // Starts gathering every rank's signature of `op` (before op itself, in issue order on
  // comm_, so the k-th exchange of every rank is the same MPI call even when the collectives
  // differ).
  void start_signature_exchange(mpi_op& op) {
    const auto N = static_cast<std::size_t>(size_);
    op.signatures.assign((N + 1) * signature_fields, 0);
    std::int64_t* mine = op.signatures.data() + N * signature_fields;
    write_signature(mine, op.desc, false);
    check(MPI_Iallgather(mine, signature_fields, MPI_INT64_T, op.signatures.data(),
                         signature_fields, MPI_INT64_T, comm_, &op.signature_request),
          "MPI_Iallgather", op);
    op.signatures_compared = false;
  }

  // The ranks that did not issue the collective being waited for (the roll call), as text.
  std::string missing_ranks() {
    const std::uint64_t k = checking_call_ != 0 ? checking_call_
                            : !queue_.empty()   ? queue_.front()->call
                                                : calls_;
    const auto grace = std::clamp<std::chrono::milliseconds>(
        opts_.timeout / 10, std::chrono::milliseconds(50), std::chrono::seconds(1));
    return roll_.ask(phase2_, names_, k, calls_, grace);
  }

  std::string me() const { return names_.me(); }
  int world_arg() const noexcept { return names_.world_arg(); }

  // Compares what every rank is about to call before it starts (blocking; check_matching, and
  // split() with either check).
  void check_matching(std::unique_lock<std::mutex>& lk, const collective_desc& d, bool is_split,
                      std::uint64_t call) {
    const auto N = static_cast<std::size_t>(size_);
    // Kept in the state: if the exchange times out, MPI may still use the buffer later (close()
    // then never frees it).
    check_buffer_.assign((N + 1) * signature_fields, 0);
    std::int64_t* mine = check_buffer_.data() + N * signature_fields;
    write_signature(mine, d, is_split);
    MPI_Request req = MPI_REQUEST_NULL;
    const std::string what = concat(describe(d, is_split), " (call #", call, ", matching check)");
    mpi_check(MPI_Iallgather(mine, signature_fields, MPI_INT64_T, check_buffer_.data(),
                             signature_fields, MPI_INT64_T, comm_, &req),
              "MPI_Iallgather", what, rank_, size_, world_arg());
    checking_call_ = call;
    struct not_checking {
      std::uint64_t& call;
      ~not_checking() { call = 0; }
    } guard{checking_call_};
    poll(
        lk,
        [&] {
          int flag = 0;
          mpi_check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test", what, rank_, size_,
                    world_arg());
          return flag != 0;
        },
        [&] { return what; });
    compare_signatures(check_buffer_.data(), call, names_);
  }

  template <class What>
  void throw_if_broken(What what) const {
    if (!broken_.empty()) {
      throw comm_aborted(
          concat("mpi_comm: ", what(), " on ", me(), ": the communicator is unusable: ", broken_));
    }
  }

  // Throws comm_error naming `op` when an MPI call failed (the message is built only then).
  void check(int rc, const char* mpi_function, const mpi_op& op) {
    stages().check(rc, mpi_function, op);
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
        roll_.answer(phase2_, names_, calls_);
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
  // The reductions' scratch, kept between collectives up to opts_.scratch_cache_bytes; given
  // back wherever a collective completes (also on the progress thread), trimmed (and counted
  // in opts_.ledger) only in calls on the communicator.
  scratch_cache scratch_;
  int rank_ = 0;
  int size_ = 1;
  traffic_ledger traffic_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<mpi_op>> queue_;
  std::vector<std::shared_ptr<mpi_op>> failed_;  // kept: MPI may still use their buffers
  std::vector<std::int64_t> check_buffer_;
  std::uint64_t checking_call_ = 0;  // the call whose matching check is waited for
  mpi_roll_call roll_;               // finds the ranks a timed-out collective waits for
  mpi_names names_;                  // how messages name this communicator's ranks
  std::uint64_t calls_ = 0;
  std::string broken_;  // why the communicator is unusable; empty while it is fine
  bool closed_ = false;
  bool stop_ = false;
  std::thread progress_thread_;
};

}  // namespace detail

SHARDKIT_NAMESPACE_END
