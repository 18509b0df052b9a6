//! \file comm/communicator.hpp
//! The Communicator concept every engine is written against and the work-handle concept of
//! asynchronous collectives (the reduction operations are core/reduce_op.hpp).
//!
//! Semantics follow NCCL:
//!  - all_reduce(in, out, n, op): every rank gets op over all ranks' n elements.
//!  - reduce_scatter(in, out, count, op): `in` holds size()·count elements; rank r gets
//!    op over all ranks of in[r·count, (r+1)·count). In place when out == in + rank()·count.
//!  - all_gather(in, out, count): `out` holds size()·count elements, rank q's `in` at
//!    out[q·count]. In place when in == out + rank()·count.
//!  - broadcast(buf, n, root): every rank gets root's n elements.
//!  - barrier(): returns once every rank has entered it.
//!  - split(color, key): collective; ranks with the same color (>= 0) form a new communicator,
//!    ranked by (key, rank in the parent), like MPI_Comm_split.
//! Counts are elements, not bytes. Reductions of 16-bit floats accumulate in fp32 and round
//! once. shardkit's communicators reduce in a fixed order (rank 0, 1, ..., N-1) so results are
//! bit-identical whatever the timing. Each *_async form returns a work handle; the buffers must
//! stay alive and untouched until its wait() returns. Collectives run in the order they are
//! issued on each rank; ranks must issue the same sequence.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/reduce_op.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>

SHARDKIT_NAMESPACE_BEGIN

//! A handle to an asynchronous collective. wait() blocks the host until the collective is done
//! and rethrows its error; test() says whether it is done without blocking.
template <class W>
concept work_handle = std::movable<W> && requires(W& w) {
  w.wait();
  { w.test() } -> std::convertible_to<bool>;
};

//! A group of ranks that run collectives together (see the file comment for semantics).
//! Checked for float and bf16; communicators support every shardkit element type they can
//! reduce (float, double, bf16, fp16, integers).
template <class C>
concept communicator = requires(C& c, const C& cc, float* f, const float* cf, bf16* h,
                                const bf16* ch, std::size_t n, reduce_op op, int root) {
  typename C::memory_space;
  requires memory_space<typename C::memory_space>;
  typename C::work_type;
  requires work_handle<typename C::work_type>;
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  c.all_reduce(cf, f, n, op);
  c.all_reduce(ch, h, n, op);
  c.reduce_scatter(cf, f, n, op);
  c.reduce_scatter(ch, h, n, op);
  c.all_gather(cf, f, n);
  c.all_gather(ch, h, n);
  c.broadcast(f, n, root);
  c.barrier();
  { c.split(root, root) } -> std::same_as<C>;
  { c.all_reduce_async(cf, f, n, op) } -> std::same_as<typename C::work_type>;
  { c.reduce_scatter_async(ch, h, n, op) } -> std::same_as<typename C::work_type>;
  { c.all_gather_async(ch, h, n) } -> std::same_as<typename C::work_type>;
  { cc.traffic() } -> std::same_as<const traffic_ledger&>;
};

namespace detail {

//! What one rank asked for at one position of its collective sequence; communicators compare
//! these across ranks to detect mismatched calls and use them in error messages.
struct collective_desc {
  collective kind = collective::barrier;
  dtype type = dtype::u8;
  std::size_t count = 0;
  int root = 0;
  reduce_op op = reduce_op::sum;
  int color = 0;  // split
  int key = 0;    // split

  bool matches(const collective_desc& o) const noexcept {
    if (kind != o.kind) return false;
    switch (kind) {
      case collective::barrier:
        return true;
      case collective::broadcast:
        return type == o.type && count == o.count && root == o.root;
      case collective::all_gather:
      case collective::all_to_all:
        return type == o.type && count == o.count;
      case collective::all_reduce:
      case collective::reduce_scatter:
        return type == o.type && count == o.count && op == o.op;
    }
    return false;
  }
};

//! "all_reduce(fp32, count 8, sum)", "broadcast(bf16, count 4, root 1)", "barrier", "split".
inline std::string describe(const collective_desc& d, bool is_split = false) {
  if (is_split) return "split";
  std::string s = name(d.kind);
  if (d.kind == collective::barrier) return s;
  s += concat("(", name(d.type), ", count ", d.count);
  if (d.kind == collective::all_reduce || d.kind == collective::reduce_scatter) {
    s += concat(", ", name(d.op));
  }
  if (d.kind == collective::broadcast) s += concat(", root ", d.root);
  return s + ")";
}

}  // namespace detail

SHARDKIT_NAMESPACE_END
