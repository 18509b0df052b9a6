// step_control used alone: the once-per-step control exchange over the ranks (exact gradient
// statistics of the elements each rank owns, the count of non-finite gradients, the schedule
// check), the decision it leads to (clip coefficient, gradient multiplier, skipped step) and
// dynamic loss scaling. Checked against statistics computed in the test from the gradients
// every rank holds, against docs/accounting.md's control-message sizes, and for bad settings.
#include "zero/component_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

using namespace shardkit;
using test::comp::checks;

namespace {

// The global gradient of the tests: Ψ elements of ref::grad_value (multiples of 1/64, exact in
// bf16), of which rank q of N owns the chunk [⌊qΨ/N⌋, ⌊(q+1)Ψ/N⌋).
constexpr std::size_t psi = 37;
inline float global_grad(std::size_t k) {
  return ref::grad_value(5, 0, 3, k);
}
inline std::size_t chunk_lo(std::size_t q, std::size_t N) {
  return q * psi / N;
}

// docs/accounting.md: the control all-reduce carries 64-bit words: the non-finite count
// whenever it is sent, 256 squared-norm bins with clipping or report_grad_norm, 2 words of
// schedule check; plus a max all-reduce of one 32-bit word for the inf-norm.
std::uint64_t control_bytes(bool stats, bool loss_scaling, bool schedule, bool inf, int N, int r) {
  const std::uint64_t n = static_cast<std::uint64_t>(N), me = static_cast<std::uint64_t>(r);
  std::uint64_t words = stats ? 257 : (loss_scaling || schedule) ? 1 : 0;
  if (schedule) words += 2;
  if (N <= 1) return 0;
  return (words != 0 ? test::comp::ar_bytes(words, n, me, 8) : 0) +
         (inf ? test::comp::ar_bytes(1, n, me, 4) : 0);
}

// One exchange on one rank over its chunk of the global gradient (stored as G, handed to
// for_each_owned in two runs), `bad` replacing element `bad_at` with a non-finite value on rank
// `bad_rank`. Returns the result, the report of decide(base = 1/N) and the multiplier.
template <class G, class Comm>
std::tuple<control_result, step_report, double> exchange_on(Comm& c, step_control<host_space>& sc,
                                                            bool schedule, std::uint64_t hash,
                                                            traffic_ledger& traffic,
                                                            int bad_rank = -1, float bad = 0,
                                                            std::size_t bad_at = 0) {
  const auto N = static_cast<std::size_t>(c.size()), q = static_cast<std::size_t>(c.rank());
  std::vector<G> mine;
  for (std::size_t k = chunk_lo(q, N); k < chunk_lo(q + 1, N); ++k) {
    mine.push_back(from_float<G>(c.rank() == bad_rank && k == bad_at ? bad : global_grad(k)));
  }
  const std::size_t half = mine.size() / 2;
  const control_result ctl = sc.template exchange<G>(
      c,
      [&](auto&& f) {
        f(mine.data(), half);
        f(mine.data() + half, mine.size() - half);
      },
      schedule, hash, 1, traffic);
  step_report rep;
  const double mult = sc.decide(ctl, 1.0 / static_cast<double>(N), rep);
  return {ctl, rep, mult};
}

}  // namespace

TEMPLATE_TEST_CASE("step_control alone: exact norms over the ranks' owned elements, clipping",
                   "[components][step_control]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n);
  double sum_sq = 0, max_abs = 0;
  for (std::size_t k = 0; k < psi; ++k) {
    const double g = global_grad(k);
    sum_sq += g * g;  // multiples of 1/4096: exact in double
    max_abs = std::max(max_abs, std::fabs(g));
  }
  const double base = 1.0 / n;
  auto run = [&]<class G>(G, step_control_options o) {
    return World::run(n, [&](Comm& c) -> std::string {
      checks check;
      step_control<host_space> sc(o);
      traffic_ledger control;
      c.barrier();
      const traffic_ledger before = c.traffic();
      const auto [ctl, rep, mult] = exchange_on<G>(c, sc, false, 0, control);
      c.barrier();
      const bool stats = o.report_grad_norm || o.clip_grad_norm > 0;
      const bool inf =
          o.report_grad_norm || (o.clip_grad_norm > 0 && o.clip_norm == grad_norm_kind::inf);
      const std::uint64_t want = control_bytes(stats, sc.loss_scaling(), false, inf, n, c.rank());
      check(control.total_bytes_sent() == want, "the exchange recorded ",
            control.total_bytes_sent(), " bytes; docs/accounting.md says ", want);
      check(c.traffic().since(before).total_bytes_sent() == want, "the communicator sent ",
            c.traffic().since(before).total_bytes_sent(), " bytes, ", want, " expected");
      check(ctl.nonfinite == 0 && ctl.schedule_ok, "non-finite or schedule trouble reported");
      if (o.report_grad_norm || o.clip_norm == grad_norm_kind::l2) {
        check(ctl.have_norm == stats && (!stats || ctl.norm_squared == sum_sq),
              "norm² = ", ctl.norm_squared, ", the sum of squares of every element once is ",
              sum_sq);
      }
      if (inf) {
        check(ctl.have_inf_norm && ctl.max_abs == max_abs, "max |g| = ", ctl.max_abs, ", not ",
              max_abs);
      }
      // The report carries the norms that were computed (of the averaged gradient), NaN else.
      const bool l2 =
          o.report_grad_norm || (o.clip_grad_norm > 0 && o.clip_norm == grad_norm_kind::l2);
      if (l2) {
        check(rep.grad_norm == static_cast<float>(std::sqrt(sum_sq) * base), "grad_norm ",
              rep.grad_norm, ", expected ", std::sqrt(sum_sq) * base);
      } else {
        check(std::isnan(rep.grad_norm), "an L2 norm was reported without being computed");
      }
      if (inf) {
        check(rep.grad_inf_norm == static_cast<float>(max_abs * base), "grad_inf_norm ",
              rep.grad_inf_norm, ", expected ", max_abs * base);
      } else {
        check(std::isnan(rep.grad_inf_norm), "an inf-norm was reported without being computed");
      }
      // docs: coef = min(1, max / (norm + 1e-6)) of the averaged gradient; multiplier base·coef.
      double coef = 1.0;
      if (o.clip_grad_norm > 0) {
        const double norm =
            o.clip_norm == grad_norm_kind::l2 ? std::sqrt(sum_sq) * base : max_abs * base;
        coef = std::min(1.0, static_cast<double>(o.clip_grad_norm) / (norm + 1e-6));
      }
      check(std::fabs(mult - base * coef) <= 1e-15 * base, "multiplier ", mult, ", expected ",
            base * coef);
      check(rep.clip_coef == static_cast<float>(coef), "clip_coef ", rep.clip_coef, ", expected ",
            coef);
      check(!rep.skipped, "a finite step was skipped");
      return check.failure;
    });
  };
  SECTION("report_grad_norm, bf16 and fp32 gradients") {
    step_control_options o;
    o.report_grad_norm = true;
    test::require_all_ok(run(bf16{}, o));
    test::require_all_ok(run(float{}, o));
  }
  SECTION("clipping the L2 norm (active) and the inf-norm (active and not)") {
    step_control_options o;
    o.clip_grad_norm = 0.25f;
    test::require_all_ok(run(bf16{}, o));
    o.clip_norm = grad_norm_kind::inf;
    test::require_all_ok(run(float{}, o));
    o.clip_grad_norm = 1e6f;  // far above the norm: coefficient 1
    test::require_all_ok(run(bf16{}, o));
  }
  SECTION("nothing is exchanged when no feature asks for it") {
    const auto per_rank = World::run(n, [&](Comm& c) -> std::string {
      checks check;
      step_control_options o;
      o.check_schedule = false;
      step_control<host_space> sc(o);
      check(
          !sc.loss_scaling() && !sc.needs_norm() && !sc.needs_inf_norm() && sc.loss_scale() == 1.0f,
          "a feature is on by default");
      traffic_ledger control;
      c.barrier();
      const traffic_ledger before = c.traffic();
      const auto [ctl, rep, mult] = exchange_on<bf16>(c, sc, true, 42, control);
      c.barrier();
      check(control.total_bytes_sent() == 0 && control.total_calls() == 0,
            "the exchange issued a collective");
      check(c.traffic().since(before).total_calls() == 1, "the communicator saw ",
            c.traffic().since(before).total_calls(), " calls, only the test's barrier expected");
      check(!ctl.have_norm && ctl.schedule_ok && mult == 1.0 / n, "results without an exchange");
      return check.failure;
    });
    test::require_all_ok(per_rank);
  }
}

TEMPLATE_TEST_CASE("step_control alone: a non-finite gradient skips the step on every rank",
                   "[components][step_control]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n);
  const float bad = GENERATE(INFINITY, -INFINITY, NAN);
  const int bad_rank = n - 1;
  const auto per_rank = World::run(n, [&](Comm& c) -> std::string {
    checks check;
    step_control_options o;
    o.loss_scale = loss_scale_options{.init_scale = 1024.0f,
                                      .growth_factor = 2.0f,
                                      .growth_interval = 2,
                                      .backoff_factor = 0.5f,
                                      .min_scale = 256.0f};
    step_control<host_space> sc(o);
    check(sc.loss_scaling() && sc.loss_scale() == 1024.0f, "loss scaling is not at 1024");
    traffic_ledger control;
    // The last rank's chunk holds the bad element.
    const std::size_t at =
        chunk_lo(static_cast<std::size_t>(bad_rank), static_cast<std::size_t>(n));
    auto once = [&](bool overflow) {
      const auto [ctl, rep, mult] =
          exchange_on<float>(c, sc, false, 0, control, overflow ? bad_rank : -1, bad, at);
      step_report r = rep;
      sc.update_scale(r);
      check(ctl.nonfinite == (overflow ? 1u : 0u), "counted ", ctl.nonfinite,
            " non-finite gradients");
      check(r.skipped == overflow, "skipped = ", r.skipped, " with overflow = ", overflow);
      return r;
    };
    // Overflow: skipped, scale halves. Then growth after growth_interval = 2 good steps.
    const float scales[] = {512, 512, 1024, 512, 256, 256};
    const bool overflows[] = {true, false, false, true, true, true};
    for (int s = 0; s < 6; ++s) {
      const step_report r = once(overflows[s]);
      check(r.loss_scale == scales[s] && sc.loss_scale() == scales[s], "step ", s, ": loss scale ",
            r.loss_scale, ", expected ", scales[s]);
      // At the minimum (256), a further overflow is reported, not looped on.
      check(r.loss_scale_at_minimum == (s == 5), "step ", s, ": loss_scale_at_minimum is ",
            r.loss_scale_at_minimum);
    }
    const std::uint64_t per = control_bytes(false, true, false, false, n, c.rank());
    check(control.total_bytes_sent() == 6 * per, "six exchanges of the count sent ",
          control.total_bytes_sent(), " bytes, expected ", 6 * per);
    sc.set_scale_state(4096.0f, 1);
    check(sc.loss_scale() == 4096.0f && sc.good_steps() == 1, "set_scale_state did not stick");
    once(false);
    check(sc.loss_scale() == 8192.0f, "growth after a restored count: ", sc.loss_scale());
    return check.failure;
  });
  test::require_all_ok(per_rank);
}

TEMPLATE_TEST_CASE("step_control alone: the schedule check and replicated owners",
                   "[components][step_control]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(2, 3, 4);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n);
  SECTION("a rank whose collective sequence differs is seen by every rank") {
    const auto per_rank = World::run(n, [&](Comm& c) {
      step_control_options o;
      o.loss_scale = loss_scale_options{};
      step_control<host_space> sc(o);
      traffic_ledger control;
      const auto same = std::get<0>(exchange_on<bf16>(c, sc, true, 0xabcdef, control));
      const auto differ =
          std::get<0>(exchange_on<bf16>(c, sc, true, c.rank() == 1 ? 0x123 : 0xabcdef, control));
      const std::uint64_t want = 2 * control_bytes(false, true, true, false, n, c.rank());
      return std::tuple{same.schedule_ok, differ.schedule_ok, control.total_bytes_sent() == want};
    });
    for (const auto& [same, differ, bytes] : per_rank) {
      CHECK(same);
      CHECK_FALSE(differ);
      CHECK(bytes);
    }
  }
  SECTION("hybrid sharding: every element visited once per replica counts once") {
    if (n % 2 != 0) return;
    const auto per_rank = World::run(n, [&](Comm& c) -> std::string {
      checks check;
      step_control_options o;
      o.report_grad_norm = true;
      step_control<host_space> sc(o);
      // Two replicas: ranks q and q + n/2 own the same chunk of n/2 chunks; one element is
      // infinite in both replicas (the replicas hold the same reduced gradient).
      const std::size_t half = static_cast<std::size_t>(n / 2);
      const std::size_t q = static_cast<std::size_t>(c.rank()) % half;
      std::vector<float> mine;
      double sum_sq = 0;
      for (std::size_t k = 0; k < psi; ++k) sum_sq += double(global_grad(k)) * global_grad(k);
      for (std::size_t k = chunk_lo(q, half); k < chunk_lo(q + 1, half); ++k) {
        mine.push_back(global_grad(k));
      }
      traffic_ledger control;
      auto each = [&](auto&& f) { f(mine.data(), mine.size()); };
      const auto ctl = sc.exchange<float>(c, each, false, 0, 2, control);
      check(ctl.norm_squared == sum_sq && ctl.nonfinite == 0, "norm² ", ctl.norm_squared,
            " over two replicas, expected ", sum_sq);
      if (q == 0) mine[0] = INFINITY;
      const auto bad = sc.exchange<float>(c, each, false, 0, 2, control);
      check(bad.nonfinite == 1, "one infinite element in both replicas counted ", bad.nonfinite,
            " times");
      return check.failure;
    });
    test::require_all_ok(per_rank);
  }
}

TEMPLATE_TEST_CASE("step_control refuses bad settings", "[components][step_control][errors]",
                   SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  if (!test::fits<World>(2)) return;
  auto refused = [&](auto make) { return test::comp::errors_on<World>(2, [&](Comm&) { make(); }); };
  test::comp::require_all_contain(refused([] {
                                    step_control_options o;
                                    o.clip_grad_norm = -1.0f;
                                    step_control<host_space> sc(o);
                                  }),
                                  "clip_grad_norm must be finite and >= 0 (0 = off), got -1");
  test::comp::require_all_contain(
      refused([] {
        step_control_options o;
        o.loss_scale = loss_scale_options{.backoff_factor = 1.5f};
        step_control<host_space> sc(o);
      }),
      "loss_scale_options need 0 < min_scale <= init_scale (finite), growth_factor >= 1, 0 < "
      "backoff_factor < 1 and growth_interval >= 1");
  test::comp::require_all_contain(refused([] {
                                    step_control<host_space> sc;
                                    sc.set_scale_state(0.0f, 0);
                                  }),
                                  "step_control: a loss scale must be finite and positive, got 0");
  // fp16 turns loss scaling on (at 65536) unless disabled.
  step_control_options fp16;
  fp16.fp16 = true;
  CHECK(step_control<host_space>(fp16).loss_scale() == 65536.0f);
  fp16.disable_loss_scale = true;
  CHECK_FALSE(step_control<host_space>(fp16).loss_scaling());
}

// docs/accounting.md: the control message always carries the non-finite count (1 word) when it
// is sent at all; the schedule check adds 2, so a schedule-only exchange sends 3 words.
TEST_CASE("step_control: a schedule-only exchange sends the 3 words docs/accounting.md states",
          "[components][step_control]") {
  const auto per_rank = run_ranks(2, [](thread_comm& c) {
    step_control<host_space> sc;
    traffic_ledger control;
    (void)exchange_on<bf16>(c, sc, true, 7, control);
    return control.total_bytes_sent();
  });
  for (std::size_t r = 0; r < per_rank.size(); ++r) {
    REQUIRE(per_rank[r] == control_bytes(false, false, true, false, 2, static_cast<int>(r)));
  }
}
