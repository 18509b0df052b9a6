//! \file comm/mpi.hpp
//! `mpi_comm`: the Communicator over MPI (ranks in separate processes, on one node or many), and
//! `mpi_main` / `mpi_session` to start and end an MPI program so that a failing rank never leaves
//! the others waiting. It and comm/mpi/ are the only shardkit headers that include <mpi.h>; link
//! the CMake target `shardkit::mpi`.
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
//!  - reduce_scatter(count c): an all-to-all (MPI_Ialltoallv) hands each rank every other
//!    rank's c elements of its own slice (into scratch), which it then reduces in rank order,
//!    its own c elements read where they lie, into `out`.
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
//!    fewer collectives) throws comm_timeout (after 2 minutes by default); ranks that issue
//!    different collectives get collective_mismatch on every rank instead of a hang or a wrong
//!    answer (`detect_divergence`, on by default; `check_matching` checks before starting).
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
//! **Memory.** reduce_scatter and all_reduce receive every other rank's contribution to this
//! rank's slice before reducing it: scratch of (N−1)·count (reduce_scatter) or about (N−1)/N·n
//! (all_reduce) elements per collective in flight. When a collective is done, its scratch is kept
//! for the next ones, up to `mpi_comm_options::scratch_cache_bytes` (256 MiB by default; 0 frees
//! every block at once) per communicator: a block allocated per call is, beyond glibc's mmap
//! threshold, fresh pages that the kernel clears and faults in on every call (a quarter of a
//! 67M-parameter model's stage-0 step at N = 2). `mpi_comm_options::ledger`
//! counts the scratch, kept blocks included, as comm_scratch (comm/detail/scratch_cache.hpp).
//!
//! One endpoint is used by one thread at a time (besides its own progress thread).
//!
//! Files: mpi/support.hpp (options, datatypes, errors, one collective's state),
//! mpi/signatures.hpp (how errors name ranks, the divergence signatures), mpi/stages.hpp (each
//! collective as MPI non-blocking calls and its rank-ordered reduction), mpi/state.hpp (the
//! transport: queue, progress, timeouts, matching check, scratch cache), mpi/communicator.hpp
//! (mpi_comm and mpi_work, behind comm/detail/frontend.hpp), mpi/main.hpp (mpi_main,
//! mpi_session); comm/detail/scratch_cache.hpp keeps the reductions' scratch.
#pragma once

#include <shardkit/comm/mpi/communicator.hpp>
#include <shardkit/comm/mpi/main.hpp>
#include <shardkit/comm/mpi/signatures.hpp>
#include <shardkit/comm/mpi/stages.hpp>
#include <shardkit/comm/mpi/state.hpp>
#include <shardkit/comm/mpi/support.hpp>
