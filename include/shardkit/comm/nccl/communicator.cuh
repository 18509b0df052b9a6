//! \file comm/nccl/communicator.cuh
//! `nccl_communicator`: one rank's endpoint of an NCCL communicator (comm/nccl.cuh has the
//! overview), its work handle `nccl_work` and `nccl_group`. The typed calls come from
//! comm/detail/frontend.hpp; the transport issues each collective on the communication stream,
//! ordered after the compute stream, deterministic reductions included
//! (comm/deterministic.hpp's schedule).
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/frontend.hpp>
#include <shardkit/comm/detail/work.hpp>
#include <shardkit/comm/deterministic.hpp>
#include <shardkit/comm/nccl/state.cuh>
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

namespace detail {
//! The NCCL transport's side of a work handle (comm/detail/work.hpp).
struct nccl_handle {
  std::shared_ptr<nccl_state> state;
  std::shared_ptr<nccl_op_state> op;
  bool settled = false;  // waited for, or the compute stream made to wait

  void wait() {
    settled = true;
    state->wait(*op);
  }
  bool test() const {
    if (!op || op->error) return true;
    if (!op->recorded) return false;
    if (state->failed()) return true;
    cuda_device_guard guard(state->device());
    const cudaError_t e = cudaEventQuery(op->done.get());
    if (e == cudaErrorNotReady) return false;
    (void)cudaGetLastError();
    return true;
  }
  // A handle dropped without wait() or wait_on() makes the compute stream wait, so that later
  // compute-stream work (a reuse, a stream-ordered free) cannot overtake the collective.
  void settle() noexcept {
    if (!op || settled) return;
    settled = true;
    if (!op->recorded) {
      op->dropped = true;
      return;
    }
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess) {
      if (current != state->device()) (void)cudaSetDevice(state->device());
      (void)cudaStreamWaitEvent(state->compute_stream(), op->done.get(), 0);
      if (current != state->device()) (void)cudaSetDevice(current);
    }
  }
};
}  // namespace detail

//! Handle to an asynchronous NCCL collective (see the file comment). wait() blocks the host
//! until it is done and raises its error (comm_error, comm_timeout, comm_aborted); wait_on(s)
//! makes later work on stream s wait for it without blocking the host.
class nccl_work : public detail::basic_work<detail::nccl_handle> {
 public:
  nccl_work() = default;
  nccl_work(std::shared_ptr<detail::nccl_state> s, std::shared_ptr<detail::nccl_op_state> op)
      : basic_work(detail::nccl_handle{std::move(s), std::move(op), false}) {}

  //! Makes work enqueued later on `stream` wait for the collective, without blocking the host.
  void wait_on(cudaStream_t stream) {
    auto& h = op();
    if (!h.op) return;
    if (h.op->error) std::rethrow_exception(h.op->error);
    if (!h.op->recorded) {
      detail::raise<usage_error>("nccl_work::wait_on: ", h.op->what,
                                 " was issued inside an nccl_group that has not ended yet");
    }
    h.state->throw_if_aborted();
    cuda_device_guard guard(h.state->device());
    h.op->done.wait_on(stream);
    h.settled = true;
  }

  //! What the collective was ("all_reduce(bf16, count 1024, sum) #7").
  const std::string& what() const noexcept {
    static const std::string none = "no collective";
    return op().op ? op().op->what : none;
  }
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
class nccl_communicator : public detail::comm_frontend<nccl_communicator> {
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
    ncclConfig_t* cfg = state_->config_slot();
    cfg->blocking = 0;  // every call returns at once; shardkit polls with a timeout
    const ncclResult_t r = ncclCommInitRankConfig(state_->new_comm_slot(), size, id, rank, cfg);
    state_->set_handle(std::atomic_ref<ncclComm_t>(*state_->new_comm_slot()).load());
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

  //! Collective: ranks with the same `color` (>= 0) form a new communicator, ordered by
  //! (key, rank) (ncclCommSplit). The new endpoint has the same options and device; it gets its
  //! own communication stream unless the options name one.
  nccl_communicator split(int color, int key) {
    detail::check_split_color(color);
    no_group("split");
    auto& s = *state_;
    s.throw_if_aborted();
    cuda_device_guard guard(s.device());
    const std::string what =
        detail::concat("split(color ", color, ", key ", key, ") #", s.next_call());
    // The new state first: NCCL writes the child into it (new_comm_slot), also later.
    auto st = std::make_shared<detail::nccl_state>(nullptr, 0, 1, s.device(), s.options());
    st->config_slot()->blocking = 0;
    s.check(ncclCommSplit(s.handle(), color, key, st->new_comm_slot(), st->config_slot()), what);
    const ncclComm_t child = s.await_new_comm(st->new_comm_slot(), what);
    st->set_handle(child);
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

  //! Batches the asynchronous collectives issued while the returned object lives.
  [[nodiscard]] nccl_group group() { return nccl_group(*this); }

 private:
  friend class nccl_group;
  explicit nccl_communicator(std::shared_ptr<detail::nccl_state> s) : state_(std::move(s)) {}

  friend class detail::comm_frontend<nccl_communicator>;

  // The transport interface of comm/detail/frontend.hpp.
  traffic_ledger& ledger() noexcept { return state_->traffic(); }
  const traffic_ledger& ledger() const noexcept { return state_->traffic(); }

  // Synchronous collectives: outside any nccl_group, then a host wait.
  template <class T>
  void run(const detail::collective_desc& d, const T* in, T* out) {
    no_group(name(d.kind));
    start(d, in, out).wait();
  }
  template <class T>
  nccl_work start(const detail::collective_desc& d, const T* in, T* out) {
    switch (d.kind) {
      case collective::all_reduce:
        return issue_all_reduce(in, out, d.count, d.op);
      case collective::reduce_scatter:
        return issue_reduce_scatter(in, out, d.count, d.op);
      case collective::all_gather:
        return issue_all_gather(in, out, d.count);
      case collective::broadcast:
        return issue_broadcast(out, d.count, d.root);
      case collective::all_to_all:
        return issue_all_to_all(in, out, d.count);
      case collective::barrier:
        no_group("barrier");
        return issue_barrier();
    }
    detail::raise("nccl_communicator: unknown collective");
  }

  // A barrier: a one-word all-reduce (the host waits for it in run()).
  nccl_work issue_barrier() {
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
    return nccl_work(state_, op);
  }

  template <class T>
  nccl_work issue_all_reduce(const T* in, T* out, std::size_t n, reduce_op op = reduce_op::sum) {
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
      else if (s.size() == 1)
        one_rank_copy(in, out, n);
      else
        s.check(ncclAllReduce(in, out, n, detail::nccl_type(dtype_of<T>), detail::nccl_op(op),
                              s.handle(), s.stream()),
                w->what);
    }
    return finish(w, detail::make_desc(collective::all_reduce, dtype_of<T>, n, reduce_op::sum));
  }

  template <class T>
  nccl_work issue_reduce_scatter(const T* in, T* out, std::size_t count,
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
      else if (s.size() == 1)
        one_rank_copy(in, out, count);
      else
        s.check(ncclReduceScatter(in, out, count, detail::nccl_type(dtype_of<T>),
                                  detail::nccl_op(op), s.handle(), s.stream()),
                w->what);
    }
    return finish(
        w, detail::make_desc(collective::reduce_scatter, dtype_of<T>, count, reduce_op::sum));
  }

  template <class T>
  nccl_work issue_all_gather(const T* in, T* out, std::size_t count) {
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
    return finish(w, detail::make_desc(collective::all_gather, dtype_of<T>, count, reduce_op::sum));
  }

  template <class T>
  nccl_work issue_broadcast(T* buf, std::size_t n, int root) {
    auto& s = *state_;
    s.throw_if_aborted();
    cuda_device_guard guard(s.device());
    auto w = s.issue(detail::describe_collective(collective::broadcast, dtype_of<T>, n,
                                                 reduce_op::sum, root, s.next_call()));
    s.order_after_compute();
    if (n != 0) {
      s.check(
          ncclBroadcast(buf, buf, n, detail::nccl_type(dtype_of<T>), root, s.handle(), s.stream()),
          w->what);
    }
    return finish(w,
                  detail::make_desc(collective::broadcast, dtype_of<T>, n, reduce_op::sum, root));
  }

  template <class T>
  nccl_work issue_all_to_all(const T* in, T* out, std::size_t count) {
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
    return finish(w, detail::make_desc(collective::all_to_all, dtype_of<T>, count, reduce_op::sum));
  }

  void no_group(const char* what) const {
    if (state_->in_group()) {
      detail::raise<usage_error>(
          "nccl_communicator: ", what,
          " cannot be issued inside an nccl_group (synchronous collectives, barrier, split and "
          "deterministic reductions, which launch a kernel between NCCL calls, need the group "
          "to have ended)");
    }
  }

  nccl_work finish(const std::shared_ptr<detail::nccl_op_state>& w,
                   const detail::collective_desc& d) {
    auto& s = *state_;
    s.complete(w);
    detail::record(s.traffic(), d, s.rank(), s.size());
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

  // A reduction over one rank is its input, whatever the operation: a copy on the
  // communication stream (none in place). NCCL's own one-rank path left the last 17 of 70,001
  // fp32 elements of an out-of-place ncclAvg unwritten on an H200 (the sum, a plain copy there,
  // was right), and the host engine's identity is what the deterministic form promises.
  template <class T>
  void one_rank_copy(const T* in, T* out, std::size_t n) {
    if (in != out) copy_bytes_async(out, in, n * sizeof(T), state_->stream());
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

SHARDKIT_NAMESPACE_END
