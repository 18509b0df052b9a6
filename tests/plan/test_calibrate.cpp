// The calibration of the time model (plan/calibrate.hpp): the fit recovers α and β from times
// the model itself computes, stays close under noise, names what is wrong with bad samples, and
// the sweep runs on the thread communicator; the flags shardkit-plan --calibrate prints parse
// back (examples/shardkit-plan/calibrate.hpp); timed_comm forwards and counts.
#include <shardkit/comm/thread.hpp>
#include <shardkit/comm/timed.hpp>
#include <shardkit/plan/calibrate.hpp>

#include "shardkit-plan/calibrate.hpp"
#include "shardkit-plan/parse.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace plan = shardkit::plan;
using Catch::Contains;
using shardkit::collective;

namespace {

// Samples whose times are time.hpp's own flat-ring formula on one link.
std::vector<plan::calibration_sample> model_samples(const plan::link& l,
                                                    std::vector<std::uint64_t> ranks) {
  std::vector<plan::calibration_sample> out;
  plan::cluster c;
  c.gpus_per_node = 1024;
  c.intra = l;
  for (const std::uint64_t P : ranks) {
    for (const collective op :
         {collective::all_gather, collective::reduce_scatter, collective::all_reduce}) {
      for (std::uint64_t bytes = 4096; bytes <= (std::uint64_t{64} << 20); bytes *= 4) {
        const std::uint64_t n = bytes / 2;  // bf16 elements of the whole array
        const std::uint64_t count = op == collective::all_reduce ? n : n / P;
        const double t = plan::collective_time(op, count, 2, plan::placement{P, P}, c);
        out.push_back({op, count, 2, P, t});
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("calibrate: ring_coefficients are the ring formulas, and the model's times") {
  // The closed forms of plan/time.hpp's file comment, written out here: messages and bytes in
  // sequence of a flat ring over P ranks, n elements of 4 bytes.
  const auto want = [](collective op, std::uint64_t n, std::uint64_t P) -> plan::ring_terms {
    const double s = static_cast<double>(P - 1);
    const double chunk = static_cast<double>((n + P - 1) / P * 4);
    switch (op) {
      case collective::all_reduce:
        return {2 * s, 2 * s * chunk};
      case collective::broadcast:
        return {s, 4.0 * static_cast<double>(n)};
      case collective::barrier:
        return {s, 0.0};
      default:  // reduce-scatter, all-gather, all-to-all: n elements per rank and step
        return {s, s * 4.0 * static_cast<double>(n)};
    }
  };
  const plan::link l{3.7e-6, 12.5e9};
  plan::cluster c;
  c.gpus_per_node = 64;
  c.intra = l;
  for (const collective op :
       {collective::all_gather, collective::reduce_scatter, collective::all_reduce,
        collective::all_to_all, collective::broadcast, collective::barrier}) {
    for (const std::uint64_t P : {2u, 3u, 4u, 8u}) {
      for (const std::uint64_t n : {1u, 7u, 1000u, 1u << 20}) {
        INFO(name(op) << ", " << n << " elements, " << P << " ranks");
        const auto t = plan::ring_coefficients(op, n, 4, P);
        const auto w = want(op, n, P);
        CHECK(t.a == w.a);
        CHECK(t.b == w.b);
        const double model = plan::collective_time(op, n, 4, plan::placement{P, P}, c);
        CHECK(model == Approx(w.a * l.latency_s + w.b / l.bytes_per_s).epsilon(1e-12));
      }
    }
    CHECK(plan::ring_coefficients(op, 1000, 4, 1).a == 0.0);  // one rank: no ring
    CHECK(plan::collective_time(op, 1000, 4, plan::placement{1, 1}, c) == 0.0);
  }
}

TEST_CASE("calibrate: the fit recovers alpha and beta exactly from the model's own times") {
  for (const plan::link l :
       {plan::link{5e-6, 450e9}, plan::link{2.5e-5, 3e9}, plan::link{1e-7, 80e9}}) {
    for (const auto& ranks : {std::vector<std::uint64_t>{2}, std::vector<std::uint64_t>{4},
                              std::vector<std::uint64_t>{2, 3, 8}}) {
      const auto s = model_samples(l, ranks);
      const plan::link_fit f = plan::fit_link(s);
      CHECK_FALSE(f.latency_fixed_at_zero);
      CHECK(f.fitted.latency_s == Approx(l.latency_s).epsilon(1e-9));
      CHECK(f.fitted.bytes_per_s == Approx(l.bytes_per_s).epsilon(1e-9));
      CHECK(f.max_rel_error < 1e-9);
      REQUIRE(f.model_seconds.size() == s.size());
      for (std::size_t i = 0; i < s.size(); ++i) {
        CHECK(f.model_seconds[i] == Approx(s[i].seconds).epsilon(1e-9));
      }
    }
  }
}

TEST_CASE("calibrate: with 5% multiplicative noise the fit stays within 10%") {
  const plan::link l{8e-6, 20e9};
  std::mt19937 rng(42);
  std::uniform_real_distribution<double> noise(0.95, 1.05);
  for (int trial = 0; trial < 20; ++trial) {
    auto s = model_samples(l, {4});
    for (auto& x : s) x.seconds *= noise(rng);
    const plan::link_fit f = plan::fit_link(s);
    CHECK(f.fitted.latency_s == Approx(l.latency_s).epsilon(0.10));
    CHECK(f.fitted.bytes_per_s == Approx(l.bytes_per_s).epsilon(0.10));
    CHECK(f.max_rel_error < 0.12);
    CHECK(f.rms_rel_error <= f.max_rel_error);
  }
}

TEST_CASE("calibrate: a negative alpha is refitted with alpha = 0 and reported") {
  // Pure bandwidth with a little less time at the small sizes: the unconstrained α is < 0.
  std::vector<plan::calibration_sample> s;
  for (std::uint64_t n = 1024; n <= (1u << 22); n *= 4) {
    const double t = 2.0 * static_cast<double>(n) * 4 / 10e9 * (n < 8192 ? 0.7 : 1.0);
    s.push_back({collective::all_gather, n, 4, 3, t});
  }
  const plan::link_fit f = plan::fit_link(s);
  CHECK(f.latency_fixed_at_zero);
  CHECK(f.unconstrained_latency_s < 0);
  CHECK(f.fitted.latency_s == 0);
  CHECK(f.fitted.bytes_per_s > 0);
  CHECK(f.max_rel_error > 0);
}

TEST_CASE("calibrate: samples that cannot be fitted are named, with what was expected") {
  using S = plan::calibration_sample;
  const S ok1{collective::all_reduce, 1024, 4, 2, 1e-5};
  const S ok2{collective::all_reduce, 1 << 20, 4, 2, 1e-3};
  auto fit = [](std::vector<S> v) { return plan::fit_link(v); };
  CHECK_THROWS_AS(fit({ok1}), plan::calibration_error);
  CHECK_THROWS_WITH(fit({ok1}), Contains("1 sample(s); expected at least 2 with different sizes"));
  CHECK_THROWS_WITH(fit({ok1, ok1, ok1}), Contains("every sample has the same message size") &&
                                              Contains("expected at least 2 distinct sizes"));
  CHECK_THROWS_WITH(
      fit({ok1, S{collective::all_reduce, 1 << 20, 4, 1, 1e-3}}),
      Contains("sample 1 (all_reduce") && Contains("has 1 rank(s); expected at least 2"));
  CHECK_THROWS_WITH(fit({ok1, S{collective::all_gather, 1 << 20, 4, 2, 0.0}}),
                    Contains("sample 1") && Contains("not a positive finite number of seconds"));
  CHECK_THROWS_WITH(fit({ok1, S{collective::all_gather, 1 << 20, 4, 2, -1.0}}),
                    Contains("not a positive finite number of seconds"));
  CHECK_THROWS_WITH(fit({ok1, S{collective::all_gather, 1 << 20, 4, 2, std::nan("")}}),
                    Contains("not a positive finite number of seconds"));
  CHECK_THROWS_WITH(fit({S{collective::barrier, 0, 4, 2, 1e-5}, ok2}),
                    Contains("sample 0") && Contains("moves no bytes"));
  // Times that fall with size: no bandwidth explains them.
  CHECK_THROWS_WITH(fit({S{collective::all_reduce, 1024, 4, 2, 1e-3},
                         S{collective::all_reduce, 1 << 20, 4, 2, 1e-5}}),
                    Contains("not positive: the measured times do not grow with size"));
  CHECK_NOTHROW(fit({ok1, ok2}));
}

TEST_CASE("calibrate: sweep options are checked") {
  plan::sweep_options o;
  o.max_bytes = o.min_bytes;
  CHECK_THROWS_WITH(plan::check(o, 1),
                    Contains("rank 1") && Contains("expected at least two sizes"));
  o = {};
  o.reps = 0;
  CHECK_THROWS_WITH(plan::check(o, 0), Contains("expected reps >= 1"));
  // The optimizer's bytes age the in-place all-gathers, each timed alone: both are needed.
  o = {};
  o.optimizer_bytes = 1 << 20;
  CHECK_THROWS_WITH(plan::check(o, 2), Contains("rank 2") && Contains("optimizer_bytes 1048576") &&
                                           Contains("without fresh_input and in_place"));
  o.fresh_input = true;
  CHECK_THROWS_WITH(plan::check(o, 0), Contains("without fresh_input and in_place"));
  o.in_place = true;
  CHECK_NOTHROW(plan::check(o, 0));
  o.fresh_input = false;
  CHECK_THROWS_WITH(plan::check(o, 0), Contains("without fresh_input and in_place"));
  // The gathers grouped after one optimizer pass need that pass.
  o = {};
  o.fresh_input = o.in_place = true;
  o.gathered_bytes = 4096;
  CHECK_THROWS_WITH(plan::check(o, 3), Contains("rank 3") && Contains("gathered_bytes 4096") &&
                                           Contains("without optimizer_bytes"));
  o.optimizer_bytes = 1 << 20;
  CHECK_NOTHROW(plan::check(o, 0));
}

TEST_CASE("calibrate: gathered_bytes times the in-place all-gathers in runs after one pass") {
  // fp32, 4 KiB, 16 KiB and 64 KiB over 2 ranks: each rank contributes 2, 8 and 32 KiB to an
  // in-place all-gather. With 16 KiB gathered after each optimizer pass, the runs are 8, 2 and
  // 1 calls long (at least one, at most max_iters); each repetition (warm-up included) is one
  // run, after the sweep's one untimed call per size.
  plan::sweep_options o;
  o.max_bytes = 64 << 10;
  o.reps = 3;
  o.warmup = 1;
  o.fresh_input = true;
  o.in_place = true;
  o.out_of_place = false;
  o.optimizer_bytes = 1 << 20;
  const std::size_t counts[] = {512, 2048, 8192};  // per rank
  auto gathers = [&](const plan::sweep_options& opt) {
    const auto r = shardkit::run_ranks(2, [&](shardkit::thread_comm& c) {
      shardkit::timed_comm<shardkit::thread_comm> t(std::move(c));
      t.timing().record = true;
      const auto samples = plan::measure_collectives(t, opt);
      std::vector<int> calls(3, 0);
      for (const auto& rec : t.timing().log) {
        if (rec.kind != collective::all_gather || !rec.in_place) continue;
        for (int i = 0; i < 3; ++i) calls[i] += rec.count == counts[i] ? 1 : 0;
      }
      for (const auto& x : samples) {
        if (x.op == collective::all_gather) CHECK(x.seconds > 0);
      }
      return calls;
    });
    CHECK(r[1] == r[0]);
    return r[0];
  };
  CHECK(gathers(o) == std::vector<int>{5, 5, 5});  // each call aged by a pass of its own
  o.gathered_bytes = 16 << 10;
  CHECK(gathers(o) == std::vector<int>{1 + 4 * 8, 1 + 4 * 2, 1 + 4 * 1});
  o.max_iters = 4;
  CHECK(gathers(o) == std::vector<int>{1 + 4 * 4, 1 + 4 * 2, 1 + 4 * 1});
}

TEST_CASE("calibrate: the sweep over 2 thread ranks gives a positive, finite link") {
  plan::sweep_options o;
  // A short sweep, 4 KiB .. 4 MiB: with three decades of sizes the time per byte is positive
  // even on a machine busy with builds (4 KiB .. 64 KiB alone was not, once).
  o.max_bytes = 4 << 20;
  o.reps = 3;
  const auto results =
      shardkit::run_ranks(2, [&](shardkit::thread_comm& comm) { return plan::calibrate(comm, o); });
  REQUIRE(results.size() == 2);
  const auto& c = results[0];
  CHECK(c.samples.size() == 3 * 6);  // 3 collectives x {4, 16, 64, 256} KiB, {1, 4} MiB
  for (const auto& s : c.samples) {
    CHECK(s.ranks == 2);
    CHECK(s.seconds > 0);
  }
  CHECK(std::isfinite(c.fit.fitted.latency_s));
  CHECK(c.fit.fitted.latency_s >= 0);
  CHECK(std::isfinite(c.fit.fitted.bytes_per_s));
  CHECK(c.fit.fitted.bytes_per_s > 0);
  // Every rank returns the same samples (the slowest rank's times).
  for (std::size_t i = 0; i < c.samples.size(); ++i) {
    CHECK(results[1].samples[i].seconds == c.samples[i].seconds);
  }
  // bf16 buffers: the same sizes in bytes, 2-byte elements.
  o.element = shardkit::dtype::bf16;
  const auto b = shardkit::run_ranks(
      2, [&](shardkit::thread_comm& comm) { return plan::measure_collectives(comm, o); });
  REQUIRE(b[0].size() == c.samples.size());
  for (std::size_t i = 0; i < b[0].size(); ++i) {
    CHECK(b[0][i].elem_bytes == 2);
    CHECK(b[0][i].count == 2 * c.samples[i].count);
    CHECK(b[0][i].seconds > 0);
  }
  // Cache-cold buffers (64 MiB that the calls walk through): the same samples, timed.
  o.cold_bytes = std::size_t{64} << 20;
  const auto cold = shardkit::run_ranks(
      2, [&](shardkit::thread_comm& comm) { return plan::measure_collectives(comm, o); });
  REQUIRE(cold[0].size() == c.samples.size());
  for (std::size_t i = 0; i < cold[0].size(); ++i) {
    CHECK(cold[0][i].op == b[0][i].op);
    CHECK(cold[0][i].count == b[0][i].count);
    CHECK(cold[0][i].seconds > 0);
    CHECK(cold[1][i].seconds == cold[0][i].seconds);
  }
}

TEST_CASE("calibrate: the sweep refuses a communicator of one rank") {
  auto one = shardkit::run_ranks(1, [](shardkit::thread_comm& comm) {
    try {
      (void)plan::calibrate(comm);
    } catch (const plan::calibration_error& e) {
      return std::string(e.what());
    }
    return std::string();
  });
  CHECK_THAT(one[0], Contains("rank 0") && Contains("has 1 rank; expected at least 2"));
}

TEST_CASE("shardkit-plan --calibrate: the printed flags parse back to the fitted link") {
  for (const plan::link l : {plan::link{3.1e-6, 5.2e9}, plan::link{0, 450e9},
                             plan::link{850e-9, 750e6}, plan::link{1.25e-3, 90e3}}) {
    const std::string flags = shardkit_plan::calibration_flags(l, 4);
    std::istringstream in(flags);
    std::string flag, value;
    double alpha = -1, bw = -1;
    std::uint64_t gpn = 0;
    while (in >> flag >> value) {
      if (flag == "--gpus-per-node") gpn = cli::parse_count(flag, value);
      if (flag == "--intra-alpha") alpha = cli::parse_duration(flag, value);
      if (flag == "--intra-bw") bw = cli::parse_bandwidth(flag, value);
    }
    INFO(flags);
    CHECK(gpn == 4);
    CHECK(alpha == Approx(l.latency_s).epsilon(1e-3).margin(1e-15));
    CHECK(bw == Approx(l.bytes_per_s).epsilon(1e-3));
  }
}

TEST_CASE("shardkit-plan --calibrate: --max-bytes takes plain bytes or a unit") {
  CHECK(shardkit_plan::parse_plain_or_unit_bytes("--max-bytes", "65536") == 65536);
  CHECK(shardkit_plan::parse_plain_or_unit_bytes("--max-bytes", "1MiB") == (1u << 20));
  CHECK(shardkit_plan::parse_plain_or_unit_bytes("--max-bytes", "16MB") == 16'000'000);
  CHECK_THROWS_WITH(shardkit_plan::parse_plain_or_unit_bytes("--max-bytes", "1Mb"),
                    Contains("unknown unit 'Mb'"));
}

TEST_CASE("timed_comm forwards every collective and counts its calls and seconds") {
  using timed = shardkit::timed_comm<shardkit::thread_comm>;
  static_assert(shardkit::communicator<timed>);
  struct out {
    std::vector<float> sum, gathered;
    std::uint64_t calls_ar = 0, calls_ag = 0, calls_rs = 0, calls_total = 0;
    double seconds = 0;
    std::uint64_t bytes = 0;
  };
  const auto r = shardkit::run_ranks(2, [](shardkit::thread_comm& c) {
    timed t(std::move(c));
    out o;
    std::vector<float> x(4, static_cast<float>(t.rank() + 1));
    o.sum.resize(4);
    t.all_reduce(x.data(), o.sum.data(), 4);
    o.gathered.resize(8);
    auto w = t.all_gather_async(x.data(), o.gathered.data(), 4);
    w.wait();
    std::vector<float> part(2);
    t.reduce_scatter(x.data(), part.data(), 2);
    timed sub = t.split(0, t.rank());  // shares the timing
    sub.barrier();
    o.calls_ar = t.timing().calls_of(collective::all_reduce);
    o.calls_ag = t.timing().calls_of(collective::all_gather);
    o.calls_rs = t.timing().calls_of(collective::reduce_scatter);
    o.calls_total = t.timing().total_calls();
    o.seconds = t.timing().total_seconds();
    o.bytes = t.traffic().total_bytes_sent();
    return o;
  });
  for (const auto& o : r) {
    CHECK(o.sum == std::vector<float>(4, 3.0f));
    CHECK(o.gathered == std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2});
    CHECK(o.calls_ar == 1);
    CHECK(o.calls_ag == 1);
    CHECK(o.calls_rs == 1);
    CHECK(o.calls_total == 4);  // and the sub-communicator's barrier
    CHECK(o.seconds > 0);
    CHECK(o.bytes > 0);
  }
}

TEST_CASE(
    "timed_comm logs each call when asked: in issue order, an asynchronous one left at wait") {
  using timed = shardkit::timed_comm<shardkit::thread_comm>;
  struct out {
    std::vector<shardkit::call_record> log;
    double issued = 0, waited = 0;  // around the asynchronous call's issue and its wait()
    std::size_t before_record = 0;
  };
  const auto r = shardkit::run_ranks(2, [](shardkit::thread_comm& c) {
    timed t(std::move(c));
    out o;
    std::vector<float> x(4, 1.0f), y(8);
    t.barrier();  // not recorded: record is off
    o.before_record = t.timing().log.size();
    t.timing().record = true;
    t.all_reduce(x.data(), x.data(), 4);
    auto w = t.all_gather_async(x.data(), y.data(), 4);
    o.issued = shardkit::comm_timing::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    w.wait();
    o.waited = shardkit::comm_timing::now();
    t.reduce_scatter(y.data(), x.data(), 4);
    o.log = t.timing().log;
    return o;
  });
  for (const auto& o : r) {
    CHECK(o.before_record == 0);
    REQUIRE(o.log.size() == 3);
    CHECK(o.log[0].kind == collective::all_reduce);
    CHECK(o.log[1].kind == collective::all_gather);
    CHECK(o.log[2].kind == collective::reduce_scatter);
    for (std::size_t i = 0; i < 3; ++i) CHECK(o.log[i].entered <= o.log[i].left);
    for (std::size_t i = 1; i < 3; ++i) CHECK(o.log[i - 1].left <= o.log[i].entered);
    // the asynchronous all-gather is left when its wait() returned, after the 20 ms sleep
    CHECK(o.log[1].entered <= o.issued);
    CHECK(o.log[1].left >= o.issued + 0.019);
    CHECK(o.log[1].left <= o.waited);
  }
}

TEST_CASE("calibrate: one link per collective is recovered, and the time model uses it") {
  // Samples of three collectives, each on a link of its own.
  const plan::link ar{2e-6, 3e9}, rs{6e-6, 2.5e9}, ag{1e-6, 8e9};
  std::vector<plan::calibration_sample> samples;
  for (const auto& [op, l] :
       {std::pair{collective::all_reduce, ar}, std::pair{collective::reduce_scatter, rs},
        std::pair{collective::all_gather, ag}}) {
    for (const auto& s : model_samples(l, {2, 4})) {
      if (s.op == op) samples.push_back(s);
    }
  }
  const plan::collective_fits f = plan::fit_links_per_collective(samples);
  REQUIRE(f.all_reduce);
  REQUIRE(f.reduce_scatter);
  REQUIRE(f.all_gather);
  CHECK(f.all_reduce->fitted.latency_s == Approx(ar.latency_s).epsilon(1e-9));
  CHECK(f.all_reduce->fitted.bytes_per_s == Approx(ar.bytes_per_s).epsilon(1e-9));
  CHECK(f.reduce_scatter->fitted.bytes_per_s == Approx(rs.bytes_per_s).epsilon(1e-9));
  CHECK(f.all_gather->fitted.latency_s == Approx(ag.latency_s).epsilon(1e-9));
  CHECK(f.all_gather->max_rel_error < 1e-9);
  // One link for all three cannot explain them.
  CHECK(plan::fit_link(samples).max_rel_error > 0.1);

  plan::cluster c;
  c.gpus_per_node = 4;
  c.intra = {5e-6, 1e9};
  plan::cluster per = c;
  plan::set_per_collective_links(per, f);
  const plan::placement node{4, 4};
  for (const auto& [op, l] :
       {std::pair{collective::all_reduce, ar}, std::pair{collective::reduce_scatter, rs},
        std::pair{collective::all_gather, ag}}) {
    plan::cluster only = c;
    only.intra = l;
    CHECK(plan::collective_time(op, 1 << 20, 2, node, per) ==
          Approx(plan::collective_time(op, 1 << 20, 2, node, only)).epsilon(1e-9));
  }
  // Collectives without a link of their own keep `intra`.
  CHECK(plan::collective_time(collective::broadcast, 1 << 20, 2, node, per) ==
        plan::collective_time(collective::broadcast, 1 << 20, 2, node, c));
  // A measured link with no bandwidth is refused like `intra`'s.
  plan::setup s;
  s.ranks = 4;
  per.intra_all_gather = plan::link{1e-6, 0.0};
  CHECK(plan::placement_problem(s, per) != nullptr);
  // Samples of one collective alone that cannot be fitted are named by collective.
  std::vector<plan::calibration_sample> one_size;
  for (const auto& x : samples) {
    if (x.op != collective::all_gather ||
        (x.ranks == 2 && x.count * x.elem_bytes * x.ranks == 4096))
      one_size.push_back(x);
  }
  CHECK_THROWS_WITH(plan::fit_links_per_collective(one_size), Contains("all_gather"));
}

TEST_CASE("calibrate: in-place links are fitted apart, and the step's in-place calls use them") {
  // Out of place and in place on links of their own, every collective.
  const plan::link oop{3e-6, 2e9}, inp{2e-6, 5e9};
  std::vector<plan::calibration_sample> samples = model_samples(oop, {2});
  for (auto s : model_samples(inp, {2})) {
    s.in_place = true;
    samples.push_back(s);
  }
  const plan::collective_fits f = plan::fit_links_per_collective(samples);
  for (const collective op :
       {collective::all_reduce, collective::reduce_scatter, collective::all_gather}) {
    INFO(op);
    REQUIRE(f.of(op, false));
    REQUIRE(f.of(op, true));
    CHECK(f.of(op, false)->fitted.bytes_per_s == Approx(oop.bytes_per_s).epsilon(1e-9));
    CHECK(f.of(op, true)->fitted.bytes_per_s == Approx(inp.bytes_per_s).epsilon(1e-9));
    CHECK(f.of(op, true)->fitted.latency_s == Approx(inp.latency_s).epsilon(1e-9));
  }
  plan::cluster c;
  c.gpus_per_node = 2;
  c.intra = {9e-6, 1e9};
  plan::set_per_collective_links(c, f);
  const plan::placement node{2, 2};
  for (const collective op :
       {collective::all_reduce, collective::reduce_scatter, collective::all_gather}) {
    plan::cluster only;
    only.gpus_per_node = 2;
    for (const bool in_place : {false, true}) {
      only.intra = in_place ? inp : oop;
      CHECK(plan::collective_time(op, 1 << 20, 2, node, c, plan::algorithm::ring, in_place) ==
            Approx(plan::collective_time(op, 1 << 20, 2, node, only)).epsilon(1e-9));
    }
  }
  // A step's time takes each call's link by its placement: stage 0's all-reduce and stage 1's
  // reduce-scatter and all-gather run in place, stage 3's gathers and reduce-scatters do not.
  const std::vector<plan::unit> units = {plan::unit{1 << 20}, plan::unit{1 << 20}};
  plan::setup s;
  s.ranks = 2;
  s.bytes = plan::precision_of(shardkit::dtype::bf16, shardkit::dtype::bf16, 2);
  plan::cluster all_in, all_out;  // one link for every collective
  all_in.gpus_per_node = all_out.gpus_per_node = 2;
  all_in.intra = inp;
  all_out.intra = oop;
  for (const int stage : {0, 1, 3}) {
    s.stage = stage;
    INFO("stage " << stage);
    CHECK(plan::comm_time_per_step(s, units, c) ==
          Approx(plan::comm_time_per_step(s, units, stage == 3 ? all_out : all_in)).epsilon(1e-12));
  }
  // Stage 2: reduce-scatters from a bucket (out of place), the all-gather in place.
  s.stage = 2;
  const double rs = plan::collective_time(collective::reduce_scatter, 1 << 19, 2, node, all_out);
  const double ag = plan::collective_time(collective::all_gather, 1 << 19, 2, node, all_in);
  CHECK(plan::comm_time_per_step(s, units, c) == Approx(2 * rs + 2 * ag).epsilon(1e-12));
  // An in-place link with no bandwidth is refused like the others.
  c.intra_all_gather_in_place = plan::link{1e-6, 0.0};
  CHECK(plan::placement_problem(s, c) != nullptr);
  // Samples that cannot be fitted name the collective and the placement.
  std::vector<plan::calibration_sample> bad;
  for (const auto& x : samples) {
    if (!x.in_place || x.op != collective::reduce_scatter || x.count * x.elem_bytes * 2 == 4096) {
      bad.push_back(x);
    }
  }
  CHECK_THROWS_WITH(plan::fit_links_per_collective(bad), Contains("reduce_scatter in-place"));
}

TEST_CASE("calibrate: a sweep of fresh inputs, in place and out of place, asynchronous") {
  plan::sweep_options o;
  o.max_bytes = 1 << 20;
  o.reps = 3;
  o.fresh_input = true;
  o.in_place = true;
  o.asynchronous = true;
  o.element = shardkit::dtype::bf16;
  o.cold_bytes = std::size_t{4} << 20;
  const auto r = shardkit::run_ranks(
      2, [&](shardkit::thread_comm& comm) { return plan::measure_collectives(comm, o); });
  // 2 placements x 3 collectives x {4, 16, 64, 256} KiB and 1 MiB
  REQUIRE(r[0].size() == 2 * 3 * 5);
  for (std::size_t i = 0; i < r[0].size(); ++i) {
    const auto& s = r[0][i];
    INFO("sample " << i);
    CHECK(s.in_place == (i >= 15));
    CHECK(s.elem_bytes == 2);
    CHECK(s.seconds > 0);
    CHECK(r[1][i].seconds == s.seconds);
    CHECK(r[1][i].in_place == s.in_place);
  }
  // The sweep gives what the per-collective fit needs: with times from a known link in place of
  // the measured ones (which on a loaded machine need not grow with size, so a fit of them can
  // fail), every collective and placement is fitted, and the link comes back.
  auto modelled = r[0];
  for (auto& s : modelled) {
    const plan::ring_terms t = plan::ring_coefficients(s.op, s.count, s.elem_bytes, s.ranks);
    s.seconds = t.a * 20e-6 + t.b / (s.in_place ? 8e9 : 5e9);
  }
  const plan::collective_fits f = plan::fit_links_per_collective(modelled);
  for (const bool in_place : {false, true}) {
    for (const auto op :
         {collective::all_reduce, collective::reduce_scatter, collective::all_gather}) {
      INFO(name(op) << (in_place ? " in place" : ""));
      const auto& fit = f.of(op, in_place);
      REQUIRE(fit);
      CHECK(fit->fitted.latency_s == Approx(20e-6).epsilon(1e-6));
      CHECK(fit->fitted.bytes_per_s == Approx(in_place ? 8e9 : 5e9).epsilon(1e-6));
    }
  }
  // Sizes x2 apart: 4 KiB .. 1 MiB is 9 sizes, in order, for each placement and collective.
  o.growth = 2;
  o.in_place = false;
  o.reps = 1;
  const auto doubled = shardkit::run_ranks(
      2, [&](shardkit::thread_comm& comm) { return plan::measure_collectives(comm, o); });
  REQUIRE(doubled[0].size() == 3 * 9);
  for (std::size_t i = 1; i < 9; ++i) CHECK(doubled[0][i].count == 2 * doubled[0][i - 1].count);
  // As the engine's step finds its data: the optimizer's bytes streamed before each in-place
  // all-gather, ZeRO-3's gathers on two outputs of their own. The same samples, in the same
  // order.
  o.growth = 4;
  o.in_place = true;
  o.optimizer_bytes = std::size_t{8} << 20;
  o.gather_outputs = 2;
  const auto aged = shardkit::run_ranks(
      2, [&](shardkit::thread_comm& comm) { return plan::measure_collectives(comm, o); });
  REQUIRE(aged[0].size() == r[0].size());
  for (std::size_t i = 0; i < aged[0].size(); ++i) {
    INFO("sample " << i);
    CHECK(aged[0][i].op == r[0][i].op);
    CHECK(aged[0][i].count == r[0][i].count);
    CHECK(aged[0][i].in_place == r[0][i].in_place);
    CHECK(aged[0][i].seconds > 0);
    CHECK(aged[1][i].seconds == aged[0][i].seconds);
  }
  o.optimizer_bytes = 0;
  o.gather_outputs = 17;
  CHECK_THROWS_WITH(plan::check(o, 0), Contains("gather_outputs 17; expected 0"));
  o.gather_outputs = 0;
  o.growth = 1;
  CHECK_THROWS_WITH(plan::check(o, 0), Contains("growth 1; expected at least 2"));
  o.growth = 4;
  // Neither placement: nothing to time.
  o.in_place = o.out_of_place = false;
  CHECK_THROWS_WITH(plan::check(o, 1), Contains("rank 1") && Contains("neither out_of_place"));
}

TEST_CASE("timed_comm: serialize completes asynchronous collectives at their issue") {
  using timed = shardkit::timed_comm<shardkit::thread_comm>;
  struct out {
    std::vector<shardkit::call_record> log;
    std::vector<float> y, part;
    bool done_at_issue = false;
    double issued = 0;  // when the all-gather's issue had returned
  };
  const auto r = shardkit::run_ranks(2, [](shardkit::thread_comm& c) {
    timed t(std::move(c));
    t.timing().record = true;
    t.timing().serialize = true;
    out o;
    std::vector<float> x(4, static_cast<float>(t.rank() + 1));
    o.y.resize(8);
    auto w = t.all_gather_async(x.data(), o.y.data(), 4);
    o.issued = shardkit::comm_timing::now();
    o.done_at_issue = w.test();  // complete without waiting
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    w.wait();  // a no-op now: the record was left at the issue
    o.part.assign(o.y.begin() + 4 * t.rank(), o.y.begin() + 4 * t.rank() + 4);
    t.reduce_scatter_async(o.y.data(), o.y.data() + 4 * t.rank(), 4).wait();  // in place
    o.log = t.timing().log;
    return o;
  });
  for (std::size_t rank = 0; rank < r.size(); ++rank) {
    const auto& o = r[rank];
    const auto k = static_cast<float>(rank + 1);
    CHECK(o.done_at_issue);
    CHECK(o.part == std::vector<float>(4, k));
    CHECK(o.y[4 * rank] == 2 * k);  // the rank's slice of both ranks' y, summed in place
    REQUIRE(o.log.size() == 2);
    CHECK(o.log[0].kind == collective::all_gather);
    CHECK(o.log[0].count == 4);
    CHECK(o.log[0].elem_bytes == 4);
    CHECK_FALSE(o.log[0].in_place);
    CHECK(o.log[0].left <= o.issued);  // left before the issue returned, not at wait()
    CHECK(o.log[1].kind == collective::reduce_scatter);
    CHECK(o.log[1].in_place);
  }
}
