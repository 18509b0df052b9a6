//! \file comm/mpi/support.hpp
//! The settings of an mpi_comm and what its transport needs of MPI: datatypes for moving
//! shardkit's element types, MPI errors as comm_error, the check that MPI runs, derived
//! datatypes that free themselves, and one asynchronous collective's state (mpi_op).
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/detail/scratch_cache.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>

// shardkit uses MPI's C API; keep the deprecated C++ bindings out.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Who moves an mpi_comm's asynchronous collectives forward (see the file comment).
enum class mpi_progress : std::uint8_t {
  on_call,  //!< inside test(), wait() and later collectives of the communicator
  thread,   //!< a progress thread per communicator (needs MPI_THREAD_MULTIPLE)
};

//! Settings of an mpi_comm; communicators made by split() inherit them.
struct mpi_comm_options {
  //! How long a collective may wait for the other ranks before it fails with comm_timeout
  //! (zero: wait forever). Two minutes by default, as thread_comm: long enough for a rank to
  //! wait while another one saves an ordinary checkpoint (raise it when saves take longer),
  //! short enough that a dead or stuck rank ends the job in minutes rather than hours.
  std::chrono::milliseconds timeout{std::chrono::minutes(2)};
  //! With each collective, exchange its kind, element type, count, operation and root across
  //! the ranks (one small MPI_Iallgather of 48 bytes per rank, issued just before the collective
  //! and completed with it; issuing never waits for it) and throw collective_mismatch on every
  //! rank when they differ, instead of waiting for the timeout. The mismatched collective was
  //! started, so the communicator is unusable after (as after comm_timeout). On by default:
  //! one small message per collective (benchmarks/README.md gives the cost).
  bool detect_divergence = true;
  //! Before each collective, compare the same fields (a blocking exchange): the mismatched
  //! collective is never started and the communicator stays usable, at the price of a
  //! latency-bound wait before every collective, also asynchronous ones. Replaces
  //! detect_divergence when set.
  bool check_matching = false;
  //! See mpi_progress.
  mpi_progress progress = mpi_progress::on_call;
  //! How often the progress thread polls MPI while collectives are pending.
  std::chrono::microseconds progress_interval{50};
  //! Most elements one MPI call carries per peer, in [1, 2^30]; larger collectives are split
  //! into several calls. The default keeps every message under 1 GiB.
  std::size_t max_call_elems = std::size_t{1} << 27;
  //! Most bytes of scratch the communicator keeps for its next collectives once the ones that
  //! used it are done (reduce-scatter and all-reduce receive the other ranks' blocks into
  //! scratch: see "Memory" in comm/mpi.hpp). 0: every collective frees its own. Each
  //! communicator (split() and duplicate() make new ones) keeps its own.
  std::size_t scratch_cache_bytes = std::size_t{256} << 20;
  //! Where the scratch is counted (memory_category::comm_scratch), kept blocks included; may be
  //! null. It must outlive the communicator, and is updated only in calls on the communicator
  //! (never by its progress thread), like an engine's own ledger.
  memory_ledger* ledger = nullptr;
};

class mpi_comm;

namespace detail {

//! MPI's type for moving elements of `t` (never used for arithmetic).
inline MPI_Datatype mpi_datatype(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return MPI_FLOAT;
    case dtype::f64:
      return MPI_DOUBLE;
    case dtype::bf16:
    case dtype::f16:
      return MPI_UINT16_T;  // raw 16-bit words
    case dtype::i32:
      return MPI_INT32_T;
    case dtype::i64:
      return MPI_INT64_T;
    case dtype::u8:
      return MPI_UINT8_T;
    case dtype::u32:
      return MPI_UINT32_T;
    case dtype::u64:
      return MPI_UINT64_T;
  }
  return MPI_DATATYPE_NULL;
}

//! MPI's text for an error code ("MPI_ERR_COUNT: invalid count argument").
inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return concat("MPI error code ", code);
  return std::string(text, static_cast<std::size_t>(len));
}

//! Throws comm_error when an MPI call did not return MPI_SUCCESS.
//! `world` (when not negative) is the rank's rank in MPI_COMM_WORLD, named after its own.
inline void mpi_check(int rc, const char* mpi_function, const std::string& what, int rank, int size,
                      int world = -1) {
  if (rc == MPI_SUCCESS) return;
  throw comm_error(concat("mpi_comm: ", what, " failed on rank ", rank, " of ", size,
                          world >= 0 ? concat(" (world rank ", world, ")") : std::string(), ": ",
                          mpi_function, " returned ", mpi_error_text(rc)));
}

//! Throws usage_error unless MPI is initialised and not yet finalised.
inline void require_mpi_running(const char* who) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) {
    raise<usage_error>(who, ": MPI is ", fin ? "already finalised" : "not initialised",
                       "; create communicators between MPI_Init_thread and MPI_Finalize (or "
                       "inside shardkit::mpi_main / while a shardkit::mpi_session lives)");
  }
}

inline bool mpi_finalized() noexcept {
  int fin = 0;
  MPI_Finalized(&fin);
  return fin != 0;
}

//! A committed derived datatype, freed with its holder (MPI keeps it alive for operations that
//! already use it).
struct mpi_type_holder {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  mpi_type_holder() = default;
  mpi_type_holder(const mpi_type_holder&) = delete;
  mpi_type_holder& operator=(const mpi_type_holder&) = delete;
  ~mpi_type_holder() {
    if (type != MPI_DATATYPE_NULL && !mpi_finalized()) MPI_Type_free(&type);
  }
};

//! One asynchronous collective of an mpi_comm.
struct mpi_op {
  //! One MPI call's share: elements [begin, begin + len) of each per-peer block (or of the
  //! array, for all_reduce and broadcast), its scratch offset in bytes, and the count and
  //! displacement arrays MPI reads until the call completes.
  struct part {
    std::size_t begin = 0;
    std::size_t len = 0;
    std::size_t scratch = 0;
    std::vector<int> counts, displs, recv_counts, recv_displs;
  };

  collective_desc desc;
  std::uint64_t call = 0;
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
  std::vector<part> parts;
  scratch_block scratch;  //!< lent by the endpoint's scratch_cache, given back when reduced
  std::vector<MPI_Request> requests;
  //! detect_divergence: every rank's signature of this collective (signature_fields each),
  //! the request that gathers them, and whether they were compared.
  std::vector<std::int64_t> signatures;
  MPI_Request signature_request = MPI_REQUEST_NULL;
  bool signatures_compared = true;
  int stage = 0;  // 0: first MPI calls in flight, 1: all_reduce's all-gather in flight, 2: done
  std::exception_ptr error;

  bool done() const noexcept { return stage == 2; }
  std::string what() const { return concat(describe(desc), " (call #", call, ")"); }
};

}  // namespace detail

SHARDKIT_NAMESPACE_END
