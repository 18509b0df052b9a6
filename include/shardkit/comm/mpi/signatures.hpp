//! \file comm/mpi/signatures.hpp
//! How an mpi_comm names ranks in its errors: the names themselves, the signatures by which its
//! ranks compare the collectives they issue (detect_divergence, check_matching), and the roll
//! call by which a timeout finds the ranks that did not issue the collective.
//!
//! Every message names a rank by its rank in the communicator and, when the communicator is not
//! MPI_COMM_WORLD (a split, a sub-group of hybrid sharding), by its world rank too.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/frontend.hpp>
#include <shardkit/comm/mpi/support.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
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

//! This rank's signature of `d` at `mine` (signature_fields values).
inline void write_signature(std::int64_t* mine, const collective_desc& d, bool is_split) {
  mine[0] = static_cast<std::int64_t>(d.kind);
  mine[1] = static_cast<std::int64_t>(d.type);
  mine[2] = static_cast<std::int64_t>(d.count);
  mine[3] = static_cast<std::int64_t>(d.op);
  mine[4] = static_cast<std::int64_t>(d.root);
  mine[5] = is_split ? 1 : 0;
}

//! The roll call that names the ranks a timed-out collective waits for. The rank that times out
//! at call #k asks every other rank how many collectives it has issued (a point-to-point
//! message on the communicator's second MPI communicator, which carries no other
//! point-to-point messages); a rank answers while it waits in a collective of its own (after
//! 1 ms) or from its progress thread. Ranks that issued fewer than k did not issue it; ranks
//! that do not answer within the grace period hang outside the collectives (or died). Costs
//! nothing until a collective times out.
class mpi_roll_call {
 public:
  static constexpr int query_tag = 0x5351;
  static constexpr int reply_tag = 0x5352;

  //! Answers the queries that have arrived with `issued` (collectives issued so far). A query
  //! says its sender waits at call #k: it has issued k collectives, which is remembered.
  void answer(MPI_Comm comm, const mpi_names& n, std::uint64_t issued) {
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, query_tag, comm, &flag, &st) != MPI_SUCCESS || !flag) break;
      std::int64_t asked = 0;
      MPI_Recv(&asked, 1, MPI_INT64_T, st.MPI_SOURCE, query_tag, comm, MPI_STATUS_IGNORE);
      heard(n, st.MPI_SOURCE, asked);
      send(comm, st.MPI_SOURCE, reply_tag, static_cast<std::int64_t>(issued));
    }
  }

  //! Asks every other rank not yet known to have issued call #k, waits up to `grace` for the
  //! answers (answering queries meanwhile), and describes the ranks that did not issue it.
  std::string ask(MPI_Comm comm, const mpi_names& n, std::uint64_t k, std::uint64_t issued,
                  std::chrono::milliseconds grace) {
    if (heard_.empty()) heard_.assign(static_cast<std::size_t>(n.size), -1);
    answer(comm, n, issued);
    const auto K = static_cast<std::int64_t>(k);
    std::vector<char> replied(static_cast<std::size_t>(n.size), 0);
    int pending = 0;
    for (int q = 0; q < n.size; ++q) {
      if (q == n.rank || heard_[static_cast<std::size_t>(q)] >= K) continue;
      send(comm, q, query_tag, K);
      ++pending;
    }
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (pending > 0 && std::chrono::steady_clock::now() < deadline) {
      answer(comm, n, issued);
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, reply_tag, comm, &flag, &st) == MPI_SUCCESS && flag) {
        std::int64_t got = 0;
        MPI_Recv(&got, 1, MPI_INT64_T, st.MPI_SOURCE, reply_tag, comm, MPI_STATUS_IGNORE);
        heard(n, st.MPI_SOURCE, got);
        auto& r = replied[static_cast<std::size_t>(st.MPI_SOURCE)];
        if (!r) --pending;
        r = 1;
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    std::vector<int> behind, silent;
    std::string at;
    for (int q = 0; q < n.size; ++q) {
      const std::int64_t h = heard_[static_cast<std::size_t>(q)];
      if (q == n.rank || h >= K) continue;
      if (replied[static_cast<std::size_t>(q)]) {
        behind.push_back(q);
        at += concat(at.empty() ? "" : ", ", n.who(q), " has issued ", h);
      } else {
        silent.push_back(q);
      }
    }
    std::string out;
    if (!behind.empty()) {
      out = concat(n.ranks(behind), " did not issue it (", at, " collective(s))");
    }
    if (!silent.empty()) {
      out +=
          concat(out.empty() ? "" : "; ", n.ranks(silent), " did not answer within ", grace.count(),
                 " ms: they hang outside this communicator's collectives, or died");
    }
    if (out.empty()) out = "every rank issued it (one may have stopped driving MPI)";
    return out;
  }

  //! True when every message this roll call sent has completed (its buffers may be freed).
  bool settled() {
    while (!sent_.empty()) {
      int flag = 0;
      MPI_Test(&sent_.front().second, &flag, MPI_STATUS_IGNORE);
      if (!flag) return false;
      sent_.pop_front();
    }
    return true;
  }

 private:
  // A small message whose buffer and request outlive the call (completed ones are dropped).
  void send(MPI_Comm comm, int to, int tag, std::int64_t value) {
    while (!sent_.empty()) {
      int flag = 0;
      MPI_Test(&sent_.front().second, &flag, MPI_STATUS_IGNORE);
      if (!flag) break;
      sent_.pop_front();
    }
    sent_.emplace_back(std::make_unique<std::int64_t>(value), MPI_REQUEST_NULL);
    MPI_Isend(sent_.back().first.get(), 1, MPI_INT64_T, to, tag, comm, &sent_.back().second);
  }
  void heard(const mpi_names& n, int q, std::int64_t issued) {
    if (heard_.empty()) heard_.assign(static_cast<std::size_t>(n.size), -1);
    auto& h = heard_[static_cast<std::size_t>(q)];
    h = std::max(h, issued);
  }
  std::deque<std::pair<std::unique_ptr<std::int64_t>, MPI_Request>> sent_;
  std::vector<std::int64_t> heard_;  // per rank: most collectives it is known to have issued
};

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
