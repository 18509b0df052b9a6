//! \file comm/nccl.cuh
//! The NCCL communicator: shardkit's Communicator concept over NCCL, for device pointers.
//!
//!  - Streams. Collectives run on the communicator's *communication stream* (its own non-blocking
//!    stream, or nccl_options::stream). Each collective first makes that stream wait for the
//!    work already enqueued on the *compute stream* (set_compute_stream; the legacy default
//!    stream unless set), so inputs written there are complete when it starts.
//!  - Work handles. An *_async collective returns an nccl_work backed by a CUDA event:
//!    `wait_on(stream)` makes later work on `stream` wait for it without blocking the host (the
//!    overlap of communication and compute); `wait()` blocks the host until it is done, polling
//!    NCCL's asynchronous errors meanwhile. A handle dropped without either makes the compute
//!    stream wait. The synchronous forms block the host until the collective is done.
//!  - Determinism. NCCL's own reductions (rings, trees) do not sum in rank order, so their results
//!    depend on the topology and differ from the thread communicator's. By default
//!    (nccl_reduction::deterministic) reduce_scatter is an all-to-all of ncclSend/ncclRecv in a
//!    group followed by the rank-ordered reduction kernel (fp32 accumulation, kernels/cuda/
//!    reduce.cuh), and all_reduce is that plus an all-gather (comm/deterministic.hpp): results are
//!    bit-identical to the thread communicator, so ZeRO stages stay bit-identical on GPUs.
//!    nccl_reduction::native uses ncclReduceScatter/ncclAllReduce: faster (in-network reduction,
//!    no staging), not rank-ordered, and 16-bit data accumulate in 16 bits.
//!  - Failures. The communicator is non-blocking (ncclConfig_t::blocking = 0): every NCCL call,
//!    and every host wait, polls ncclCommGetAsyncError with the options' timeout. An NCCL error
//!    aborts the communicator (ncclCommAbort) and raises comm_error naming the call, the rank,
//!    the device and NCCL's last error; a timeout raises comm_timeout; every later call raises
//!    comm_aborted with the first reason. Nothing waits forever.
//!  - Accounting. The traffic ledger records the ring volumes of comm/volume.hpp for every
//!    collective, exactly as the thread communicator does, whatever NCCL actually sends.
//!
//! Bootstrap: every rank needs the same ncclUniqueId. nccl_bootstrap(host_comm) makes one on
//! rank 0 and broadcasts its bytes through any host communicator (thread_comm, an MPI
//! communicator); or pass an id you distributed yourself to the constructor.
//!
//!     shardkit::run_ranks(ngpus, [](shardkit::thread_comm& host) {
//!       cudaSetDevice(host.rank());
//!       auto comm = shardkit::nccl_bootstrap(host);
//!       comm.all_reduce(dev_in, dev_out, n, shardkit::reduce_op::sum);
//!     });
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/deterministic.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/cuda_memory.cuh>
#include <shardkit/core/device.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/cuda/reduce.cuh>

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! How an NCCL communicator reduces (see the file comment).
enum class nccl_reduction : std::uint8_t {
  deterministic,  //!< all-to-all + rank-ordered reduction: bit-identical to thread_comm
  native,         //!< ncclReduceScatter / ncclAllReduce: fastest, not rank-ordered
};

//! Settings of an NCCL communicator. Every rank of a communicator must use the same reduction
//! and staging_bytes.
struct nccl_options {
  nccl_reduction reduction = nccl_reduction::deterministic;
  //! How long initialisation, an NCCL call or a host wait may take before the communicator is
  //! aborted with comm_timeout.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  //! Deterministic reductions stage the all-to-all in at most this many bytes of device memory
  //! (larger blocks are reduced in rounds).
  std::size_t staging_bytes = std::size_t{64} << 20;
  //! The communication stream; nullptr: the communicator creates a non-blocking stream.
  cudaStream_t stream = nullptr;
  //! Where the staging memory is counted (comm_scratch); may be null.
  memory_ledger* ledger = nullptr;
  //! Pause between two polls of a long host wait (the first polls only yield).
  std::chrono::microseconds poll_interval{50};
};

namespace detail {

inline ncclDataType_t nccl_type(dtype t) {
  switch (t) {
    case dtype::f32:
      return ncclFloat32;
    case dtype::f64:
      return ncclFloat64;
    case dtype::bf16:
      return ncclBfloat16;
    case dtype::f16:
      return ncclFloat16;
    case dtype::i32:
      return ncclInt32;
    case dtype::i64:
      return ncclInt64;
    case dtype::u8:
      return ncclUint8;
    case dtype::u32:
      return ncclUint32;
    case dtype::u64:
      return ncclUint64;
  }
  raise("nccl: element type ", name(t), " has no NCCL equivalent");
}

inline ncclRedOp_t nccl_op(reduce_op op) {
  switch (op) {
    case reduce_op::sum:
      return ncclSum;
    case reduce_op::avg:
      return ncclAvg;
    case reduce_op::max:
      return ncclMax;
    case reduce_op::min:
      return ncclMin;
  }
  return ncclSum;
}

inline std::string describe_collective(collective kind, dtype t, std::size_t count, reduce_op op,
                                       int root, std::uint64_t call) {
  std::string s = name(kind);
  if (kind != collective::barrier) {
    s += concat("(", name(t), ", count ", count);
    if (kind == collective::all_reduce || kind == collective::reduce_scatter)
      s += concat(", ", name(op));
    if (kind == collective::broadcast) s += concat(", root ", root);
    s += ")";
  }
  return s + concat(" #", call);
}

//! One issued collective: its completion event and what it was.
struct nccl_op_state {
  cuda_event done;
  bool recorded = false;  // false while its group is open
  bool dropped = false;   // its handle went away before the group ended
  std::exception_ptr error;
  std::string what;
};

//! What an NCCL communicator and its work handles share.
class nccl_state {
 public:
  nccl_state(ncclComm_t comm, int rank, int size, int device, const nccl_options& opts)
      : comm_(comm), rank_(rank), size_(size), device_(device), opts_(opts) {
    if (opts_.stream == nullptr) {
      owned_stream_.emplace();
      stream_ = owned_stream_->get();
    } else {
      stream_ = opts_.stream;
    }
  }
  nccl_state(const nccl_state&) = delete;
  nccl_state& operator=(const nccl_state&) = delete;

  ~nccl_state() {
    int current = -1;
    const bool have_device = cudaGetDevice(&current) == cudaSuccess;
    if (have_device && current != device_) (void)cudaSetDevice(device_);
    ncclComm_t c = comm_.exchange(nullptr);
    if (c != nullptr) {
      // Finalise (flushes outstanding work), then destroy; abort when that fails or hangs.
      const ncclResult_t r = ncclCommFinalize(c);
      bool clean = r == ncclSuccess || r == ncclInProgress;
      const auto deadline = std::chrono::steady_clock::now() + opts_.timeout;
      while (clean) {
        ncclResult_t st = ncclSuccess;
        if (ncclCommGetAsyncError(c, &st) != ncclSuccess ||
            (st != ncclSuccess && st != ncclInProgress) ||
            std::chrono::steady_clock::now() > deadline) {
          clean = false;
        } else if (st == ncclSuccess) {
          break;
        } else {
          std::this_thread::sleep_for(opts_.poll_interval);
        }
      }
      if (clean)
        (void)ncclCommDestroy(c);
      else
        (void)ncclCommAbort(c);
    }
    {
      device_stream_scope scope(stream_);
      staging_.release();
      word_.release();
    }
    owned_stream_.reset();
    if (have_device && current != device_) (void)cudaSetDevice(current);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int device() const noexcept { return device_; }
  //! Takes ownership of the NCCL communicator (construction).
  void set_handle(ncclComm_t c) noexcept { comm_.store(c); }
  //! Sets rank and size once NCCL has told them (split).
  void set_identity(int rank, int size) noexcept {
    rank_ = rank;
    size_ = size;
  }
  cudaStream_t stream() const noexcept { return stream_; }
  cudaStream_t compute_stream() const noexcept { return compute_; }
  void set_compute_stream(cudaStream_t s) noexcept { compute_ = s; }
  const nccl_options& options() const noexcept { return opts_; }
  ncclComm_t handle() const noexcept { return comm_.load(); }
  traffic_ledger& traffic() noexcept { return traffic_; }
  std::uint64_t next_call() noexcept { return ++calls_; }
  bool in_group() const noexcept { return group_depth_ > 0; }

  //! Raises comm_aborted (or the comm_timeout that caused the abort) once aborted.
  void throw_if_aborted() const {
    if (!aborted_.load()) return;
    std::lock_guard lk(mu_);
    if (abort_timeout_) throw comm_timeout(abort_reason_);
    throw comm_aborted("NCCL communicator aborted: " + abort_reason_);
  }

  //! Aborts the NCCL communicator (once); later calls raise comm_aborted with `reason`.
  void abort(const std::string& reason, bool timeout = false) noexcept {
    {
      std::lock_guard lk(mu_);
      if (aborted_.load()) return;
      abort_reason_ = reason;
      abort_timeout_ = timeout;
      aborted_.store(true);
    }
    ncclComm_t c = comm_.exchange(nullptr);
    if (c != nullptr) (void)ncclCommAbort(c);
  }

  //! Checks the result of an NCCL call: in progress waits for the enqueue (non-blocking mode),
  //! an error aborts and raises comm_error.
  void check(ncclResult_t r, std::string_view what) {
    if (r == ncclSuccess) return;
    if (r == ncclInProgress) {
      await(what);
      return;
    }
    fail(r, what);
  }

  //! Waits until the communicator leaves the in-progress state (initialisation, enqueue).
  void await(std::string_view what) {
    const auto deadline = std::chrono::steady_clock::now() + opts_.timeout;
    for (std::uint64_t polls = 0;;) {
      throw_if_aborted();
      ncclResult_t st = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(handle(), &st);
      if (r != ncclSuccess) fail(r, concat(what, " (ncclCommGetAsyncError)"));
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) fail(st, what);
      if (std::chrono::steady_clock::now() > deadline) timeout(what);
      pause(polls++);
    }
  }

  //! Raises when NCCL reported an asynchronous error (aborting first).
  void poll(std::string_view what) {
    throw_if_aborted();
    ncclResult_t st = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(handle(), &st);
    if (r != ncclSuccess) fail(r, concat(what, " (ncclCommGetAsyncError)"));
    if (st != ncclSuccess && st != ncclInProgress) fail(st, what);
  }

  //! True when NCCL reported an asynchronous error or the communicator was aborted (no throw).
  bool failed() const noexcept {
    if (aborted_.load()) return true;
    ncclResult_t st = ncclSuccess;
    if (ncclCommGetAsyncError(handle(), &st) != ncclSuccess) return true;
    return st != ncclSuccess && st != ncclInProgress;
  }

  //! Blocks the host until `op` is done, polling for NCCL errors; timeout aborts.
  void wait(nccl_op_state& op) {
    if (op.error) std::rethrow_exception(op.error);
    if (!op.recorded) {
      raise<usage_error>("nccl_work::wait: ", op.what,
                         " was issued inside an nccl_group that has not ended yet");
    }
    cuda_device_guard guard(device_);
    const auto deadline = std::chrono::steady_clock::now() + opts_.timeout;
    for (std::uint64_t polls = 0;;) {
      const cudaError_t e = cudaEventQuery(op.done.get());
      if (e == cudaSuccess) {
        poll(op.what);  // a peer's failure ends NCCL's kernels early: done is not success
        return;
      }
      if (e != cudaErrorNotReady) cuda_check(e, concat("waiting for ", op.what));
      poll(op.what);
      if (std::chrono::steady_clock::now() > deadline) timeout(op.what);
      pause(polls++);
    }
  }

  //! Between two polls of a host wait: yield for the first few (short collectives), then sleep
  //! poll_interval (long ones, without burning a core).
  void pause(std::uint64_t polls) const {
    if (polls < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(opts_.poll_interval);
  }

  //! Makes the communication stream wait for the compute stream's work so far.
  void order_after_compute() {
    ready_.record(compute_);
    ready_.wait_on(stream_);
  }

  //! Records an issued collective's completion, now or when its group ends.
  std::shared_ptr<nccl_op_state> issue(std::string what) {
    auto op = std::make_shared<nccl_op_state>();
    op->what = std::move(what);
    return op;
  }
  void complete(const std::shared_ptr<nccl_op_state>& op) {
    if (group_depth_ > 0) {
      pending_.push_back(op);
    } else {
      op->done.record(stream_);
      op->recorded = true;
    }
  }

  void group_start() {
    throw_if_aborted();
    check(ncclGroupStart(), "ncclGroupStart");
    ++group_depth_;
  }

  void group_end() {
    if (group_depth_ == 0) raise<usage_error>("nccl group ended twice");
    --group_depth_;
    try {
      check(ncclGroupEnd(), "ncclGroupEnd");
      if (group_depth_ == 0) {
        for (auto& op : pending_) {
          op->done.record(stream_);
          op->recorded = true;
          if (op->dropped) op->done.wait_on(compute_);
        }
        pending_.clear();
      }
    } catch (...) {
      for (auto& op : pending_) op->error = std::current_exception();
      pending_.clear();
      throw;
    }
  }

  //! Device scratch of at least `bytes`, allocated and freed in order on the communication
  //! stream (counted as comm_scratch in the options' ledger).
  std::byte* staging(std::size_t bytes) {
    if (staging_.bytes() < bytes) {
      device_stream_scope scope(stream_);
      staging_.release();
      staging_ = buffer<std::byte, cuda_space>(bytes, opts_.ledger, memory_category::comm_scratch);
    }
    return staging_.data();
  }

  //! One device word for barriers.
  std::int32_t* word() {
    if (word_.empty()) {
      device_stream_scope scope(stream_);
      word_ = buffer<std::int32_t, cuda_space>(1, nullptr, memory_category::comm_scratch);
    }
    return word_.data();
  }

  [[noreturn]] void fail(ncclResult_t r, std::string_view what) {
    const ncclComm_t c = handle();
    std::string msg =
        format_nccl_error(what, rank_, size_, device_, static_cast<int>(r), ncclGetErrorString(r),
                          c != nullptr ? ncclGetLastError(c) : nullptr);
    abort(msg);
    throw comm_error(msg);
  }

  [[noreturn]] void timeout(std::string_view what) {
    std::string msg = format_nccl_timeout(what, rank_, size_, device_,
                                          static_cast<long long>(opts_.timeout.count()));
    abort(msg, true);
    throw comm_timeout(msg);
  }

 private:
  std::atomic<ncclComm_t> comm_;
  int rank_;
  int size_;
  int device_;
  nccl_options opts_;
  std::optional<cuda_stream> owned_stream_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t compute_ = nullptr;
  cuda_event ready_;
  mutable std::mutex mu_;
  std::atomic<bool> aborted_{false};
  bool abort_timeout_ = false;
  std::string abort_reason_;
  int group_depth_ = 0;
  std::vector<std::shared_ptr<nccl_op_state>> pending_;
  buffer<std::byte, cuda_space> staging_;
  buffer<std::int32_t, cuda_space> word_;
  traffic_ledger traffic_;
  std::uint64_t calls_ = 0;
};

}  // namespace detail

//! Handle to an asynchronous NCCL collective (see the file comment).
class nccl_work {
 public:
  nccl_work() = default;
  nccl_work(std::shared_ptr<detail::nccl_state> s, std::shared_ptr<detail::nccl_op_state> op)
      : state_(std::move(s)), op_(std::move(op)) {}
  nccl_work(nccl_work&& o) noexcept
      : state_(std::move(o.state_)),
        op_(std::move(o.op_)),
        settled_(std::exchange(o.settled_, true)) {}
  nccl_work& operator=(nccl_work&& o) noexcept {
    if (this != &o) {
      release();
      state_ = std::move(o.state_);
      op_ = std::move(o.op_);
      settled_ = std::exchange(o.settled_, true);
    }
    return *this;
  }
  nccl_work(const nccl_work&) = delete;
  nccl_work& operator=(const nccl_work&) = delete;
  ~nccl_work() { release(); }

  //! Blocks the host until the collective is done; raises its error (comm_error, comm_timeout,
  //! comm_aborted). Calling it again is a no-op.
  void wait() {
    if (!op_ || waited_) return;
    waited_ = true;
    settled_ = true;
    state_->wait(*op_);
  }

  //! Makes work enqueued later on `stream` wait for the collective, without blocking the host.
  void wait_on(cudaStream_t stream) {
    if (!op_) return;
    if (op_->error) std::rethrow_exception(op_->error);
    if (!op_->recorded) {
      detail::raise<usage_error>("nccl_work::wait_on: ", op_->what,
                                 " was issued inside an nccl_group that has not ended yet");
    }
    state_->throw_if_aborted();
    cuda_device_guard guard(state_->device());
    op_->done.wait_on(stream);
    settled_ = true;
  }

  //! True when the collective is done, failed, or the handle is empty.
  bool test() const {
    if (!op_ || op_->error) return true;
    if (!op_->recorded) return false;
    if (state_->failed()) return true;
    cuda_device_guard guard(state_->device());
    const cudaError_t e = cudaEventQuery(op_->done.get());
    if (e == cudaErrorNotReady) return false;
    (void)cudaGetLastError();
    return true;
  }

  //! What the collective was ("all_reduce(bf16, count 1024, sum) #7").
  const std::string& what() const noexcept {
    static const std::string none = "no collective";
    return op_ ? op_->what : none;
  }

 private:
  // A handle dropped without wait() or wait_on() makes the compute stream wait, so that later
  // compute-stream work (a reuse, a stream-ordered free) cannot overtake the collective.
  void release() noexcept {
    if (!op_ || settled_) return;
    if (!op_->recorded) {
      op_->dropped = true;
    } else {
      int current = -1;
      if (cudaGetDevice(&current) == cudaSuccess) {
        if (current != state_->device()) (void)cudaSetDevice(state_->device());
        (void)cudaStreamWaitEvent(state_->compute_stream(), op_->done.get(), 0);
        if (current != state_->device()) (void)cudaSetDevice(current);
      }
    }
    settled_ = true;
  }

  std::shared_ptr<detail::nccl_state> state_;
  std::shared_ptr<detail::nccl_op_state> op_;
  bool waited_ = false;
  bool settled_ = false;
};

class nccl_communicator;

//! Batches the collectives issued while it lives into one ncclGroupStart/ncclGroupEnd (NCCL
//! launches them together). Inside a group only asynchronous collectives whose transport is
//! NCCL alone are allowed (all_gather, broadcast, all_to_all, native reductions); their work
//! handles become waitable when the group ends. end() raises on failure; the destructor ends
//! the group too and, if that fails, leaves the communicator aborted (its next call raises).
class nccl_group {
 public:
  explicit nccl_group(nccl_communicator& c);
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;
  ~nccl_group();
  //! Ends the group now (ncclGroupEnd).
  void end();

 private:
  std::shared_ptr<detail::nccl_state> state_;
};

//! One rank's endpoint of an NCCL communicator (see the file comment). One thread uses an
//! endpoint at a time; all its calls run on the device that was current at construction.
class nccl_communicator {
 public:
  using memory_space = cuda_space;
  using work_type = nccl_work;

  //! Joins the communicator `id` as rank `rank` of `size` on the calling thread's current
  //! device. Every rank must call it (concurrently) with the same id and size. Raises
  //! invalid_argument for a bad rank or size, comm_error / comm_timeout when NCCL fails or the
  //! other ranks do not join within the timeout.
  nccl_communicator(const ncclUniqueId& id, int rank, int size, nccl_options opts = {}) {
    if (size < 1 || rank < 0 || rank >= size) {
      detail::raise("nccl_communicator: rank ", rank, " is not a rank of a communicator of size ",
                    size);
    }
    state_ = std::make_shared<detail::nccl_state>(nullptr, rank, size, cuda_current_device(), opts);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;  // every call returns at once; shardkit polls with a timeout
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, size, id, rank, &cfg);
    state_->set_handle(c);
    state_->check(r, "ncclCommInitRankConfig");
    state_->await("ncclCommInitRankConfig");
  }

  nccl_communicator(nccl_communicator&&) noexcept = default;
  nccl_communicator& operator=(nccl_communicator&&) noexcept = default;
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  //! Finalises the NCCL communicator once its work handles are gone too (aborts it when that
  //! fails or takes longer than the timeout).
  ~nccl_communicator() = default;

  int rank() const noexcept { return state_->rank(); }
  int size() const noexcept { return state_->size(); }
  //! The CUDA device of this endpoint.
  int device() const noexcept { return state_->device(); }
  //! The communication stream.
  cudaStream_t stream() const noexcept { return state_->stream(); }
  //! The stream whose work collectives wait for, and which dropped handles make wait.
  cudaStream_t compute_stream() const noexcept { return state_->compute_stream(); }
  void set_compute_stream(cudaStream_t s) noexcept { state_->set_compute_stream(s); }
  const nccl_options& options() const noexcept { return state_->options(); }
  //! The NCCL communicator (nullptr once aborted).
  ncclComm_t native_handle() const noexcept { return state_->handle(); }

  template <element_type T>
  void all_reduce(const T* in, T* out, std::size_t n, reduce_op op = reduce_op::sum) {
    no_group("all_reduce");
    all_reduce_async(in, out, n, op).wait();
  }
  template <element_type T>
  void reduce_scatter(const T* in, T* out, std::size_t count, reduce_op op = reduce_op::sum) {
    no_group("reduce_scatter");
    reduce_scatter_async(in, out, count, op).wait();
  }
  template <element_type T>
  void all_gather(const T* in, T* out, std::size_t count) {
    no_group("all_gather");
    all_gather_async(in, out, count).wait();
  }
  template <element_type T>
  void broadcast(T* buf, std::size_t n, int root) {
    no_group("broadcast");
    broadcast_async(buf, n, root).wait();
  }
  //! out[q·count, (q+1)·count) receives rank q's in[rank()·count, (rank()+1)·count).
  template <element_type T>
  void all_to_all(const T* in, T* out, std::size_t count) {
    no_group("all_to_all");
    all_to_all_async(in, out, count).wait();
  }
  //! Returns once every rank has called it (a one-word all-reduce, then a host wait).
  void barrier() {
    no_group("barrier");
    auto& s = *state_;
    s.throw_if_aborted();
    cuda_device_guard guard(s.device());
    auto op = s.issue(detail::describe_collective(collective::barrier, dtype::i32, 0,
                                                  reduce_op::sum, 0, s.next_call()));
    s.order_after_compute();
    std::int32_t* w = s.word();
    s.check(ncclAllReduce(w, w, 1, ncclInt32, ncclSum, s.handle(), s.stream()), op->what);
    s.complete(op);
    s.traffic().record(collective::barrier, 0);
    nccl_work(state_, op).wait();
  }

  template <element_type T>
  [[nodiscard]] nccl_work all_reduce_async(const T* in, T* out, std::size_t n,
                                           reduce_op op = reduce_op::sum) {
    auto& s = *state_;
    s.throw_if_aborted();
    const bool det = s.options().reduction == nccl_reduction::deterministic && s.size() > 1;
    if (det) no_group("a deterministic all_reduce");
    cuda_device_guard guard(s.device());
    auto w = s.issue(
        detail::describe_collective(collective::all_reduce, dtype_of<T>, n, op, 0, s.next_call()));
    s.order_after_compute();
    if (n != 0) {
      if (det)
        deterministic_all_reduce(in, out, n, op, w->what);
      else
        s.check(ncclAllReduce(in, out, n, detail::nccl_type(dtype_of<T>), detail::nccl_op(op),
                              s.handle(), s.stream()),
                w->what);
    }
    return finish(w, collective::all_reduce, n, sizeof(T));
  }

  template <element_type T>
  [[nodiscard]] nccl_work reduce_scatter_async(const T* in, T* out, std::size_t count,
                                               reduce_op op = reduce_op::sum) {
    auto& s = *state_;
    s.throw_if_aborted();
    const bool det = s.options().reduction == nccl_reduction::deterministic && s.size() > 1;
    if (det) no_group("a deterministic reduce_scatter");
    cuda_device_guard guard(s.device());
    auto w = s.issue(detail::describe_collective(collective::reduce_scatter, dtype_of<T>, count, op,
                                                 0, s.next_call()));
    s.order_after_compute();
    if (count != 0) {
      if (det)
        deterministic_reduce_scatter(in, out, count, op, w->what);
      else
        s.check(ncclReduceScatter(in, out, count, detail::nccl_type(dtype_of<T>),
                                  detail::nccl_op(op), s.handle(), s.stream()),
                w->what);
    }
    return finish(w, collective::reduce_scatter, count, sizeof(T));
  }

  template <element_type T>
  [[nodiscard]] nccl_work all_gather_async(const T* in, T* out, std::size_t count) {
    auto& s = *state_;
    s.throw_if_aborted();
    cuda_device_guard guard(s.device());
    auto w = s.issue(detail::describe_collective(collective::all_gather, dtype_of<T>, count,
                                                 reduce_op::sum, 0, s.next_call()));
    s.order_after_compute();
    if (count != 0) {
      s.check(ncclAllGather(in, out, count, detail::nccl_type(dtype_of<T>), s.handle(), s.stream()),
              w->what);
    }
    return finish(w, collective::all_gather, count, sizeof(T));
  }

  template <element_type T>
  [[nodiscard]] nccl_work broadcast_async(T* buf, std::size_t n, int root) {
    auto& s = *state_;
    s.throw_if_aborted();
    if (root < 0 || root >= s.size()) {
      detail::raise("broadcast: root ", root, " is not a rank of this communicator (size ",
                    s.size(), ")");
    }
    cuda_device_guard guard(s.device());
    auto w = s.issue(detail::describe_collective(collective::broadcast, dtype_of<T>, n,
                                                 reduce_op::sum, root, s.next_call()));
    s.order_after_compute();
    if (n != 0) {
      s.check(
          ncclBroadcast(buf, buf, n, detail::nccl_type(dtype_of<T>), root, s.handle(), s.stream()),
          w->what);
    }
    return finish(w, collective::broadcast, n, sizeof(T), root);
  }

  template <element_type T>
  [[nodiscard]] nccl_work all_to_all_async(const T* in, T* out, std::size_t count) {
    auto& s = *state_;
    s.throw_if_aborted();
    cuda_device_guard guard(s.device());
    auto w = s.issue(detail::describe_collective(collective::all_to_all, dtype_of<T>, count,
                                                 reduce_op::sum, 0, s.next_call()));
    s.order_after_compute();
    if (count != 0) {
      const int N = s.size(), r = s.rank();
      const ncclDataType_t t = detail::nccl_type(dtype_of<T>);
      s.check(ncclGroupStart(), w->what);
      for (int q = 0; q < N; ++q) {
        if (q == r) continue;
        const std::size_t qo = static_cast<std::size_t>(q) * count;
        s.check(ncclSend(in + qo, count, t, q, s.handle(), s.stream()), w->what);
        s.check(ncclRecv(out + qo, count, t, q, s.handle(), s.stream()), w->what);
      }
      s.check(ncclGroupEnd(), w->what);
      const std::size_t ro = static_cast<std::size_t>(r) * count;
      copy_bytes_async(out + ro, in + ro, count * sizeof(T), s.stream());
    }
    return finish(w, collective::all_to_all, count, sizeof(T));
  }

  //! Collective: ranks with the same `color` (>= 0) form a new communicator, ordered by
  //! (key, rank) (ncclCommSplit). The new endpoint has the same options and device; it gets its
  //! own communication stream unless the options name one.
  nccl_communicator split(int color, int key) {
    if (color < 0) detail::raise("split: color must be non-negative, got ", color);
    no_group("split");
    auto& s = *state_;
    s.throw_if_aborted();
    cuda_device_guard guard(s.device());
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t child = nullptr;
    const std::string what =
        detail::concat("split(color ", color, ", key ", key, ") #", s.next_call());
    s.check(ncclCommSplit(s.handle(), color, key, &child, &cfg), what);
    if (child == nullptr) detail::raise<comm_error>(what, " gave no communicator");
    auto st = std::make_shared<detail::nccl_state>(child, 0, 1, s.device(), s.options());
    st->await(what);
    int n = 0, r = 0;
    st->check(ncclCommCount(child, &n), what);
    st->check(ncclCommUserRank(child, &r), what);
    st->set_identity(r, n);
    st->set_compute_stream(s.compute_stream());
    return nccl_communicator(std::move(st));
  }

  //! Raises when NCCL has reported an asynchronous error (the communicator is then aborted).
  void check() {
    cuda_device_guard guard(state_->device());
    state_->poll("nccl_communicator::check");
  }

  //! Aborts the communicator (ncclCommAbort): this rank's later calls raise comm_aborted; the
  //! other ranks' collectives fail or time out.
  void abort(const std::string& reason) {
    state_->abort(detail::concat("rank ", rank(), " aborted: ", reason));
  }

  //! Bytes this rank sent per collective (ring volumes, see comm/volume.hpp).
  const traffic_ledger& traffic() const noexcept { return state_->traffic(); }
  void reset_traffic() noexcept { state_->traffic().reset(); }

  //! Batches the asynchronous collectives issued while the returned object lives.
  [[nodiscard]] nccl_group group() { return nccl_group(*this); }

 private:
  friend class nccl_group;
  explicit nccl_communicator(std::shared_ptr<detail::nccl_state> s) : state_(std::move(s)) {}

  void no_group(const char* what) const {
    if (state_->in_group()) {
      detail::raise<usage_error>(
          "nccl_communicator: ", what,
          " cannot be issued inside an nccl_group (synchronous collectives, barrier, split and "
          "deterministic reductions, which launch a kernel between NCCL calls, need the group "
          "to have ended)");
    }
  }

  nccl_work finish(const std::shared_ptr<detail::nccl_op_state>& w, collective kind,
                   std::size_t count, std::size_t esize, int root = 0) {
    auto& s = *state_;
    s.complete(w);
    s.traffic().record(
        kind, ring_bytes_sent(kind, count, esize, static_cast<std::size_t>(s.size()),
                              static_cast<std::size_t>(s.rank()), static_cast<std::size_t>(root)));
    return nccl_work(state_, w);
  }

  // reduce_scatter as an all-to-all into a staging buffer [N][piece] and the rank-ordered
  // reduction, in rounds of pieces (comm/deterministic.hpp).
  template <class T>
  void deterministic_reduce_scatter(const T* in, T* out, std::size_t count, reduce_op op,
                                    const std::string& what) {
    auto& s = *state_;
    const std::size_t N = static_cast<std::size_t>(s.size()),
                      r = static_cast<std::size_t>(s.rank());
    const ncclDataType_t t = detail::nccl_type(dtype_of<T>);
    const std::size_t p = detail::staging_piece(count, N, sizeof(T), s.options().staging_bytes);
    T* st = reinterpret_cast<T*>(s.staging(p * N * sizeof(T)));
    for (std::size_t i = 0; i < detail::piece_count(count, p); ++i) {
      const std::size_t off = i * p, len = detail::piece_length(count, p, i);
      s.check(ncclGroupStart(), what);
      for (std::size_t q = 0; q < N; ++q) {
        if (q == r) continue;
        s.check(ncclSend(in + q * count + off, len, t, static_cast<int>(q), s.handle(), s.stream()),
                what);
        s.check(ncclRecv(st + q * p, len, t, static_cast<int>(q), s.handle(), s.stream()), what);
      }
      s.check(ncclGroupEnd(), what);
      copy_bytes_async(st + r * p, in + r * count + off, len * sizeof(T), s.stream());
      gpu::reduce_strided(st, p, N, out + off, len, op, s.stream());
    }
  }

  // all_reduce: every rank reduces its chunk (chunk_begin/chunk_size of comm/volume.hpp, as the
  // thread communicator) in rounds of pieces, then the chunks are all-gathered.
  template <class T>
  void deterministic_all_reduce(const T* in, T* out, std::size_t n, reduce_op op,
                                const std::string& what) {
    auto& s = *state_;
    const std::size_t N = static_cast<std::size_t>(s.size()),
                      r = static_cast<std::size_t>(s.rank());
    const ncclDataType_t t = detail::nccl_type(dtype_of<T>);
    const std::size_t largest = (n + N - 1) / N;
    const std::size_t p = detail::staging_piece(largest, N, sizeof(T), s.options().staging_bytes);
    T* st = reinterpret_cast<T*>(s.staging(p * N * sizeof(T)));
    const std::size_t mine_begin = chunk_begin(n, N, r), mine = chunk_size(n, N, r);
    for (std::size_t i = 0; i < detail::piece_count(largest, p); ++i) {
      const std::size_t len = detail::piece_length(mine, p, i);
      s.check(ncclGroupStart(), what);
      for (std::size_t q = 0; q < N; ++q) {
        if (q == r) continue;
        const std::size_t lq = detail::piece_length(chunk_size(n, N, q), p, i);
        if (lq != 0) {
          s.check(ncclSend(in + chunk_begin(n, N, q) + i * p, lq, t, static_cast<int>(q),
                           s.handle(), s.stream()),
                  what);
        }
        if (len != 0) {
          s.check(ncclRecv(st + q * p, len, t, static_cast<int>(q), s.handle(), s.stream()), what);
        }
      }
      s.check(ncclGroupEnd(), what);
      if (len != 0) {
        copy_bytes_async(st + r * p, in + mine_begin + i * p, len * sizeof(T), s.stream());
        gpu::reduce_strided(st, p, N, out + mine_begin + i * p, len, op, s.stream());
      }
    }
    s.check(ncclGroupStart(), what);
    for (std::size_t q = 0; q < N; ++q) {
      if (q == r) continue;
      if (mine != 0) {
        s.check(ncclSend(out + mine_begin, mine, t, static_cast<int>(q), s.handle(), s.stream()),
                what);
      }
      const std::size_t nq = chunk_size(n, N, q);
      if (nq != 0) {
        s.check(ncclRecv(out + chunk_begin(n, N, q), nq, t, static_cast<int>(q), s.handle(),
                         s.stream()),
                what);
      }
    }
    s.check(ncclGroupEnd(), what);
  }

  std::shared_ptr<detail::nccl_state> state_;
};

inline nccl_group::nccl_group(nccl_communicator& c) : state_(c.state_) {
  cuda_device_guard guard(state_->device());
  state_->group_start();
}

inline void nccl_group::end() {
  if (!state_) return;
  auto s = std::move(state_);
  cuda_device_guard guard(s->device());
  s->group_end();
}

inline nccl_group::~nccl_group() {
  if (!state_) return;
  try {
    end();
  } catch (...) {  // the communicator is aborted; its next call raises with the reason
  }
}

static_assert(communicator<nccl_communicator>);

//! A fresh ncclUniqueId (call on one rank, then give it to every rank).
inline ncclUniqueId nccl_unique_id() {
  ncclUniqueId id{};
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    detail::raise<comm_error>("ncclGetUniqueId failed: ", ncclGetErrorString(r), " (",
                              static_cast<int>(r), ")");
  }
  return id;
}

//! A host communicator that can broadcast bytes: what nccl_bootstrap needs (thread_comm, an MPI
//! communicator, or your own).
template <class C>
concept byte_broadcaster = host_accessible<typename C::memory_space> &&
    requires(C& c, std::uint8_t* p) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.broadcast(p, std::size_t{1}, 0);
};

//! Creates an NCCL communicator over the ranks of `host` (same ranks, same order), on each
//! rank's current device: rank 0 makes a unique id and broadcasts it through `host`. A failure on
//! rank 0 is reported on every rank.
template <byte_broadcaster Host>
nccl_communicator nccl_bootstrap(Host& host, nccl_options opts = {}) {
  struct message {
    std::uint8_t ok;
    ncclUniqueId id;
  };
  message m{};
  std::string error;
  if (host.rank() == 0) {
    try {
      m.id = nccl_unique_id();
      m.ok = 1;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  host.broadcast(reinterpret_cast<std::uint8_t*>(&m), sizeof m, 0);
  if (m.ok != 1) {
    detail::raise<comm_error>("nccl_bootstrap: rank 0 could not create an NCCL unique id",
                              error.empty() ? std::string() : ": " + error);
  }
  return nccl_communicator(m.id, static_cast<int>(host.rank()), static_cast<int>(host.size()),
                           opts);
}

SHARDKIT_NAMESPACE_END
