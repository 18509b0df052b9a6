// ZeRO-3 misuse: every misuse of the unit hooks raises the documented error on every rank, and
// ranks that call the hooks (or hand over ZeRO-2 buckets) in different orders are stopped.
// Written once over a World: test_engine runs these on the thread communicator,
// test_engine_mpi on mpi_comm under mpiexec.
#include <shardkit/shardkit.hpp>

#include "support/world.hpp"
#include "unit_stack.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

using namespace shardkit;

namespace {

using World = SHARDKIT_TEST_WORLDS;
using Comm = World::comm_type;
using z3_engine = engine<Comm, zero3, bf16, adamw>;

template <class F>
std::vector<std::string> errors_per_rank(int n, F fn) {
  return test::messages_on<World>(n, std::move(fn));
}

using stack = test::unit_stack;

}  // namespace

TEST_CASE("misused hooks raise usage_error on every rank", "[zero3][errors]") {
  auto misuse = [](auto fn) {
    return errors_per_rank(3, [&](Comm& c) {
      stack s(3, 10);
      z3_engine e(c, s.model);
      fn(e);
    });
  };
  SECTION("backward hooks for a unit that was never gathered") {
    for (const auto& m : misuse([](z3_engine& e) { e.post_backward(1); })) {
      REQUIRE_THAT(m, Catch::Contains("post_backward(1): unit 'block1' is not in its backward") &&
                          Catch::Contains("call pre_backward(1) first"));
    }
  }
  SECTION("a unit gathered twice") {
    for (const auto& m : misuse([](z3_engine& e) {
           e.pre_forward(0);
           e.pre_forward(0);
         })) {
      REQUIRE_THAT(m, Catch::Contains("unit 'block0' is already in its forward") &&
                          Catch::Contains("gathered twice"));
    }
  }
  SECTION("parameters read outside their unit's hooks") {
    for (const auto& m : misuse([](z3_engine& e) { (void)e.param(2); })) {
      REQUIRE_THAT(m,
                   Catch::Contains("'block1.w' belongs to unit 'block1', which is not gathered"));
    }
  }
  SECTION("a gradient handed over outside its unit's backward") {
    for (const auto& m : misuse([](z3_engine& e) {
           std::vector<float> g(10);
           e.grad_ready(0, g);
         })) {
      REQUIRE_THAT(m, Catch::Contains("outside the backward of its unit 'block0'"));
    }
  }
  SECTION("a unit that finishes its backward without all its gradients") {
    for (const auto& m : misuse([](z3_engine& e) {
           e.pre_backward(2);
           std::vector<float> g(10);
           e.grad_ready(4, g);
           e.post_backward(2);
         })) {
      REQUIRE_THAT(m, Catch::Contains("'block2' finished its backward without the gradients of "
                                      "'block2.b'"));
    }
  }
  SECTION("a step before every unit finished its backward") {
    for (const auto& m : misuse([](z3_engine& e) {
           for (std::size_t u = 0; u < 3; ++u) {
             e.pre_forward(u);
             e.post_forward(u);
           }
           e.pre_backward(2);
           std::vector<float> g(10), b(3);
           e.grad_ready(5, b);
           e.grad_ready(4, g);
           e.post_backward(2);
           e.step();
         })) {
      REQUIRE_THAT(m, Catch::Contains("unit 'block0' has not finished a backward in this step"));
    }
    for (const auto& m : misuse([](z3_engine& e) {
           e.pre_backward(0);
           e.step();
         })) {
      REQUIRE_THAT(m, Catch::Contains("unit 'block0' is still in its backward"));
    }
  }
  SECTION("unknown unit indices") {
    for (const auto& m : misuse([](z3_engine& e) { e.pre_forward(3); })) {
      REQUIRE_THAT(m, Catch::Contains("unit 3 out of range (3 units declared)"));
    }
  }
}

TEST_CASE("ranks that call the hooks in different orders are stopped, not silently mixed",
          "[zero3][errors]") {
  SECTION("units of equal size: the step is refused on every rank") {
    for (const auto& m : errors_per_rank(2, [](Comm& c) {
           stack s(3, 10);
           engine_options o;
           o.prefetch = 0;  // with prefetch the gathers and reductions interleave differently,
                            // which the communicator catches even earlier (collective_mismatch)
           z3_engine e(c, s.model, {}, o);
           std::vector<std::size_t> order{0, 1, 2};
           if (c.rank() == 1) order = {1, 0, 2};  // rank 1 disagrees
           for (auto u : order) {
             e.pre_forward(u);
             e.post_forward(u);
           }
           for (auto it = order.rbegin(); it != order.rend(); ++it) {
             e.pre_backward(*it);
             std::vector<float> g(10), b(3);
             e.grad_ready(2 * *it + 1, b);
             e.grad_ready(2 * *it, g);
             e.post_backward(*it);
           }
           e.step();
         })) {
      REQUIRE_THAT(m, Catch::Contains("issued the engine's collectives in different orders") &&
                          Catch::Contains("the step was not applied"));
    }
  }
  SECTION("units of different sizes: the gather itself fails on every rank") {
    for (const auto& m : errors_per_rank(2, [](Comm& c) {
           std::vector<float> a(10), b(20);
           model_spec ms;
           ms.begin_unit("small");
           ms.add("a", a);
           ms.begin_unit("large");
           ms.add("b", b);
           engine_options o;
           o.prefetch = 0;
           z3_engine e(c, ms, {}, o);
           e.pre_forward(c.rank() == 0 ? 0 : 1);
         })) {
      REQUIRE_THAT(m, Catch::Contains("collective mismatch") && Catch::Contains("all_gather"));
    }
  }
}

TEST_CASE("ZeRO-2 buckets handed over in different orders are caught at step()",
          "[engine][errors]") {
  for (const auto& m : errors_per_rank(2, [](Comm& c) {
         std::vector<float> a(8), b(8);
         model_spec ms;
         ms.begin_unit("first");
         ms.add("a", a);
         ms.begin_unit("second");
         ms.add("b", b);
         engine<Comm, zero2, bf16, adamw> e(c, ms);
         std::vector<float> g(8, 1.0f);
         if (c.rank() == 0) {
           e.grad_ready(1, g);
           e.grad_ready(0, g);
         } else {
           e.grad_ready(0, g);
           e.grad_ready(1, g);
         }
         e.step();
       })) {
    REQUIRE_THAT(m, Catch::Contains("different orders"));
  }
}
