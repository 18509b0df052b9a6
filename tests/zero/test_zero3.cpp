// ZeRO-3 specifics: prefetch that really overlaps compute and the live-parameter limit. (Misuse
// of the unit hooks is in test_zero3_errors.cpp, over every communicator.)
#include <shardkit/shardkit.hpp>

#include "support/world.hpp"
#include "unit_stack.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

using namespace shardkit;
using namespace std::chrono_literals;

namespace {

using z3_engine = engine<thread_comm, zero3, bf16, adamw>;

using stack = test::unit_stack;

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
