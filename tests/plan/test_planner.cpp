// The planner (include/shardkit/plan/) on numbers computed by hand: docs/accounting.md's worked
// examples (as static_asserts: the planner is constexpr), the padding rules, the ZeRO-3 and hybrid
// specifications of docs/accounting.md, the alpha-beta time model and the recommendation.
#include <shardkit/core/layout.hpp>
#include <shardkit/plan/planner.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <vector>

namespace plan = shardkit::plan;
using shardkit::collective;

namespace {

constexpr plan::setup make(int stage, std::uint64_t ranks,
                           plan::precision p = plan::precision::mixed()) {
  plan::setup s;
  s.stage = stage;
  s.ranks = ranks;
  s.bytes = p;
  return s;
}

constexpr std::uint64_t GB = 1'000'000'000;

// ---- docs/accounting.md, bytes held per rank (bf16 + fp32 master + Adam: 16 B/parameter) --
constexpr std::uint64_t psi7 = 7'000'000'000;
static_assert(plan::memory_per_rank(make(0, 8), psi7).model_state().total() == 112 * GB);
static_assert(plan::memory_per_rank(make(1, 8), psi7).model_state().total() == 38'500'000'000);
static_assert(plan::memory_per_rank(make(2, 8), psi7).model_state().total() == 26'250'000'000);
static_assert(plan::memory_per_rank(make(3, 8), psi7).model_state().total() == 14 * GB);

constexpr std::uint64_t psi13 = 13'000'000'000;
static_assert(plan::memory_per_rank(make(1, 16), psi13).model_state().total() == 61'750'000'000);
static_assert(plan::memory_per_rank(make(2, 16), psi13).model_state().total() == 37'375'000'000);
static_assert(plan::memory_per_rank(make(3, 16), psi13).model_state().total() == 13 * GB);

// The MLP 64→256→10 with biases: 19,210 parameters; fp32 master + m + v.
constexpr std::uint64_t mlp_psi = 64 * 256 + 256 + 256 * 10 + 10;
static_assert(mlp_psi == 19'210);
constexpr std::uint64_t master_and_moments(const plan::memory_bytes& m) {
  return m.master_params + m.optimizer_moments;
}
static_assert(master_and_moments(plan::memory_per_rank(make(0, 4), mlp_psi)) == 230'520);
static_assert(plan::summarize(make(1, 4), std::array{plan::unit{mlp_psi}}).shard == 4'803);
static_assert(master_and_moments(plan::memory_per_rank(make(1, 4), mlp_psi)) == 57'636);
static_assert(master_and_moments(plan::memory_per_rank(make(2, 4), mlp_psi)) == 57'636);
static_assert(master_and_moments(plan::memory_per_rank(make(3, 4), mlp_psi)) == 57'636);

// ---- docs/accounting.md, bytes sent per rank per step: 2(N-1)/N·2Ψ (0-2), 1.5× for stage 3 --
static_assert(plan::bytes_sent_per_step(make(0, 8), psi7).total() == 24'500'000'000);
static_assert(plan::bytes_sent_per_step(make(1, 8), psi7).total() == 24'500'000'000);
static_assert(plan::bytes_sent_per_step(make(2, 8), psi7).total() == 24'500'000'000);
static_assert(plan::bytes_sent_per_step(make(3, 8), psi7).total() == 36'750'000'000);
static_assert(2 * plan::bytes_sent_per_step(make(3, 8), psi7).total() ==
              3 * plan::bytes_sent_per_step(make(0, 8), psi7).total());
// The MLP on 4 ranks (stage 2, the README's example): 2·3·4803·2 = 57,636.
static_assert(plan::bytes_sent_per_step(make(2, 4), mlp_psi).total() == 57'636);

// ---- the recommendation: the lowest stage that fits
// ----------------------------------------------
constexpr plan::unit one_7b[] = {{psi7}};
static_assert(plan::plan_all(make(0, 8), one_7b, {}, {80 * GB}).recommended == 1);
static_assert(plan::plan_all(make(0, 8), one_7b, {}, {38'500'000'000}).recommended == 1);
// One byte less and nothing fits: as one unit, ZeRO-2 stages all 14 GB of gradients in one
// bucket (40.25 GB) and ZeRO-3 gathers the whole model (42 GB).
static_assert(plan::plan_all(make(0, 8), one_7b, {}, {38'499'999'999}).recommended == -1);
static_assert(plan::plan_all(make(0, 8), one_7b, {}, {42 * GB}).stages[3].fits);

// The example of README.md and plan/planner.hpp, verbatim.
namespace readme {
namespace plan = shardkit::plan;
constexpr plan::unit model[] = {{7'000'000'000}};  // one entry per unit or bucket
constexpr plan::setup s{.ranks = 8};               // bf16 + fp32 master + AdamW
constexpr auto report = plan::plan_all(s, model, plan::cluster{}, {80'000'000'000});
static_assert(report.recommended == 1 && report.stages[1].memory.total() == 38'500'000'000);
}  // namespace readme

}  // namespace

TEST_CASE("planner: the padded shard S = round_up(ceil(psi / N), alignment), by hand") {
  // docs/accounting.md, "Layout and padding"; each value worked out by hand.
  CHECK(plan::shard_elems(19'210, 4, 1) == 4'803);       // 19210 / 4 = 4802.5
  CHECK(plan::shard_elems(19'210, 4, 8) == 4'808);       // 4803 up to a multiple of 8
  CHECK(plan::shard_elems(19'210, 1, 1) == 19'210);      // one rank holds everything
  CHECK(plan::shard_elems(5, 8, 1) == 1);                // fewer elements than ranks
  CHECK(plan::shard_elems(1, 64, 8) == 8);               // one element, padded to the alignment
  CHECK(plan::shard_elems(1'000'003, 7, 1) == 142'858);  // 142857.57...
  CHECK(plan::shard_elems(1'000'003, 7, 8) == 142'864);  // 17858 x 8
  CHECK(plan::shard_elems(1'000'003, 64, 8) == 15'632);  // 15626 up to 1954 x 8
  CHECK(plan::shard_elems(7'000'000'000, 8, 1) == 875'000'000);
}

TEST_CASE("planner: single-unit memory and traffic equal formulas.hpp's closed forms") {
  // formulas.hpp is what the engine reports as expected_state_bytes(); the planner generalises
  // it and must agree on one group. S comes from the specification (docs/accounting.md), not
  // from plan::shard_elems, which the planner itself uses.
  const auto spec_shard = [](std::uint64_t psi, std::uint64_t n, std::uint64_t a) {
    const std::uint64_t per_rank = (psi + n - 1) / n;  // ceil(psi / N)
    return (per_rank + a - 1) / a * a;                 // rounded up to the alignment
  };
  for (int stage = 0; stage <= 3; ++stage) {
    for (std::uint64_t n : {1u, 2u, 3u, 4u, 7u, 8u, 64u}) {
      for (std::uint64_t psi : {1u, 2u, 5u, 19'210u, 1'000'003u}) {
        for (std::uint64_t a : {1u, 8u}) {
          for (const auto p : {plan::precision::mixed(2), plan::precision::mixed(1),
                               plan::precision::fp32(2), plan::precision::fp32(1)}) {
            auto s = make(stage, n, p);
            s.alignment = a;
            INFO("stage " << stage << " N " << n << " psi " << psi << " alignment " << a);
            const std::uint64_t S = stage == 0 ? psi : spec_shard(psi, n, a);
            CHECK(plan::memory_per_rank(s, psi).model_state() ==
                  plan::model_state_bytes(stage, psi, n, S, p));
            for (std::uint64_t r = 0; r < n; ++r) {
              CHECK(plan::bytes_sent_per_step(s, psi, r).total() ==
                    plan::step_bytes_sent(stage, psi, n, S, p.working_bytes, r));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("planner: precision by dtype and optimizer") {
  STATIC_REQUIRE(
      plan::precision_of(shardkit::dtype::bf16, plan::optimizer_kind::adamw).state_bytes == 8);
  STATIC_REQUIRE(
      plan::precision_of(shardkit::dtype::f16, plan::optimizer_kind::adam).master_bytes == 4);
  STATIC_REQUIRE(
      plan::precision_of(shardkit::dtype::f32, plan::optimizer_kind::sgd_momentum).state_bytes ==
      4);
  constexpr auto f = plan::precision_of(shardkit::dtype::f32, plan::optimizer_kind::adamw);
  STATIC_REQUIRE(f.working_bytes == 4 && f.grad_bytes == 4 && f.master_bytes == 0);
  // fp32 + Adam: 4 + 4 + 0 + 8 = 16 bytes per parameter, like mixed precision.
  STATIC_REQUIRE(plan::memory_per_rank(make(0, 1, f), 10u).total() == 160);
  // bf16 + SGD with momentum: 2 + 2 + 4 + 4 = 12.
  constexpr auto sgd =
      plan::precision_of(shardkit::dtype::bf16, plan::optimizer_kind::sgd_momentum);
  STATIC_REQUIRE(plan::memory_per_rank(make(0, 1, sgd), 10u).total() == 120);
}

TEST_CASE("planner: gradients of their own type (fp32 gradients under bf16 parameters)") {
  using shardkit::dtype;
  // The fp32 master exists iff the working parameters are 16-bit, whatever the gradients.
  STATIC_REQUIRE(plan::precision_of(dtype::bf16, dtype::f32, plan::optimizer_kind::adamw) ==
                 plan::precision{2, 4, 4, 8});
  STATIC_REQUIRE(plan::precision_of(dtype::f32, dtype::bf16, 2) == plan::precision{4, 2, 0, 8});
  STATIC_REQUIRE(plan::precision_of(dtype::f16, dtype::bf16, plan::optimizer_kind::sgd_momentum) ==
                 plan::precision{2, 2, 4, 4});
  STATIC_REQUIRE(plan::precision_of(dtype::bf16, dtype::bf16, 2) ==
                 plan::precision_of(dtype::bf16, 2));
  // 7e9 on 8 ranks, bf16 + fp32 gradients + Adam (2 + 4 + 4 + 8 = 18 bytes per parameter),
  // S = 875e6: stage 0 18Ψ = 126 GB; stage 1 2Ψ + 4Ψ + 12S = 52.5 GB; stage 2 2Ψ + 16S = 28 GB;
  // stage 3 18S = 15.75 GB.
  constexpr auto p = plan::precision_of(dtype::bf16, dtype::f32, plan::optimizer_kind::adamw);
  STATIC_REQUIRE(plan::memory_per_rank(make(0, 8, p), psi7).model_state().total() == 126 * GB);
  STATIC_REQUIRE(plan::memory_per_rank(make(1, 8, p), psi7).model_state().total() ==
                 52'500'000'000);
  STATIC_REQUIRE(plan::memory_per_rank(make(2, 8, p), psi7).model_state().total() == 28 * GB);
  STATIC_REQUIRE(plan::memory_per_rank(make(3, 8, p), psi7).model_state().total() ==
                 15'750'000'000);
  STATIC_REQUIRE(plan::memory_per_rank(make(2, 8, p), psi7).grads == 3'500'000'000);
  // Bytes sent: gradients (all-reduce, reduce-scatter) at 4 bytes, all-gathers at 2.
  //   stage 0: (2Ψ - 2S)·4 = 49 GB; stages 1, 2: 7S·4 + 7S·2 = 36.75 GB; stage 3: 7S·4 + 2·7S·2
  //   = 49 GB.
  STATIC_REQUIRE(plan::bytes_sent_per_step(make(0, 8, p), psi7).total() == 49 * GB);
  STATIC_REQUIRE(plan::bytes_sent_per_step(make(1, 8, p), psi7).reduce_scatter == 24'500'000'000);
  STATIC_REQUIRE(plan::bytes_sent_per_step(make(1, 8, p), psi7).all_gather == 12'250'000'000);
  STATIC_REQUIRE(plan::bytes_sent_per_step(make(2, 8, p), psi7).total() == 36'750'000'000);
  STATIC_REQUIRE(plan::bytes_sent_per_step(make(3, 8, p), psi7).total() == 49 * GB);
  // Stage 2's staging buffer holds fp32 gradients: 4·N·S for one bucket.
  STATIC_REQUIRE(plan::memory_per_rank(make(2, 8, p), psi7).grad_buckets == 28 * GB);
}

TEST_CASE("planner: stage 2 buckets with alignment, staging buffers and micro-batches") {
  // Units {5, 14, 67, 7} on 4 ranks, alignment 4: S_u = 4, 4, 20, 4, S = 32.
  static constexpr plan::unit units[] = {{5}, {14}, {67}, {7}};
  auto s = make(2, 4);
  s.alignment = 4;
  s.grad_buffers = 2;
  s.micro_batches = 3;
  constexpr auto check = [](plan::setup x) {
    const auto l = plan::summarize(x, units);
    const auto m = plan::memory_per_rank(x, units);
    return l.shard == 32 && l.largest_shard == 20 && l.padded() == 128 && l.padding() == 35 &&
           m.working_params == 2 * 4 * 32 && m.grads == 2 * 32 && m.master_params == 4 * 32 &&
           m.optimizer_moments == 8 * 32 && m.grad_buckets == 2 * 2 * 4 * 20 &&
           m.comm_scratch == 2 * 2 * 20 && m.gathered_params == 0;
  };
  CHECK(check(s));
  // Stage 2 reduce-scatters every bucket each micro-batch and all-gathers once: 3·(k+1)·S·2.
  const auto b = plan::bytes_sent_per_step(s, units);
  CHECK(b.reduce_scatter == 3 * 3 * 32 * 2);
  CHECK(b.all_gather == 3 * 32 * 2);
  CHECK(b.all_reduce == 0);
  CHECK(b.reduce_scatter_calls == 3 * 4);
  CHECK(b.all_gather_calls == 4);
  // Stage 1 ignores units: one group of 93 elements, S = round_up(24, 4) = 24; no buckets.
  s.stage = 1;
  const auto m1 = plan::memory_per_rank(s, units);
  CHECK(m1.working_params == 2 * 4 * 24);
  CHECK(m1.grad_buckets == 0);
  CHECK(m1.comm_scratch == 0);
  CHECK(plan::bytes_sent_per_step(s, units).total() == 2 * 3 * 24 * 2);
  // Scratch: only buffers that receive a later micro-batch's bucket. One bucket, two buffers,
  // two micro-batches: the second micro-batch uses buffer 1 only.
  auto one = make(2, 4);
  one.grad_buffers = 2;
  one.micro_batches = 2;
  CHECK(plan::memory_per_rank(one, 100u).comm_scratch == 1 * 2 * 25);
  one.micro_batches = 3;
  CHECK(plan::memory_per_rank(one, 100u).comm_scratch == 2 * 2 * 25);
  one.micro_batches = 1;
  CHECK(plan::memory_per_rank(one, 100u).comm_scratch == 0);
  // Empty units are never reduced and take no staging round.
  constexpr plan::unit with_empty[] = {{3}, {0}, {9}};
  auto e = make(2, 2);
  e.grad_buffers = 4;
  e.micro_batches = 2;
  CHECK(plan::memory_per_rank(e, with_empty).comm_scratch == 2 * 2 * 5);
  CHECK(plan::bytes_sent_per_step(e, with_empty).reduce_scatter_calls == 2 * 2);
}

TEST_CASE("planner: buckets and uniform units") {
  // As flat_layout::bucketed: closed backwards at 16 elements.
  const std::vector<std::uint64_t> sizes{5, 0, 13, 1, 64, 3, 0, 7};
  const auto b = plan::buckets(sizes, 16);
  REQUIRE(b.size() == 2);
  CHECK(b[0].numel == 19);
  CHECK(b[1].numel == 74);
  const std::vector<std::size_t> sz(sizes.begin(), sizes.end());
  const auto layout = shardkit::flat_layout::bucketed(sz, 3, 16);
  REQUIRE(layout.num_groups() == b.size());
  for (std::size_t g = 0; g < b.size(); ++g) CHECK(layout.group(g).numel == b[g].numel);
  CHECK(plan::buckets(sizes, 0).size() == 1);
  CHECK(plan::buckets(sizes, 1).size() == 6);  // zero-size parameters join their neighbour

  const auto u = plan::uniform_units(10, 3);
  REQUIRE(u.size() == 4);
  CHECK((u[0].numel == 3 && u[1].numel == 3 && u[2].numel == 3 && u[3].numel == 1));
  CHECK(plan::uniform_units(7'000'000'000, 200'000'000).size() == 35);
  CHECK(plan::uniform_units(10, 0).size() == 1);
  CHECK(plan::uniform_units(10, 20).size() == 1);
}

TEST_CASE("planner: ZeRO-3 units, prefetch, persistence and resharding (docs/accounting.md)") {
  // Units {100, 10, 300, 50, 8} on 4 ranks: S_u = 25, 3, 75, 13, 2; S = 118. Below 20 elements
  // persist: {10, 8}, Σ S_u = 5; the others are transient, the largest S_u = 75.
  std::array<plan::unit, 5> units{{{100}, {10}, {300}, {50}, {8}}};
  auto s = make(3, 4);
  s.persist_below = 20;
  const auto l = plan::summarize(s, units);
  CHECK(l.shard == 118);
  CHECK(l.persistent_units == 2);
  CHECK(l.persistent_shard == 5);
  CHECK(l.transient_units == 3);
  CHECK(l.largest_transient_shard == 75);

  // Live bound: N·((1 + D)·75 + 5) = 4·155.
  CHECK(plan::live_elems(s, std::span<const plan::unit>(units)) == 620);
  auto m = plan::memory_per_rank(s, units);
  CHECK(m.working_params == 2 * 118);
  CHECK(m.grads == 2 * 118);
  CHECK(m.master_params == 4 * 118);
  CHECK(m.optimizer_moments == 8 * 118);
  CHECK(m.gathered_params == 2 * 620);
  CHECK(m.grad_buckets == 1 * 2 * 4 * 75);
  CHECK(m.comm_scratch == 0);
  CHECK(m.total() == 16 * 118 + 2 * 620 + 2 * 4 * 75);

  // Bytes: transient units AG forward + AG backward + RS: 3·3·(25 + 75 + 13)·2; persistent
  // units one AG + one RS: 2·3·5·2.
  auto b = plan::bytes_sent_per_step(s, units);
  CHECK(b.all_gather == 2 * 3 * 113 * 2 + 3 * 5 * 2);
  CHECK(b.reduce_scatter == 3 * 118 * 2);
  CHECK(b.total() == 3 * 3 * 113 * 2 + 2 * 3 * 5 * 2);
  CHECK(b.all_gather_calls == 3 * 2 + 2);
  CHECK(b.reduce_scatter_calls == 5);

  // Deeper prefetch: the window is capped by the 3 transient units.
  s.prefetch = 5;
  CHECK(plan::live_elems(s, std::span<const plan::unit>(units)) == 4 * (3 * 75 + 5));
  s.prefetch = 0;
  CHECK(plan::live_elems(s, std::span<const plan::unit>(units)) == 4 * (75 + 5));
  s.prefetch = 1;

  // Live limit: the engine prefetches less to stay under it (the bound is capped), and only a
  // limit below the largest unit plus the persistent ones, 4·(75 + 5) = 320 elements, is an
  // error at set-up.
  s.max_live_elems = 400;
  CHECK(plan::live_limit_ok(s, plan::summarize(s, units)));
  CHECK(plan::live_elems(s, std::span<const plan::unit>(units)) == 400);
  s.max_live_elems = 320;
  CHECK(plan::live_limit_ok(s, plan::summarize(s, units)));
  s.max_live_elems = 319;
  CHECK_FALSE(plan::live_limit_ok(s, plan::summarize(s, units)));
  CHECK_FALSE(plan::plan_stage(s, units, {}, {1'000'000'000}).fits);
  s.max_live_elems = 0;

  // The 300-element unit stays gathered from forward to backward: one all-gather less per
  // micro-batch, and it is held in addition to the window.
  units[2].reshard_after_forward = false;
  CHECK(plan::live_elems(s, std::span<const plan::unit>(units)) == 4 * (2 * 75 + 5 + 75));
  b = plan::bytes_sent_per_step(s, units);
  CHECK(b.all_gather == 2 * 3 * 113 * 2 - 3 * 75 * 2 + 3 * 5 * 2);
  CHECK(b.total() == 3 * 3 * 113 * 2 - 3 * 75 * 2 + 2 * 3 * 5 * 2);
  units[2].reshard_after_forward = true;

  // Two micro-batches: transient units gather twice and everything reduce-scatters per
  // micro-batch; persistent units still gather once per step. One staging buffer → one scratch.
  s.micro_batches = 2;
  b = plan::bytes_sent_per_step(s, units);
  CHECK(b.all_gather == 2 * 2 * 3 * 113 * 2 + 3 * 5 * 2);
  CHECK(b.reduce_scatter == 2 * 3 * 118 * 2);
  CHECK(plan::memory_per_rank(s, units).comm_scratch == 2 * 75);

  // No persistent units and resharding on: 3(N−1)·S·w = 1.5× stage 0 when N divides Ψ.
  constexpr plan::unit even[] = {{400}, {800}, {1200}};
  STATIC_REQUIRE(plan::bytes_sent_per_step(make(3, 4), even).total() == 3 * 3 * 600 * 2);
  STATIC_REQUIRE(2 * plan::bytes_sent_per_step(make(3, 4), even).total() ==
                 3 * plan::bytes_sent_per_step(make(0, 4), even).total());
  // One unit per model: the gathered peak is that unit (no second unit to prefetch).
  STATIC_REQUIRE(plan::memory_per_rank(make(3, 8), psi7).gathered_params == 14 * GB);
}

TEST_CASE("planner: hybrid sharding (shard within G, replicate across N/G)") {
  // Memory: the stage with N replaced by G.
  constexpr plan::unit units[] = {{1001}, {37}, {512}};
  for (int stage = 1; stage <= 3; ++stage) {
    for (std::uint64_t g : {1u, 2u, 4u}) {
      auto h = make(stage, 12);
      h.shard_ranks = g;
      h.grad_buffers = 2;
      h.micro_batches = 2;
      h.persist_below = 40;
      auto plain = h;
      plain.ranks = g;
      plain.shard_ranks = 0;
      INFO("stage " << stage << " G " << g);
      CHECK(h.hybrid() == (g != 12));
      CHECK(plan::memory_per_rank(h, units) == plan::memory_per_rank(plain, units));
    }
  }
  // Bytes: Ψ = 1001 on 12 ranks, G = 4, R = 3 (stage 1): S = 251.
  //   reduce-scatter and all-gather in the shard group: 3·251·2 each;
  //   all-reduce of 251 over 3 replicas, chunks 83, 84, 84:
  //   replica 0: 2·251 − 83 − 84 = 335, replica 1: 502 − 84 − 84 = 334, replica 2: 335.
  auto h = make(1, 12);
  h.shard_ranks = 4;
  for (std::uint64_t r = 0; r < 12; ++r) {
    const auto b = plan::bytes_sent_per_step(h, 1001u, r);
    INFO("rank " << r);
    CHECK(b.reduce_scatter == 3 * 251 * 2);
    CHECK(b.all_gather == 3 * 251 * 2);
    CHECK(b.all_reduce == (r / 4 == 1 ? 334u : 335u) * 2);
    CHECK(b.calls() == 3);
  }
  // When R divides S the all-reduce is 2(R−1)/R·S·w: Ψ = 1200, G = 4, S = 300, R = 3: 400·2.
  CHECK(plan::bytes_sent_per_step(h, 1200u).all_reduce == 2 * 2 * 300 * 2 / 3);
  // Stage 2 with 3 micro-batches reduce-scatters each one, all-reduces and gathers once.
  h.stage = 2;
  h.micro_batches = 3;
  const auto b2 = plan::bytes_sent_per_step(h, 1200u);
  CHECK(b2.reduce_scatter == 3 * 3 * 300 * 2);
  CHECK(b2.all_reduce == 800);
  CHECK(b2.all_gather == 3 * 300 * 2);
  // ZeRO-3 hybrid gathers inside the shard group: 3·(G−1)·S_u·w per unit, + the all-reduce.
  h.stage = 3;
  h.micro_batches = 1;
  const auto b3 = plan::bytes_sent_per_step(h, 1200u);
  CHECK(b3.all_gather == 2 * 3 * 300 * 2);
  CHECK(b3.reduce_scatter == 3 * 300 * 2);
  CHECK(b3.all_reduce == 800);
  // A shard group of 1: plain data parallelism over the (padded) shard, no RS/AG.
  h.stage = 1;
  h.shard_ranks = 1;
  const auto b1 = plan::bytes_sent_per_step(h, 1200u);
  CHECK(b1.reduce_scatter + b1.all_gather == 0);
  CHECK(b1.all_reduce == 2 * 1200 * 11 / 12 * 2);
  // Stage 0 ignores the shard group.
  auto s0 = make(0, 12);
  s0.shard_ranks = 4;
  CHECK_FALSE(s0.hybrid());
  CHECK(plan::bytes_sent_per_step(s0, 1200u) == plan::bytes_sent_per_step(make(0, 12), 1200u));
}

TEST_CASE("planner: set-up validation names the problem") {
  auto s = make(1, 8);
  CHECK(plan::invalid_reason(s) == nullptr);
  s.shard_ranks = 3;
  REQUIRE(plan::invalid_reason(s) != nullptr);
  CHECK_THROWS_WITH(plan::validate(s), Catch::Contains("must divide the number of ranks") &&
                                           Catch::Contains("shard_ranks 3"));
  s.shard_ranks = 0;
  s.ranks = 0;
  CHECK_THROWS_AS(plan::validate(s), shardkit::invalid_argument);
  s.ranks = 8;
  s.stage = 4;
  CHECK_THROWS_WITH(plan::validate(s), Catch::Contains("stage must be 0, 1, 2 or 3"));
  s.stage = 2;
  s.grad_buffers = 0;
  CHECK_THROWS_WITH(plan::validate(s), Catch::Contains("grad_buffers"));
  s.grad_buffers = 1;
  s.micro_batches = 0;
  CHECK_THROWS_WITH(plan::validate(s), Catch::Contains("micro_batches"));
  s.micro_batches = 1;
  s.alignment = 0;
  CHECK_THROWS_WITH(plan::validate(s), Catch::Contains("alignment"));

  plan::cluster c;
  auto p = make(1, 12);
  CHECK(plan::placement_problem(p, c) != nullptr);  // 12 ranks on nodes of 8
  p.ranks = 16;
  CHECK(plan::placement_problem(p, c) == nullptr);
  p.shard_ranks = 4;
  CHECK(plan::placement_problem(p, c) == nullptr);
  p.ranks = 24;
  p.shard_ranks = 12;
  CHECK(plan::placement_problem(p, c) != nullptr);  // neither divides a node nor whole nodes
  p.shard_ranks = 8;
  c.inter.bytes_per_s = 0;
  CHECK(plan::placement_problem(p, c) != nullptr);
}

TEST_CASE("time model: alpha-beta ring collectives, computed by hand") {
  plan::cluster c;
  c.gpus_per_node = 8;
  c.intra = {1e-6, 100e9};
  c.inter = {1e-5, 10e9};
  const auto approx = [](double x) { return Approx(x).epsilon(1e-12); };
  const plan::placement node{8, 8}, two_nodes{16, 8}, four_nodes_one_each{4, 1};
  CHECK(node.nodes() == 1);
  CHECK(two_nodes.nodes() == 2);

  // One node: 7 steps of α + c·e·β.
  CHECK(plan::collective_time(collective::reduce_scatter, 1000, 2, node, c) ==
        approx(7 * (1e-6 + 2000 / 100e9)));
  CHECK(plan::collective_time(collective::all_gather, 1000, 2, node, c) ==
        approx(7 * (1e-6 + 2000 / 100e9)));
  // All-reduce of 1001 elements: chunks of at most ⌈1001/8⌉ = 126.
  CHECK(plan::collective_time(collective::all_reduce, 1001, 2, node, c) ==
        approx(14 * (1e-6 + 252 / 100e9)));
  // Broadcast, pipelined chain; barrier.
  CHECK(plan::collective_time(collective::broadcast, 1000, 4, node, c) ==
        approx(7 * 1e-6 + 4000 / 100e9));
  CHECK(plan::collective_time(collective::barrier, 0, 4, node, c) == approx(7e-6));
  CHECK(plan::collective_time(collective::all_reduce, 1000, 2, plan::placement{1, 1}, c) == 0.0);

  // Two nodes, flat ring: the slowest link (α = 1e-5, 10 GB/s) bounds all 15 steps.
  CHECK(plan::collective_time(collective::all_reduce, 1600, 2, two_nodes, c) ==
        approx(30 * (1e-5 + 200 / 10e9)));
  // Hierarchical all-reduce: intra RS of 200-element chunks, inter all-reduce of 200 over 2
  // nodes (chunks of 100), intra AG.
  CHECK(plan::collective_time(collective::all_reduce, 1600, 2, two_nodes, c,
                              plan::algorithm::hierarchical) ==
        approx(7 * (1e-6 + 400 / 100e9) + 2 * (1e-5 + 200 / 10e9) + 7 * (1e-6 + 400 / 100e9)));
  // 1601 elements: intra chunks of ⌈1601/8⌉ = 201, inter chunks of ⌈201/2⌉ = 101.
  CHECK(plan::collective_time(collective::all_reduce, 1601, 2, two_nodes, c,
                              plan::algorithm::hierarchical) ==
        approx(2 * 7 * (1e-6 + 402 / 100e9) + 2 * (1e-5 + 202 / 10e9)));
  // Hierarchical reduce-scatter of 100 per rank: intra with 2·100 per rank, then inter.
  CHECK(plan::collective_time(collective::reduce_scatter, 100, 2, two_nodes, c,
                              plan::algorithm::hierarchical) ==
        approx(7 * (1e-6 + 400 / 100e9) + 1 * (1e-5 + 200 / 10e9)));
  // One member per node: hierarchical is the flat inter-node ring.
  CHECK(plan::collective_time(collective::all_gather, 100, 2, four_nodes_one_each, c,
                              plan::algorithm::hierarchical) == approx(3 * (1e-5 + 200 / 10e9)));
  // All-to-all has no two-level form here: the flat ring.
  CHECK(plan::collective_time(collective::all_to_all, 100, 2, two_nodes, c,
                              plan::algorithm::hierarchical) == approx(15 * (1e-5 + 200 / 10e9)));

  // Per step: stage 1 with Ψ = 1600 on 16 ranks (2 nodes), bf16: RS + AG of S = 100.
  auto s = make(1, 16);
  CHECK(plan::comm_time_per_step(s, 1600u, c) == approx(2 * 15 * (1e-5 + 200 / 10e9)));
  CHECK(plan::comm_time_per_step(s, 1600u, c, plan::algorithm::hierarchical) ==
        approx(2 * (7 * (1e-6 + 400 / 100e9) + (1e-5 + 200 / 10e9))));
  // Stage 0: one all-reduce of 1600.
  CHECK(plan::comm_time_per_step(make(0, 16), 1600u, c) == approx(30 * (1e-5 + 200 / 10e9)));
  // Stage 2 with 4 equal units pays α per bucket: 4 × (RS + AG) of S_u = 25.
  constexpr plan::unit four[] = {{400}, {400}, {400}, {400}};
  CHECK(plan::comm_time_per_step(make(2, 16), four, c) == approx(8 * 15 * (1e-5 + 50 / 10e9)));

  // Hybrid on 32 ranks (4 nodes), shard groups of 8 = one node, Ψ = 1600: S = 200.
  // Shard collectives stay on NVLink; the replica all-reduce of 200 over 4 nodes (one member
  // each) is an inter-node ring with chunks of 50.
  auto h = make(1, 32);
  h.shard_ranks = 8;
  const auto shard = plan::place(h, plan::comm_group::shard, c);
  const auto replica = plan::place(h, plan::comm_group::replica, c);
  CHECK((shard.size == 8 && shard.per_node == 8));
  CHECK((replica.size == 4 && replica.per_node == 1));
  CHECK(plan::comm_time_per_step(h, 1600u, c) ==
        approx(2 * 7 * (1e-6 + 400 / 100e9) + 6 * (1e-5 + 100 / 10e9)));
  // Shard groups of 2 on 16 ranks: 4 members of each replica group per node, on 2 nodes.
  h.ranks = 16;
  h.shard_ranks = 2;
  const auto rep2 = plan::place(h, plan::comm_group::replica, c);
  CHECK((rep2.size == 8 && rep2.per_node == 4 && rep2.nodes() == 2));
  const auto world = plan::place(make(0, 1024), plan::comm_group::world, c);
  CHECK((world.size == 1024 && world.per_node == 8 && world.nodes() == 128));
}

TEST_CASE("planner: plan_all recommends the lowest stage that fits") {
  // 7e9 parameters on 8 GPUs in units of 2e8 (35 units, S_u = 2.5e7):
  //   stage 1: 38.5 GB; stage 2: 26.25 GB + one bucket of 2·8·2.5e7 = 26.65 GB;
  //   stage 3: 14 GB + gathered 2·(2·8·2.5e7) + bucket 0.4 GB = 15.2 GB.
  const auto units = plan::uniform_units(psi7, 200'000'000);
  const auto at = [&](std::uint64_t gpu, std::uint64_t headroom = 0, std::uint64_t act = 0) {
    auto s = make(0, 8);
    s.activation_bytes = act;
    return plan::plan_all(s, units, {}, {gpu, headroom});
  };
  const auto r80 = at(80 * GB);
  CHECK(r80.stages[1].memory.total() == 38'500'000'000);
  CHECK(r80.stages[2].memory.total() == 26'650'000'000);
  CHECK(r80.stages[3].memory.total() == 15'200'000'000);
  CHECK(r80.recommended == 1);
  CHECK(at(32 * GB).recommended == 2);
  CHECK(at(24 * GB).recommended == 3);
  CHECK(at(15'200'000'000).recommended == 3);
  CHECK(at(15'199'999'999).recommended == -1);
  // Headroom and activations count against the GPU.
  CHECK(at(40 * GB, 2 * GB).recommended == 2);      // 38 GB usable
  CHECK(at(80 * GB, 0, 45 * GB).recommended == 2);  // 38.5 + 45 > 80
  CHECK(at(80 * GB, 0, 45 * GB).stages[2].memory.total() == 71'650'000'000);
  CHECK(at(80 * GB).stages[0].fits == false);
  CHECK((plan::gpu_budget{10, 20}.usable() == 0));
}
