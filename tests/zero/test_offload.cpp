// The offloaded optimizer (zero/offload_optimizer.hpp): an engine with OffloadOptimizer trains
// bit for bit like the same engine without it, at stages 1-3, several rank counts, fp32 and
// bf16 working values, with micro-batches and clipping, pipelined or serial, on 1 or 3 host
// threads; its ledgers hold the device-side and host-side bytes of docs/accounting.md; bad
// input is named.
#include <shardkit/shardkit.hpp>

#include "support/reference.hpp"
#include "support/world.hpp"

#include <bit>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using shardkit::memory_category;

struct offload_case {
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> units;  // unit starts (stage 2 and 3 groups); empty: one unit
};

struct run_result {
  std::vector<std::uint64_t> bits;  // parameters, master and state after every step
  std::uint64_t device[shardkit::memory_category_count] = {};
  std::uint64_t host[shardkit::memory_category_count] = {};
  std::uint64_t copies = 0;
  std::size_t shard = 0;
  bool reports_agree = true;  // the engine's expected bytes equal its ledgers
};

template <class T>
std::uint64_t bits_of(T x) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(x);
  else
    return x.bits;
}

struct train_config {
  int steps = 3;
  int micro_batches = 2;
  float clip = 0.5f;
  std::size_t host_threads = 1;
  shardkit::offload_schedule schedule = shardkit::offload_schedule::pipelined;
  std::size_t shard_group = 0;  // hybrid sharding: ranks per shard group
};

template <class Policies, class W>
std::vector<run_result> train(int N, const offload_case& mc, const train_config& cfg) {
  using engine_t = shardkit::engine<shardkit::thread_comm, Policies, W, shardkit::adamw>;
  return test::thread_world::run(N, [&](shardkit::thread_comm& c) {
    shardkit::model_spec model;  // holds views of the initial values: they outlive it
    std::vector<std::vector<float>> inits(mc.sizes.size());
    std::size_t next = 0;
    for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
      if ((next < mc.units.size() && mc.units[next] == i) || (mc.units.empty() && i == 0)) {
        model.begin_unit("u" + std::to_string(i));
        ++next;
      }
      auto& init = inits[i];
      init.resize(mc.sizes[i]);
      for (std::size_t k = 0; k < init.size(); ++k) init[k] = ref::init_value(i, k);
      model.add("p" + std::to_string(i), init);
    }
    shardkit::engine_options eo;
    eo.clip_grad_norm = cfg.clip;
    eo.host_threads = cfg.host_threads;
    eo.shard_group_size = cfg.shard_group;
    engine_t eng(c, model, shardkit::adam_options{.lr = 1e-2f, .weight_decay = 0.05f}, eo);
    if constexpr (Policies::offload_optimizer) eng.optimizer().set_schedule(cfg.schedule);
    run_result out;
    std::vector<float> g;
    const std::size_t U = eng.num_units();
    auto params_of = [&](std::size_t u) {
      std::pair<std::size_t, std::size_t> r{0, 0};
      for (std::size_t i = 0; i < eng.num_params(); ++i) {
        if (eng.unit_of(i) != u) continue;
        if (r.first == r.second) r.first = i;
        r.second = i + 1;
      }
      return r;
    };
    for (int t = 1; t <= cfg.steps; ++t) {
      for (int mb = 0; mb < cfg.micro_batches; ++mb) {
        eng.begin_micro_batch(mb + 1 == cfg.micro_batches);
        for (std::size_t u = 0; u < U; ++u) {
          eng.pre_forward(u);
          eng.post_forward(u);
        }
        for (std::size_t u = U; u-- > 0;) {
          eng.pre_backward(u);
          const auto [b, e] = params_of(u);
          for (std::size_t i = e; i-- > b;) {
            g.resize(mc.sizes[i]);
            for (std::size_t k = 0; k < g.size(); ++k)
              g[k] = ref::grad_value(t, c.rank(), i, k, mb);
            eng.grad_ready(i, g);
          }
          eng.post_backward(u);
        }
      }
      const auto rep = eng.step();
      out.bits.push_back(rep.skipped ? 1 : 0);
      if constexpr (engine_t::has_master) {
        for (float x : eng.master_shard()) out.bits.push_back(bits_of(x));
      }
      for (std::size_t s = 0; s < 2; ++s) {
        for (float x : eng.optimizer_state(s)) out.bits.push_back(bits_of(x));
      }
      if constexpr (engine_t::stage == 3) {
        for (auto x : eng.param_shard()) out.bits.push_back(bits_of(x));
      } else {
        for (std::size_t i = 0; i < eng.num_params(); ++i) {
          for (auto x : eng.param(i)) out.bits.push_back(bits_of(x));
        }
      }
    }
    for (std::size_t k = 0; k < shardkit::memory_category_count; ++k) {
      out.device[k] = eng.memory().peak(static_cast<memory_category>(k));
      if constexpr (Policies::offload_optimizer) {
        out.host[k] = eng.optimizer().memory().peak(static_cast<memory_category>(k));
      }
    }
    if constexpr (Policies::offload_optimizer) {
      out.copies = eng.optimizer().copies();
      const auto& h = eng.optimizer().memory();
      const auto want = eng.expected_host_bytes();
      out.reports_agree = eng.expected_state_bytes() == eng.measured_state_bytes() &&
                          want.master_params == h.current(memory_category::master_params) &&
                          want.optimizer_moments == h.current(memory_category::optimizer_moments) &&
                          want.staging == h.current(memory_category::offload_staging);
    }
    out.shard = eng.layout().shard_numel();
    return out;
  });
}

// S = Σ_g ceil(Ψ_g / N) over the groups of the stage (docs/accounting.md, "Layout and padding").
std::uint64_t shard_elems(int stage, const offload_case& mc, std::uint64_t n) {
  std::vector<std::size_t> starts{0};
  if (stage >= 2 && !mc.units.empty()) starts = mc.units;
  std::uint64_t s = 0;
  for (std::size_t k = 0; k < starts.size(); ++k) {
    const std::size_t e = k + 1 < starts.size() ? starts[k + 1] : mc.sizes.size();
    std::uint64_t psi = 0;
    for (std::size_t i = starts[k]; i < e; ++i) psi += mc.sizes[i];
    s += (psi + n - 1) / n;
  }
  return s;
}

template <class Plain, class Offload, class W>
void check_same(int stage) {
  const std::vector<offload_case> cases = {
      {{5, 0, 13, 1, 64, 3, 0, 7}, {0, 2, 4, 6}},
      {{1, 0, 2}, {}},
      {{16 * 32, 32, 32 * 10, 10}, {0, 2}},
  };
  for (const auto& mc : cases) {
    for (int N : {1, 2, 3, 4}) {
      CAPTURE(stage, N, mc.sizes.size(), sizeof(W));
      train_config cfg;
      const auto plain = train<Plain, W>(N, mc, cfg);
      for (std::size_t threads : {std::size_t{1}, std::size_t{3}}) {
        for (auto sched :
             {shardkit::offload_schedule::pipelined, shardkit::offload_schedule::serial}) {
          CAPTURE(threads, static_cast<int>(sched));
          cfg.host_threads = threads;
          cfg.schedule = sched;
          const auto off = train<Offload, W>(N, mc, cfg);
          REQUIRE(off.size() == plain.size());
          const std::uint64_t n = static_cast<std::uint64_t>(N);
          const std::uint64_t S = shard_elems(stage, mc, n);
          const std::uint64_t w = sizeof(W), m = std::is_same_v<W, float> ? 0 : 4, k = 8;
          for (int r = 0; r < N; ++r) {
            CAPTURE(r);
            CHECK(off[r].bits == plain[r].bits);
            CHECK(off[r].reports_agree);
            REQUIRE(off[r].shard == S);
            const auto dev = [&](memory_category c) { return off[r].device[std::size_t(c)]; };
            const auto host = [&](memory_category c) { return off[r].host[std::size_t(c)]; };
            const auto was = [&](memory_category c) { return plain[r].device[std::size_t(c)]; };
            // Device: what the plain engine holds, less the master and state.
            CHECK(dev(memory_category::master_params) == 0);
            CHECK(dev(memory_category::optimizer_moments) == 0);
            CHECK(dev(memory_category::working_params) == (stage == 3 ? w * S : w * n * S));
            CHECK(dev(memory_category::grads) == (stage == 1 ? w * n * S : w * S));
            for (auto c : {memory_category::working_params, memory_category::grads,
                           memory_category::grad_buckets, memory_category::gathered_params,
                           memory_category::comm_scratch}) {
              CHECK(dev(c) == was(c));
            }
            // Host: master m·S, state k·S, staging (g + w)·S; nothing else.
            CHECK(was(memory_category::master_params) == m * S);
            CHECK(host(memory_category::master_params) == m * S);
            CHECK(host(memory_category::optimizer_moments) == k * S);
            CHECK(host(memory_category::offload_staging) == 2 * w * S);
            CHECK(host(memory_category::working_params) + host(memory_category::grads) == 0);
            CHECK(dev(memory_category::offload_staging) == 0);
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("offload: stage 1 equals the device optimizer bit for bit", "[offload]") {
  check_same<shardkit::zero1, shardkit::zero1_offload, shardkit::bf16>(1);
  check_same<shardkit::zero1, shardkit::zero1_offload, float>(1);
}

TEST_CASE("offload: stage 2 equals the device optimizer bit for bit", "[offload]") {
  check_same<shardkit::zero2, shardkit::zero2_offload, shardkit::bf16>(2);
  check_same<shardkit::zero2, shardkit::zero2_offload, float>(2);
}

TEST_CASE("offload: stage 3 equals the device optimizer bit for bit", "[offload]") {
  check_same<shardkit::zero3, shardkit::zero3_offload, shardkit::bf16>(3);
  check_same<shardkit::zero3, shardkit::zero3_offload, float>(3);
}

TEST_CASE("offload: hybrid sharding equals the device optimizer bit for bit", "[offload]") {
  const offload_case mc{{5, 0, 13, 1, 64, 3, 0, 7}, {0, 2, 4, 6}};
  train_config cfg;
  cfg.shard_group = 2;  // 4 ranks: two shard groups of 2, replicated
  CHECK(train<shardkit::zero2_offload, shardkit::bf16>(4, mc, cfg)[3].bits ==
        train<shardkit::zero2, shardkit::bf16>(4, mc, cfg)[3].bits);
  CHECK(train<shardkit::zero3_offload, shardkit::bf16>(4, mc, cfg)[2].bits ==
        train<shardkit::zero3, shardkit::bf16>(4, mc, cfg)[2].bits);
}

TEST_CASE("offload: copies, one per group each way (and the fp32 values in)", "[offload]") {
  // Two units of 1 and 8 elements on 2 ranks: rank 1 holds only padding of the first, so it
  // copies nothing of it.
  const offload_case mc{{1, 8}, {0, 1}};
  train_config cfg;
  cfg.steps = 2;
  const auto bf = train<shardkit::zero2_offload, shardkit::bf16>(2, mc, cfg);
  CHECK(bf[0].copies == 2 * 2 * 2);
  CHECK(bf[1].copies == 2 * 2 * 1);
  const auto f32 = train<shardkit::zero2_offload, float>(2, mc, cfg);
  CHECK(f32[0].copies == 2 * 3 * 2);
  CHECK(f32[1].copies == 2 * 3 * 1);
}

TEST_CASE("offload: a host thread count of 0 is named", "[offload]") {
  shardkit::model_spec model;
  std::vector<float> w(10, 1.0f);
  model.add("w", w);
  shardkit::engine_options eo;
  eo.host_threads = 0;
  const auto errs = test::errors_per_rank(2, [&](shardkit::thread_comm& c) {
    shardkit::engine<shardkit::thread_comm, shardkit::zero2_offload> e(c, model, {}, eo);
  });
  for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("host_threads must be at least 1"));
}

TEST_CASE("offload: the step's part bounds are checked", "[offload]") {
  const std::vector<std::size_t> numels{10}, starts{}, group{0};
  shardkit::flat_layout layout(numels, starts, 1);
  shardkit::shard_optimizer<shardkit::host_space, shardkit::adamw, shardkit::bf16> opt(
      layout, 0, group,
      shardkit::param_groups<shardkit::adam_options>(std::vector<shardkit::adam_options>(1)));
  CHECK_THROWS_WITH(opt.set_step_parts({4, 4}), Catch::Contains("must ascend strictly"));
  CHECK_THROWS_WITH(opt.set_step_parts({10}), Catch::Contains("must ascend strictly"));
  opt.set_step_parts({3, 7});
  CHECK(opt.step_parts() == 3);
}

TEST_CASE("offload: a step cut into parts, in any order, is the unsplit step", "[offload]") {
  using opt_t = shardkit::shard_optimizer<shardkit::host_space, shardkit::adamw, shardkit::bf16>;
  const std::vector<std::size_t> numels{37, 0, 100, 5}, starts{0, 2}, group{0, 0, 1, 1};
  shardkit::flat_layout layout(numels, starts, 3);
  const shardkit::param_groups<shardkit::adam_options> groups(
      std::vector<shardkit::adam_options>{{.lr = 1e-2f}, {.lr = 3e-3f, .weight_decay = 0.1f}});
  for (std::size_t r = 0; r < 3; ++r) {
    opt_t whole(layout, r, group, groups), cut(layout, r, group, groups);
    cut.set_step_parts({1, layout.group(1).shard_offset, layout.shard_numel() - 1});
    std::vector<shardkit::bf16> g(layout.padded_numel()), w1(g.size()), w2(g.size());
    for (std::size_t k = 0; k < g.size(); ++k) g[k] = shardkit::bf16(ref::grad_value(1, 0, 0, k));
    const auto grads = shardkit::flat_span<const shardkit::bf16>::full(g.data(), g.size());
    for (int t = 0; t < 3; ++t) {
      whole.step(grads, shardkit::flat_span<shardkit::bf16>::full(w1.data(), w1.size()), 0.5f);
      cut.bind(grads, shardkit::flat_span<shardkit::bf16>::full(w2.data(), w2.size()));
      cut.begin_step(0.5f);
      for (std::size_t p = cut.step_parts(); p-- > 0;) cut.step_part(p);  // last part first
    }
    CAPTURE(r);
    CHECK(cut.step_parts() == 4);
    for (std::size_t k = 0; k < g.size(); ++k) REQUIRE(w1[k].bits == w2[k].bits);
    for (std::size_t k = 0; k < layout.shard_numel(); ++k) {
      REQUIRE(whole.master()[k] == cut.master()[k]);
      REQUIRE(whole.state(1)[k] == cut.state(1)[k]);
    }
  }
  opt_t unbound(layout, 0, group, groups);
  CHECK_THROWS_WITH(unbound.begin_step(1.0f), Catch::Contains("bind() first"));
}
