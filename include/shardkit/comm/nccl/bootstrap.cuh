//! \file comm/nccl/bootstrap.cuh
//! Making an NCCL communicator: a unique id, and `nccl_bootstrap`, which creates one over the
//! ranks of any host communicator (thread_comm, mpi_comm) by broadcasting rank 0's id.
#pragma once

#include <shardkit/comm/nccl/communicator.cuh>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>

#include <nccl.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

SHARDKIT_NAMESPACE_BEGIN

//! A fresh ncclUniqueId (call on one rank, then give it to every rank).
inline ncclUniqueId nccl_unique_id() {
  ncclUniqueId id{};
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    detail::raise<comm_error>("ncclGetUniqueId failed: ", ncclGetErrorString(r), " (",
                              static_cast<int>(r), ")");
  }
  return id;
}

//! A host communicator that can broadcast bytes: what nccl_bootstrap needs (thread_comm, an MPI
//! communicator, or your own).
template <class C>
concept byte_broadcaster = host_accessible<typename C::memory_space> &&
    requires(C& c, std::uint8_t* p) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.broadcast(p, std::size_t{1}, 0);
};

//! Creates an NCCL communicator over the ranks of `host` (same ranks, same order), on each
//! rank's current device: rank 0 makes a unique id and broadcasts it through `host`. A failure on
//! rank 0 is reported on every rank.
template <byte_broadcaster Host>
nccl_communicator nccl_bootstrap(Host& host, nccl_options opts = {}) {
  struct message {
    std::uint8_t ok;
    ncclUniqueId id;
  };
  message m{};
  std::string error;
  if (host.rank() == 0) {
    try {
      m.id = nccl_unique_id();
      m.ok = 1;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  host.broadcast(reinterpret_cast<std::uint8_t*>(&m), sizeof m, 0);
  if (m.ok != 1) {
    detail::raise<comm_error>("nccl_bootstrap: rank 0 could not create an NCCL unique id",
                              error.empty() ? std::string() : ": " + error);
  }
  return nccl_communicator(m.id, static_cast<int>(host.rank()), static_cast<int>(host.size()),
                           opts);
}

SHARDKIT_NAMESPACE_END
