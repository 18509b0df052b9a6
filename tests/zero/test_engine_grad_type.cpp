// Gradients in their own type: engine<Comm, Policies, Working, Optimizer, Grad>. bf16 working
// parameters with fp32 gradients at stages 0-3, against the unsharded reference that rounds
// gradient sums to the gradient type (fp32: the synthetic gradients sum exactly) and parameters
// to the working type (bf16); the stages agree bit for bit; the ledger holds 4 bytes per
// gradient element (staging buckets 4·N·S_g) and a step sends reduce-scatters and all-reduces at
// 4 bytes per element and all-gathers at 2 (docs/accounting.md, computed in the test). Written
// once over a World like test_engine.cpp.
#include "zero/engine_harness.hpp"

#include <catch2/catch.hpp>

using namespace shardkit;

namespace {

template <class World, class Policies>
std::vector<test::outcome> fp32_grads(int n, const test::model_case& mc,
                                      const test::run_config& cfg) {
  return test::train<World, Policies, bf16, adamw, float>(n, mc, cfg);
}

}  // namespace

TEMPLATE_TEST_CASE(
    "fp32 gradients under bf16 working parameters: stages 0-3 match the "
    "reference and each other bit for bit",
    "[engine][grad_type]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  const int n = GENERATE(1, 2, 3, 4, 7, 8);
  const auto mc = test::model_cases()[GENERATE(0u, 1u, 2u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, mc.name);
  test::run_config cfg;
  const auto s0 = fp32_grads<World, zero0>(n, mc, cfg);
  test::require_ok(s0);
  const auto s1 = fp32_grads<World, zero1>(n, mc, cfg);
  test::require_ok(s1);
  const auto s2 = fp32_grads<World, zero2>(n, mc, cfg);
  test::require_ok(s2);
  test::run_config small = cfg;  // small buckets, two staging buffers
  small.options.bucket_elems = 16;
  small.options.grad_buffers = 2;
  const auto s2b = fp32_grads<World, zero2>(n, mc, small);
  test::require_ok(s2b);
  const auto s3 = fp32_grads<World, zero3>(n, mc, cfg);
  test::require_ok(s3);
  test::run_config z3 = cfg;  // deeper prefetch, two staging buffers, the first unit kept
  z3.options.prefetch = 2;
  z3.options.grad_buffers = 2;
  z3.keep_after_forward = {true};
  const auto s3b = fp32_grads<World, zero3>(n, mc, z3);
  test::require_ok(s3b);
  test::run_config z3p = cfg;  // small units persist
  z3p.options.persist_below = 16;
  const auto s3p = fp32_grads<World, zero3>(n, mc, z3p);
  test::require_ok(s3p);

  const auto h = test::agreed_working_hash(s0);
  CHECK(test::agreed_working_hash(s1) == h);
  CHECK(test::agreed_working_hash(s2) == h);
  CHECK(test::agreed_working_hash(s2b) == h);
  CHECK(test::agreed_working_hash(s3) == h);
  CHECK(test::agreed_working_hash(s3b) == h);
  CHECK(test::agreed_working_hash(s3p) == h);
  CHECK(s1[0].master_hash == s0[0].master_hash);
  CHECK(s2[0].master_hash == s0[0].master_hash);
  CHECK(s2b[0].master_hash == s0[0].master_hash);
  CHECK(s3[0].master_hash == s0[0].master_hash);
  CHECK(s3b[0].master_hash == s0[0].master_hash);
  CHECK(s3p[0].master_hash == s0[0].master_hash);
}

TEMPLATE_TEST_CASE("fp32 gradients under bf16: micro-batches, clipping and hybrid sharding",
                   "[engine][grad_type]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  const auto mc = test::model_cases()[GENERATE(0u, 1u, 3u)];
  CAPTURE(World::name, mc.name);
  SECTION("three micro-batches: exact fp32 sums, so every stage the same bits") {
    test::run_config cfg;
    cfg.micro_batches = 3;
    for (int n : {1, 3, 4}) {
      if (!test::fits<World>(n)) continue;
      CAPTURE(n);
      const auto a = fp32_grads<World, zero0>(n, mc, cfg);
      const auto b = fp32_grads<World, zero1>(n, mc, cfg);
      const auto c = fp32_grads<World, zero2>(n, mc, cfg);
      const auto d = fp32_grads<World, zero3>(n, mc, cfg);
      test::require_ok(a);
      test::require_ok(b);
      test::require_ok(c);
      test::require_ok(d);
      CHECK(test::agreed_working_hash(b) == test::agreed_working_hash(a));
      CHECK(test::agreed_working_hash(c) == test::agreed_working_hash(a));
      CHECK(test::agreed_working_hash(d) == test::agreed_working_hash(a));
    }
  }
  SECTION("clipping and reported norms over fp32 gradients") {
    test::run_config cfg;
    cfg.options.clip_grad_norm = 0.5f;
    cfg.options.report_grad_norm = true;
    for (int n : {2, 4}) {
      if (!test::fits<World>(n)) continue;
      CAPTURE(n);
      const auto a = fp32_grads<World, zero0>(n, mc, cfg);
      const auto c = fp32_grads<World, zero2>(n, mc, cfg);
      const auto d = fp32_grads<World, zero3>(n, mc, cfg);
      test::require_ok(a);
      test::require_ok(c);
      test::require_ok(d);
      CHECK(test::agreed_working_hash(c) == test::agreed_working_hash(a));
      CHECK(test::agreed_working_hash(d) == test::agreed_working_hash(a));
    }
  }
  SECTION("hybrid sharding: the replicas' all-reduce carries fp32") {
    const auto [n, g] = GENERATE(std::pair{4, 2}, std::pair{8, 4});
    if (!test::fits<World>(n)) return;
    CAPTURE(n, g);
    test::run_config cfg;
    cfg.options.shard_group_size = static_cast<std::size_t>(g);
    const auto plain = test::agreed_working_hash(fp32_grads<World, zero0>(n, mc, {}));
    const auto h1 = fp32_grads<World, zero1>(n, mc, cfg);
    const auto h2 = fp32_grads<World, zero2>(n, mc, cfg);
    const auto h3 = fp32_grads<World, zero3>(n, mc, cfg);
    test::require_ok(h1);
    test::require_ok(h2);
    test::require_ok(h3);
    CHECK(test::agreed_working_hash(h1) == plain);
    CHECK(test::agreed_working_hash(h2) == plain);
    CHECK(test::agreed_working_hash(h3) == plain);
  }
}

// The worked numbers of docs/accounting.md's MLP 64-256-10 (Ψ = 19,210 in two units of 16,640
// and 2,570 elements) on 4 ranks, with fp32 gradients under bf16 working parameters:
//   one group: S = ceil(19,210 / 4) = 4,803;  units: S_0 = 4,160, S_1 = ceil(2,570 / 4) = 643,
//   S = 4,803, N·max S_u = 16,640.
//   grads held:  stage 0: 4·19,210 = 76,840;  stage 1: 4·4·4,803 = 76,848;  stages 2, 3: 4·4,803
//                = 19,212;  staging (stages 2, 3, one buffer): 4·16,640 = 66,560.
//   bytes sent per step: stage 0 all-reduces 19,210 fp32 in chunks 4,802 / 4,803 / 4,802 /
//   4,803, every rank (2·19,210 − 4,802 − 4,803)·4 = 115,260; stages 1, 2 reduce-scatter 3·4,803
//   fp32 and all-gather 3·4,803 bf16: 57,636 + 28,818 = 86,454; stage 3 adds a second
//   all-gather: 57,636 + 2·28,818 = 115,272.
TEMPLATE_TEST_CASE("fp32 gradients under bf16: the ledger and the bytes sent, worked numbers",
                   "[engine][grad_type][facts]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  if (!test::fits<World>(4)) return;
  struct numbers {
    std::uint64_t grads, working, staging, sent;
  };
  auto measure = [&]<class P>(P) {
    return World::run(4, [&](Comm& c) {
      model_spec m;
      m.begin_unit("layer0");
      m.add("w0", 64 * 256);
      m.add("b0", 256);
      m.begin_unit("layer1");
      m.add("w1", 256 * 10);
      m.add("b1", 10);
      engine<Comm, P, bf16, adamw, float> e(c, m);
      std::vector<float> g;
      for (std::size_t u = 0; u < 2; ++u) {  // ZeRO-3 gathers each unit for its forward
        e.pre_forward(u);
        e.post_forward(u);
      }
      for (std::size_t u = 2; u-- > 0;) {
        e.pre_backward(u);
        for (std::size_t i = 2 * u + 2; i-- > 2 * u;) {
          g.assign(e.registry().numel(i), 0.25f);
          e.grad_ready(i, g);
        }
        e.post_backward(u);
      }
      const auto rep = e.step();
      return numbers{e.memory().current(memory_category::grads),
                     e.memory().current(memory_category::working_params),
                     e.memory().peak(memory_category::grad_buckets), rep.bytes_sent};
    });
  };
  const auto s0 = measure(zero0{});
  const auto s1 = measure(zero1{});
  const auto s2 = measure(zero2{});
  const auto s3 = measure(zero3{});
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(s0[r].grads == 76'840);
    CHECK(s1[r].grads == 76'848);
    CHECK(s2[r].grads == 19'212);
    CHECK(s3[r].grads == 19'212);
    CHECK(s0[r].working == 2 * 19'210);  // the working copy stays bf16
    CHECK(s3[r].working == 2 * 4'803);
    CHECK(s2[r].staging == 66'560);
    CHECK(s3[r].staging == 66'560);
    CHECK(s0[r].sent == 115'260);
    CHECK(s1[r].sent == 86'454);
    CHECK(s2[r].sent == 86'454);
    CHECK(s3[r].sent == 115'272);
  }
  STATIC_REQUIRE(engine<thread_comm, zero2, bf16, adamw, float>::precision() ==
                 accounting::precision{2, 4, 4, 8});
}
