// ZeRO stages 0, 1 and 2 against the independent unsharded reference, bit-identity between
// stages, the ledger against FACTS.md's formulas, and micro-batch accumulation. Written once
// over a World: test_engine runs them on the thread communicator, test_engine_mpi on mpi_comm
// under mpiexec (cases with more ranks than the MPI job are skipped with a warning).
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

  const auto h = test::agreed_working_hash(s0);
  CHECK(test::agreed_working_hash(s1) == h);
  CHECK(test::agreed_working_hash(s2) == h);
  CHECK(test::agreed_working_hash(s2b) == h);
  if constexpr (!std::is_same_v<W, float>) {
    // the fp32 master copies too (the same on every rank after gathering)
    CHECK(s1[0].master_hash == s0[0].master_hash);
    CHECK(s2[0].master_hash == s0[0].master_hash);
    CHECK(s2b[0].master_hash == s0[0].master_hash);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("stages 0, 1, 2 match the unsharded reference and each other bit for bit",
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

TEMPLATE_TEST_CASE("FACTS.md worked numbers: MLP 64-256-10 on 4 ranks", "[engine][facts]",
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
      test::require_ok(a);
      test::require_ok(b);
      test::require_ok(c);
      CHECK(test::agreed_working_hash(a) == test::agreed_working_hash(b));
      CHECK(test::agreed_working_hash(a) == test::agreed_working_hash(c));
      // bf16: each stage against the reference with its own rounding points.
      test::require_ok(test::train<World, zero0, bf16, adamw>(n, mc, cfg));
      test::require_ok(test::train<World, zero2, bf16, adamw>(n, mc, cfg));
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
