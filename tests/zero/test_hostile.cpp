// What a hostile user tries: sizes that overflow, ranks given different models or settings,
// hyper-parameters that would turn every parameter non-finite, one rank's invalid input, and
// the report of a skipped step. Each must end in a named error on every rank (never a crash,
// a hang or a silently wrong result). Written once over a World: test_engine runs these on the
// thread communicator, test_engine_mpi on mpi_comm under mpiexec.
#include <shardkit/shardkit.hpp>

#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using namespace shardkit;

namespace {

constexpr std::size_t two_to(int k) {
  return std::size_t{1} << k;
}

template <class Comm, class P, class W = bf16, class Opt = adamw>
using engine_of = engine<Comm, P, W, Opt>;

//! Every rank's error starts with `type` and contains every part of `what`.
void require_every_rank(const std::vector<std::string>& per_rank, const std::string& type,
                        const std::vector<std::string>& what) {
  REQUIRE_FALSE(per_rank.empty());
  for (std::size_t r = 0; r < per_rank.size(); ++r) {
    INFO("rank " << r << ": " << per_rank[r]);
    REQUIRE(per_rank[r].rfind(type + ": ", 0) == 0);
    for (const auto& w : what) REQUIRE_THAT(per_rank[r], Catch::Contains(w));
  }
}

// A small model; rank-dependent variants come from `variant`.
model_spec small_model(int variant = 0) {
  model_spec m;
  m.add("fc.weight", variant == 1 ? 21 : 20);
  m.add("fc.bias", 4);
  m.begin_unit("head");
  if (variant == 2) {
    m.add("head.weight", 12);  // same total as head.weight + head.bias
  } else {
    m.add("head.weight", 8);
    m.add("head.bias", 4);
  }
  return m;
}

}  // namespace

// ---- sizes that do not fit ---------------------------------------------------------------------

TEST_CASE("layout, buffer, ledger and planner sizes that overflow are named errors",
          "[hostile][overflow]") {
  const std::size_t huge = two_to(63);
  {
    const std::vector<std::size_t> two{huge, huge};
    REQUIRE_THROWS_AS(flat_layout::single_group(two, 1), size_overflow);
    REQUIRE_THROWS_WITH(flat_layout::single_group(two, 1), Catch::Contains("overflows"));
  }
  {
    const std::vector<std::size_t> one{SIZE_MAX};
    REQUIRE_THROWS_AS(flat_layout::single_group(one, 2), size_overflow);  // 2 * ceil(max / 2)
  }
  {
    const std::vector<std::size_t> one{100};
    REQUIRE_THROWS_AS(flat_layout::single_group(one, 2, two_to(63) + 1), size_overflow);
    // alignment 2^62 fits on one rank but not padded over four
    REQUIRE_NOTHROW(flat_layout::single_group(one, 1, two_to(62)));
    REQUIRE_THROWS_AS(flat_layout::single_group(one, 4, two_to(62)), size_overflow);
  }
  // 2^62 fp32 elements are 2^64 bytes
  REQUIRE_THROWS_AS((buffer<float>(two_to(62), nullptr, memory_category::grads)), size_overflow);
  REQUIRE_THROWS_WITH((buffer<float>(two_to(62), nullptr, memory_category::grads)),
                      Catch::Contains("buffer: bytes"));
  memory_ledger ledger;
  ledger.add(memory_category::grads, SIZE_MAX - 1);
  REQUIRE_THROWS_AS(ledger.add(memory_category::grads, 2), size_overflow);
  REQUIRE(ledger.current(memory_category::grads) == SIZE_MAX - 1);  // unchanged by the failure

  plan::setup s;
  s.stage = 0;
  s.ranks = 2;
  s.bytes = plan::precision::mixed();
  REQUIRE_THROWS_AS(plan::memory_per_rank(s, std::uint64_t{1} << 62), size_overflow);
  REQUIRE_THROWS_AS(accounting::shard_elems(UINT64_MAX, 1, 2), size_overflow);
  REQUIRE(accounting::shard_elems(10, 4, 4) == 4);  // ceil(10 / 4) = 3, aligned to 4
}

TEMPLATE_TEST_CASE(
    "an engine over a model too large for the address space is refused on "
    "every rank",
    "[hostile][overflow]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n);
  SECTION("one parameter of 2^63 elements, every stage") {
    const int stage = GENERATE(0, 1, 2, 3);
    CAPTURE(stage);
    const auto errs = test::typed_errors_on<World>(n, [&](Comm& c) {
      model_spec m;
      m.add("huge", two_to(63));
      switch (stage) {
        case 0: {
          engine_of<Comm, zero0> e0(c, m);
        } break;
        case 1: {
          engine_of<Comm, zero1> e1(c, m);
        } break;
        case 2: {
          engine_of<Comm, zero2> e2(c, m);
        } break;
        default: {
          engine_of<Comm, zero3> e3(c, m);
        } break;
      }
    });
    // A byte count that overflows, or (ZeRO-3 on two ranks: 2^62 elements per rank fit the
    // address space) an allocation the system refuses: a named error either way.
    for (std::size_t r = 0; r < errs.size(); ++r) {
      INFO("rank " << r << ": " << errs[r]);
      REQUIRE(
          ((errs[r].rfind("size_overflow: ", 0) == 0 && Catch::contains(errs[r], "overflows")) ||
           (errs[r].rfind("error: allocating ", 0) == 0 &&
            Catch::contains(errs[r], "memory failed"))));
    }
  }
  SECTION("two parameters of 2^63 elements") {
    const auto errs = test::typed_errors_on<World>(n, [&](Comm& c) {
      model_spec m;
      m.add("a", two_to(63));
      m.add("b", two_to(63));
      engine_of<Comm, zero1> e(c, m);
    });
    // the model's own count, or the layout's: both name the overflow
    for (const auto& msg : errs)
      REQUIRE_THAT(msg, Catch::Contains("std::size_t can count") || Catch::Contains("overflows"));
  }
  SECTION("2^62 fp32 elements at stage 2") {
    const auto errs = test::typed_errors_on<World>(n, [&](Comm& c) {
      model_spec m;
      m.add("big", two_to(62) * static_cast<std::size_t>(c.size()));
      engine_of<Comm, zero2, float> e(c, m);
    });
    require_every_rank(errs, "size_overflow", {"bytes"});
  }
  SECTION("alignment 2^62") {
    const auto errs = test::typed_errors_on<World>(n, [&](Comm& c) {
      engine_options eo;
      eo.alignment = two_to(62);
      engine_of<Comm, zero2> e(c, small_model(), {}, eo);
    });
    require_every_rank(errs, "size_overflow", {"overflows"});
  }
}

// ---- ranks that disagree -----------------------------------------------------------------------

TEMPLATE_TEST_CASE(
    "ranks given different models or settings are refused, naming the field and "
    "the ranks",
    "[hostile][agreement]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = 3;
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name);
  const int stage = GENERATE(0, 1, 2, 3);
  CAPTURE(stage);
  auto build = [stage](Comm& c, const model_spec& m, const adam_options& o,
                       const engine_options& eo) {
    switch (stage) {
      case 0: {
        engine_of<Comm, zero0> e0(c, m, o, eo);
      } break;
      case 1: {
        engine_of<Comm, zero1> e1(c, m, o, eo);
      } break;
      case 2: {
        engine_of<Comm, zero2> e2(c, m, o, eo);
      } break;
      default: {
        engine_of<Comm, zero3> e3(c, m, o, eo);
      } break;
    }
  };
  SECTION("rank 1 has a parameter of 21 elements where the others have 20") {
    const auto errs = test::typed_errors_on<World>(
        n, [&](Comm& c) { build(c, small_model(c.rank() == 1 ? 1 : 0), {}, {}); });
    require_every_rank(errs, "invalid_argument",
                       {"parameter shapes differs: ranks {0, 2} vs {1}", "same model"});
  }
  SECTION("rank 2 lacks a parameter, the total is the same") {
    const auto errs = test::typed_errors_on<World>(
        n, [&](Comm& c) { build(c, small_model(c.rank() == 2 ? 2 : 0), {}, {}); });
    require_every_rank(errs, "invalid_argument", {"parameter names differs: ranks {0, 1} vs {2}"});
  }
  SECTION("rank 0 has another learning rate") {
    const auto errs = test::typed_errors_on<World>(
        n, [&](Comm& c) { build(c, small_model(), {.lr = c.rank() == 0 ? 2e-3f : 1e-3f}, {}); });
    require_every_rank(errs, "invalid_argument",
                       {"optimizer and its options per parameter group differs: ranks {0} vs "
                        "{1, 2}"});
  }
  SECTION("weight decay, average_grads and loss scaling differ on different ranks") {
    const auto errs = test::typed_errors_on<World>(n, [&](Comm& c) {
      adam_options o;
      o.weight_decay = c.rank() == 1 ? 0.01f : 0.0f;
      engine_options eo;
      eo.average_grads = c.rank() != 2;
      if (c.rank() == 0) eo.loss_scale = loss_scale_options{};
      build(c, small_model(), o, eo);
    });
    require_every_rank(errs, "invalid_argument",
                       {"optimizer and its options per parameter group differs: ranks {0, 2} vs "
                        "{1}",
                        "average_grads differs: ranks {0, 1} vs {2}",
                        "loss scaling (loss_scale, disable_loss_scale) differs: ranks {0} vs {1, "
                        "2}"});
  }
}

TEMPLATE_TEST_CASE("one rank's invalid input stops every rank at once", "[hostile][agreement]",
                   SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = 3;
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name);
  const auto errs = test::typed_errors_on<World>(n, [&](Comm& c) {
    engine_options eo;
    eo.alignment = c.rank() == 1 ? 0 : 1;
    engine_of<Comm, zero2> e(c, small_model(), {}, eo);
  });
  REQUIRE(errs.size() == 3);
  REQUIRE_THAT(errs[1], Catch::StartsWith("invalid_argument: ") &&
                            Catch::Contains("alignment must be at least 1"));
  for (const int r : {0, 2}) {
    INFO("rank " << r << ": " << errs[static_cast<std::size_t>(r)]);
    REQUIRE_THAT(errs[static_cast<std::size_t>(r)],
                 Catch::StartsWith("invalid_argument: ") &&
                     Catch::Contains("rank(s) {1} of 3 refused their arguments"));
  }
}

// ---- hyper-parameters
// ----------------------------------------------------------------------------

TEMPLATE_TEST_CASE("hyper-parameters that would make parameters non-finite are refused",
                   "[hostile][hyper]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = 2;
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name);
  const float inf = std::numeric_limits<float>::infinity();
  struct adam_case {
    adam_options o;
    const char* what;
  };
  const std::vector<adam_case> adam_cases = {
      {{.weight_decay = std::nanf("")}, "weight_decay must be finite and non-negative"},
      {{.weight_decay = inf}, "weight_decay must be finite and non-negative"},
      {{.weight_decay = -0.1f}, "weight_decay must be finite and non-negative"},
      {{.lr = 1e-3f, .weight_decay = 1e30f}, "lr * weight_decay"},
      {{.lr = 0.5f, .weight_decay = 2.0f}, "lr * weight_decay"},
      {{.eps = inf}, "eps must be positive and finite"},
      {{.eps = 0.0f}, "eps must be positive and finite"},
      {{.beta1 = 1.0f}, "betas must lie in [0, 1)"},
      {{.lr = -1.0f}, "learning rate of parameter group 0"},
  };
  for (const auto& ac : adam_cases) {
    CAPTURE(ac.what);
    const auto errs = test::typed_errors_on<World>(
        n, [&](Comm& c) { engine_of<Comm, zero1> e(c, small_model(), ac.o); });
    require_every_rank(errs, "invalid_argument", {ac.what});
  }
  struct sgd_case {
    sgd_options o;
    const char* what;
  };
  const std::vector<sgd_case> sgd_cases = {
      {{.momentum = 1.0f}, "momentum must lie in [0, 1)"},
      {{.momentum = -0.5f}, "momentum must lie in [0, 1)"},
      {{.momentum = std::nanf("")}, "momentum must lie in [0, 1)"},
      {{.weight_decay = std::nanf("")}, "weight_decay must be finite and non-negative"},
      {{.lr = 0.1f, .weight_decay = 10.0f}, "lr * weight_decay"},
  };
  for (const auto& sc : sgd_cases) {
    CAPTURE(sc.what);
    const auto errs = test::typed_errors_on<World>(
        n, [&](Comm& c) { engine_of<Comm, zero2, float, sgd_momentum> e(c, small_model(), sc.o); });
    require_every_rank(errs, "invalid_argument", {sc.what});
  }
}

// ---- reports
// -------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("a step skipped for a non-finite gradient reports an infinite norm",
                   "[hostile][report]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n);
  const float bad = GENERATE(std::numeric_limits<float>::infinity(), std::nanf(""));
  const auto per_rank = World::run(n, [&](Comm& c) -> std::string {
    engine_options eo;
    eo.report_grad_norm = true;
    engine_of<Comm, zero2, float> e(c, small_model(), {}, eo);
    for (std::size_t i = 0; i < e.num_params(); ++i) {
      std::vector<float> g(e.param(i).size(), 0.5f);
      if (i == 0 && c.rank() == 0) g[3] = bad;
      e.grad_ready(i, g);
    }
    const step_report rep = e.step();
    if (!rep.skipped) return "the step was not skipped";
    if (!(std::isinf(rep.grad_norm) && rep.grad_norm > 0)) {
      return "grad_norm = " + std::to_string(rep.grad_norm) + ", expected +inf";
    }
    if (!(std::isinf(rep.grad_inf_norm) && rep.grad_inf_norm > 0)) {
      return "grad_inf_norm = " + std::to_string(rep.grad_inf_norm) + ", expected +inf";
    }
    // A finite step after it reports a finite norm: sqrt(N * 0.5^2 * 36) / N per element sum.
    for (std::size_t i = 0; i < e.num_params(); ++i) {
      std::vector<float> g(e.param(i).size(), 0.5f);
      e.grad_ready(i, g);
    }
    const step_report ok = e.step();
    if (ok.skipped) return "a finite step was skipped";
    const double expected = std::sqrt(36.0 * 0.25);  // averaged gradient 0.5 on 36 elements
    if (std::abs(ok.grad_norm - expected) > 1e-6 * expected) {
      return "finite grad_norm = " + std::to_string(ok.grad_norm) + ", expected " +
             std::to_string(expected);
    }
    return {};
  });
  test::require_all_ok(per_rank);
}

// ---- misleading errors
// ---------------------------------------------------------------------------

TEMPLATE_TEST_CASE("a gradient handed over twice is named as the cause", "[hostile][errors]",
                   SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = 2;
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name);
  // small_model(): unit 0 = fc.weight (20), fc.bias (4); unit 'head' = head.weight (8),
  // head.bias (4). Backward hands over the head first.
  SECTION("ZeRO-2: the bucket was already reduced when the gradient came again") {
    const auto errs = test::typed_errors_on<World>(n, [&](Comm& c) {
      engine_of<Comm, zero2, float> e(c, small_model());
      auto give = [&](std::size_t i) {
        std::vector<float> g(e.param(i).size(), 0.25f);
        e.grad_ready(i, g);
      };
      give(3);
      give(2);
      give(3);  // again: the head's bucket has been reduced already
      give(1);
      give(0);
      (void)e.step();
    });
    require_every_rank(errs, "usage_error",
                       {"the gradient of 'head.bias' was handed over again after",
                        "had received all of its gradients and been reduced"});
  }
  SECTION("ZeRO-3: the unit's backward ends after a gradient came twice") {
    const auto errs = test::typed_errors_on<World>(n, [&](Comm& c) {
      engine_of<Comm, zero3, float> e(c, small_model());
      for (std::size_t u = 0; u < e.num_units(); ++u) {
        e.pre_forward(u);
        e.post_forward(u);
      }
      e.pre_backward(1);
      for (const std::size_t i : {3, 2, 3}) {
        std::vector<float> g(e.param(i).size(), 0.25f);
        e.grad_ready(i, g);
      }
      e.post_backward(1);
    });
    require_every_rank(errs, "usage_error",
                       {"the gradient of 'head.bias' was handed over again after unit 'head'",
                        "finished its backward without the gradients of 'head.weight'"});
  }
}
