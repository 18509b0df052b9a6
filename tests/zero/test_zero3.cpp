// ZeRO-3 specifics: prefetch that really overlaps compute, the live-parameter limit, and every
// misuse of the unit hooks raising the documented error on every rank.
#include <shardkit/shardkit.hpp>

#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

using namespace shardkit;
using namespace std::chrono_literals;

namespace {

using z3_engine = engine<thread_comm, zero3, bf16, adamw>;

// A stack of `units` units with one weight of `elems` elements each (plus a bias for variety).
struct stack {
  std::vector<std::vector<float>> values;
  model_spec model;
  stack(std::size_t units, std::size_t elems) {
    values.reserve(2 * units);
    for (std::size_t u = 0; u < units; ++u) {
      values.emplace_back(elems, 0.01f * static_cast<float>(u + 1));
      values.emplace_back(3, 0.0f);
      model.begin_unit("block" + std::to_string(u));
      model.add("block" + std::to_string(u) + ".w", values[values.size() - 2]);
      model.add("block" + std::to_string(u) + ".b", values.back());
    }
  }
};

// Forward and backward over every unit in order, handing over constant gradients.
template <class E>
void one_step(E& e, std::chrono::microseconds compute = 0us) {
  const std::size_t U = e.num_units();
  for (std::size_t u = 0; u < U; ++u) {
    e.pre_forward(u);
    std::this_thread::sleep_for(compute);
    e.post_forward(u);
  }
  for (std::size_t u = U; u-- > 0;) {
    e.pre_backward(u);
    std::this_thread::sleep_for(compute);
    for (std::size_t i = 2 * u + 2; i-- > 2 * u;) {
      std::vector<float> g(e.param(i).size(), 0.5f);
      e.grad_ready(i, g);
    }
    e.post_backward(u);
  }
  e.step();
}

using test::errors_per_rank;

}  // namespace

TEST_CASE("prefetched gathers complete while the previous unit computes", "[zero3][prefetch]") {
  // Each unit "computes" for 20 ms. With prefetch, unit u+1's all-gather is issued when unit u
  // starts and has finished (on the communicator's progress thread) before unit u ends.
  auto r = run_ranks(4, [](thread_comm& c) {
    stack s(6, 4096);
    engine_options o;
    o.prefetch = 1;
    o.trace = true;
    z3_engine e(c, s.model, {}, o);
    one_step(e, 20ms);  // the first step records the hook order
    e.clear_trace();
    one_step(e, 20ms);
    return e.trace();
  });
  for (const auto& trace : r) {
    auto at = [&](trace_event::kind k, std::size_t u, bool bwd) {
      for (const auto& ev : trace) {
        if (ev.what == k && ev.unit == u && ev.backward == bwd) return ev.time;
      }
      FAIL("missing trace event for unit " << u);
      return std::chrono::steady_clock::time_point{};
    };
    using K = trace_event::kind;
    for (std::size_t u = 1; u < 6; ++u) {  // forward: unit u prefetched during unit u-1
      CHECK(at(K::gather_issued, u, false) <= at(K::compute_started, u - 1, false));
      CHECK(at(K::gather_completed, u, false) < at(K::compute_ended, u - 1, false));
    }
    for (std::size_t u = 0; u + 1 < 6; ++u) {  // backward runs in reverse
      CHECK(at(K::gather_issued, u, true) <= at(K::compute_started, u + 1, true));
      CHECK(at(K::gather_completed, u, true) < at(K::compute_ended, u + 1, true));
    }
  }
}

TEST_CASE("without prefetch, a unit is gathered only when its hook asks", "[zero3][prefetch]") {
  auto r = run_ranks(2, [](thread_comm& c) {
    stack s(4, 100);
    engine_options o;
    o.prefetch = 0;
    o.trace = true;
    z3_engine e(c, s.model, {}, o);
    one_step(e);
    std::size_t issued = 0;
    for (const auto& ev : e.trace()) issued += ev.what == trace_event::kind::gather_issued;
    return std::pair{issued, e.memory().peak(memory_category::gathered_params)};
  });
  for (auto [issued, peak] : r) {
    CHECK(issued == 8);                 // each unit once in forward, once in backward
    CHECK(peak == 104 * sizeof(bf16));  // one unit (103 elements padded to 104) at a time
  }
}

TEST_CASE("the live-parameter limit", "[zero3][limit]") {
  SECTION("a unit larger than the limit is rejected at construction") {
    for (const auto& msg : errors_per_rank(2, [](thread_comm& c) {
           stack s(3, 1000);
           engine_options o;
           o.max_live_elems = 500;
           z3_engine e(c, s.model, {}, o);
         })) {
      REQUIRE_THAT(msg, Catch::Contains("max_live_elems = 500") && Catch::Contains("'block0'") &&
                            Catch::Contains("1004 elements"));
    }
  }
  SECTION("prefetching stops short of the limit") {
    auto r = run_ranks(2, [](thread_comm& c) {
      stack s(5, 1000);  // 1003 elements per unit, 1004 padded
      engine_options o;
      o.prefetch = 3;
      o.max_live_elems = 2100;  // room for two units, not four
      z3_engine e(c, s.model, {}, o);
      one_step(e);
      one_step(e);
      return std::pair{e.memory().peak(memory_category::gathered_params), e.gathered_bytes_bound()};
    });
    for (auto [peak, bound] : r) {
      CHECK(peak <= 2100 * sizeof(bf16));
      CHECK(peak == 2 * 1004 * sizeof(bf16));
      CHECK(bound == 2100 * sizeof(bf16));
    }
  }
}

TEST_CASE("misused hooks raise usage_error on every rank", "[zero3][errors]") {
  auto misuse = [](auto fn) {
    return errors_per_rank(3, [&](thread_comm& c) {
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
    for (const auto& m : errors_per_rank(2, [](thread_comm& c) {
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
    for (const auto& m : errors_per_rank(2, [](thread_comm& c) {
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
  for (const auto& m : errors_per_rank(2, [](thread_comm& c) {
         std::vector<float> a(8), b(8);
         model_spec ms;
         ms.begin_unit("first");
         ms.add("a", a);
         ms.begin_unit("second");
         ms.add("b", b);
         engine<thread_comm, zero2, bf16, adamw> e(c, ms);
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

TEST_CASE("hooks are no-ops in stages 0-2, so framework code can call them at any stage",
          "[engine]") {
  auto r = run_ranks(2, [](thread_comm& c) {
    stack s(3, 10);
    engine<thread_comm, zero2, bf16, adamw> e(c, s.model);
    one_step(e);
    return static_cast<float>(e.param(0)[0]);
  });
  auto r3 = run_ranks(2, [](thread_comm& c) {
    stack s(3, 10);
    z3_engine e(c, s.model);
    one_step(e);
    e.pre_forward(0);
    const float v = static_cast<float>(e.param(0)[0]);
    e.post_forward(0);
    return v;
  });
  REQUIRE(r == r3);
}
