// ZeRO stages 0-3 against the independent unsharded reference, bit-identity between stages,
// hybrid sharding, the ledger against docs/accounting.md's formulas, and micro-batch accumulation.
// Written once over a World: test_engine runs them on the thread communicator, test_engine_mpi on
// mpi_comm under mpiexec (cases with more ranks than the MPI job are skipped with a warning).
#include "zero/engine_harness.hpp"

#include <catch2/catch.hpp>

using namespace shardkit;

namespace {

template <class World, class W, class Opt>
void stages_agree(int n, const test::model_case& mc) {
  test::run_config cfg;
  const auto s0 = test::train<World, zero0, W, Opt>(n, mc, cfg);
  test::require_ok(s0);
  const auto s1 = test::train<World, zero1, W, Opt>(n, mc, cfg);
  test::require_ok(s1);
  const auto s2 = test::train<World, zero2, W, Opt>(n, mc, cfg);
  test::require_ok(s2);
  // ZeRO-2 with small buckets and two staging buffers
  test::run_config small = cfg;
  small.options.bucket_elems = 16;
  small.options.grad_buffers = 2;
  const auto s2b = test::train<World, zero2, W, Opt>(n, mc, small);
  test::require_ok(s2b);
  const auto s3 = test::train<World, zero3, W, Opt>(n, mc, cfg);
  test::require_ok(s3);
  // ZeRO-3 without prefetch, with deeper prefetch and two staging buffers, and with the first
  // unit kept gathered from forward to backward
  test::run_config z3 = cfg;
  z3.options.prefetch = 0;
  const auto s3a = test::train<World, zero3, W, Opt>(n, mc, z3);
  test::require_ok(s3a);
  z3.options.prefetch = 2;
  z3.options.grad_buffers = 2;
  z3.keep_after_forward = {true};
  const auto s3b = test::train<World, zero3, W, Opt>(n, mc, z3);
  test::require_ok(s3b);
  // ... and with small units persisting (gathered for the whole step), the gathered buffers
  // kept from one step to the next
  test::run_config z3p = cfg;
  z3p.options.persist_below = 16;
  z3p.options.keep_gathered_buffers = true;
  const auto s3p = test::train<World, zero3, W, Opt>(n, mc, z3p);
  test::require_ok(s3p);

  const auto h = test::agreed_working_hash(s0);
  CHECK(test::agreed_working_hash(s1) == h);
  CHECK(test::agreed_working_hash(s2) == h);
  CHECK(test::agreed_working_hash(s2b) == h);
  CHECK(test::agreed_working_hash(s3) == h);
  CHECK(test::agreed_working_hash(s3a) == h);
  CHECK(test::agreed_working_hash(s3b) == h);
  CHECK(test::agreed_working_hash(s3p) == h);
  if constexpr (!std::is_same_v<W, float>) {
    // the fp32 master copies too (the same on every rank after gathering)
    CHECK(s1[0].master_hash == s0[0].master_hash);
    CHECK(s2[0].master_hash == s0[0].master_hash);
    CHECK(s2b[0].master_hash == s0[0].master_hash);
    CHECK(s3[0].master_hash == s0[0].master_hash);
    CHECK(s3b[0].master_hash == s0[0].master_hash);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("stages 0-3 match the unsharded reference and each other bit for bit",
                   "[engine]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  const int n = GENERATE(1, 2, 3, 4, 7, 8);
  const auto mc = test::model_cases()[GENERATE(0u, 1u, 2u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, mc.name);
  SECTION("bf16 working parameters, AdamW") {
    stages_agree<World, bf16, adamw>(n, mc);
  }
  SECTION("bf16 working parameters, Adam") {
    stages_agree<World, bf16, adam>(n, mc);
  }
  SECTION("fp16 working parameters, AdamW") {
    stages_agree<World, fp16, adamw>(n, mc);
  }
  SECTION("fp32 working parameters, AdamW") {
    stages_agree<World, float, adamw>(n, mc);
  }
}

TEMPLATE_TEST_CASE("docs/accounting.md worked numbers: MLP 64-256-10 on 4 ranks", "[engine][facts]",
                   SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  if (!test::fits<World>(4)) return;
  const std::vector<std::size_t> sizes{64 * 256, 256, 256 * 10, 10};
  auto bytes = [&]<class P>(P) {
    return World::run(4, [&](Comm& c) {
      model_spec m;
      for (auto n : sizes) m.add("p", n);
      engine<Comm, P, bf16, adamw> e(c, m);
      return e.measured_state_bytes();
    });
  };
  const auto s0 = bytes(zero0{});
  const auto s1 = bytes(zero1{});
  const auto s2 = bytes(zero2{});
  for (int r = 0; r < 4; ++r) {
    // Unsharded fp32 master + m + v = 230,520 bytes; sharded over 4 ranks: 12 x 4,803 = 57,636.
    CHECK(s0[r].master_params + s0[r].optimizer_moments == 230'520);
    CHECK(s1[r].master_params + s1[r].optimizer_moments == 57'636);
    CHECK(s2[r].master_params + s2[r].optimizer_moments == 57'636);
    CHECK(s0[r].total() == 16 * 19'210);                 // stage 0: 16 psi
    CHECK(s1[r].total() == 4 * 4 * 4'803 + 12 * 4'803);  // 4 N S + 12 S
    CHECK(s2[r].total() == 2 * 4 * 4'803 + 14 * 4'803);  // 2 N S + 14 S
  }
}

TEMPLATE_TEST_CASE("micro-batches accumulate into one step", "[engine][accumulation]",
                   SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  test::run_config cfg;
  cfg.micro_batches = 3;
  for (const auto& mc : test::model_cases()) {
    for (int n : {1, 3, 4}) {
      if (!test::fits<World>(n)) continue;
      CAPTURE(World::name, mc.name, n);
      // fp32 with dyadic gradients: every sum is exact, so all stages agree bit for bit.
      const auto a = test::train<World, zero0, float, adamw>(n, mc, cfg);
      const auto b = test::train<World, zero1, float, adamw>(n, mc, cfg);
      const auto c = test::train<World, zero2, float, adamw>(n, mc, cfg);
      const auto d = test::train<World, zero3, float, adamw>(n, mc, cfg);
      test::require_ok(a);
      test::require_ok(b);
      test::require_ok(c);
      test::require_ok(d);
      CHECK(test::agreed_working_hash(a) == test::agreed_working_hash(b));
      CHECK(test::agreed_working_hash(a) == test::agreed_working_hash(c));
      CHECK(test::agreed_working_hash(a) == test::agreed_working_hash(d));
      // bf16: each stage against the reference with its own rounding points.
      test::require_ok(test::train<World, zero0, bf16, adamw>(n, mc, cfg));
      test::require_ok(test::train<World, zero2, bf16, adamw>(n, mc, cfg));
      test::require_ok(test::train<World, zero3, bf16, adamw>(n, mc, cfg));
    }
  }
}

TEMPLATE_TEST_CASE("summed instead of averaged gradients", "[engine]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  test::run_config cfg;
  cfg.options.average_grads = false;
  if (!test::fits<World>(3)) return;
  const auto mc = test::model_cases()[0];
  test::require_ok(test::train<World, zero1, bf16, adamw>(3, mc, cfg));
  test::require_ok(test::train<World, zero2, float, adam>(3, mc, cfg));
}

TEMPLATE_TEST_CASE("hybrid sharding: shard within groups of G ranks, replicate across N/G",
                   "[engine][hybrid]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  const auto [n, g] = GENERATE(std::pair{4, 2}, std::pair{6, 3}, std::pair{8, 2}, std::pair{8, 4});
  const auto mc = test::model_cases()[GENERATE(0u, 1u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(n, g, mc.name);
  test::run_config cfg;
  cfg.options.shard_group_size = static_cast<std::size_t>(g);
  cfg.options.report_grad_norm = true;  // each element counted once, not once per replica
  SECTION("fp32: exact sums, so hybrid equals plain ZeRO and stage 0 bit for bit") {
    test::run_config plain;
    const auto h = test::agreed_working_hash(test::train<World, zero0, float, adam>(n, mc, plain));
    const auto h1 = test::train<World, zero1, float, adam>(n, mc, cfg);
    const auto h2 = test::train<World, zero2, float, adam>(n, mc, cfg);
    const auto h3 = test::train<World, zero3, float, adam>(n, mc, cfg);
    test::require_ok(h1);
    test::require_ok(h2);
    test::require_ok(h3);
    CHECK(test::agreed_working_hash(h1) == h);
    CHECK(test::agreed_working_hash(h2) == h);
    CHECK(test::agreed_working_hash(h3) == h);
  }
  SECTION("bf16: two-level rounding, against the reference; stages agree with each other") {
    cfg.options.clip_grad_norm = 0.5f;
    const auto h1 = test::train<World, zero1, bf16, adam>(n, mc, cfg);
    const auto h2 = test::train<World, zero2, bf16, adam>(n, mc, cfg);
    const auto h3 = test::train<World, zero3, bf16, adam>(n, mc, cfg);
    test::require_ok(h1);
    test::require_ok(h2);
    test::require_ok(h3);
    CHECK(test::agreed_working_hash(h2) == test::agreed_working_hash(h1));
    CHECK(test::agreed_working_hash(h3) == test::agreed_working_hash(h1));
  }
}

TEST_CASE("hybrid sharding rejects group sizes that do not tile the ranks",
          "[engine][hybrid][errors]") {
  auto r = run_ranks(6, [](thread_comm& c) -> std::string {
    std::vector<float> w(10);
    model_spec m;
    m.add("w", w);
    engine_options o;
    o.shard_group_size = 4;
    try {
      engine<thread_comm, zero2, bf16, adamw> e(c, m, {}, o);
    } catch (const invalid_argument& x) {
      return x.what();
    }
    return {};
  });
  for (const auto& msg : r)
    REQUIRE_THAT(msg, Catch::Contains("shard_group_size = 4 does not divide the 6 ranks"));
}
