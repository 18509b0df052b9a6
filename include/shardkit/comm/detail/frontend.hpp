//! \file comm/detail/frontend.hpp
//! The front end every shardkit communicator shares, so that thread, MPI and NCCL implement
//! only their transport. `comm_frontend<Derived>` (a CRTP base) provides the typed calls of the
//! Communicator concept (comm/communicator.hpp), synchronous and asynchronous, and their
//! argument checks: a broadcast root that is a rank, all_to_all buffers that do not overlap,
//! split colours that are not negative. Each call becomes a `collective_desc` (what, element
//! type, count, operation, root) handed to the transport, which implements
//!
//!     template <element_type T> void run(const collective_desc&, const T* in, T* out);
//!     template <element_type T> work_type start(const collective_desc&, const T* in, T* out);
//!     traffic_ledger& ledger() noexcept;   const traffic_ledger& ledger() const noexcept;
//!     int rank() const;                      int size() const;
//!
//! (`in`/`out` are null for a barrier, both the buffer for a broadcast). Transports record the
//! ring volume of every completed collective with record(); the mismatch message of ranks that
//! called different collectives is mismatch_message() for all of them.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/reduce_op.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

SHARDKIT_NAMESPACE_BEGIN
namespace detail {

//! The description of one call.
inline collective_desc make_desc(collective k, dtype t, std::size_t n,
                                 reduce_op op = reduce_op::sum, int root = 0) noexcept {
  collective_desc d;
  d.kind = k;
  d.type = t;
  d.count = n;
  d.op = op;
  d.root = root;
  return d;
}

//! "collective mismatch at call #c: rank 0 called X but rank q called Y (...)". `first` and
//! `other` name ranks 0 and q when the communicator is not the world (e.g. "world rank 3 (rank
//! 1 of the sub-group of world ranks {1, 3})").
inline std::string mismatch_message(std::uint64_t call, const collective_desc& d0, bool split0,
                                    int q, const collective_desc& dq, bool split_q,
                                    const std::string& first = {}, const std::string& other = {}) {
  return concat("collective mismatch at call #", call, ": ",
                first.empty() ? std::string("rank 0") : first, " called ", describe(d0, split0),
                " but ", other.empty() ? concat("rank ", q) : other, " called ",
                describe(dq, split_q),
                " (every rank must issue the same collectives in the same order)");
}

//! Records the ring volume (comm/volume.hpp) rank `rank` of `size` sent in collective `d`.
inline void record(traffic_ledger& ledger, const collective_desc& d, int rank, int size) noexcept {
  ledger.record(d.kind,
                ring_bytes_sent(d.kind, d.count, size_of(d.type), static_cast<std::size_t>(size),
                                static_cast<std::size_t>(rank), static_cast<std::size_t>(d.root)));
}

//! Raises invalid_argument unless `color` may be passed to split().
inline void check_split_color(int color) {
  if (color < 0) raise("split: color must be non-negative, got ", color);
}

template <class Derived>
class comm_frontend {
 public:
  //! Every rank gets op over all ranks' n elements.
  template <element_type T>
  void all_reduce(const T* in, T* out, std::size_t n, reduce_op op = reduce_op::sum) {
    self().run(make_desc(collective::all_reduce, dtype_of<T>, n, op), in, out);
  }
  //! `in` holds size()·count elements; rank r gets op over all ranks of its slice r.
  template <element_type T>
  void reduce_scatter(const T* in, T* out, std::size_t count, reduce_op op = reduce_op::sum) {
    self().run(make_desc(collective::reduce_scatter, dtype_of<T>, count, op), in, out);
  }
  //! `out` holds size()·count elements, rank q's `in` at out[q·count].
  template <element_type T>
  void all_gather(const T* in, T* out, std::size_t count) {
    self().run(make_desc(collective::all_gather, dtype_of<T>, count), in, out);
  }
  //! Every rank gets root's n elements.
  template <element_type T>
  void broadcast(T* buf, std::size_t n, int root) {
    self().run(broadcast_desc(dtype_of<T>, n, root), static_cast<const T*>(buf), buf);
  }
  //! out[q·count, (q+1)·count) receives rank q's in[rank()·count, (rank()+1)·count); `in` and
  //! `out` must not overlap.
  template <element_type T>
  void all_to_all(const T* in, T* out, std::size_t count) {
    check_separate(in, out, count);
    self().run(make_desc(collective::all_to_all, dtype_of<T>, count), in, out);
  }
  //! Returns once every rank has entered it.
  void barrier() {
    self().run(make_desc(collective::barrier, dtype::u8, 0),
               static_cast<const std::uint8_t*>(nullptr), static_cast<std::uint8_t*>(nullptr));
  }

  template <element_type T>
  [[nodiscard]] auto all_reduce_async(const T* in, T* out, std::size_t n,
                                      reduce_op op = reduce_op::sum) {
    return self().start(make_desc(collective::all_reduce, dtype_of<T>, n, op), in, out);
  }
  template <element_type T>
  [[nodiscard]] auto reduce_scatter_async(const T* in, T* out, std::size_t count,
                                          reduce_op op = reduce_op::sum) {
    return self().start(make_desc(collective::reduce_scatter, dtype_of<T>, count, op), in, out);
  }
  template <element_type T>
  [[nodiscard]] auto all_gather_async(const T* in, T* out, std::size_t count) {
    return self().start(make_desc(collective::all_gather, dtype_of<T>, count), in, out);
  }
  template <element_type T>
  [[nodiscard]] auto broadcast_async(T* buf, std::size_t n, int root) {
    return self().start(broadcast_desc(dtype_of<T>, n, root), static_cast<const T*>(buf), buf);
  }
  template <element_type T>
  [[nodiscard]] auto all_to_all_async(const T* in, T* out, std::size_t count) {
    check_separate(in, out, count);
    return self().start(make_desc(collective::all_to_all, dtype_of<T>, count), in, out);
  }
  [[nodiscard]] auto barrier_async() {
    return self().start(make_desc(collective::barrier, dtype::u8, 0),
                        static_cast<const std::uint8_t*>(nullptr),
                        static_cast<std::uint8_t*>(nullptr));
  }

  //! Bytes this rank sent per collective (ring volumes, see comm/volume.hpp).
  const traffic_ledger& traffic() const noexcept { return self().ledger(); }
  void reset_traffic() noexcept { self().ledger().reset(); }

 protected:
  comm_frontend() = default;

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  collective_desc broadcast_desc(dtype t, std::size_t n, int root) const {
    if (root < 0 || root >= self().size()) {
      raise("broadcast: root ", root, " is not a rank of this communicator (size ", self().size(),
            ")");
    }
    return make_desc(collective::broadcast, t, n, reduce_op::sum, root);
  }

  template <class T>
  void check_separate(const T* in, const T* out, std::size_t count) const {
    const std::size_t n = static_cast<std::size_t>(self().size()) * count;
    if (n != 0 && in < out + n && out < in + n) {
      raise("all_to_all: `in` and `out` overlap; they must be separate buffers of ", n,
            " elements each (size() x count)");
    }
  }
};

}  // namespace detail
SHARDKIT_NAMESPACE_END
