// Training features under sharding, for every stage: dynamic loss scaling with overflow
// skipping, global gradient-norm clipping, gradient accumulation with declared micro-batches,
// parameter groups with a learning-rate schedule, and pluggable optimizers. Each is checked
// against the independent unsharded reference (support/reference.hpp). Written once over a
// World: test_training runs these on the thread communicator, test_training_mpi on mpi_comm
// under mpiexec.
#include "zero/engine_harness.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

using namespace shardkit;

namespace {

using world_t = SHARDKIT_TEST_WORLDS;
using Comm = world_t::comm_type;

// Runs the configuration for stages 0-3 at N ranks, checks each against the reference, and
// that they agree with each other bit for bit. Adam with L2 weight decay by default: unlike
// AdamW, its update depends on the gradient's scale, so a wrong unscaling, averaging or
// clipping factor cannot hide behind Adam's scale invariance.
template <class World, class W, class Opt = adam>
void all_stages(int n, const test::model_case& mc, const test::run_config& cfg) {
  if (!test::fits<World>(n)) return;
  const auto s0 = test::train<World, zero0, W, Opt>(n, mc, cfg);
  const auto s1 = test::train<World, zero1, W, Opt>(n, mc, cfg);
  const auto s2 = test::train<World, zero2, W, Opt>(n, mc, cfg);
  const auto s3 = test::train<World, zero3, W, Opt>(n, mc, cfg);
  test::require_ok(s0);
  test::require_ok(s1);
  test::require_ok(s2);
  test::require_ok(s3);
  if (cfg.micro_batches == 1 || std::is_same_v<W, float>) {
    const auto h = test::agreed_working_hash(s0);
    CHECK(test::agreed_working_hash(s1) == h);
    CHECK(test::agreed_working_hash(s2) == h);
    CHECK(test::agreed_working_hash(s3) == h);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("an inf on one rank in one step makes every rank skip it, state untouched",
                   "[training][loss-scale]", SHARDKIT_TEST_WORLDS) {
  const int n = GENERATE(1, 3, 4);
  const auto mc = test::model_cases()[GENERATE(0u, 1u)];
  CAPTURE(n, mc.name);
  test::run_config cfg;
  cfg.steps = 4;
  cfg.inject_inf_step = 2;
  cfg.inject_rank = n - 1;
  SECTION("fp16 (loss scaling on by default)") {
    all_stages<TestType, fp16>(n, mc, cfg);
  }
  SECTION("bf16 with loss scaling") {
    cfg.options.loss_scale = loss_scale_options{.init_scale = 256.0f};
    all_stages<TestType, bf16>(n, mc, cfg);
  }
  SECTION("fp32 with the norm reported (the pass that finds the overflow)") {
    cfg.options.report_grad_norm = true;
    all_stages<TestType, float>(n, mc, cfg);
  }
}

TEST_CASE(
    "the loss scale backs off on overflow, grows after a run of good steps, and reports "
    "its minimum",
    "[training][loss-scale]") {
  auto r = world_t::run(2, [](Comm& c) {
    std::vector<float> w(6, 0.5f);
    model_spec m;
    m.add("w", w);
    engine_options o;
    o.loss_scale = loss_scale_options{.init_scale = 8.0f,
                                      .growth_factor = 2.0f,
                                      .growth_interval = 2,
                                      .backoff_factor = 0.5f,
                                      .min_scale = 2.0f};
    engine<Comm, zero2, bf16, adamw> e(c, m, {}, o);
    std::vector<std::string> log;
    // overflow, overflow, overflow (at the minimum), good, good (growth), good
    for (bool overflow : {true, true, true, false, false, false}) {
      std::vector<float> g(6, 1.0f * e.loss_scale());
      if (overflow && c.rank() == 1) g[3] = NAN;
      e.grad_ready(0, g);
      const auto rep = e.step();
      log.push_back((rep.skipped ? "skip " : "step ") +
                    std::to_string(static_cast<int>(rep.loss_scale)) +
                    (rep.loss_scale_at_minimum ? " min" : ""));
    }
    return log;
  });
  const std::vector<std::string> want{"skip 4", "skip 2", "skip 2 min",
                                      "step 2", "step 4", "step 4"};
  REQUIRE(r[0] == want);
  REQUIRE(r[1] == want);
}

TEMPLATE_TEST_CASE(
    "global gradient-norm clipping equals the reference, bit-identical across "
    "stages",
    "[training][clipping]", SHARDKIT_TEST_WORLDS) {
  const int n = GENERATE(1, 2, 3, 4, 8);
  const auto mc = test::model_cases()[GENERATE(0u, 1u, 2u, 3u)];
  CAPTURE(n, mc.name);
  test::run_config cfg;
  cfg.options.report_grad_norm = true;
  SECTION("norms reported, no clipping") {
    all_stages<TestType, bf16>(n, mc, cfg);
  }
  SECTION("L2 clipping") {
    cfg.options.clip_grad_norm = 0.5f;  // below the gradients' norm: clipping is active
    all_stages<TestType, bf16>(n, mc, cfg);
    all_stages<TestType, float>(n, mc, cfg);
  }
  SECTION("inf-norm clipping") {
    cfg.options.clip_grad_norm = 0.25f;
    cfg.options.clip_norm = grad_norm_kind::inf;
    all_stages<TestType, bf16>(n, mc, cfg);
  }
}

TEMPLATE_TEST_CASE("k declared micro-batches equal one batch k times the size",
                   "[training][accumulation]", SHARDKIT_TEST_WORLDS) {
  const int n = GENERATE(1, 3, 4);
  const auto mc = test::model_cases()[GENERATE(0u, 1u, 3u)];
  CAPTURE(n, mc.name);
  test::run_config cfg;
  cfg.micro_batches = 4;
  cfg.declare_micro_batches = true;  // the step averages over the 4 micro-batches
  all_stages<TestType, float>(n, mc, cfg);
  all_stages<TestType, bf16>(n, mc, cfg);
}

TEST_CASE("4 micro-batches give the step of one batch with the mean gradient",
          "[training][accumulation]") {
  // Direct check, independent of the harness: micro-batch gradients g_m versus one batch whose
  // gradient is their mean (exact in fp32 for these dyadic values).
  auto run = [](bool micro) {
    return world_t::run(3, [micro](Comm& c) {
      std::vector<float> w(11, 0.25f);
      model_spec m;
      m.add("w", w);
      engine<Comm, zero2, float, sgd_momentum> e(c, m, {.lr = 0.1f});  // scale-sensitive
      std::vector<float> mean(11, 0.0f);
      for (int mb = 0; mb < 4; ++mb) {
        std::vector<float> g(11);
        for (std::size_t k = 0; k < 11; ++k) g[k] = ref::grad_value(1, c.rank(), 0, k, mb);
        for (std::size_t k = 0; k < 11; ++k) mean[k] += g[k] / 4;
        if (micro) {
          e.begin_micro_batch(mb == 3);
          e.grad_ready(0, g);
        }
      }
      if (!micro) e.grad_ready(0, mean);
      const auto rep = e.step();
      return std::pair{std::vector<float>(e.param(0).begin(), e.param(0).end()), rep.micro_batches};
    });
  };
  const auto a = run(true), b = run(false);
  for (int r = 0; r < 3; ++r) {
    CHECK(a[r].second == 4);
    for (std::size_t k = 0; k < 11; ++k)
      CHECK(a[r].first[k] == Approx(b[r].first[k]).epsilon(1e-6));
  }
}

TEST_CASE("micro-batch boundaries are checked", "[training][accumulation][errors]") {
  auto errors = [](auto fn) {
    return world_t::run(2, [&](Comm& c) -> std::string {
      std::vector<float> w(4);
      model_spec m;
      m.add("w", w);
      engine<Comm, zero1, bf16, adamw> e(c, m);
      try {
        fn(e);
      } catch (const usage_error& x) {
        return x.what();
      }
      return {};
    });
  };
  for (const auto& msg : errors([](auto& e) {
         e.begin_micro_batch(false);
         e.step();
       })) {
    REQUIRE_THAT(msg, Catch::Contains("none was declared the last"));
  }
  for (const auto& msg : errors([](auto& e) {
         e.begin_micro_batch(true);
         e.begin_micro_batch(false);
       })) {
    REQUIRE_THAT(msg, Catch::Contains("declared the last of the step; call step() first"));
  }
}

TEMPLATE_TEST_CASE("parameter groups get their own lr and weight decay and a schedule scales them",
                   "[training][groups]", SHARDKIT_TEST_WORLDS) {
  const int n = GENERATE(1, 3, 4);
  const auto mc = test::model_cases()[GENERATE(0u, 1u, 3u)];
  CAPTURE(n, mc.name);
  test::run_config cfg;
  cfg.steps = 4;
  cfg.groups = {{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f},
                {.lr = 3e-3f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.0f}};
  cfg.schedule = [](std::uint64_t t) { return 1.0f / static_cast<float>(t); };
  all_stages<TestType, bf16>(n, mc, cfg);
  all_stages<TestType, bf16, adamw>(n, mc, cfg);
}

TEST_CASE("a parameter in a group without options is rejected", "[training][groups][errors]") {
  REQUIRE_THROWS_WITH(world_t::run(1,
                                   [](Comm& c) {
                                     std::vector<float> w(4);
                                     model_spec m;
                                     m.add("w", w, 1);
                                     engine<Comm, zero1, bf16, adamw> e(c, m);
                                   }),
                      Catch::Contains("'w' is in parameter group 1 but only 1 set(s)"));
}

namespace {

// A user's own optimizer policy: Adagrad (one fp32 state per element).
struct adagrad {
  static constexpr std::size_t state_count = 1;
  static constexpr const char* name = "adagrad";
  struct options {
    float lr = 0.1f;
    float eps = 1e-10f;
  };
  struct constants {
    float lr, eps, grad_scale;
  };
  static constants prepare(const options& o, std::uint64_t, float lr, float grad_scale) {
    return {lr, o.eps, grad_scale};
  }
  template <class V>
  static void update(V& p, V* s, V g, const constants& k) {
    using std::sqrt;
    g = g * k.grad_scale;
    s[0] = s[0] + g * g;
    p = p - k.lr * g / (sqrt(s[0]) + k.eps);
  }
};
static_assert(optimizer_policy<adagrad>);

// Trains w (13 elements) for 3 steps with optimizer O at stage P on 3 ranks; returns the final
// parameters and the bytes of optimizer state per rank.
template <class O, class P>
std::pair<std::vector<float>, std::size_t> train_with(typename O::options opt) {
  auto r = world_t::run(3, [&](Comm& c) {
    std::vector<float> w(13);
    for (std::size_t k = 0; k < 13; ++k) w[k] = ref::init_value(0, k);
    model_spec m;
    m.begin_unit("all");
    m.add("w", w);
    engine<Comm, P, float, O> e(c, m, opt);
    for (int t = 1; t <= 3; ++t) {
      e.pre_forward(0);
      e.post_forward(0);
      e.pre_backward(0);
      std::vector<float> g(13);
      for (std::size_t k = 0; k < 13; ++k) g[k] = ref::grad_value(t, c.rank(), 0, k);
      e.grad_ready(0, g);
      e.post_backward(0);
      e.step();
    }
    e.pre_forward(0);
    std::vector<float> out(e.param(0).begin(), e.param(0).end());
    e.post_forward(0);
    return std::pair{out, e.memory().current(memory_category::optimizer_moments)};
  });
  return r[0];
}

}  // namespace

TEST_CASE("optimizers are policies: SGD with momentum and a user's Adagrad",
          "[training][optimizer]") {
  // Independent references in double.
  std::vector<double> sgd(13), mom(13, 0.0), ada(13), acc(13, 0.0);
  for (std::size_t k = 0; k < 13; ++k) sgd[k] = ada[k] = ref::init_value(0, k);
  for (int t = 1; t <= 3; ++t) {
    for (std::size_t k = 0; k < 13; ++k) {
      double g = 0;
      for (int r = 0; r < 3; ++r) g += ref::grad_value(t, r, 0, k);
      g /= 3;
      mom[k] = 0.9 * mom[k] + (g + 0.01 * sgd[k]);
      sgd[k] -= 0.05 * mom[k];
      acc[k] += g * g;
      ada[k] -= 0.1 * g / (std::sqrt(acc[k]) + 1e-10);
    }
  }
  const std::size_t S = (13 + 2) / 3;  // 5 elements of state per rank and per fp32 state
  auto check = [&](const auto& got, const std::vector<double>& want, std::size_t state_bytes) {
    for (std::size_t k = 0; k < 13; ++k) CHECK(got.first[k] == Approx(want[k]).epsilon(1e-5));
    CHECK(got.second == state_bytes);
  };
  const sgd_options so{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f};
  check(train_with<sgd_momentum, zero0>(so), sgd, 13 * 4);
  check(train_with<sgd_momentum, zero1>(so), sgd, S * 4);
  check(train_with<sgd_momentum, zero2>(so), sgd, S * 4);
  check(train_with<sgd_momentum, zero3>(so), sgd, S * 4);
  check(train_with<adagrad, zero0>({}), ada, 13 * 4);
  check(train_with<adagrad, zero3>({}), ada, S * 4);
  // The formulas follow the optimizer's state size: 4 bytes per element instead of Adam's 8.
  STATIC_REQUIRE(engine<Comm, zero1, bf16, sgd_momentum>::precision().state_bytes == 4);
  STATIC_REQUIRE(engine<Comm, zero1, bf16, adamw>::precision().state_bytes == 8);
}
