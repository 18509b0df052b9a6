// How the host loops are chosen and run on several threads: SHARDKIT_HOST_ISA (an unknown value
// is an error that names the accepted ones), the persistent thread team and the executor
// interface, and the same bits whatever the number of threads for every host loop, the
// optimizer's step plan, shard_optimizer and the engine (host_threads, host_executor).
#include <shardkit/comm/thread.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/grad_stats.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/host/reduce.hpp>
#include <shardkit/zero/engine.hpp>
#include <shardkit/zero/shard_optimizer.hpp>

#include "kernels/support.hpp"
#include "zero/engine_harness.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

using namespace shardkit;
using Catch::Matchers::Contains;

using namespace kernel_test;

namespace {
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (pattern(a[i]) != pattern(b[i])) return false;
  return true;
}

// An executor of the user's kind: runs the tasks on the calling thread, last first (any order
// must give the same result).
class reverse_executor final : public host::executor {
 public:
  std::size_t concurrency() const noexcept override { return 3; }
  void bulk(std::size_t count, host::task_ref task) override {
    ++batches;
    for (std::size_t i = count; i-- > 0;) task(i);
  }
  int batches = 0;
};

// The executors every multi-threaded check runs with: none, teams of 1 to 4 threads, the
// reverse executor.
struct executors {
  std::vector<std::unique_ptr<host::thread_team>> teams;
  reverse_executor reverse;
  executors() {
    for (std::size_t t = 1; t <= 4; ++t) teams.push_back(std::make_unique<host::thread_team>(t));
  }
  template <class F>
  void each(F&& f) {
    for (auto& t : teams) {
      INFO("thread_team of " << t->concurrency() << " threads");
      f(static_cast<host::executor*>(t.get()));
    }
    INFO("an executor of the user's that runs tasks in reverse order");
    f(static_cast<host::executor*>(&reverse));
  }
};
}  // namespace

TEST_CASE(
    "SHARDKIT_HOST_ISA forces a build, and unknown values and builds the CPU lacks are errors",
    "[kernels][isa]") {
  const std::vector<host::isa> all = host::detail::compiled_isas();
  const std::vector<host::isa> runs = host::available_isas();
  SECTION("unset or empty: the best build this CPU runs") {
    scoped_env e("SHARDKIT_HOST_ISA", nullptr);
    REQUIRE(host::detail::isa_from_environment() == runs.back());
    scoped_env empty("SHARDKIT_HOST_ISA", "");
    REQUIRE(host::detail::isa_from_environment() == runs.back());
  }
  SECTION("each build this CPU runs can be forced by name") {
    for (host::isa i : runs) {
      scoped_env e("SHARDKIT_HOST_ISA", host::name(i));
      REQUIRE(host::detail::isa_from_environment() == i);
    }
  }
  SECTION("an unknown value is an error naming the accepted values, never a fallback") {
    scoped_env e("SHARDKIT_HOST_ISA", "avx1024");
    std::string accepted;
    for (host::isa i : all) accepted += std::string(accepted.empty() ? "" : ", ") + host::name(i);
    REQUIRE_THROWS_AS(host::detail::isa_from_environment(), invalid_argument);
    REQUIRE_THROWS_WITH(
        host::detail::isa_from_environment(),
        Contains("SHARDKIT_HOST_ISA=avx1024") && Contains("accepted values: " + accepted));
  }
  SECTION("a build this CPU cannot run is an error naming those it can") {
    for (host::isa i : all) {
      bool available = false;
      for (host::isa r : runs) available = available || r == i;
      if (available) continue;
      scoped_env e("SHARDKIT_HOST_ISA", host::name(i));
      REQUIRE_THROWS_WITH(host::detail::isa_from_environment(),
                          Contains("this CPU cannot run") && Contains("it runs: baseline"));
    }
  }
  SECTION("scoped_isa forces a build in-process and restores the previous one") {
    const host::isa before = host::active_isa();
    for (host::isa i : runs) {
      host::scoped_isa s(i);
      REQUIRE(host::active_isa() == i);
      REQUIRE(std::string(host_isa()) == host::name(i));
    }
    REQUIRE(host::active_isa() == before);
  }
}

TEST_CASE("software prefetch defaults per processor and kind of loop", "[kernels][prefetch]") {
  using host::prefetch_loop;
  using host::detail::cpu_features;
  using host::detail::default_software_prefetch;
  // {avx2, avx512, avx512bf16, amd, family}
  constexpr cpu_features xeon{true, true, true, false, 6u};
  constexpr cpu_features zen3{true, false, false, true, 0x19u};
  constexpr cpu_features zen4{true, true, true, true, 0x19u};
  constexpr cpu_features zen5{true, true, true, true, 0x1Au};
  constexpr cpu_features later_amd{true, true, true, true, 0x1Bu};
  constexpr cpu_features avx2_only_intel{true, false, false, false, 6u};
  for (prefetch_loop l : {prefetch_loop::step, prefetch_loop::copy}) {
    CAPTURE(host::name(l));
    CHECK(default_software_prefetch(xeon, l));
    CHECK(default_software_prefetch(zen3, l));
    CHECK(default_software_prefetch(avx2_only_intel, l));
    CHECK_FALSE(default_software_prefetch(zen4, l));
  }
  CHECK(default_software_prefetch(zen5, prefetch_loop::step));
  CHECK_FALSE(default_software_prefetch(zen5, prefetch_loop::copy));
  CHECK(default_software_prefetch(later_amd, prefetch_loop::step));
  CHECK_FALSE(default_software_prefetch(later_amd, prefetch_loop::copy));
  STATIC_REQUIRE(std::string_view(host::detail::prefetch_words(true, true)) == "on");
  STATIC_REQUIRE(std::string_view(host::detail::prefetch_words(false, false)) == "off");
  STATIC_REQUIRE(std::string_view(host::detail::prefetch_words(true, false)) ==
                 "step on, copy off");
  STATIC_REQUIRE(std::string_view(host::detail::prefetch_words(false, true)) ==
                 "step off, copy on");
  // This processor's defaults are those of its features.
  for (prefetch_loop l : {prefetch_loop::step, prefetch_loop::copy}) {
    CHECK(default_software_prefetch(l) == default_software_prefetch(host::detail::cpu(), l));
  }
}

TEST_CASE("SHARDKIT_HOST_PREFETCH turns software prefetch on and off, other values are errors",
          "[kernels][prefetch]") {
  using host::prefetch_loop;
  const auto& cpu = host::detail::cpu();
  const prefetch_loop loops[] = {prefetch_loop::step, prefetch_loop::copy};
  SECTION("unset or empty: each kind of loop takes this processor's default") {
    for (prefetch_loop l : loops) {
      const bool expected = host::detail::default_software_prefetch(cpu, l);
      scoped_env e("SHARDKIT_HOST_PREFETCH", nullptr);
      REQUIRE(host::detail::software_prefetch_from_environment(l) == expected);
      scoped_env empty("SHARDKIT_HOST_PREFETCH", "");
      REQUIRE(host::detail::software_prefetch_from_environment(l) == expected);
    }
  }
  SECTION("on and off set every kind of loop") {
    for (prefetch_loop l : loops) {
      {
        scoped_env e("SHARDKIT_HOST_PREFETCH", "on");
        REQUIRE(host::detail::software_prefetch_from_environment(l));
      }
      scoped_env e("SHARDKIT_HOST_PREFETCH", "off");
      REQUIRE_FALSE(host::detail::software_prefetch_from_environment(l));
    }
  }
  SECTION("any other value is an error naming the accepted values and the defaults") {
    for (const char* bad : {"1", "yes", "ON", "on ", "auto", "step"}) {
      scoped_env e("SHARDKIT_HOST_PREFETCH", bad);
      REQUIRE_THROWS_AS(host::detail::software_prefetch_from_environment(prefetch_loop::step),
                        invalid_argument);
      REQUIRE_THROWS_WITH(
          host::detail::software_prefetch_from_environment(prefetch_loop::copy),
          Contains(std::string("SHARDKIT_HOST_PREFETCH=") + bad) &&
              Contains("expected on or off") &&
              Contains(std::string(host::detail::default_software_prefetch_name())));
    }
  }
  SECTION("scoped_prefetch sets every kind in-process, nests, and restores the previous setting") {
    const bool step = host::software_prefetch(prefetch_loop::step);
    const bool copy = host::software_prefetch(prefetch_loop::copy);
    {
      host::scoped_prefetch off(false);
      REQUIRE_FALSE(host::software_prefetch(prefetch_loop::step));
      REQUIRE_FALSE(host::software_prefetch(prefetch_loop::copy));
      {
        host::scoped_prefetch on(true);
        REQUIRE(host::software_prefetch(prefetch_loop::step));
        REQUIRE(host::software_prefetch(prefetch_loop::copy));
      }
      REQUIRE_FALSE(host::software_prefetch(prefetch_loop::step));
      REQUIRE(std::string(host::software_prefetch_name()) == "off");
    }
    REQUIRE(host::software_prefetch(prefetch_loop::step) == step);
    REQUIRE(host::software_prefetch(prefetch_loop::copy) == copy);
  }
}

TEST_CASE("display_family reads CPUID leaf 1 as both vendors' manuals define it",
          "[kernels][prefetch]") {
  // EAX of leaf 1 on processors whose family is published: base family 0xF adds the extended
  // family, any other base family stands alone (its extended-family bits are ignored).
  STATIC_REQUIRE(host::detail::display_family(0x00A10F11u) == 0x19u);  // AMD EPYC 9004, Zen 4
  STATIC_REQUIRE(host::detail::display_family(0x00A00F11u) == 0x19u);  // AMD EPYC 7003, Zen 3
  STATIC_REQUIRE(host::detail::display_family(0x00B00F21u) == 0x1Au);  // AMD EPYC 9005, Zen 5
  STATIC_REQUIRE(host::detail::display_family(0x00830F10u) == 0x17u);  // AMD EPYC 7002, Zen 2
  STATIC_REQUIRE(host::detail::display_family(0x000806F8u) == 6u);  // Intel Xeon, Sapphire Rapids
  STATIC_REQUIRE(host::detail::display_family(0x0FF00600u) == 6u);  // extended bits, base 6
  STATIC_REQUIRE(host::detail::display_family(0u) == 0u);
  // What this machine reports agrees with its vendor: every x86-64 processor of AMD is of
  // family 0xF or above, every one of Intel of family 6 or above.
  const auto& cpu = host::detail::cpu();
  if (cpu.avx2) {
    CHECK(cpu.family >= (cpu.amd ? 0xFu : 6u));
  }
}

TEST_CASE("thread_team runs every task of a batch exactly once, again and again",
          "[kernels][parallel]") {
  for (std::size_t threads = 1; threads <= 4; ++threads) {
    host::thread_team team(threads);
    REQUIRE(team.concurrency() == threads);
    for (std::size_t count : {0u, 1u, 2u, 3u, 4u, 7u, 64u, 1000u}) {
      for (int round = 0; round < 3; ++round) {
        std::vector<std::atomic<int>> hits(count);
        auto task = [&](std::size_t i) { hits[i].fetch_add(1); };
        team.bulk(count, host::task_ref(task));
        for (std::size_t i = 0; i < count; ++i) {
          CAPTURE(threads, count, round, i);
          REQUIRE(hits[i].load() == 1);
        }
      }
    }
  }
  REQUIRE_THROWS_AS(host::thread_team(0), invalid_argument);
}

TEST_CASE("thread_team: errors, nested and concurrent batches", "[kernels][parallel]") {
  host::thread_team team(3);
  SECTION("a task's exception reaches the caller after the batch, and the team stays usable") {
    std::atomic<int> ran{0};
    auto task = [&](std::size_t i) {
      ran.fetch_add(1);
      if (i == 5) throw std::runtime_error("task 5 failed");
    };
    REQUIRE_THROWS_WITH(team.bulk(10, host::task_ref(task)), "task 5 failed");
    REQUIRE(ran.load() == 10);
    std::atomic<int> again{0};
    auto count = [&](std::size_t) { again.fetch_add(1); };
    team.bulk(10, host::task_ref(count));
    REQUIRE(again.load() == 10);
  }
  SECTION("a batch issued from inside a task runs inline") {
    std::atomic<int> inner{0};
    auto leaf = [&](std::size_t) { inner.fetch_add(1); };
    auto outer = [&](std::size_t) { team.bulk(4, host::task_ref(leaf)); };
    team.bulk(3, host::task_ref(outer));
    REQUIRE(inner.load() == 12);
  }
  SECTION("batches from two threads at once both complete") {
    std::atomic<int> a{0}, b{0};
    auto ta = [&](std::size_t) { a.fetch_add(1); };
    auto tb = [&](std::size_t) { b.fetch_add(1); };
    std::thread other([&] {
      for (int k = 0; k < 200; ++k) team.bulk(5, host::task_ref(tb));
    });
    for (int k = 0; k < 200; ++k) team.bulk(7, host::task_ref(ta));
    other.join();
    REQUIRE(a.load() == 1400);
    REQUIRE(b.load() == 1000);
  }
}

TEST_CASE("parallel_for covers the range once, in pieces at 64-element boundaries",
          "[kernels][parallel]") {
  executors ex;
  ex.each([](host::executor* e) {
    for (std::size_t n : {0u, 1u, 63u, 64u, 65u, 1000u, 4096u, 100003u}) {
      for (std::size_t grain : {1u, 64u, 1000u}) {
        CAPTURE(n, grain);
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int> pieces{0};
        host::parallel_for(e, n, grain, [&](std::size_t b, std::size_t end) {
          pieces.fetch_add(1);
          REQUIRE(b < end);
          REQUIRE(b % host::piece_alignment == 0);
          for (std::size_t i = b; i < end; ++i) hits[i].fetch_add(1);
        });
        for (std::size_t i = 0; i < n; ++i) REQUIRE(hits[i].load() == 1);
        REQUIRE(static_cast<std::size_t>(pieces.load()) <= std::max<std::size_t>(1, n / grain));
      }
    }
  });
}

namespace {
// Independent statistics: grad_stats' definition, one element at a time.
template <class G>
host::grad_stats reference_stats(const std::vector<G>& g) {
  host::grad_stats s;
  for (const G& x : g) {
    const std::uint32_t a = std::bit_cast<std::uint32_t>(static_cast<float>(x)) & 0x7fffffffu;
    const std::uint32_t e = a >> 23;
    if (e == 0xffu) {
      ++s.words[host::grad_stats::bins];
      continue;
    }
    const std::uint64_t m = ((a & 0x7fffffu) | (e != 0 ? 0x800000u : 0u)) >> 8;
    s.words[e] += m * m;
    if (a > s.max_abs_bits) s.max_abs_bits = a;
  }
  return s;
}
}  // namespace

TEST_CASE("gradient statistics: every build and split gives the definition's bins",
          "[kernels][stats]") {
  std::uint64_t s = 21;
  std::vector<float> f(300007);
  for (auto& x : f) x = random_float(s, 4.0f);
  for (std::size_t i = 0; i < f.size(); i += 97) {  // every kind of float: NaN, inf, subnormal
    f[i] = std::bit_cast<float>(static_cast<std::uint32_t>(splitmix(s)));
  }
  std::vector<bf16> b(f.size());
  std::vector<fp16> h(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) {
    b[i] = bf16(f[i]);
    h[i] = fp16(f[i]);
  }
  const auto want_f = reference_stats(f), want_b = reference_stats(b), want_h = reference_stats(h);
  REQUIRE(want_f.nonfinite() > 0);
  executors ex;
  for (host::isa i : host::available_isas()) {
    host::scoped_isa forced(i);
    INFO("host loops: " << host::name(i) << " build");
    host::grad_stats got_f, got_b, got_h;
    host::accumulate_stats(f.data(), f.size(), got_f);
    host::accumulate_stats(b.data(), b.size(), got_b);
    host::accumulate_stats(h.data(), h.size(), got_h);
    REQUIRE(got_f.words == want_f.words);
    REQUIRE(got_f.max_abs_bits == want_f.max_abs_bits);
    REQUIRE(got_b.words == want_b.words);
    REQUIRE(got_b.max_abs_bits == want_b.max_abs_bits);
    REQUIRE(got_h.words == want_h.words);
    REQUIRE(got_h.max_abs_bits == want_h.max_abs_bits);
    REQUIRE(host::count_nonfinite(f.data(), f.size()) == want_f.nonfinite());
    // pieces of odd lengths through one accumulator
    host::stats_accumulator acc;
    for (std::size_t at = 0, len = 1; at < f.size(); at += len, len = len * 3 + 1) {
      acc.add(f.data() + at, std::min(len, f.size() - at));
    }
    host::grad_stats pieces;
    acc.add_to(pieces);
    REQUIRE(pieces.words == want_f.words);
    // on threads
    ex.each([&](host::executor* e) {
      host::grad_stats t;
      host::parallel_accumulate_stats(e, f.data(), f.size(), t);
      REQUIRE(t.words == want_f.words);
      REQUIRE(t.max_abs_bits == want_f.max_abs_bits);
    });
  }
}

TEST_CASE("host loops on 1 to 4 threads compute the bits of one thread", "[kernels][parallel]") {
  const std::size_t n = (1u << 20) + 37;  // pieces end inside vectors, a tail at the end
  std::uint64_t s = 3;
  std::vector<float> p0(n), m0(n), v0(n), g32(n);
  std::vector<bf16> g16(n);
  std::vector<fp16> gh(n);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = random_float(s);
    m0[i] = random_float(s, 0.01f);
    v0[i] = std::fabs(random_float(s, 1e-4f));
    g32[i] = random_float(s, 2.0f);
    g16[i] = bf16(random_float(s, 2.0f));
    gh[i] = fp16(random_float(s, 2.0f));
  }
  const auto k = adamw::prepare({.lr = 1e-3f, .weight_decay = 0.01f}, 4, 1e-3f, 0.5f);
  auto step = [&](host::executor* e, auto grads, auto* out_tag) {
    using W = std::remove_pointer_t<decltype(out_tag)>;
    auto p = p0, m = m0, v = v0;
    std::vector<W> out(n);
    float* st[2] = {m.data(), v.data()};
    if (e == nullptr)
      host::fused_step<adamw>(k, p.data(), st, grads->data(), out.data(), n);
    else
      host::parallel_fused_step<adamw>(e, k, p.data(), st, grads->data(), out.data(), n);
    return std::make_tuple(p, m, v, out);
  };
  const auto want_b = step(nullptr, &g16, static_cast<bf16*>(nullptr));
  const auto want_f = step(nullptr, &g32, static_cast<float*>(nullptr));
  const auto want_h = step(nullptr, &gh, static_cast<fp16*>(nullptr));
  std::vector<bf16> cast_b(n);
  std::vector<fp16> cast_h(n);
  std::vector<float> widen(n);
  host::convert(g32.data(), cast_b.data(), n);
  host::convert(g32.data(), cast_h.data(), n);
  host::convert(g16.data(), widen.data(), n);
  std::vector<bf16> acc_b(g16);
  host::accumulate(g32.data(), acc_b.data(), n);
  const float* ins[3] = {p0.data(), m0.data(), g32.data()};
  std::vector<float> red_sum(n), red_max(n);
  host::reduce_ordered(ins, 3, red_sum.data(), n, reduce_op::sum);
  host::reduce_ordered(ins, 3, red_max.data(), n, reduce_op::max);

  executors ex;
  ex.each([&](host::executor* e) {
    const auto got_b = step(e, &g16, static_cast<bf16*>(nullptr));
    REQUIRE(same_bits(std::get<0>(got_b), std::get<0>(want_b)));
    REQUIRE(same_bits(std::get<1>(got_b), std::get<1>(want_b)));
    REQUIRE(same_bits(std::get<2>(got_b), std::get<2>(want_b)));
    REQUIRE(same_bits(std::get<3>(got_b), std::get<3>(want_b)));
    const auto got_f = step(e, &g32, static_cast<float*>(nullptr));
    REQUIRE(same_bits(std::get<0>(got_f), std::get<0>(want_f)));
    REQUIRE(same_bits(std::get<3>(got_f), std::get<3>(want_f)));
    const auto got_h = step(e, &gh, static_cast<fp16*>(nullptr));
    REQUIRE(same_bits(std::get<0>(got_h), std::get<0>(want_h)));
    REQUIRE(same_bits(std::get<3>(got_h), std::get<3>(want_h)));

    std::vector<bf16> cb(n);
    std::vector<fp16> ch(n);
    std::vector<float> w(n);
    host::parallel_convert(e, g32.data(), cb.data(), n);
    host::parallel_convert(e, g32.data(), ch.data(), n);
    host::parallel_convert(e, g16.data(), dtype::bf16, w.data(), dtype::f32, n);
    REQUIRE(same_bits(cb, cast_b));
    REQUIRE(same_bits(ch, cast_h));
    REQUIRE(same_bits(w, widen));
    std::vector<bf16> ab(g16);
    host::parallel_accumulate(e, g32.data(), ab.data(), n);
    REQUIRE(same_bits(ab, acc_b));
    std::vector<float> rs(n), rm(n);
    host::parallel_reduce_ordered(e, ins, 3, rs.data(), n, reduce_op::sum);
    host::parallel_reduce_ordered(e, dtype::f32, reinterpret_cast<const void* const*>(ins), 3,
                                  rm.data(), n, reduce_op::max);
    REQUIRE(same_bits(rs, red_sum));
    REQUIRE(same_bits(rm, red_max));
  });
  REQUIRE(ex.reverse.batches > 0);  // the user's executor was used
}

TEST_CASE("the host step plan on threads: runs of several groups, cut anywhere",
          "[kernels][parallel][optimizer]") {
  using ops_t = space_ops<host_space>;
  using run_t = step_run<adamw, bf16, bf16>;
  // runs of uneven lengths, two groups with different constants
  const std::vector<std::size_t> lengths{5, 70000, 1, 33, 150001, 64, 9999};
  std::size_t n = 0;
  for (auto x : lengths) n += x;
  std::uint64_t s = 8;
  std::vector<float> p0(n), m0(n), v0(n);
  std::vector<bf16> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = random_float(s);
    g[i] = bf16(random_float(s));
  }
  const std::vector<adamw::constants> k{
      adamw::prepare({.lr = 1e-3f, .weight_decay = 0.01f}, 2, 1e-3f, 1.0f),
      adamw::prepare({.lr = 5e-2f, .weight_decay = 0.0f}, 2, 5e-2f, 0.25f)};
  auto run_with = [&](ops_t ops) {
    auto p = p0, m = m0, v = v0;
    std::vector<bf16> w(n);
    std::vector<run_t> runs;
    std::size_t at = 0;
    for (std::size_t r = 0; r < lengths.size(); ++r) {
      run_t x;
      x.params = p.data() + at;
      x.state[0] = m.data() + at;
      x.state[1] = v.data() + at;
      x.grads = g.data() + at;
      x.working = w.data() + at;
      x.count = lengths[r];
      x.group = r % 2;
      runs.push_back(x);
      at += lengths[r];
    }
    auto plan = ops.make_step_plan<adamw, bf16, bf16>(std::span<const run_t>(runs), 2);
    plan.launch(std::span<const adamw::constants>(k));
    return std::make_pair(p, w);
  };
  // independent expectation: each run stepped alone with its group's constants
  auto p = p0, m = m0, v = v0;
  std::vector<bf16> w(n);
  std::size_t at = 0;
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    float* st[2] = {m.data() + at, v.data() + at};
    host::fused_step_scalar<adamw>(k[r % 2], p.data() + at, st, g.data() + at, w.data() + at,
                                   lengths[r]);
    at += lengths[r];
  }
  for (std::size_t t = 1; t <= 4; ++t) {
    CAPTURE(t);
    const auto got = run_with(ops_t::with_threads(t));
    REQUIRE(same_bits(got.first, p));
    REQUIRE(same_bits(got.second, w));
  }
  const auto user = run_with(ops_t(std::make_shared<reverse_executor>()));
  REQUIRE(same_bits(user.first, p));
  REQUIRE_THROWS_AS(ops_t::with_threads(0), invalid_argument);
}

TEST_CASE("shard_optimizer on a thread team computes the bits of one thread",
          "[kernels][parallel][optimizer]") {
  const std::vector<std::size_t> numels{200000, 7, 90001};
  const flat_layout layout(numels, {}, 1);
  const std::vector<std::size_t> groups{0, 1, 0};
  std::uint64_t s = 4;
  std::vector<std::vector<float>> init;
  for (auto n : numels) {
    init.emplace_back(n);
    for (auto& x : init.back()) x = random_float(s);
  }
  std::vector<bf16> grads(layout.padded_numel());
  for (auto& x : grads) x = bf16(random_float(s));
  auto train = [&](space_ops<host_space> ops) {
    shard_optimizer<host_space, adamw, bf16> opt(
        layout, 0, groups, param_groups<adam_options>({{.lr = 1e-2f}, {.lr = 1e-3f}}), nullptr,
        ops);
    for (std::size_t i = 0; i < numels.size(); ++i) opt.load(i, init[i].data(), dtype::f32);
    std::vector<bf16> working(layout.padded_numel());
    for (int t = 0; t < 3; ++t) {
      opt.step(flat_span<const bf16>::full(grads.data(), grads.size()),
               flat_span<bf16>::full(working.data(), working.size()), 0.5f);
    }
    std::vector<float> master(opt.master().begin(), opt.master().end());
    return std::make_pair(master, working);
  };
  const auto one = train(space_ops<host_space>{});
  for (std::size_t t = 1; t <= 4; ++t) {
    CAPTURE(t);
    const auto got = train(space_ops<host_space>::with_threads(t));
    REQUIRE(same_bits(got.first, one.first));
    REQUIRE(same_bits(got.second, one.second));
  }
}

namespace {
template <class Policies>
std::vector<test::outcome> train_threads(int ranks, std::size_t threads,
                                         std::shared_ptr<host::executor> exec = nullptr) {
  const test::model_case mc{"large enough for several threads", {150000, 3, 70001, 129}, {0, 2}};
  test::run_config cfg;
  cfg.options.host_threads = threads;
  cfg.options.host_executor = std::move(exec);
  cfg.options.clip_grad_norm = 0.5f;  // the statistics pass on threads too
  cfg.options.report_grad_norm = true;
  return test::train<test::thread_world, Policies, bf16, adamw>(ranks, mc, cfg);
}

template <class Policies>
void engine_threads_agree() {
  const auto one = train_threads<Policies>(2, 1);
  test::require_ok(one);
  for (std::size_t t = 2; t <= 4; ++t) {
    CAPTURE(t);
    const auto got = train_threads<Policies>(2, t);
    test::require_ok(got);
    REQUIRE(test::agreed_working_hash(got) == test::agreed_working_hash(one));
    REQUIRE(got[0].master_hash == one[0].master_hash);
  }
  // one team shared by both ranks (their batches take turns)
  const auto shared = train_threads<Policies>(2, 1, std::make_shared<host::thread_team>(3));
  test::require_ok(shared);
  REQUIRE(test::agreed_working_hash(shared) == test::agreed_working_hash(one));
}
}  // namespace

TEST_CASE("engine: host_threads 1-4 and a shared host_executor give the same bits, stages 0-3",
          "[engine][parallel]") {
  SECTION("stage 0") {
    engine_threads_agree<zero0>();
  }
  SECTION("stage 1") {
    engine_threads_agree<zero1>();
  }
  SECTION("stage 2") {
    engine_threads_agree<zero2>();
  }
  SECTION("stage 3") {
    engine_threads_agree<zero3>();
  }
}

TEST_CASE("engine: host_threads = 0 is rejected, naming the option", "[engine][parallel]") {
  std::vector<float> w(10, 1.0f);
  model_spec model;
  model.add("w", w);
  engine_options o;
  o.host_threads = 0;
  REQUIRE_THROWS_WITH(
      run_ranks(
          1, [&](thread_comm& c) { engine<thread_comm, zero1, bf16, adamw> e(c, model, {}, o); }),
      Contains("engine_options::host_threads must be at least 1"));
}
