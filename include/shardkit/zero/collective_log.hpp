//! \file zero/collective_log.hpp
//! `collective_log`: what the ZeRO components record of the data collectives they issue. The
//! bytes each sends (the ring volumes of comm/volume.hpp, on the communicator it ran on) go into
//! a traffic ledger, so a step's traffic can be checked against zero/accounting.hpp; and every
//! collective is mixed into a running hash of the step's sequence (kind, group, count), which
//! step_control compares across ranks once per step to catch ranks that issued different
//! sequences. The components of one engine share one log; a component used alone may be given
//! none (nullptr): it then records nothing.
#pragma once

#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/ledger.hpp>

#include <cstddef>
#include <cstdint>

SHARDKIT_NAMESPACE_BEGIN

class collective_log {
 public:
  //! Records collective `c` of `count` elements of `elem_bytes` bytes (NCCL counts: per rank for
  //! reduce-scatter and all-gather, the whole array for all-reduce), issued on `comm`, and mixes
  //! (c, tag, count) into the step's sequence hash. `tag` names what it was for (a group index).
  template <class Comm>
  void record(const Comm& comm, collective c, std::size_t count, std::size_t elem_bytes,
              std::uint64_t tag) noexcept {
    traffic_.record(c, ring_bytes_sent(c, count, elem_bytes, static_cast<std::size_t>(comm.size()),
                                       static_cast<std::size_t>(comm.rank())));
    hash_ = mix(hash_ ^ (static_cast<std::uint64_t>(c) << 56) ^ (tag << 20) ^ count);
  }

  //! Bytes of the recorded collectives.
  const traffic_ledger& traffic() const noexcept { return traffic_; }
  //! The sequence hash of the collectives recorded since the last reset_sequence().
  std::uint64_t sequence_hash() const noexcept { return hash_; }
  void reset_sequence() noexcept { hash_ = 0; }

  //! splitmix64's finaliser: a bijective mix of 64 bits.
  static constexpr std::uint64_t mix(std::uint64_t z) noexcept {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

 private:
  traffic_ledger traffic_;
  std::uint64_t hash_ = 0;
};

SHARDKIT_NAMESPACE_END
