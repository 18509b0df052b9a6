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
//!
//! Files: nccl/state.cuh (options, error polling, aborts, groups, staging), nccl/communicator.cuh
//! (nccl_communicator, nccl_work, nccl_group, behind comm/detail/frontend.hpp),
//! nccl/bootstrap.cuh (nccl_unique_id, nccl_bootstrap).
#pragma once

#include <shardkit/comm/nccl/bootstrap.cuh>
#include <shardkit/comm/nccl/communicator.cuh>
#include <shardkit/comm/nccl/state.cuh>
