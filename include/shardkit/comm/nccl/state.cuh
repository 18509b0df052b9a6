//! \file comm/nccl/state.cuh
//! The NCCL transport's shared state (comm/nccl.cuh has the overview): the options, NCCL's
//! types for shardkit's, one collective's completion event, and `detail::nccl_state`, what an
//! endpoint and its work handles share: the NCCL communicator, the communication and compute
//! streams, the non-blocking error polling with a timeout, aborts, groups, and the staging
//! buffer of the deterministic reductions.
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
  //! Where NCCL is to write the communicator this state will own, and the configuration it is
  //! created with (ncclCommInitRankConfig, ncclCommSplit). A non-blocking call keeps the
  //! address of its output and writes it again from its own thread when the initialisation
  //! ends, which can be after the call and our wait have returned: on a caller's stack that
  //! write lands in whatever frame is there then. So both live as long as the state.
  ncclComm_t* new_comm_slot() noexcept { return &new_comm_; }
  ncclConfig_t* config_slot() noexcept { return &config_; }
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

  //! Waits until NCCL has written a communicator to `slot` (a non-blocking ncclCommSplit
  //! reports success before the child exists and writes it when its initialisation ends),
  //! polling this communicator, the parent, for errors; timeout aborts. Returns the child.
  ncclComm_t await_new_comm(ncclComm_t* slot, std::string_view what) {
    const auto deadline = std::chrono::steady_clock::now() + opts_.timeout;
    for (std::uint64_t polls = 0;;) {
      if (const ncclComm_t c = std::atomic_ref<ncclComm_t>(*slot).load()) return c;
      poll(what);
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
  ncclComm_t new_comm_ = nullptr;
  ncclConfig_t config_ = NCCL_CONFIG_INITIALIZER;
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

SHARDKIT_NAMESPACE_END
