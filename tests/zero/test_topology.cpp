// topology used alone: plain ZeRO shards over all ranks; hybrid sharding shards within groups of
// G consecutive ranks and replicates across the R = N / G groups (docs/accounting.md, "Hybrid
// sharding"). Checked by gathering the world ranks of each group, by the errors for group sizes
// that do not tile the ranks, and by hybrid ZeRO-2 assembled from the components over the
// topology's groups (shard_grads + reduce_replicas, step_control, shard_optimizer,
// replicated_params) against the unsharded reference and the specification's byte counts.
#include "zero/component_support.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using namespace shardkit;
using test::comp::checks;
using test::comp::mcase;
using test::comp::spec_layout;

namespace {

// The world ranks of the members of `group`, in the group's rank order.
template <class Comm>
std::vector<int> members(Comm& group, int world_rank) {
  std::vector<float> mine{static_cast<float>(world_rank)},
      all(static_cast<std::size_t>(group.size()));
  group.all_gather(mine.data(), all.data(), 1);
  return {all.begin(), all.end()};
}

// Hybrid ZeRO-2 from the components on one rank: G ranks per shard group, N / G replicas. bf16
// working parameters, fp32 gradients (exact sums: the result is the unsharded one).
template <class Comm>
std::string hybrid_zero2(Comm& c, const mcase& mc, std::size_t G) {
  checks check;
  const int N = c.size(), r = c.rank();
  const std::uint64_t g = G, R = static_cast<std::uint64_t>(N) / g,
                      me = static_cast<std::uint64_t>(r);
  test::comp::model_values mv(mc);
  const param_registry reg(mv.spec);
  topology<Comm> topo(c, G);
  Comm& shard_group = topo.shard_group();
  Comm* replicas = topo.replica_group();
  check(topo.hybrid() == (R > 1 || G < static_cast<std::uint64_t>(N)), "hybrid() is ",
        topo.hybrid());
  const spec_layout L = test::comp::make_spec(mc.sizes, test::comp::unit_starts(mc), g);
  const flat_layout layout(mc.sizes, reg.unit_starts(), G);
  const auto shard = static_cast<std::size_t>(topo.shard_rank());
  shard_grads<Comm, float> grads(shard_group, layout, shard, reg);
  replicated_params<Comm, bf16> params(shard_group, layout, shard, reg);
  shard_optimizer<host_space, adamw, bf16, float> opt(
      layout, shard, reg.param_groups(), param_groups<adam_options>(test::comp::adam_groups()));
  step_control_options so;
  so.report_grad_norm = true;
  step_control<host_space> control(so);
  for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
    params.load(i, mv.init[i].data(), dtype::f32);
    opt.load(i, mv.init[i]);
  }
  auto reference = test::comp::reference_for(mc, true);
  for (std::uint64_t t = 1; t <= 3; ++t) {
    c.barrier();
    const traffic_ledger w0 = c.traffic(), s0 = shard_group.traffic();
    const traffic_ledger r0 = replicas ? replicas->traffic() : traffic_ledger{};
    for (std::size_t i = mc.sizes.size(); i-- > 0;)
      grads.add(i, test::comp::grad_of(mc, i, t, r, 0));
    grads.finish();
    if (replicas) grads.reduce_replicas(*replicas);
    traffic_ledger ctl_bytes;
    const auto ctl = control.template exchange<float>(
        c, [&](auto&& f) { grads.for_each_owned(f); }, false, 0, R, ctl_bytes);
    std::vector<double> mean = test::comp::reduced<float>(mc, t, 0, N, 1, false);
    double sum_sq = 0;
    for (auto& x : mean) {
      sum_sq += x * x;
      x /= N;
    }
    // The statistics count every element once, not once per replica (up to the documented
    // truncation of fp32 gradients to 16 significant bits; these need at most 11).
    check(ctl.norm_squared == sum_sq, "step ", t, ": norm² ", ctl.norm_squared, ", expected ",
          sum_sq);
    opt.step(grads.gradients(), params.working(), 1.0f / static_cast<float>(N));
    params.after_step(true);
    grads.reset();
    c.barrier();
    if (replicas) replicas->barrier();
    shard_group.barrier();
    // Bytes: reduce-scatter (fp32) and all-gather (bf16) of every group in the shard group, one
    // all-reduce of the fp32 shard across the replicas, nothing else on the world.
    std::uint64_t want_shard = 0;
    for (const auto& q : L.groups) {
      want_shard +=
          test::comp::rs_or_ag_bytes(q.shard, g, 4) + test::comp::rs_or_ag_bytes(q.shard, g, 2);
    }
    const std::uint64_t want_rep = R > 1 ? test::comp::ar_bytes(L.S, R, me / g, 4) : 0;
    const bool same_world = &shard_group == &c;
    const std::uint64_t got_shard = shard_group.traffic().since(s0).total_bytes_sent();
    const std::uint64_t got_rep = replicas ? replicas->traffic().since(r0).total_bytes_sent() : 0;
    const std::uint64_t got_world = c.traffic().since(w0).total_bytes_sent();
    const std::uint64_t control_sent = ctl_bytes.total_bytes_sent();
    check(got_shard == want_shard + (same_world ? control_sent : 0), "step ", t,
          ": the shard group sent ", got_shard, " bytes; expected ", want_shard);
    check(got_rep == want_rep, "step ", t, ": the replica group sent ", got_rep,
          " bytes; expected ", want_rep);
    check(got_world == (same_world ? want_shard : 0) + control_sent, "step ", t,
          ": the world sent ", got_world, " bytes besides");
    reference.step(mean);
  }
  std::vector<float> master(L.S * g);
  shard_group.all_gather(opt.master().data(), master.data(), L.S);
  for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
    const auto v = params.view(i);
    for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
      const float x = master[L.owner(i, k) * L.S + L.shard_offset(i, k)];
      const double want = reference.p[L.flat_offset[i] + k];
      check(std::fabs(x - want) <= 1e-6, "p", i, "[", k, "] = ", x, ", the reference says ", want);
      check(v[k].bits == bf16(x).bits, "working p", i, "[", k, "] is not the rounded master");
    }
  }
  return check.failure;
}

}  // namespace

TEMPLATE_TEST_CASE("topology alone: plain ZeRO shards over every rank", "[components][topology]",
                   SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n);
  const auto per_rank = World::run(n, [&](Comm& c) -> std::string {
    checks check;
    for (std::size_t G : {std::size_t{0}, static_cast<std::size_t>(n)}) {
      topology<Comm> t(c, G);
      check(!t.hybrid() && &t.shard_group() == &c && &t.world() == &c &&
                t.replica_group() == nullptr && t.shard_comm() == nullptr,
            "G = ", G, ": not plain ZeRO over the world");
      check(t.rank() == c.rank() && t.ranks() == n && t.shard_rank() == c.rank() &&
                t.shard_size() == n && t.replicas() == 1 && t.replica_rank() == 0,
            "G = ", G, ": rank ", t.rank(), " of ", t.ranks(), ", shard rank ", t.shard_rank(),
            " of ", t.shard_size(), ", replicas ", t.replicas());
    }
    return check.failure;
  });
  test::require_all_ok(per_rank);
}

TEMPLATE_TEST_CASE("topology alone: hybrid shard and replica groups hold the right ranks",
                   "[components][topology][hybrid]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const auto [n, G] = GENERATE(std::pair{4, 2}, std::pair{4, 1}, std::pair{6, 3}, std::pair{6, 2},
                               std::pair{8, 4}, std::pair{8, 2});
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, G);
  const auto per_rank = World::run(n, [&](Comm& c) -> std::string {
    checks check;
    const int r = c.rank(), R = n / G;
    topology<Comm> t(c, static_cast<std::size_t>(G));
    check(t.hybrid() && t.shard_comm() == &t.shard_group() && t.replica_group() != nullptr,
          "not hybrid");
    check(t.shard_rank() == r % G && t.shard_size() == G && t.replicas() == R &&
              t.replica_rank() == r / G,
          "shard rank ", t.shard_rank(), " of ", t.shard_size(), ", replica ", t.replica_rank(),
          " of ", t.replicas());
    // Shard group ⌊r/G⌋: the G consecutive ranks; replica group r mod G: stride G.
    std::vector<int> want_shard, want_replica;
    for (int j = 0; j < G; ++j) want_shard.push_back(r / G * G + j);
    for (int q = 0; q < R; ++q) want_replica.push_back(r % G + q * G);
    check(members(t.shard_group(), r) == want_shard && t.shard_group().rank() == r % G, "rank ", r,
          "'s shard group is not ranks ", want_shard.front(), "..", want_shard.back());
    check(members(*t.replica_group(), r) == want_replica && t.replica_group()->rank() == r / G,
          "rank ", r, "'s replica group is not ranks ", r % G, " + k·", G);
    return check.failure;
  });
  test::require_all_ok(per_rank);
}

TEMPLATE_TEST_CASE("topology alone: a shard group size that does not divide the ranks is refused",
                   "[components][topology][errors]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const auto [n, G] = GENERATE(std::pair{6, 4}, std::pair{4, 3}, std::pair{3, 2});
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, G);
  test::comp::require_all_contain(
      test::comp::errors_on<World>(
          n, [&](Comm& c) { topology<Comm> t(c, static_cast<std::size_t>(G)); }),
      "hybrid sharding: shard_group_size = " + std::to_string(G) + " does not divide the " +
          std::to_string(n) + " ranks (every shard group must have the same size)");
}

TEMPLATE_TEST_CASE("hybrid ZeRO-2 assembled over the topology's groups matches the reference",
                   "[components][topology][hybrid][assembled]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const auto [n, G] =
      GENERATE(std::pair{2, 1}, std::pair{4, 2}, std::pair{4, 4}, std::pair{6, 3}, std::pair{8, 2});
  const auto mc = test::comp::models()[GENERATE(0u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, G, mc.name);
  test::require_all_ok(
      World::run(n, [&](Comm& c) { return hybrid_zero2(c, mc, static_cast<std::size_t>(G)); }));
}
