//! \file plan/time.hpp
//! An alpha-beta model of the time ring collectives take on a cluster of nodes, and from it the
//! communication time of one optimizer step (the collectives of plan/comm.hpp).
//!
//! The model. A message of b bytes over a link takes α + b·β (α: latency per message, β = 1 /
//! bandwidth). A ring over P ranks runs in synchronous steps; in each step every rank sends one
//! chunk to its neighbour, and the step ends when the slowest link is done:
//!
//!     reduce-scatter, all-gather (c elements per rank):  (P−1)·(α + c·e·β)
//!     all-reduce (n elements, chunks of at most ⌈n/P⌉):  2(P−1)·(α + ⌈n/P⌉·e·β)
//!     all-to-all (c elements per peer):                   (P−1)·(α + c·e·β)
//!     broadcast (n elements, pipelined chain):            (P−1)·α + n·e·β
//!
//! A cluster is nodes of `gpus_per_node` GPUs; links inside a node (NVLink) have α_intra,
//! β_intra, links between nodes α_inter, β_inter. Placement: rank r lives on node r /
//! gpus_per_node; a group is spread evenly: `per_node` of its members on each node it spans.
//!
//! A communicator whose collectives are not all rings of one link (a calibration shows it:
//! plan/calibrate.hpp) can be given one measured link per collective inside a node
//! (cluster::intra_all_reduce, intra_reduce_scatter, intra_all_gather), used in place of intra,
//! and one per collective run in place (cluster::intra_all_reduce_in_place etc.), used for the
//! collectives a step issues in place (collective_call::in_place; plan/comm.hpp).
//!
//!  - flat ring: one ring over the whole group. If it spans one node it runs on intra-node
//!    links; otherwise its slowest link bounds every step: α = max(α_intra, α_inter),
//!    β = max(β_intra, β_inter).
//!  - hierarchical (two-level, P = g·m ranks: g members per node on m nodes): reduce-scatter =
//!    ring reduce-scatter inside each node (m·c elements per rank) then across nodes (c per rank,
//!    g rings in parallel); all-gather the reverse; all-reduce of n elements = intra-node
//!    reduce-scatter into chunks of ⌈n/g⌉, inter-node all-reduce of that chunk, intra-node
//!    all-gather:
//!        RS, AG: (g−1)·(α_i + m·c·e·β_i) + (m−1)·(α_e + c·e·β_e)
//!        AR:     2(g−1)·(α_i + ⌈n/g⌉·e·β_i) + 2(m−1)·(α_e + ⌈⌈n/g⌉/m⌉·e·β_e)
//!    With m = 1 or g = 1 it is the flat ring. all-to-all and broadcast use the flat ring.
//!
//! Assumptions (state them when quoting a number): bandwidths are per GPU and per direction
//! (full duplex; across nodes each GPU has its own NIC, as in rail-optimised clusters); links
//! are not shared with other traffic; collectives of a step run one after another and do not
//! overlap compute (a step's communication time is the sum, an upper bound on what overlap
//! leaves exposed); the reduction arithmetic and kernel launches are free. The byte counts of
//! the ledger follow the flat ring (plan/comm.hpp) whichever algorithm the time uses.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/plan/comm.hpp>
#include <shardkit/plan/model.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

//! One kind of link: latency per message and bandwidth per direction.
struct link {
  double latency_s = 5e-6;     //!< α: seconds per message
  double bytes_per_s = 450e9;  //!< bandwidth, bytes per second per direction (β = 1 / this)
};

//! Nodes of `gpus_per_node` GPUs, a fast network inside a node and a slower one between nodes.
struct cluster {
  std::uint64_t gpus_per_node = 8;  //!< ranks per node (one rank per GPU)
  link intra{5e-6, 450e9};          //!< inside a node (e.g. NVLink4: 450 GB/s per direction)
  link inter{5e-6, 50e9};           //!< between nodes (e.g. one 400 Gbit/s NIC per GPU)
  //! Links measured per collective inside a node (plan::fit_links_per_collective), which
  //! replace `intra` for that collective: a communicator whose collectives are not all rings
  //! (the thread communicator's one-pass all-reduce costs about what its all-gather does, where
  //! a ring all-reduce costs twice as much) is then described by one fitted link each. Unset:
  //! `intra`.
  std::optional<link> intra_all_reduce{};
  std::optional<link> intra_reduce_scatter{};
  std::optional<link> intra_all_gather{};
  //! Links measured in place (the all-reduce on one buffer, the reduce-scatter into the rank's
  //! own slice of its input, the all-gather from the rank's own slice of its output), for the
  //! collectives a step issues in place (collective_call::in_place). A host communicator's
  //! in-place all-reduce and all-gather cost about half what they do out of place (the output
  //! is not a second array read before it is written). Unset: the collective's link above.
  std::optional<link> intra_all_reduce_in_place{};
  std::optional<link> intra_reduce_scatter_in_place{};
  std::optional<link> intra_all_gather_in_place{};
};

//! The link of collective `op` inside a node of `c`: its own measured link where one is set,
//! for its placement (in place or not) where one is set for that.
constexpr link intra_link(const cluster& c, collective op, bool in_place = false) noexcept {
  switch (op) {
    case collective::all_reduce:
      if (in_place && c.intra_all_reduce_in_place) return *c.intra_all_reduce_in_place;
      return c.intra_all_reduce.value_or(c.intra);
    case collective::reduce_scatter:
      if (in_place && c.intra_reduce_scatter_in_place) return *c.intra_reduce_scatter_in_place;
      return c.intra_reduce_scatter.value_or(c.intra);
    case collective::all_gather:
      if (in_place && c.intra_all_gather_in_place) return *c.intra_all_gather_in_place;
      return c.intra_all_gather.value_or(c.intra);
    default:
      return c.intra;
  }
}

//! The two ways of running a collective over several nodes that the model knows.
enum class algorithm : std::uint8_t {
  ring,          //!< one flat ring over the group
  hierarchical,  //!< inside each node, then across nodes, then inside each node
};

constexpr const char* name(algorithm a) noexcept {
  return a == algorithm::ring ? "ring" : "hierarchical";
}

//! How a group of ranks sits on the cluster: `size` members, `per_node` on each node it spans.
struct placement {
  std::uint64_t size = 1;
  std::uint64_t per_node = 1;
  constexpr std::uint64_t nodes() const noexcept {
    return per_node == 0 ? 0 : (size + per_node - 1) / per_node;
  }
};

//! Why the ranks of `s` cannot be placed on `c` evenly, or nullptr. The model needs N ≤ the GPUs
//! of one node or N a multiple of it, and a hybrid shard group that divides a node or is made
//! of whole nodes.
constexpr const char* placement_problem(const setup& s, const cluster& c) noexcept {
  const std::uint64_t gpn = c.gpus_per_node;
  if (gpn == 0) return "gpus_per_node must be at least 1";
  if (s.ranks > gpn && s.ranks % gpn != 0) {
    return "the number of ranks must fit in one node or be a multiple of gpus_per_node";
  }
  const std::uint64_t G = s.shard_group();
  if (s.hybrid() && G % gpn != 0 && gpn % G != 0) {
    return "the hybrid shard group must divide gpus_per_node or be a multiple of it";
  }
  if (!(c.intra.bytes_per_s > 0) || !(c.inter.bytes_per_s > 0)) {
    return "link bandwidths must be positive";
  }
  if (!(c.intra.latency_s >= 0) || !(c.inter.latency_s >= 0)) {
    return "link latencies must not be negative";
  }
  for (const auto* l : {&c.intra_all_reduce, &c.intra_reduce_scatter, &c.intra_all_gather,
                        &c.intra_all_reduce_in_place, &c.intra_reduce_scatter_in_place,
                        &c.intra_all_gather_in_place}) {
    if (l->has_value() && !((*l)->bytes_per_s > 0)) return "link bandwidths must be positive";
    if (l->has_value() && !((*l)->latency_s >= 0)) return "link latencies must not be negative";
  }
  return nullptr;
}

//! Where group `g` of setup `s` sits (rank r on node r / gpus_per_node; shard groups are
//! consecutive ranks, replica groups every G-th rank). Preconditions: placement_problem() is null.
constexpr placement place(const setup& s, comm_group g, const cluster& c) noexcept {
  const std::uint64_t gpn = c.gpus_per_node;
  const std::uint64_t P = group_size(s, g);
  switch (g) {
    case comm_group::world:
    case comm_group::shard:
      return {P, std::min(P, gpn)};
    case comm_group::replica: {
      const std::uint64_t G = s.shard_group();
      return {P, G >= gpn ? 1 : std::min(P, gpn / G)};
    }
  }
  return {P, 1};
}

namespace detail {
constexpr std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) noexcept {
  return b == 0 ? 0 : (a + b - 1) / b;
}
}  // namespace detail

//! A flat ring's time on one kind of link as t = a·α + b·β: `a` messages and `b` bytes in
//! sequence (the formulas of the file comment). The calibration (plan/calibrate.hpp) fits α and
//! β against these coefficients; the model evaluates them.
struct ring_terms {
  double a = 0.0;  //!< messages in sequence (ring steps)
  double b = 0.0;  //!< bytes in sequence (bytes of all ring steps)
};

//! The coefficients of collective `op` of `count` elements of `e` bytes over a ring of p ranks.
constexpr ring_terms ring_coefficients(collective op, std::uint64_t count, std::uint64_t e,
                                       std::uint64_t p) noexcept {
  if (p <= 1) return {};
  const double steps = static_cast<double>(p - 1);
  switch (op) {
    case collective::reduce_scatter:
    case collective::all_gather:
    case collective::all_to_all:
      return {steps, steps * static_cast<double>(count * e)};
    case collective::all_reduce:
      return {2.0 * steps, 2.0 * steps * static_cast<double>(detail::ceil_div(count, p) * e)};
    case collective::broadcast:
      return {steps, static_cast<double>(count * e)};
    case collective::barrier:
      return {steps, 0.0};
  }
  return {};
}

namespace detail {
//! Flat ring over p ranks on one kind of link.
constexpr double ring_time(collective op, std::uint64_t count, std::uint64_t e, std::uint64_t p,
                           const link& l) noexcept {
  const ring_terms t = ring_coefficients(op, count, e, p);
  return t.a * l.latency_s + t.b / l.bytes_per_s;
}
}  // namespace detail

//! The slowest link a flat ring of collective `op` over `where` crosses.
constexpr link bottleneck(const placement& where, const cluster& c,
                          collective op = collective::barrier, bool in_place = false) noexcept {
  const link intra = intra_link(c, op, in_place);
  if (where.nodes() <= 1) return intra;
  return {std::max(intra.latency_s, c.inter.latency_s),
          std::min(intra.bytes_per_s, c.inter.bytes_per_s)};
}

//! Seconds one collective takes (see the file comment). `count` follows NCCL: per rank for
//! reduce-scatter/all-gather/all-to-all, the whole array for all-reduce/broadcast.
constexpr double collective_time(collective op, std::uint64_t count, std::uint64_t elem_bytes,
                                 const placement& where, const cluster& c,
                                 algorithm a = algorithm::ring, bool in_place = false) noexcept {
  const std::uint64_t g = where.per_node, m = where.nodes();  // g members on each of m nodes
  const bool two_level = a == algorithm::hierarchical && g > 1 && m > 1 &&
                         (op == collective::reduce_scatter || op == collective::all_gather ||
                          op == collective::all_reduce);
  if (!two_level) {
    return detail::ring_time(op, count, elem_bytes, where.size, bottleneck(where, c, op, in_place));
  }
  if (op == collective::all_reduce) {
    const std::uint64_t chunk = detail::ceil_div(count, g);
    return detail::ring_time(collective::reduce_scatter, chunk, elem_bytes, g,
                             intra_link(c, collective::reduce_scatter, in_place)) +
           detail::ring_time(collective::all_reduce, chunk, elem_bytes, m, c.inter) +
           detail::ring_time(collective::all_gather, chunk, elem_bytes, g,
                             intra_link(c, collective::all_gather, in_place));
  }
  return detail::ring_time(op, m * count, elem_bytes, g, intra_link(c, op, in_place)) +
         detail::ring_time(op, count, elem_bytes, m, c.inter);
}

//! Seconds of communication per optimizer step for setup `s` on cluster `c`: the sum over the
//! step's collectives (plan/comm.hpp) of their times. Preconditions: invalid_reason(s) and
//! placement_problem(s, c) are null.
constexpr double comm_time_per_step(const setup& s, std::span<const unit> units, const cluster& c,
                                    algorithm a = algorithm::ring) {
  double t = 0.0;
  for_each_collective(s, units, [&](const collective_call& call) {
    t += static_cast<double>(call.repeat) * collective_time(call.op, call.count, call.elem_bytes,
                                                            place(s, call.group, c), c, a,
                                                            call.in_place);
  });
  return t;
}

//! As above, for a model of `psi` elements in one unit.
constexpr double comm_time_per_step(const setup& s, std::uint64_t psi, const cluster& c,
                                    algorithm a = algorithm::ring) {
  const unit one[1] = {unit{psi}};
  return comm_time_per_step(s, std::span<const unit>(one), c, a);
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
