//! \file zero/topology.hpp
//! `topology`: where a rank's shards live. Plain ZeRO shards over all N ranks. Hybrid sharding
//! (FSDP's HYBRID_SHARD, ZeRO++'s hpZ) shards within *shard groups* of G consecutive ranks and
//! replicates across the R = N / G groups; the ranks at the same position of every shard group
//! form a *replica group*:
//!
//!     N = 8, G = 4:   shard groups {0 1 2 3} {4 5 6 7}     replica groups {0 4} {1 5} {2 6} {3 7}
//!
//! Gradients are reduce-scattered in the shard group and their shard all-reduced across the
//! replica group; parameters are gathered in the shard group. Building a hybrid topology is
//! collective (two split() calls on the world communicator).
//!
//!     shardkit::topology<shardkit::thread_comm> topo(comm, 2);   // shard over pairs
//!     auto& shard_comm = topo.shard_group();                      // the ranks of my pair
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/device.hpp>
#include <shardkit/core/error.hpp>

#include <cstddef>
#include <optional>

SHARDKIT_NAMESPACE_BEGIN

template <communicator Comm>
class topology {
 public:
  //! Shards over all ranks of `world` (shard_group_size 0 or N), or over shard groups of
  //! `shard_group_size` consecutive ranks, which must divide N. `world` must outlive the
  //! topology.
  explicit topology(Comm& world, std::size_t shard_group_size = 0)
      : world_(&world), rank_(world.rank()), ranks_(world.size()) {
    if (ranks_ < 1 || rank_ < 0 || rank_ >= ranks_) {
      detail::raise("topology: the communicator reports rank ", rank_, " of ", ranks_);
    }
    shard_rank_ = rank_;
    shard_size_ = ranks_;
    const std::size_t g = shard_group_size;
    if (g == 0 || g == static_cast<std::size_t>(ranks_)) return;
    if (static_cast<std::size_t>(ranks_) % g != 0) {
      detail::raise("hybrid sharding: shard_group_size = ", g, " does not divide the ", ranks_,
                    " ranks (every shard group must have the same size)");
    }
    const int gi = static_cast<int>(g);
    shard_.emplace(world.split(rank_ / gi, rank_));
    replica_.emplace(world.split(rank_ % gi, rank_));
    shard_rank_ = rank_ % gi;
    shard_size_ = gi;
  }

  topology(const topology&) = delete;
  topology& operator=(const topology&) = delete;
  topology(topology&&) noexcept = default;
  topology& operator=(topology&&) noexcept = default;

  //! All ranks.
  Comm& world() noexcept { return *world_; }
  const Comm& world() const noexcept { return *world_; }
  //! The ranks this rank shards with: the shard group's communicator under hybrid sharding, the
  //! world otherwise (shard_comm() is the same but null without hybrid sharding).
  Comm& shard_group() noexcept { return shard_ ? *shard_ : *world_; }
  const Comm& shard_group() const noexcept { return shard_ ? *shard_ : *world_; }
  //! The ranks holding the same shard as this one (nullptr without hybrid sharding).
  Comm* replica_group() noexcept { return replica_ ? &*replica_ : nullptr; }
  //! The shard group's own communicator (nullptr without hybrid sharding).
  Comm* shard_comm() noexcept { return shard_ ? &*shard_ : nullptr; }

  bool hybrid() const noexcept { return shard_.has_value(); }
  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return ranks_; }
  //! This rank's position in its shard group and the group's size G.
  int shard_rank() const noexcept { return shard_rank_; }
  int shard_size() const noexcept { return shard_size_; }
  //! R = N / G, and which replica (shard group) this rank is in.
  int replicas() const noexcept { return ranks_ / shard_size_; }
  int replica_rank() const noexcept { return rank_ / shard_size_; }

  //! Device communicators: gives every communicator of the topology the compute stream whose
  //! work their collectives must wait for (no-op for communicators without set_compute_stream).
  void set_compute_stream(device_stream s) {
    if constexpr (requires(Comm & c) { c.set_compute_stream(s); }) {
      world_->set_compute_stream(s);
      if (shard_) shard_->set_compute_stream(s);
      if (replica_) replica_->set_compute_stream(s);
    } else {
      (void)s;
    }
  }

 private:
  Comm* world_;
  int rank_;
  int ranks_;
  int shard_rank_ = 0;
  int shard_size_ = 1;
  std::optional<Comm> shard_;
  std::optional<Comm> replica_;
};

SHARDKIT_NAMESPACE_END
