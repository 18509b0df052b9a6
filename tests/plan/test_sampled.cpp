// The time model read off a calibration's samples (plan/sampled.hpp): exact at the sampled
// sizes, log-log interpolation between them, nothing outside them or for another collective,
// placement or rank count; bad samples named; a step's time from the samples where they reach
// and from the cluster's links elsewhere. And the sweep's options that time the collectives as
// the engine's step finds them (plan/calibrate.hpp).
#include <shardkit/comm/thread.hpp>
#include <shardkit/plan/calibrate.hpp>
#include <shardkit/plan/sampled.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace plan = shardkit::plan;
using Catch::Contains;
using shardkit::collective;

namespace {

plan::calibration_sample sample(collective op, std::uint64_t count, double seconds,
                                bool in_place = false, std::uint64_t ranks = 2,
                                std::uint64_t elem_bytes = 2) {
  return {op, count, elem_bytes, ranks, seconds, in_place};
}

// t = 1 µs · (bytes / 1 KiB)^0.7: a power law, which log-log interpolation reproduces exactly.
double power_law(std::uint64_t bytes) {
  return 1e-6 * std::pow(static_cast<double>(bytes) / 1024.0, 0.7);
}

}  // namespace

TEST_CASE("sampled_times: the samples at their sizes, log-log interpolation between them") {
  std::vector<plan::calibration_sample> s;
  for (std::uint64_t n = 1024; n <= (std::uint64_t{1} << 20); n *= 4) {
    s.push_back(sample(collective::reduce_scatter, n, power_law(2 * n)));
  }
  // Another placement and rank count, ten times slower: never mixed with the ones above.
  s.push_back(sample(collective::reduce_scatter, 1024, 10 * power_law(2048), true));
  s.push_back(sample(collective::reduce_scatter, 1 << 20, 10 * power_law(2 << 20), true));
  s.push_back(sample(collective::reduce_scatter, 1024, 10 * power_law(2048), false, 4));
  s.push_back(sample(collective::reduce_scatter, 1 << 20, 10 * power_law(2 << 20), false, 4));
  const plan::sampled_times t(s);
  CHECK(t.samples().size() == s.size());

  // At a sampled size: the sample itself.
  REQUIRE(t.at(collective::reduce_scatter, 4096, 2, 2, false));
  CHECK(*t.at(collective::reduce_scatter, 4096, 2, 2, false) == s[1].seconds);
  // Between samples: the power law they lie on (not the straight line between them).
  for (const std::uint64_t n : {1500u, 3000u, 100000u, 1000000u}) {
    INFO("count " << n);
    const auto v = t.at(collective::reduce_scatter, n, 2, 2, false);
    REQUIRE(v);
    CHECK(*v == Approx(power_law(2 * n)).epsilon(1e-9));
  }
  // Keyed by bytes: 4-byte elements of half the count are the same call.
  CHECK(*t.at(collective::reduce_scatter, 1500, 4, 2, false) ==
        Approx(power_law(6000)).epsilon(1e-9));
  // In place and over 4 ranks: their own samples.
  CHECK(*t.at(collective::reduce_scatter, 3000, 2, 2, true) ==
        Approx(10 * power_law(6000)).epsilon(1e-9));
  CHECK(*t.at(collective::reduce_scatter, 3000, 2, 4, false) ==
        Approx(10 * power_law(6000)).epsilon(1e-9));
  // Outside the sampled sizes, or of what was not sampled: nothing.
  CHECK_FALSE(t.at(collective::reduce_scatter, 1000, 2, 2, false));
  CHECK_FALSE(t.at(collective::reduce_scatter, (1 << 20) + 1, 2, 2, false));
  CHECK_FALSE(t.at(collective::all_gather, 4096, 2, 2, false));
  CHECK_FALSE(t.at(collective::reduce_scatter, 4096, 2, 8, false));
  CHECK_FALSE(plan::sampled_times{}.at(collective::all_reduce, 4096, 2, 2, false));
  CHECK(plan::sampled_times{}.empty());
}

TEST_CASE("sampled_times: repeated samples merge into their geometric mean") {
  const plan::sampled_times t({sample(collective::all_gather, 4096, 1e-6),
                               sample(collective::all_gather, 4096, 4e-6),
                               sample(collective::all_gather, 4096, 9e-6, false, 2, 4)});
  // 4096 4-byte elements are 16 KiB: a second size, not a third sample of the first.
  REQUIRE(t.samples().size() == 2);
  CHECK(*t.at(collective::all_gather, 4096, 2, 2, false) == Approx(2e-6).epsilon(1e-12));
  CHECK(*t.at(collective::all_gather, 4096, 4, 2, false) == 9e-6);
  CHECK(*t.at(collective::all_gather, 8192, 2, 2, false) == 9e-6);
}

TEST_CASE("sampled_times: samples that cannot be measured times are named") {
  const auto bad = [](plan::calibration_sample x) {
    return std::vector<plan::calibration_sample>{sample(collective::all_reduce, 1024, 1e-6), x};
  };
  CHECK_THROWS_WITH(plan::sampled_times(bad(sample(collective::all_reduce, 1024, 1e-6, false, 1))),
                    Contains("sample 1") && Contains("fewer than 2 ranks"));
  CHECK_THROWS_WITH(plan::sampled_times(bad(sample(collective::all_reduce, 0, 1e-6))),
                    Contains("sample 1") && Contains("no bytes"));
  CHECK_THROWS_WITH(plan::sampled_times(bad(sample(collective::broadcast, 1024, 1e-6))),
                    Contains("sample 1") && Contains("expected all-reduce, reduce-scatter"));
  CHECK_THROWS_WITH(plan::sampled_times(bad(sample(collective::all_reduce, 1024, 0.0))),
                    Contains("sample 1") && Contains("not positive and finite"));
  CHECK_THROWS_WITH(plan::sampled_times(bad(sample(collective::all_reduce, 1024,
                                                   std::numeric_limits<double>::quiet_NaN()))),
                    Contains("not positive and finite"));
  CHECK_THROWS_AS(plan::sampled_times(bad(sample(collective::all_reduce, 1024, -1.0))),
                  plan::calibration_error);
}

TEST_CASE("sampled_times: a step's time from the samples where they reach, the links elsewhere") {
  // Stage 3 on 4 ranks, 3 units, on one node: per-unit all-gathers and reduce-scatters.
  plan::setup s;
  s.stage = 3;
  s.ranks = 4;
  s.bytes =
      plan::precision_of(shardkit::dtype::bf16, shardkit::dtype::bf16, plan::optimizer_kind::adamw);
  const std::vector<plan::unit> units{{1 << 20}, {1 << 18}, {3 << 16}};
  plan::cluster a;  // the links a user gave
  a.gpus_per_node = 4;
  a.intra = {20e-6, 5e9};
  plan::cluster b = a;  // what was measured: another link
  b.intra = {7e-6, 11e9};
  // Samples of b exactly at the sizes of the step's reduce-scatters and all-gathers.
  std::vector<plan::calibration_sample> measured;
  plan::for_each_collective(s, units, [&](const plan::collective_call& c) {
    if (c.op != collective::reduce_scatter && c.op != collective::all_gather) return;
    const plan::placement where = plan::place(s, c.group, b);
    measured.push_back({c.op, c.count, c.elem_bytes, where.size,
                        plan::collective_time(c.op, c.count, c.elem_bytes, where, b,
                                              plan::algorithm::ring, c.in_place),
                        c.in_place});
  });
  REQUIRE(measured.size() >= 4);
  const plan::sampled_times t(measured);
  // Every call is sampled: b's times, not a's.
  double want = 0.0;
  plan::for_each_collective(s, units, [&](const plan::collective_call& c) {
    const bool sampled = c.op == collective::reduce_scatter || c.op == collective::all_gather;
    want += static_cast<double>(c.repeat) *
            plan::collective_time(c.op, c.count, c.elem_bytes, plan::place(s, c.group, a),
                                  sampled ? b : a, plan::algorithm::ring, c.in_place);
  });
  CHECK(plan::comm_time_per_step(s, units, a, t) == Approx(want).epsilon(1e-12));
  CHECK(plan::comm_time_per_step(s, units, a, t) != Approx(plan::comm_time_per_step(s, units, a)));
  // No samples: the links alone.
  CHECK(plan::comm_time_per_step(s, units, a, plan::sampled_times{}) ==
        plan::comm_time_per_step(s, units, a));
  // Without in-place samples, the in-place calls read the out-of-place ones (as an unset
  // in-place link falls back to the collective's link).
  std::vector<plan::calibration_sample> out_only;
  double want_out = 0.0;
  plan::for_each_collective(s, units, [&](const plan::collective_call& c) {
    const plan::placement where = plan::place(s, c.group, b);
    const bool sampled = c.op == collective::reduce_scatter || c.op == collective::all_gather;
    if (sampled) {
      out_only.push_back({c.op, c.count, c.elem_bytes, where.size,
                          plan::collective_time(c.op, c.count, c.elem_bytes, where, b), false});
    }
    want_out += static_cast<double>(c.repeat) *
                plan::collective_time(c.op, c.count, c.elem_bytes, where, sampled ? b : a,
                                      plan::algorithm::ring, !sampled && c.in_place);
  });
  const plan::sampled_times out_times(out_only);
  CHECK_FALSE(out_times.has(collective::all_gather, 4, true));
  CHECK(out_times.has(collective::all_gather, 4, false));
  CHECK(plan::comm_time_per_step(s, units, a, out_times) == Approx(want_out).epsilon(1e-12));
  // Groups that span nodes (2 ranks per node): the samples stand for links inside a node, so
  // every call takes the links.
  plan::cluster two_nodes = a;
  two_nodes.gpus_per_node = 2;
  CHECK(plan::comm_time_per_step(s, units, two_nodes, t) ==
        plan::comm_time_per_step(s, units, two_nodes));
}

TEST_CASE("calibrate: a sweep with outputs zeroed, timed from the last start to the first return") {
  plan::sweep_options o;
  o.max_bytes = 1 << 20;
  o.reps = 3;
  o.fresh_input = true;
  o.asynchronous = true;
  o.element = shardkit::dtype::bf16;
  o.zero_reduce_outputs = true;
  const auto r = shardkit::run_ranks(
      2, [&](shardkit::thread_comm& comm) { return plan::measure_collectives(comm, o); });
  REQUIRE(r[0].size() == 3 * 5);  // 3 collectives x {4, 16, 64, 256} KiB and 1 MiB
  for (std::size_t i = 0; i < r[0].size(); ++i) {
    INFO("sample " << i);
    CHECK(r[0][i].seconds > 0);
    CHECK(std::isfinite(r[0][i].seconds));
    CHECK(r[1][i].seconds == r[0][i].seconds);  // every rank the same time
  }
  // The samples make a sampled_times that answers at every sampled size.
  const plan::sampled_times t(r[0]);
  for (const auto& x : r[0]) {
    CHECK(t.at(x.op, x.count, x.elem_bytes, x.ranks, x.in_place) == x.seconds);
  }
  // Timed from the last rank's start to the first rank's return, back to back as well.
  o.after_last_arrival = true;
  for (const bool fresh : {true, false}) {
    o.fresh_input = fresh;
    o.zero_reduce_outputs = fresh;
    const auto a = shardkit::run_ranks(
        2, [&](shardkit::thread_comm& comm) { return plan::measure_collectives(comm, o); });
    REQUIRE(a[0].size() == r[0].size());
    for (std::size_t i = 0; i < a[0].size(); ++i) {
      INFO("fresh " << fresh << ", sample " << i);
      CHECK(a[0][i].seconds > 0);
      CHECK(std::isfinite(a[0][i].seconds));
      CHECK(a[1][i].seconds == a[0][i].seconds);
    }
  }
  // Zeroing the outputs prepares a call that is then timed alone.
  o.zero_reduce_outputs = true;
  o.fresh_input = false;
  CHECK_THROWS_WITH(plan::check(o, 3), Contains("rank 3") && Contains("zero_reduce_outputs") &&
                                           Contains("without fresh_input"));
}
