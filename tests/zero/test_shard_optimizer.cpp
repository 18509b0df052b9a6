// shard_optimizer used alone (ZeRO-1 as a user assembles it): the user's own all-reduce of a
// full padded gradient buffer feeds the sharded optimizer, the user all-gathers the working
// parameters. Checked against the unsharded double-precision reference (support/reference.hpp),
// against the bytes the specification gives for its state (docs/accounting.md), and for every
// misuse that must be refused. Written once over a World: test_components runs it on threads,
// test_components_mpi under mpiexec.
#include "zero/component_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

using namespace shardkit;
using test::comp::checks;
using test::comp::mcase;
using test::comp::spec_layout;

namespace {

// ZeRO-1 by hand on one rank: returns the rank's first failed check. The layout has the groups
// `starts` (one group: ZeRO-1's usual layout) and `align`ment; W working parameters, G
// gradients (the user's all-reduce runs in G).
template <class W, class G, class Opt, class Comm>
std::string zero1_by_hand(Comm& c, const mcase& mc, const std::vector<std::size_t>& starts,
                          std::size_t align, int steps) {
  using opt_t = shard_optimizer<host_space, Opt, W, G>;
  checks check;
  const int N = c.size(), r = c.rank();
  const auto U = static_cast<std::uint64_t>(N);
  const std::size_t P = mc.sizes.size();
  const spec_layout L = test::comp::make_spec(mc.sizes, starts, U, align);
  const spec_layout L1 = test::comp::make_spec(mc.sizes, {}, 1, 1);  // the stage-0 form

  const flat_layout layout(mc.sizes, starts, static_cast<std::size_t>(N), align);
  const flat_layout whole(mc.sizes, {}, 1);
  std::vector<std::size_t> pg(P);
  for (std::size_t i = 0; i < P; ++i) pg[i] = i % 2;
  using options = typename Opt::options;
  const auto groups = test::comp::groups_for<Opt>();
  opt_t opt(layout, static_cast<std::size_t>(r), pg, param_groups<options>(groups));
  opt_t shard_fed(layout, static_cast<std::size_t>(r), pg, param_groups<options>(groups));
  opt_t stage0(whole, 0, pg, param_groups<options>(groups));

  // The user's buffers. Padding is filled with values that must never be read or written: NaN
  // gradients, a sentinel working value.
  const W sentinel = from_float<W>(123.0f);
  std::vector<W> working(L.padded(), sentinel), working_shard(L.S, sentinel),
      working0(L1.padded(), sentinel);
  std::vector<G> grads(L.padded(), from_float<G>(std::numeric_limits<float>::quiet_NaN()));
  std::vector<G> grads_shard(L.S, from_float<G>(std::numeric_limits<float>::quiet_NaN()));
  std::vector<G> grads0(L1.padded());
  std::vector<float> init;
  for (std::size_t i = 0; i < P; ++i) {
    std::vector<float> v(mc.sizes[i]);
    for (std::size_t k = 0; k < v.size(); ++k) {
      v[k] = ref::init_value(i, k);
      working[L.full_offset(i, k)] = from_float<W>(v[k]);
      working0[L1.full_offset(i, k)] = from_float<W>(v[k]);
      if (L.owner(i, k) == static_cast<std::uint64_t>(r)) {
        working_shard[L.shard_offset(i, k)] = from_float<W>(v[k]);
      }
    }
    opt.load(i, v);
    shard_fed.load(i, v);
    stage0.load(i, v);
  }

  auto reference = test::comp::reference_of<Opt>(mc);
  const float scale = 1.0f / static_cast<float>(N);
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t i = 0; i < P; ++i) {
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
        grads[L.full_offset(i, k)] = from_float<G>(ref::grad_value(t, r, i, k));
        grads0[L1.full_offset(i, k)] = grads[L.full_offset(i, k)];
      }
    }
    // The user's own reduction: one all-reduce of the whole padded buffer (padding included).
    c.all_reduce(grads.data(), grads.data(), grads.size(), reduce_op::sum);
    c.all_reduce(grads0.data(), grads0.data(), grads0.size(), reduce_op::sum);
    for (std::size_t i = 0; i < P; ++i) {
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
        if (L.owner(i, k) == static_cast<std::uint64_t>(r)) {
          grads_shard[L.shard_offset(i, k)] = grads[L.full_offset(i, k)];
        }
      }
    }
    opt.step(flat_span<const G>::full(grads.data(), grads.size()),
             flat_span<W>::full(working.data(), working.size()), scale);
    shard_fed.step(flat_span<const G>::shard(grads_shard.data(), grads_shard.size()),
                   flat_span<W>::shard(working_shard.data(), working_shard.size()), scale);
    stage0.step(flat_span<const G>::full(grads0.data(), grads0.size()),
                flat_span<W>::full(working0.data(), working0.size()), scale);
    // Each rank updated its slices; the user's all-gather (in place) brings them to everyone.
    for (const auto& g : L.groups) {
      if (g.shard == 0) continue;
      W* base = working.data() + g.full;
      c.all_gather(base + static_cast<std::uint64_t>(r) * g.shard, base, g.shard);
    }
    // Reference: the mean of the ranks' gradients, summed (and rounded once) in G.
    std::vector<double> mean = test::comp::reduced<G>(mc, t, 0, N, 1, true);
    for (auto& x : mean) x /= N;
    reference.step(mean);
  }
  check(opt.steps() == static_cast<std::uint64_t>(steps), "steps() is ", opt.steps());

  // The fp32 values of every element: the gathered master (16-bit training) or the working copy.
  std::vector<float> master(L.S * U);
  if constexpr (opt_t::has_master) {
    check(opt.master().size() == L.S, "master() has ", opt.master().size(), " elements, S = ", L.S);
    c.all_gather(opt.master().data(), master.data(), L.S);
  }
  const double tolerance = std::is_same_v<Opt, sgd_momentum> ? 1e-5 : 1e-6;
  for (std::size_t i = 0; i < P; ++i) {
    for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
      const std::uint64_t owner = L.owner(i, k), so = L.shard_offset(i, k);
      const W w = working[L.full_offset(i, k)];
      const float value = opt_t::has_master ? master[owner * L.S + so] : static_cast<float>(w);
      const double want = reference.p[L.flat_offset[i] + k];
      check(std::fabs(value - want) <= tolerance, "p", i, "[", k, "] = ", value,
            ", the reference says ", want);
      check(test::comp::bits_of(w) == test::comp::bits_of(from_float<W>(value)), "working p", i,
            "[", k, "] is not the rounded fp32 value");
      // The stage-0 form (every rank steps every element) computes the same bits.
      const W w0 = working0[L1.full_offset(i, k)];
      check(test::comp::bits_of(w0) == test::comp::bits_of(w), "the 1-way optimizer's p", i, "[", k,
            "] differs from the sharded one's");
      if (owner == static_cast<std::uint64_t>(r)) {
        check(test::comp::bits_of(working_shard[so]) == test::comp::bits_of(w),
              "the optimizer fed shard coordinates differs at p", i, "[", k, "]");
        if constexpr (opt_t::has_master) {
          check(std::bit_cast<std::uint32_t>(shard_fed.master()[so]) ==
                    std::bit_cast<std::uint32_t>(opt.master()[so]),
                "master of the shard-fed optimizer differs at p", i, "[", k, "]");
        }
      }
    }
  }
  // Padding is never touched: neither the NaN gradients nor the sentinel working values.
  std::vector<bool> is_true(L.padded(), false);
  for (std::size_t i = 0; i < P; ++i) {
    for (std::size_t k = 0; k < mc.sizes[i]; ++k) is_true[L.full_offset(i, k)] = true;
  }
  for (std::uint64_t e = 0; e < L.padded(); ++e) {
    if (!is_true[e]) {
      check(test::comp::bits_of(working[e]) == test::comp::bits_of(sentinel), "padding element ", e,
            " of the working buffer was written");
    }
  }

  // Bytes held: fp32 master m·S (0 in fp32 training), optimizer state 4·states·S.
  const std::uint64_t m = opt_t::has_master ? 4 : 0, k = 4 * Opt::state_count;
  const auto& mem = opt.memory();
  check(mem.current(memory_category::master_params) == m * L.S, "master holds ",
        mem.current(memory_category::master_params), " bytes, expected ", m * L.S);
  check(mem.current(memory_category::optimizer_moments) == k * L.S, "optimizer state holds ",
        mem.current(memory_category::optimizer_moments), " bytes, expected ", k * L.S);
  check(stage0.memory().current(memory_category::optimizer_moments) == k * L.psi,
        "the 1-way optimizer holds ", stage0.memory().current(memory_category::optimizer_moments),
        " bytes of state, expected ", k * L.psi);
  check(
      mem.current(memory_category::grads) == 0 && mem.current(memory_category::working_params) == 0,
      "the optimizer holds gradient or working-parameter bytes");
  return check.failure;
}

}  // namespace

TEMPLATE_TEST_CASE(
    "shard_optimizer alone: a user's all-reduce feeding ZeRO-1 matches the reference",
    "[components][shard_optimizer]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  const auto mc = test::comp::models()[GENERATE(0u, 1u, 2u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, mc.name);
  auto run = [&](auto body) { test::require_all_ok(World::run(n, body)); };
  const auto units = test::comp::unit_starts(mc);
  SECTION("bf16 working parameters, fp32 gradients, AdamW, one group") {
    run([&](Comm& c) { return zero1_by_hand<bf16, float, adamw>(c, mc, {}, 1, 3); });
  }
  SECTION("bf16 working parameters and gradients, Adam, the units as groups, alignment 4") {
    run([&](Comm& c) { return zero1_by_hand<bf16, bf16, adam>(c, mc, units, 4, 3); });
  }
  SECTION("fp32 working parameters and gradients, AdamW, the units as groups") {
    run([&](Comm& c) { return zero1_by_hand<float, float, adamw>(c, mc, units, 1, 3); });
  }
  SECTION("fp32, SGD with momentum (which, unlike Adam, sees the gradient's scale)") {
    run([&](Comm& c) { return zero1_by_hand<float, float, sgd_momentum>(c, mc, {}, 2, 4); });
  }
}

TEMPLATE_TEST_CASE("shard_optimizer refuses wrong buffers and settings on every rank",
                   "[components][shard_optimizer][errors]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  using opt_t = shard_optimizer<host_space, adamw, bf16, float>;
  const int n = 3;
  if (!test::fits<World>(n)) return;
  const std::vector<std::size_t> sizes{5, 0, 13};
  const std::vector<std::size_t> pg{0, 0, 0};
  // N = 3: S = ceil(18 / 3) = 6, N·S = 18 in one group; with alignment 4, S = 8 and N·S = 24.
  auto with = [&](std::size_t align, auto misuse) {
    return test::comp::errors_on<World>(n, [&](Comm& c) {
      const flat_layout layout(sizes, {}, 3, align);
      opt_t opt(layout, static_cast<std::size_t>(c.rank()), pg,
                param_groups<adam_options>({adam_options{}}));
      misuse(opt);
    });
  };
  std::vector<float> g(24, 0.5f), g_short(6, 0.5f);
  std::vector<bf16> w(24), w_short(6);
  using gspan = flat_span<const float>;
  using wspan = flat_span<bf16>;
  SECTION("a gradient buffer of the wrong size") {
    test::comp::require_all_contain(
        with(4, [&](opt_t& o) { o.step(gspan::full(g.data(), 18), wspan::full(w.data(), 24), 1); }),
        "shard_optimizer::step: the gradient buffer in full coordinates has 18 elements, "
        "expected 24 (N·S, layout.padded_numel())");
  }
  SECTION("a working buffer in the wrong coordinates") {
    test::comp::require_all_contain(
        with(4,
             [&](opt_t& o) { o.step(gspan::full(g.data(), 24), wspan::shard(w.data(), 24), 1); }),
        "the working-parameter buffer in shard coordinates has 24 elements, expected 8 (S, "
        "layout.shard_numel())");
  }
  SECTION("a shard-sized gradient passed as full coordinates") {
    test::comp::require_all_contain(
        with(1,
             [&](opt_t& o) {
               o.step(gspan::full(g_short.data(), 6), wspan::shard(w_short.data(), 6), 1);
             }),
        "the gradient buffer in full coordinates has 6 elements, expected 18");
  }
  SECTION("a null buffer") {
    test::comp::require_all_contain(
        with(1, [&](opt_t& o) { o.step(gspan::full(nullptr, 18), wspan::full(w.data(), 18), 1); }),
        "the gradient buffer is null but should hold 18 elements");
  }
  SECTION("a non-finite gradient scale and a negative learning-rate scale") {
    test::comp::require_all_contain(
        with(1,
             [&](opt_t& o) {
               o.step(gspan::full(g.data(), 18), wspan::full(w.data(), 18), std::nanf(""));
             }),
        "shard_optimizer::step: the gradient scale must be finite, got nan");
    test::comp::require_all_contain(
        with(1,
             [&](opt_t& o) {
               o.step(gspan::full(g.data(), 18), wspan::full(w.data(), 18), 1.0f, -1.0f);
             }),
        "the learning-rate scale must be finite and non-negative, got -1");
  }
  SECTION("a refused step changes nothing") {
    const auto counts = World::run(n, [&](Comm& c) {
      const flat_layout layout(sizes, {}, 3);
      opt_t opt(layout, static_cast<std::size_t>(c.rank()), pg,
                param_groups<adam_options>({adam_options{}}));
      try {
        opt.step(gspan::full(g.data(), 17), wspan::full(w.data(), 18), 1);
      } catch (const invalid_argument&) {
      }
      return opt.steps();
    });
    for (auto s : counts) CHECK(s == 0);
  }
  SECTION("a parameter's initial values of the wrong size") {
    test::comp::require_all_contain(with(1,
                                         [&](opt_t& o) {
                                           std::vector<float> v(4);
                                           o.load(0, v);
                                         }),
                                    "shard_optimizer::load: parameter #0 needs a host tensor of 5 "
                                    "elements, got 4 elements");
  }
  SECTION("construction: a shard outside the layout, parameter groups that do not fit") {
    const auto bad_shard = test::comp::errors_on<World>(n, [&](Comm&) {
      const flat_layout layout(sizes, {}, 3);
      opt_t opt(layout, 3, pg, param_groups<adam_options>({adam_options{}}));
    });
    test::comp::require_all_contain(bad_shard, "shard_optimizer: shard 3 of a layout of 3 shards");
    const auto short_groups = test::comp::errors_on<World>(n, [&](Comm& c) {
      const flat_layout layout(sizes, {}, 3);
      const std::vector<std::size_t> two{0, 0};
      opt_t opt(layout, static_cast<std::size_t>(c.rank()), two,
                param_groups<adam_options>({adam_options{}}));
    });
    test::comp::require_all_contain(short_groups,
                                    "shard_optimizer: 2 parameter groups given for 3 parameters");
    const auto missing_group = test::comp::errors_on<World>(n, [&](Comm& c) {
      const flat_layout layout(sizes, {}, 3);
      const std::vector<std::size_t> uses1{0, 1, 0};
      opt_t opt(layout, static_cast<std::size_t>(c.rank()), uses1,
                param_groups<adam_options>({adam_options{}}));
    });
    test::comp::require_all_contain(missing_group,
                                    "shard_optimizer: parameter #1 is in parameter group 1 but "
                                    "only 1 set(s) of optimizer options were given");
    const auto bad_beta = test::comp::errors_on<World>(n, [&](Comm& c) {
      const flat_layout layout(sizes, {}, 3);
      opt_t opt(layout, static_cast<std::size_t>(c.rank()), pg,
                param_groups<adam_options>({adam_options{.beta1 = 1.0f}}));
    });
    test::comp::require_all_contain(bad_beta, "shard_optimizer: Adam betas must lie in [0, 1)");
  }
}

// A buffer of the wrong size that starts where the previous one did is refused, not stepped as
// if it were whole (step() reuses its plan only for the same buffers).
TEST_CASE("shard_optimizer::step checks the buffer sizes on every call, not only the first",
          "[components][shard_optimizer][errors]") {
  const std::vector<std::size_t> sizes{5, 3};
  const flat_layout layout(sizes, {}, 2);  // S = 4, N·S = 8
  const std::vector<std::size_t> pg{0, 0};
  shard_optimizer<host_space, adamw, float, float> opt(
      layout, 0, pg, param_groups<adam_options>({adam_options{}}));
  std::vector<float> g(8, 0.5f), w(8, 1.0f);
  opt.step(flat_span<const float>::full(g.data(), 8), flat_span<float>::full(w.data(), 8), 1.0f);
  REQUIRE_THROWS_WITH(
      opt.step(flat_span<const float>::full(g.data(), 3), flat_span<float>::full(w.data(), 8),
               1.0f),
      Catch::Contains("the gradient buffer in full coordinates has 3 elements, expected 8"));
}
