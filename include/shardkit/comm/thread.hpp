//! \file comm/thread.hpp
//! The in-process thread communicator: N ranks as threads of one process, each with its own
//! communicator endpoint. It is the embedded default (train on several ranks without MPI) and
//! the oracle the other communicators are tested against.
//!
//!  - Deterministic: reductions sum in rank order 0..N-1 (fp32 accumulation for 16-bit data),
//!    so results do not depend on thread timing.
//!  - Asynchronous collectives run on the rank's progress thread and really progress while the
//!    rank computes; synchronous ones run on the caller's thread when nothing is queued.
//!  - Safe: ranks that call different collectives get `collective_mismatch` on every rank; a
//!    collective that waits longer than the timeout fails with `comm_timeout` on every waiting
//!    rank; when a rank's function throws, the group is aborted and every other rank's pending
//!    or later collective fails with `comm_aborted` naming that rank. Nothing hangs.
//!
//!     shardkit::run_ranks(4, [](shardkit::thread_comm& comm) {
//!       std::vector<float> x(8, float(comm.rank()));
//!       comm.all_reduce(x.data(), x.data(), x.size(), shardkit::reduce_op::sum);
//!     });
//!
//! One endpoint is used by one thread at a time (its rank's thread).
//!
//! Files: thread/group.hpp (the group's rendezvous, timeouts, aborts, splits),
//! thread/communicator.hpp (the endpoint: a transport behind comm/detail/frontend.hpp),
//! thread/run_ranks.hpp.
#pragma once

#include <shardkit/comm/thread/communicator.hpp>
#include <shardkit/comm/thread/group.hpp>
#include <shardkit/comm/thread/run_ranks.hpp>
