//! \file comm/mpi/signatures.hpp
//! How an mpi_comm names ranks in its errors, and the signatures by which its ranks compare
//! the collectives they issue (detect_divergence, check_matching).
//!
//! Every message names a rank by its rank in the communicator and, when the communicator is not
//! MPI_COMM_WORLD (a split, a sub-group of hybrid sharding), by its world rank too. A signature
//! (kind, element type, count, operation, root, split: 48 bytes) goes from each rank to each
//! other one as a point-to-point message; a rank whose signature never arrives is a rank that
//! did not issue the collective, which is what a timeout reports.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/frontend.hpp>
#include <shardkit/comm/mpi/support.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace detail {

//! The ranks of one communicator as messages name them.
struct mpi_names {
  int rank = 0;
  int size = 1;
  bool is_world = true;       // the communicator is MPI_COMM_WORLD (or congruent to it)
  std::vector<int> world_of;  // world rank of each rank

  mpi_names() = default;
  explicit mpi_names(MPI_Comm comm) {
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    int same = MPI_UNEQUAL;
    MPI_Comm_compare(comm, MPI_COMM_WORLD, &same);
    is_world = same == MPI_IDENT || same == MPI_CONGRUENT;
    world_of.resize(static_cast<std::size_t>(size));
    for (int q = 0; q < size; ++q) world_of[static_cast<std::size_t>(q)] = q;
    if (!is_world) {
      MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
      MPI_Comm_group(comm, &mine);
      MPI_Comm_group(MPI_COMM_WORLD, &world);
      const std::vector<int> ranks(world_of);
      MPI_Group_translate_ranks(mine, size, ranks.data(), world, world_of.data());
      MPI_Group_free(&mine);
      MPI_Group_free(&world);
    }
  }

  //! "rank 2 of 4", plus " (world rank 6)" when the communicator is not MPI_COMM_WORLD.
  std::string me() const { return concat("rank ", rank, " of ", size, world_suffix(rank)); }
  //! "rank 2", plus " (world rank 6)" when the communicator is not MPI_COMM_WORLD.
  std::string who(int q) const { return concat("rank ", q, world_suffix(q)); }
  //! "rank(s) {1, 2} of 4", plus " (world rank(s) {5, 6})".
  std::string ranks(const std::vector<int>& qs) const {
    std::string local, world;
    for (int q : qs) {
      local += (local.empty() ? "" : ", ") + std::to_string(q);
      world += (world.empty() ? "" : ", ") + std::to_string(world_of[static_cast<std::size_t>(q)]);
    }
    return concat("rank(s) {", local, "} of ", size,
                  is_world ? std::string() : concat(" (world rank(s) {", world, "})"));
  }
  //! This rank's world rank for mpi_check (-1: the same as its rank).
  int world_arg() const noexcept {
    return is_world ? -1 : world_of[static_cast<std::size_t>(rank)];
  }

 private:
  std::string world_suffix(int q) const {
    if (is_world) return {};
    return concat(" (world rank ", world_of[static_cast<std::size_t>(q)], ")");
  }
};

inline constexpr int signature_fields = 6;
inline constexpr int signature_tag = 0x5348;  // on the communicator's second MPI communicator

//! This rank's signature of `d` at `mine` (signature_fields values).
inline void write_signature(std::int64_t* mine, const collective_desc& d, bool is_split) {
  mine[0] = static_cast<std::int64_t>(d.kind);
  mine[1] = static_cast<std::int64_t>(d.type);
  mine[2] = static_cast<std::int64_t>(d.count);
  mine[3] = static_cast<std::int64_t>(d.op);
  mine[4] = static_cast<std::int64_t>(d.root);
  mine[5] = is_split ? 1 : 0;
}

//! Posts a receive of each other rank's signature into `all` (rank order) and sends this rank's
//! (already at its place in `all`) to each, on `comm` (one that carries no other
//! point-to-point messages). `reqs`: the receives in rank order, then the sends.
inline void post_signatures(std::int64_t* all, std::vector<MPI_Request>& reqs,
                            const std::string& what, MPI_Comm comm, const mpi_names& n) {
  reqs.assign(2 * static_cast<std::size_t>(n.size - 1), MPI_REQUEST_NULL);
  std::size_t k = 0;
  for (int q = 0; q < n.size; ++q) {
    if (q == n.rank) continue;
    mpi_check(MPI_Irecv(all + static_cast<std::size_t>(q) * signature_fields, signature_fields,
                        MPI_INT64_T, q, signature_tag, comm, &reqs[k++]),
              "MPI_Irecv", what, n.rank, n.size, n.world_arg());
  }
  const std::int64_t* mine = all + static_cast<std::size_t>(n.rank) * signature_fields;
  for (int q = 0; q < n.size; ++q) {
    if (q == n.rank) continue;
    mpi_check(MPI_Isend(mine, signature_fields, MPI_INT64_T, q, signature_tag, comm, &reqs[k++]),
              "MPI_Isend", what, n.rank, n.size, n.world_arg());
  }
}

//! Tests every request of a signature exchange (completed ones become MPI_REQUEST_NULL); true
//! when all are complete.
inline bool signatures_arrived(std::vector<MPI_Request>& reqs, const std::string& what,
                               const mpi_names& n) {
  bool all = true;
  for (auto& req : reqs) {
    if (req == MPI_REQUEST_NULL) continue;
    int flag = 0;
    mpi_check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test", what, n.rank, n.size,
              n.world_arg());
    all = all && flag != 0;
  }
  return all;
}

//! The ranks whose signature has not arrived (after signatures_arrived() tested the requests).
inline std::vector<int> missing_senders(const std::vector<MPI_Request>& reqs, const mpi_names& n) {
  std::vector<int> missing;
  for (int q = 0, k = 0; q < n.size; ++q) {
    if (q == n.rank) continue;
    if (reqs[static_cast<std::size_t>(k++)] != MPI_REQUEST_NULL) missing.push_back(q);
  }
  return missing;
}

//! Throws collective_mismatch (on every rank: each compares the same values) unless the
//! signatures at `all` (rank order) agree.
inline void compare_signatures(const std::int64_t* all, std::uint64_t call, const mpi_names& n) {
  auto desc_of = [&](int q, bool& split) {
    const std::int64_t* f = all + static_cast<std::size_t>(q) * signature_fields;
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
  for (int q = 1; q < n.size; ++q) {
    bool split_q = false;
    const collective_desc dq = desc_of(q, split_q);
    if (split_q != split0 || (!split0 && !dq.matches(d0))) {
      throw collective_mismatch(
          concat(mismatch_message(call, d0, split0, q, dq, split_q, n.who(0), n.who(q)),
                 "; seen on ", n.me()));
    }
  }
}

}  // namespace detail
SHARDKIT_NAMESPACE_END
