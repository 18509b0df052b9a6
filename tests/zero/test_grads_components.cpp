// The gradient components used alone: full_grads (stages 0 and 1: all-reduce or reduce-scatter
// of a full buffer, micro-batches accumulated locally) and shard_grads (ZeRO-2 buckets reduced as
// they fill, micro-batches reduced into the shard, ZeRO-3 units bracketed by begin_group /
// end_group). Each is driven by hand and checked against sums computed from the independent
// gradient generator with the roundings the specification prescribes, against the layout sizes
// and byte counts of docs/accounting.md computed in the test, and for the misuse each must refuse
// on every rank. Then ZeRO-0/1/2 assembled from them (with replicated_params and
// shard_optimizer) against the unsharded reference and each other.
#include "zero/component_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

using namespace shardkit;
using test::comp::checks;
using test::comp::mcase;
using test::comp::spec_layout;

namespace {

// Visit counts of the elements of a rank's buffer that for_each_owned(f) hands out.
template <class Comp>
std::vector<float> visits(const Comp& comp, const void* base, std::size_t size) {
  using G = typename Comp::grad_type;
  std::vector<float> v(size, 0.0f);
  comp.for_each_owned([&](const G* p, std::size_t count) {
    const auto at = static_cast<std::size_t>(p - static_cast<const G*>(base));
    for (std::size_t j = 0; j < count; ++j) v.at(at + j) += 1.0f;
  });
  return v;
}

// full_grads on one rank: two steps of K micro-batches, handed over in varying orders (the
// second step's first micro-batch written in place through view()), reduced once per step.
template <class G, class Comm>
std::string full_grads_by_hand(Comm& c, const mcase& mc, full_grads_reduction mode,
                               const std::vector<std::size_t>& starts, std::size_t align, int K) {
  checks check;
  const int N = c.size(), r = c.rank();
  const auto n = static_cast<std::uint64_t>(N);
  const bool all_reduce = mode == full_grads_reduction::all_reduce;
  const std::size_t P = mc.sizes.size();
  test::comp::model_values mv(mc);
  const param_registry reg(mv.spec);
  // Stage 0: a 1-way layout (Ψ elements, no padding); stage 1: sharded over the ranks.
  const spec_layout L = all_reduce ? test::comp::make_spec(mc.sizes, {}, 1)
                                   : test::comp::make_spec(mc.sizes, starts, n, align);
  const flat_layout layout =
      all_reduce ? flat_layout(mc.sizes, {}, 1) : flat_layout(mc.sizes, starts, c.size(), align);
  const std::size_t shard = all_reduce ? 0 : static_cast<std::size_t>(r);
  memory_ledger mem;
  collective_log log;
  full_grads<Comm, G> fg(c, layout, shard, mode, reg, &mem, &log);
  const std::uint64_t g = sizeof(G);
  check(mem.current(memory_category::grads) == g * L.padded(), "the gradient buffer holds ",
        mem.current(memory_category::grads), " bytes; g·", all_reduce ? "Ψ" : "N·S", " = ",
        g * L.padded());
  check(fg.gradients().size == L.padded() && fg.gradients().coords == flat_coords::full,
        "gradients() is not the full buffer of ", L.padded(), " elements");

  for (std::uint64_t t = 1; t <= 2; ++t) {
    for (int mb = 0; mb < K; ++mb) {
      for (std::size_t j = 0; j < P; ++j) {
        const std::size_t i = mb % 2 == 0 ? j : P - 1 - j;  // any order
        const auto grad = test::comp::grad_of(mc, i, t, r, mb);
        if (t == 2 && mb == 0) {  // written in place
          auto v = fg.view(i);
          check(v.size() == mc.sizes[i], "view(", i, ") has ", v.size(), " elements");
          for (std::size_t k = 0; k < v.size(); ++k) v[k] = from_float<G>(grad[k]);
        } else {
          fg.add(i, grad);
        }
      }
    }
    const traffic_ledger before = c.traffic();
    const std::uint64_t logged = log.traffic().total_bytes_sent();
    fg.reduce();
    c.barrier();
    std::uint64_t want = 0;
    if (all_reduce) {
      want = L.psi != 0 ? test::comp::ar_bytes(L.psi, n, static_cast<std::uint64_t>(r), g) : 0;
    } else {
      for (const auto& q : L.groups) want += test::comp::rs_or_ag_bytes(q.shard, n, g);
    }
    const std::uint64_t sent = c.traffic().since(before).total_bytes_sent();
    check(sent == want, "step ", t, ": reduce() sent ", sent, " bytes; the specification says ",
          want);
    check(log.traffic().total_bytes_sent() - logged == want, "step ", t, ": the log recorded ",
          log.traffic().total_bytes_sent() - logged, " bytes, ", want, " were sent");

    const std::vector<double> total = test::comp::reduced<G>(mc, t, 0, N, K, true);
    const std::vector<double> local = test::comp::reduced<G>(mc, t, r, r + 1, K, true);
    const auto grads = fg.gradients();
    std::vector<bool> is_true(L.padded(), false);
    for (std::size_t i = 0; i < P; ++i) {
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
        const std::uint64_t at = L.full_offset(i, k);
        is_true[at] = true;
        // All-reduce: every element summed. Reduce-scatter: this rank's slices summed, the rest
        // keeps the rank's own accumulated gradient.
        const bool mine = all_reduce || L.owner(i, k) == static_cast<std::uint64_t>(r);
        const double want_v = mine ? total[L.flat_offset[i] + k] : local[L.flat_offset[i] + k];
        check(static_cast<double>(static_cast<float>(grads.data[at])) == want_v, "step ", t, ": p",
              i, "[", k, "] = ", static_cast<float>(grads.data[at]), ", expected ", want_v,
              mine ? " (the sum over ranks)" : " (this rank's own gradient)");
      }
    }
    for (std::uint64_t e = 0; e < L.padded(); ++e) {
      if (!is_true[e]) {
        check(static_cast<float>(grads.data[e]) == 0.0f, "padding element ", e, " is not zero");
      }
    }
    // for_each_owned: over all ranks every true element exactly once, padding never.
    std::vector<float> seen = visits(fg, grads.data, grads.size);
    c.all_reduce(seen.data(), seen.data(), seen.size(), reduce_op::sum);
    for (std::uint64_t e = 0; e < L.padded(); ++e) {
      check(seen[e] == (is_true[e] ? 1.0f : 0.0f), "for_each_owned visits element ", e, " ",
            seen[e], " times over all ranks");
    }
    fg.reset();
    for (std::uint64_t e = 0; e < L.padded(); ++e) {
      check(static_cast<float>(fg.gradients().data[e]) == 0.0f, "reset() left element ", e);
    }
  }
  return check.failure;
}

// shard_grads on one rank: two steps of K micro-batches, every gradient handed over in backward
// order (as backward produces them); with `units`, each unit bracketed by begin_group/end_group.
template <class G, class Comm>
std::string shard_grads_by_hand(Comm& c, const mcase& mc, std::size_t bucket, std::size_t B, int K,
                                bool units) {
  checks check;
  const int N = c.size(), r = c.rank();
  const auto n = static_cast<std::uint64_t>(N);
  const auto me = static_cast<std::uint64_t>(r);
  const std::size_t P = mc.sizes.size();
  test::comp::model_values mv(mc);
  const param_registry reg(mv.spec);
  const auto starts =
      bucket != 0 ? test::comp::bucket_starts(mc.sizes, bucket) : test::comp::unit_starts(mc);
  const spec_layout L = test::comp::make_spec(mc.sizes, starts, n);
  const flat_layout layout = bucket != 0 ? flat_layout::bucketed(mc.sizes, c.size(), bucket)
                                         : flat_layout(mc.sizes, reg.unit_starts(), c.size());
  memory_ledger mem;
  collective_log log;
  shard_grads_options o;
  o.grad_buffers = B;
  o.groups_are_units = units;
  shard_grads<Comm, G> sg(c, layout, me, reg, o, &mem, &log);
  const std::uint64_t g = sizeof(G);
  check(layout.num_groups() == L.groups.size(), "the layout has ", layout.num_groups(),
        " groups, the specification ", L.groups.size());
  for (std::size_t q = 0; q < L.groups.size() && q < layout.num_groups(); ++q) {
    check(sg.expected(q) == L.groups[q].nonempty, "group ", q, " expects ", sg.expected(q),
          " gradients, it has ", L.groups[q].nonempty, " parameters with elements");
  }
  // The parameter whose gradient completes its group: the first one with elements (gradients
  // come last parameter first).
  auto completes = [&](std::size_t i) {
    if (mc.sizes[i] == 0) return false;
    const auto& q = L.group_of_param(i);
    for (std::size_t j = q.first; j < i; ++j) {
      if (mc.sizes[j] != 0) return false;
    }
    return true;
  };

  for (std::uint64_t t = 1; t <= 2; ++t) {
    const traffic_ledger before = c.traffic();
    for (int mb = 0; mb < K; ++mb) {
      std::size_t open_unit = reg.num_units();
      for (std::size_t i = P; i-- > 0;) {
        const std::size_t u = reg.unit_of(i);
        if (units && u != open_unit) {
          sg.begin_group(u);
          open_unit = u;
        }
        const bool issued = sg.add(i, test::comp::grad_of(mc, i, t, r, mb));
        check(issued == completes(i), "step ", t, ": add(", i, ") returned ", issued,
              "; it completes its group: ", completes(i));
        if (units && i == reg.unit_begin(u)) {
          // the last gradient already issued the unit's reduce-scatter
          check(!sg.end_group(u), "end_group(", u, ") issued a second reduce-scatter");
        }
      }
    }
    sg.finish();
    c.barrier();
    std::uint64_t want = 0;
    for (const auto& q : L.groups) want += K * test::comp::rs_or_ag_bytes(q.shard, n, g);
    const std::uint64_t sent = c.traffic().since(before).total_bytes_sent();
    check(sent == want, "step ", t, " sent ", sent, " bytes; K·Σ (N-1)·S_g·g = ", want);
    for (std::size_t q = 0; q < L.groups.size(); ++q) {
      const std::size_t want_rounds = L.groups[q].psi != 0 ? static_cast<std::size_t>(K) : 0;
      check(sg.rounds(q) == want_rounds, "group ", q, " was reduced ", sg.rounds(q),
            " times; expected ", want_rounds);
    }

    const std::vector<double> total = test::comp::reduced<G>(mc, t, 0, N, K, false);
    const auto shard = sg.gradients();
    check(shard.size == L.S && shard.coords == flat_coords::shard, "gradients() has ", shard.size,
          " elements in ", name(shard.coords), " coordinates; expected the shard of S = ", L.S);
    std::vector<bool> is_true(L.S, false);
    std::uint64_t owned = 0;
    for (std::size_t i = 0; i < P; ++i) {
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
        if (L.owner(i, k) != me) continue;
        const std::uint64_t at = L.shard_offset(i, k);
        is_true[at] = true;
        ++owned;
        const double want_v = total[L.flat_offset[i] + k];
        check(static_cast<double>(static_cast<float>(shard.data[at])) == want_v, "step ", t, ": p",
              i, "[", k, "] = ", static_cast<float>(shard.data[at]), " in the shard, expected ",
              want_v);
      }
    }
    for (std::uint64_t e = 0; e < L.S; ++e) {
      if (!is_true[e]) {
        check(static_cast<float>(shard.data[e]) == 0.0f, "padding element ", e, " of the shard");
      }
    }
    const std::vector<float> seen = visits(sg, shard.data, shard.size);
    for (std::uint64_t e = 0; e < L.S; ++e) {
      check(seen[e] == (is_true[e] ? 1.0f : 0.0f), "for_each_owned visits shard element ", e, " ",
            seen[e], " times");
    }
    (void)owned;
    sg.reset();
  }
  // Bytes held: the shard (g·S), B staging buffers of the largest group (g·N·max S_g), and with
  // K >= 2 one scratch slice per staging buffer that received a later micro-batch.
  const std::uint64_t smax = L.max_shard();
  const std::uint64_t later = static_cast<std::uint64_t>(K - 1) * L.nonempty_groups();
  check(mem.current(memory_category::grads) == g * L.S, "the shard holds ",
        mem.current(memory_category::grads), " bytes; g·S = ", g * L.S);
  check(mem.peak(memory_category::grads) == g * L.S, "gradient storage peaked above the shard");
  check(mem.peak(memory_category::grad_buckets) == B * g * n * smax, "staging peaked at ",
        mem.peak(memory_category::grad_buckets), " bytes; B·g·N·max S_g = ", B * g * n * smax);
  check(mem.peak(memory_category::comm_scratch) == std::min<std::uint64_t>(B, later) * g * smax,
        "scratch peaked at ", mem.peak(memory_category::comm_scratch),
        " bytes; min(B, (K-1)·U)·g·max S_g = ", std::min<std::uint64_t>(B, later) * g * smax);
  return check.failure;
}

}  // namespace

TEMPLATE_TEST_CASE("full_grads alone: all-reduce (stage 0) and reduce-scatter (stage 1)",
                   "[components][full_grads]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  const auto mc = test::comp::models()[GENERATE(0u, 1u, 2u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, mc.name);
  auto run = [&](auto body) { test::require_all_ok(World::run(n, body)); };
  const auto units = test::comp::unit_starts(mc);
  SECTION("all-reduce over a 1-way layout, fp32 and bf16, 1 and 3 micro-batches") {
    run([&](Comm& c) {
      return full_grads_by_hand<float>(c, mc, full_grads_reduction::all_reduce, {}, 1, 1);
    });
    run([&](Comm& c) {
      return full_grads_by_hand<bf16>(c, mc, full_grads_reduction::all_reduce, {}, 1, 3);
    });
  }
  SECTION("reduce-scatter of one group, of the units, aligned to 4, 1 and 3 micro-batches") {
    run([&](Comm& c) {
      return full_grads_by_hand<float>(c, mc, full_grads_reduction::reduce_scatter, {}, 1, 1);
    });
    run([&](Comm& c) {
      return full_grads_by_hand<bf16>(c, mc, full_grads_reduction::reduce_scatter, units, 4, 3);
    });
  }
}

TEMPLATE_TEST_CASE("shard_grads alone: buckets reduced as they fill, micro-batches, units",
                   "[components][shard_grads]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  const auto mc = test::comp::models()[GENERATE(0u, 1u, 2u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, mc.name);
  auto run = [&](auto body) { test::require_all_ok(World::run(n, body)); };
  SECTION("the units as buckets, one staging buffer, one micro-batch") {
    run([&](Comm& c) { return shard_grads_by_hand<float>(c, mc, 0, 1, 1, false); });
  }
  SECTION("buckets of 16 elements, two staging buffers, 3 micro-batches (fp32), 2 (bf16)") {
    run([&](Comm& c) { return shard_grads_by_hand<float>(c, mc, 16, 2, 3, false); });
    run([&](Comm& c) { return shard_grads_by_hand<bf16>(c, mc, 16, 2, 2, false); });
  }
  SECTION("buckets of 16 elements, one staging buffer, three micro-batches, bf16") {
    run([&](Comm& c) { return shard_grads_by_hand<bf16>(c, mc, 16, 1, 3, false); });
  }
  SECTION("buckets of 4 elements, one staging buffer, two micro-batches") {
    run([&](Comm& c) { return shard_grads_by_hand<bf16>(c, mc, 4, 1, 2, false); });
  }
  SECTION("ZeRO-3 units bracketed by begin_group and end_group, two micro-batches") {
    run([&](Comm& c) { return shard_grads_by_hand<float>(c, mc, 0, 1, 2, true); });
    run([&](Comm& c) { return shard_grads_by_hand<bf16>(c, mc, 0, 2, 2, true); });
  }
}

// With two staging buffers and one bucket, micro-batch 2 reuses the first buffer while
// micro-batch 1 is still in the second; the shard must still add them as s0 + s1 + s2 (issue
// order), so that 16-bit results do not depend on grad_buffers.
TEMPLATE_TEST_CASE("shard_grads adds a bucket's micro-batches to a bf16 shard in micro-batch order",
                   "[components][shard_grads]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  if (!test::fits<World>(2)) return;
  const mcase one_bucket{"one bucket", {3, 0, 0, 9}, {}};
  test::require_all_ok(World::run(
      2, [&](Comm& c) { return shard_grads_by_hand<bf16>(c, one_bucket, 16, 2, 3, false); }));
}

TEMPLATE_TEST_CASE("the gradient components refuse misuse on every rank",
                   "[components][shard_grads][full_grads][errors]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = 3;
  if (!test::fits<World>(n)) return;
  // Two units: u0 = {p0, p1}, u1 = {p2, p3}.
  const mcase mc{"two units", {4, 6, 2, 5}, {0, 2}};
  auto with_shard_grads = [&](shard_grads_options o, auto misuse) {
    return test::comp::errors_on<World>(n, [&](Comm& c) {
      test::comp::model_values mv(mc);
      const param_registry reg(mv.spec);
      const flat_layout layout(mc.sizes, reg.unit_starts(), c.size());
      shard_grads<Comm, float> sg(c, layout, static_cast<std::size_t>(c.rank()), reg, o);
      misuse(sg, c);
    });
  };
  auto grad = [&](std::size_t i, std::size_t size = 0) {
    return std::vector<float>(size != 0 ? size : mc.sizes[i], 0.25f);
  };
  SECTION("end_group with a gradient missing names the unit and the parameter") {
    shard_grads_options o;
    o.groups_are_units = true;
    test::comp::require_all_contain(with_shard_grads(o,
                                                     [&](auto& sg, Comm&) {
                                                       sg.begin_group(1);
                                                       sg.add(3, grad(3));
                                                       sg.end_group(1);
                                                     }),
                                    "shard_grads::end_group: unit 'u1' finished its backward "
                                    "without the gradients of 'p2'");
    test::comp::require_all_contain(
        with_shard_grads(o,
                         [&](auto& sg, Comm&) {
                           sg.begin_group(1);
                           sg.end_group(1);  // nothing at all
                         }),
        "unit 'u1' finished its backward without the gradients of 'p2', 'p3'");
  }
  SECTION("finish with gradients missing names them") {
    test::comp::require_all_contain(with_shard_grads({},
                                                     [&](auto& sg, Comm&) {
                                                       sg.add(3, grad(3));
                                                       sg.add(2, grad(2));
                                                       sg.add(0, grad(0));
                                                       sg.finish();
                                                     }),
                                    "missing: 'p1'");
  }
  SECTION("gradients of interleaved groups need enough staging buffers") {
    test::comp::require_all_contain(with_shard_grads({},
                                                     [&](auto& sg, Comm&) {
                                                       sg.add(0, grad(0));
                                                       sg.add(2, grad(2));
                                                     }),
                                    "the gradient of parameter 'p2' belongs to bucket 1, but all 1 "
                                    "staging buffer(s) hold incomplete bucket(s) {0}");
    shard_grads_options two;
    two.grad_buffers = 2;
    const auto fine = with_shard_grads(two, [&](auto& sg, Comm&) {
      sg.add(0, grad(0));
      sg.add(2, grad(2));
      sg.add(1, grad(1));
      sg.add(3, grad(3));
      sg.finish();
    });
    for (const auto& m : fine) CHECK(m == "");
  }
  SECTION("a gradient of the wrong size") {
    test::comp::require_all_contain(
        with_shard_grads({}, [&](auto& sg, Comm&) { sg.add(0, grad(0, 3)); }),
        "shard_grads::add: the gradient of parameter 'p0' (#0) has 3 elements, expected 4 (the "
        "parameter's size)");
  }
  SECTION("allow_missing_grads treats missing gradients as zero") {
    const auto per_rank = World::run(n, [&](Comm& c) {
      checks check;
      test::comp::model_values mv(mc);
      const param_registry reg(mv.spec);
      const flat_layout layout(mc.sizes, reg.unit_starts(), c.size());
      const spec_layout L = test::comp::make_spec(mc.sizes, {0, 2}, 3);
      shard_grads_options o;
      o.allow_missing_grads = true;
      o.groups_are_units = true;
      shard_grads<Comm, float> sg(c, layout, static_cast<std::size_t>(c.rank()), reg, o);
      sg.begin_group(1);
      sg.add(3, grad(3));
      check(sg.end_group(1), "end_group(1) did not issue the incomplete unit's reduce-scatter");
      sg.add(0, grad(0));  // p1 and p2 never come
      sg.finish();
      for (std::size_t i = 0; i < 4; ++i) {
        for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
          if (L.owner(i, k) != static_cast<std::uint64_t>(c.rank())) continue;
          const float want = (i == 0 || i == 3) ? 3 * 0.25f : 0.0f;
          check(sg.gradients().data[L.shard_offset(i, k)] == want, "p", i, "[", k,
                "] = ", sg.gradients().data[L.shard_offset(i, k)], ", expected ", want);
        }
      }
      return check.failure;
    });
    test::require_all_ok(per_rank);
  }
  SECTION("construction: staging buffers, layouts that do not fit the communicator or registry") {
    shard_grads_options none;
    none.grad_buffers = 0;
    test::comp::require_all_contain(with_shard_grads(none, [](auto&, Comm&) {}),
                                    "shard_grads: grad_buffers must be at least 1, got 0");
    auto build = [&](auto make) {
      return test::comp::errors_on<World>(n, [&](Comm& c) {
        test::comp::model_values mv(mc);
        const param_registry reg(mv.spec);
        make(c, reg);
      });
    };
    test::comp::require_all_contain(build([&](Comm& c, const param_registry& reg) {
                                      const flat_layout four(mc.sizes, reg.unit_starts(), 4);
                                      shard_grads<Comm, float> sg(
                                          c, four, static_cast<std::size_t>(c.rank()), reg);
                                    }),
                                    "of a layout of 4 shards over a communicator of 3 ranks");
    test::comp::require_all_contain(build([&](Comm& c, const param_registry& reg) {
                                      const std::vector<std::size_t> three{4, 6, 2};
                                      const flat_layout other(three, {}, 3);
                                      shard_grads<Comm, float> sg(
                                          c, other, static_cast<std::size_t>(c.rank()), reg);
                                    }),
                                    "shard_grads: the layout has 3 parameters, the registry 4");
    test::comp::require_all_contain(
        build([&](Comm& c, const param_registry& reg) {
          const flat_layout two(mc.sizes, {}, 2);
          full_grads<Comm, float> fg(c, two, 0, full_grads_reduction::reduce_scatter, reg);
        }),
        "full_grads: a reduce-scatter layout of 2 shards over a communicator of 3 ranks");
    test::comp::require_all_contain(
        build([&](Comm& c, const param_registry& reg) {
          const flat_layout whole(mc.sizes, {}, 1);
          full_grads<Comm, float> fg(c, whole, 0, full_grads_reduction::all_reduce, reg);
          fg.add(1, grad(1, 2));
        }),
        "full_grads::add: the gradient of parameter 'p1' (#1) has 2 elements, expected 6");
  }
}

// A 1-way layout of several groups with an alignment is padded: the all-reduce must cover the
// later groups' elements too (past Ψ in the buffer).
TEST_CASE("full_grads all-reduce sums every element of a padded 1-way layout",
          "[components][full_grads]") {
  const auto last = run_ranks(2, [](thread_comm& c) {
    model_spec m;
    m.add("a", 5);
    m.begin_unit("u1");
    m.add("b", 13);
    const param_registry reg(m);
    const std::vector<std::size_t> sizes{5, 13}, starts{0, 1};
    const flat_layout whole(sizes, starts, 1, 4);  // groups of 8 and 16 elements: 6 of padding
    full_grads<thread_comm, float> fg(c, whole, 0, full_grads_reduction::all_reduce, reg);
    fg.add(0, std::vector<float>(5, 1.0f));
    fg.add(1, std::vector<float>(13, 1.0f));
    fg.reduce();
    return fg.gradients().data[whole.param(1).offset + 12];  // the last element of b
  });
  for (float x : last) REQUIRE(x == 2.0f);
}

TEMPLATE_TEST_CASE("ZeRO-0, 1 and 2 assembled from the gradient components match the reference",
                   "[components][full_grads][shard_grads][assembled]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  const auto mc = test::comp::models()[GENERATE(0u, 1u, 2u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, mc.name);
  using test::comp::assemble;
  using test::comp::assemble_config;
  auto run = [&](auto body) {
    const auto per_rank = World::run(n, body);
    for (std::size_t r = 0; r < per_rank.size(); ++r) {
      INFO("rank " << r);
      REQUIRE(per_rank[r].failure == "");
      REQUIRE(per_rank[r].working_hash == per_rank[0].working_hash);
    }
    return per_rank[0];
  };
  SECTION("bf16 working parameters, fp32 gradients: every stage the same bits") {
    assemble_config cfg;
    const auto s0 = run([&](Comm& c) { return assemble<0, bf16, float>(c, mc, cfg); });
    const auto s1 = run([&](Comm& c) { return assemble<1, bf16, float>(c, mc, cfg); });
    const auto s2 = run([&](Comm& c) { return assemble<2, bf16, float>(c, mc, cfg); });
    assemble_config small = cfg;
    small.bucket = 16;
    small.grad_buffers = 2;
    small.alignment = 4;
    const auto s2b = run([&](Comm& c) { return assemble<2, bf16, float>(c, mc, small); });
    CHECK(s1.working_hash == s0.working_hash);
    CHECK(s2.working_hash == s0.working_hash);
    CHECK(s2b.working_hash == s0.working_hash);
    CHECK(s1.master_hash == s0.master_hash);
    CHECK(s2.master_hash == s0.master_hash);
    CHECK(s2b.master_hash == s0.master_hash);
  }
  SECTION("bf16 gradients, and fp32 with three micro-batches") {
    assemble_config cfg;
    const auto b0 = run([&](Comm& c) { return assemble<0, bf16, bf16>(c, mc, cfg); });
    const auto b2 = run([&](Comm& c) { return assemble<2, bf16, bf16>(c, mc, cfg); });
    CHECK(b2.working_hash == b0.working_hash);  // one micro-batch: the same roundings
    cfg.micro_batches = 3;
    cfg.grad_buffers = 2;
    const auto f0 = run([&](Comm& c) { return assemble<0, float, float>(c, mc, cfg); });
    const auto f1 = run([&](Comm& c) { return assemble<1, float, float>(c, mc, cfg); });
    const auto f2 = run([&](Comm& c) { return assemble<2, float, float>(c, mc, cfg); });
    CHECK(f1.working_hash == f0.working_hash);  // exact sums: every stage the same bits
    CHECK(f2.working_hash == f0.working_hash);
    cfg.grad_buffers = 1;
    run([&](Comm& c) { return assemble<1, bf16, bf16>(c, mc, cfg); });
    run([&](Comm& c) { return assemble<2, bf16, bf16>(c, mc, cfg); });
  }
}
