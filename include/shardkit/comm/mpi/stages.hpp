//! \file comm/mpi/stages.hpp
//! `detail::mpi_stages`: how one collective of an mpi_comm endpoint runs as MPI non-blocking
//! calls (comm/mpi.hpp has the overview). A collective of more than `max_call_elems` elements per
//! block is split into several MPI calls (strided datatypes for the per-peer blocks). Stage 0 is
//! the first MPI exchange: barrier, broadcast, all-gather and all-to-all are done when it
//! completes; reduce-scatter receives every other rank's block of its slice into scratch (an
//! all-to-all-v that skips the rank's own block) and reduces them and its own block, read where
//! it lies, in rank order on the host (host::reduce_ordered), so that every rank's result is
//! bit-identical to the thread communicator's; all-reduce does the same for its chunk, then
//! all-gathers the reduced chunks on the second communicator (stage 1). Leaving the own block
//! out of the exchange saves copying it to scratch and back: 1/N of the bytes each rank reads
//! and writes, and of its scratch. comm/mpi/state.hpp queues the collectives and drives these
//! stages in issue order.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/frontend.hpp>
#include <shardkit/comm/mpi/support.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/kernels/host/reduce.hpp>

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace detail {

//! The MPI calls of one endpoint's collectives: what it needs of the endpoint, by value.
struct mpi_stages {
  MPI_Comm comm;    //!< the first stage of every collective
  MPI_Comm phase2;  //!< all_reduce's all-gathers, started in completion (= issue) order
  int rank = 0;
  int size = 1;
  int world = -1;  //!< this rank in MPI_COMM_WORLD for messages, or -1 (comm is the world)
  std::size_t max_call_elems = 0;    //!< most elements per block in one MPI call
  scratch_cache* scratch = nullptr;  //!< lends the reductions' scratch, takes it back

  //! Throws comm_error naming `op` and this rank when an MPI call failed (the message is built
  //! only then).
  void check(int rc, const char* mpi_function, const mpi_op& op) const {
    if (rc != MPI_SUCCESS) mpi_check(rc, mpi_function, op.what(), rank, size, world);
  }

  //! The MPI part of `op`'s first stage is complete: reduces what arrived and, for all_reduce,
  //! starts its all-gather on `phase2` (stage 1); otherwise the collective is done (stage 2).
  void finish_first_stage(mpi_op& op) const {
    const collective_desc& d = op.desc;
    const std::size_t e = size_of(d.type);
    const auto N = static_cast<std::size_t>(size);
    const auto r = static_cast<std::size_t>(rank);
    std::vector<const void*> src(N);
    if (d.kind == collective::reduce_scatter) {
      // This rank's own block of its slice in the input; in place, that is the output itself.
      for (const auto& p : op.parts) {
        for (std::size_t q = 0; q < N; ++q) {
          src[q] = q == r ? op.in + (r * d.count + p.begin) * e
                          : op.scratch.get() + p.scratch + peer_slot(q) * p.len * e;
        }
        host::reduce_ordered(d.type, src.data(), N, op.out + p.begin * e, p.len, d.op);
      }
    } else if (d.kind == collective::all_reduce) {
      for (const auto& p : op.parts) {
        const std::size_t mine = chunk_size(p.len, N, r);
        const std::size_t at = (p.begin + chunk_begin(p.len, N, r)) * e;
        for (std::size_t q = 0; q < N; ++q) {
          src[q] = q == r ? op.in + at : op.scratch.get() + p.scratch + peer_slot(q) * mine * e;
        }
        host::reduce_ordered(d.type, src.data(), N, op.out + at, mine, d.op);
      }
      scratch->give(std::move(op.scratch));
      const MPI_Datatype t = mpi_datatype(d.type);
      for (auto& p : op.parts) {
        // The all-to-all-v is complete: its send counts become the all-gather's counts, this
        // rank's own chunk included.
        p.counts[r] = static_cast<int>(chunk_size(p.len, N, r));
        MPI_Request req = MPI_REQUEST_NULL;
        check(MPI_Iallgatherv(MPI_IN_PLACE, 0, t, op.out + p.begin * e, p.counts.data(),
                              p.displs.data(), t, phase2, &req),
              "MPI_Iallgatherv", op);
        op.requests.push_back(req);
      }
      op.stage = 1;
      return;
    }
    scratch->give(std::move(op.scratch));
    op.stage = 2;
  }

  //! Starts the first MPI stage of `op`: its calls' requests go to op.requests.
  void start(mpi_op& op) const {
    const collective_desc& d = op.desc;
    const std::size_t e = size_of(d.type);
    const MPI_Datatype t = mpi_datatype(d.type);
    const auto N = static_cast<std::size_t>(size);
    const auto r = static_cast<std::size_t>(rank);
    const std::size_t L = max_call_elems;
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
        issued(MPI_Ibarrier(comm, &req), "MPI_Ibarrier");
        break;
      case collective::broadcast:
        pieces(c);
        for (const auto& p : op.parts) {
          issued(MPI_Ibcast(op.out + p.begin * e, static_cast<int>(p.len), t, d.root, comm, &req),
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
                                  comm, &req),
                   "MPI_Iallgather");
          } else {
            mpi_type_holder block;
            make_strided(block, t, p.len, c * e, op);
            issued(MPI_Iallgather(send, static_cast<int>(p.len), t, op.out + p.begin * e, 1,
                                  block.type, comm, &req),
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
                                 comm, &req),
                   "MPI_Ialltoall");
          } else {
            mpi_type_holder block;
            make_strided(block, t, p.len, c * e, op);
            issued(MPI_Ialltoall(op.in + p.begin * e, 1, block.type, op.out + p.begin * e, 1,
                                 block.type, comm, &req),
                   "MPI_Ialltoall");
          }
        }
        break;
      }
      case collective::reduce_scatter: {
        // Every other rank's block of this rank's slice, into scratch in rank order without this
        // rank; its own block is reduced where it lies (finish_first_stage).
        pieces(c);
        op.scratch = scratch->take((N - 1) * c * e);
        // Displacements in elements while they fit an int; per-peer block types otherwise.
        const bool plain = op.parts.size() == 1 && N * c <= static_cast<std::size_t>(INT_MAX);
        for (auto& p : op.parts) {
          p.scratch = (N - 1) * p.begin * e;
          std::byte* recv = op.scratch.get() + p.scratch;
          const int n = plain ? static_cast<int>(c) : 1;
          p.counts.assign(N, n);
          p.recv_counts.assign(N, n);
          p.counts[r] = p.recv_counts[r] = 0;
          p.displs.resize(N);
          p.recv_displs.resize(N);
          for (std::size_t q = 0; q < N; ++q) {
            p.displs[q] = static_cast<int>(q) * n;
            p.recv_displs[q] = q == r ? 0 : static_cast<int>(peer_slot(q)) * n;
          }
          if (plain) {
            issued(MPI_Ialltoallv(op.in, p.counts.data(), p.displs.data(), t, recv,
                                  p.recv_counts.data(), p.recv_displs.data(), t, comm, &req),
                   "MPI_Ialltoallv");
          } else {
            mpi_type_holder send_block, recv_block;
            make_strided(send_block, t, p.len, c * e, op);
            make_strided(recv_block, t, p.len, p.len * e, op);
            issued(MPI_Ialltoallv(op.in + p.begin * e, p.counts.data(), p.displs.data(),
                                  send_block.type, recv, p.recv_counts.data(), p.recv_displs.data(),
                                  recv_block.type, comm, &req),
                   "MPI_Ialltoallv");
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
            p.recv_displs[q] = q == r ? 0 : static_cast<int>(peer_slot(q) * mine);
          }
          // This rank's own chunk stays where it is (finish_first_stage reads it there).
          p.counts[r] = p.recv_counts[r] = 0;
          p.scratch = scratch_bytes;
          scratch_bytes += (N - 1) * mine * e;
        }
        op.scratch = scratch->take(scratch_bytes);
        for (auto& p : op.parts) {
          issued(MPI_Ialltoallv(op.in + p.begin * e, p.counts.data(), p.displs.data(), t,
                                op.scratch.get() + p.scratch, p.recv_counts.data(),
                                p.recv_displs.data(), t, comm, &req),
                 "MPI_Ialltoallv");
        }
        break;
      }
    }
  }

 private:
  // Where peer q's block lies in scratch, which holds every rank's but this one's, in rank order.
  std::size_t peer_slot(std::size_t q) const noexcept {
    return q < static_cast<std::size_t>(rank) ? q : q - 1;
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
};

}  // namespace detail

SHARDKIT_NAMESPACE_END
