// Shared harness of the engine tests: trains a model with synthetic gradients on N ranks of a
// World, and checks on every rank, against the independent reference (support/reference.hpp):
// the parameters, the working copy, the ledger's bytes held and the bytes sent per step.
// Returns per-rank outcomes with bit hashes so tests can compare stages with each other.
#pragma once

#include <shardkit/shardkit.hpp>

#include "support/reference.hpp"
#include "support/world.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace test {

struct model_case {
  const char* name;
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> units;  // parameter indices where units start (empty: one unit)
};

inline std::vector<model_case> model_cases() {
  return {
      {"uneven sizes with zero-size tensors", {5, 0, 13, 1, 64, 3, 0, 7}, {}},
      {"uneven sizes in four units", {5, 0, 13, 1, 64, 3, 0, 7}, {0, 2, 4, 6}},
      {"fewer elements than ranks", {1, 0, 2}, {}},
      {"MLP 64-256-10", {64 * 256, 256, 256 * 10, 10}, {0, 2}},
  };
}

struct outcome {
  std::string failure;  // first failed check on this rank, empty when all held
  std::uint64_t working_hash = 0;
  std::uint64_t master_hash = 0;
  double max_err = 0;
};

//! The members of an outcome, for worlds that move results between processes (support/serial.hpp).
inline auto fields(outcome& o) {
  return std::tie(o.failure, o.working_hash, o.master_hash, o.max_err);
}

inline std::uint64_t mix_hash(std::uint64_t h, std::uint64_t v) {
  return ref::hash(h ^ v) + v;
}

template <class T>
std::uint64_t bits(T x) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(x);
  else
    return x.bits;
}

//! Groups (as parameter index ranges) that the engine is specified to use for this stage:
//! stage 0 and 1 one group; stage 2 buckets closed backwards at `bucket` elements, else the
//! declared units, else one group.
inline std::vector<std::pair<std::size_t, std::size_t>> expected_groups(int stage,
                                                                        const model_case& mc,
                                                                        std::size_t bucket) {
  const std::size_t P = mc.sizes.size();
  std::vector<std::size_t> starts{0};
  if (stage == 2 && bucket != 0) {
    std::vector<std::size_t> rev;
    std::size_t acc = 0;
    for (std::size_t i = P; i-- > 1;) {
      acc += mc.sizes[i];
      if (acc >= bucket) {
        rev.push_back(i);
        acc = 0;
      }
    }
    starts.insert(starts.end(), rev.rbegin(), rev.rend());
  } else if (stage >= 2 && !mc.units.empty()) {
    starts = mc.units;  // stage 2 without a bucket size, and stage 3 always: the units
  }
  std::vector<std::pair<std::size_t, std::size_t>> g;
  for (std::size_t k = 0; k < starts.size(); ++k) {
    g.emplace_back(starts[k], k + 1 < starts.size() ? starts[k + 1] : P);
  }
  return g;
}

struct run_config {
  int steps = 3;
  int micro_batches = 1;
  shardkit::engine_options options{};
  shardkit::adam_options adam{
      .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.05f};
  double tolerance = 1e-6;               // max |p - reference|
  std::vector<bool> keep_after_forward;  // ZeRO-3: units declared reshard_after_forward = false
  //! Parameter groups: parameter i uses groups[i % groups.size()] (empty: `adam` for all).
  std::vector<shardkit::adam_options> groups;
  //! Learning-rate schedule (factor for step t); empty: none.
  std::function<float(std::uint64_t)> schedule;
  //! Declare micro-batches with begin_micro_batch (the step then averages over them).
  bool declare_micro_batches = false;
  //! Step at which rank `inject_rank` hands over an infinite gradient (0: never).
  int inject_inf_step = 0;
  int inject_rank = 0;
};

//! Grad: the engine's gradient type (its fifth template argument; default the working type).
template <class World, class Policies, class W, class Opt, class Grad = W>
std::vector<outcome> train(int N, const model_case& mc, const run_config& cfg) {
  using Comm = typename World::comm_type;
  using engine_t = shardkit::engine<Comm, Policies, W, Opt, Grad>;
  constexpr int stage = Policies::stage;
  constexpr bool decoupled = std::is_same_v<Opt, shardkit::adamw>;
  return World::run(N, [&](Comm& c) -> outcome {
    outcome out;
    std::ostringstream fail;
    auto check = [&](bool ok, auto&&... what) {
      if (!ok && out.failure.empty()) {
        (fail << ... << what);
        out.failure = fail.str();
      }
    };
    const std::size_t P = mc.sizes.size();
    std::vector<std::vector<float>> init(P);
    std::vector<double> ref_p;
    for (std::size_t i = 0; i < P; ++i) {
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
        init[i].push_back(ref::init_value(i, k));
        ref_p.push_back(init[i].back());
      }
    }
    const std::vector<shardkit::adam_options> groups =
        cfg.groups.empty() ? std::vector<shardkit::adam_options>{cfg.adam} : cfg.groups;
    auto group_of = [&](std::size_t i) { return i % groups.size(); };
    shardkit::model_spec model;
    std::size_t next_unit = 0;
    for (std::size_t i = 0; i < P; ++i) {
      if ((next_unit < mc.units.size() && mc.units[next_unit] == i) ||
          (mc.units.empty() && i == 0)) {
        const bool keep =
            next_unit < cfg.keep_after_forward.size() && cfg.keep_after_forward[next_unit];
        model.begin_unit("", shardkit::unit_options{.reshard_after_forward = !keep});
        ++next_unit;
      }
      model.add("p" + std::to_string(i), init[i], group_of(i));
    }
    const auto traffic0 = c.traffic();
    shardkit::engine_options eo = cfg.options;
    if (std::is_same_v<W, shardkit::fp16> && !eo.loss_scale) {
      eo.loss_scale = shardkit::loss_scale_options{.init_scale = 1024.0f};  // fits fp16 sums
    }
    engine_t eng(c, model, shardkit::param_groups<shardkit::adam_options>(groups), eo);
    if (cfg.schedule) eng.set_lr_schedule(cfg.schedule);
    const std::uint64_t psi = ref_p.size();
    ref::adam reference;
    reference.decoupled = decoupled;
    reference.p = ref_p;
    reference.m.assign(psi, 0.0);
    reference.v.assign(psi, 0.0);
    for (const auto& o : groups) {
      reference.groups.push_back({o.lr, o.beta1, o.beta2, o.eps, o.weight_decay});
    }
    for (std::size_t i = 0; i < P; ++i)
      reference.group.insert(reference.group.end(), mc.sizes[i], group_of(i));

    // Shard size and per-group sizes from the specification, not from the engine.
    // Hybrid sharding: shard over groups of G consecutive ranks, R = N / G replicas.
    const std::uint64_t nw = static_cast<std::uint64_t>(N);
    const std::uint64_t G =
        stage != 0 && cfg.options.shard_group_size != 0 ? cfg.options.shard_group_size : nw;
    const std::uint64_t R = nw / G;
    const std::uint64_t n = G;  // ranks a group is sharded over
    std::uint64_t S = 0, largest_padded = 0;
    for (auto [b, e] : expected_groups(stage, mc, cfg.options.bucket_elems)) {
      std::uint64_t psi_g = 0;
      for (std::size_t i = b; i < e; ++i) psi_g += mc.sizes[i];
      S += (psi_g + n - 1) / n;
      largest_padded = std::max(largest_padded, n * ((psi_g + n - 1) / n));
    }
    const std::uint64_t w = sizeof(W);
    const std::uint64_t gw = sizeof(Grad);  // gradients: reduce-scatters, all-reduces, staging

    std::vector<float> g;
    const std::size_t U = eng.num_units();
    auto unit_params = [&](std::size_t u) {
      const std::size_t b = mc.units.empty() ? 0 : mc.units[u];
      const std::size_t e = mc.units.empty() || u + 1 == mc.units.size() ? P : mc.units[u + 1];
      return std::pair{b, e};
    };
    // ZeRO-3 units from the specification: padded size N·S_u, persistent (fewer than
    // persist_below elements), kept from forward to backward.
    struct unit_spec {
      std::uint64_t shard = 0, padded = 0;
      bool persistent = false, kept = false;
    };
    std::vector<unit_spec> units(U);
    std::uint64_t largest_transient = 0, fixed_live = 0, persistent_live = 0, transient = 0;
    for (std::size_t u = 0; u < U; ++u) {
      std::uint64_t psi_u = 0;
      for (auto [b, e] = unit_params(u); b < e; ++b) psi_u += mc.sizes[b];
      units[u].shard = (psi_u + n - 1) / n;
      units[u].padded = n * units[u].shard;
      units[u].persistent = psi_u < cfg.options.persist_below;
      units[u].kept = u < cfg.keep_after_forward.size() && cfg.keep_after_forward[u];
      if (units[u].persistent) {
        fixed_live += units[u].padded;
        persistent_live += units[u].padded;
      } else {
        largest_transient = std::max(largest_transient, units[u].padded);
        ++transient;
        if (units[u].kept) fixed_live += units[u].padded;
      }
    }
    // Everything a skipped step must leave untouched, bit for bit.
    auto snapshot = [&] {
      std::vector<std::uint64_t> v{eng.steps_taken()};
      if constexpr (engine_t::has_master) {
        for (float x : eng.master_shard()) v.push_back(std::bit_cast<std::uint32_t>(x));
      }
      for (std::size_t s = 0; s < Opt::state_count; ++s) {
        for (float x : eng.optimizer_state(s)) v.push_back(std::bit_cast<std::uint32_t>(x));
      }
      if constexpr (stage == 3) {
        for (auto x : eng.param_shard()) v.push_back(bits(x));
      } else {
        for (std::size_t i = 0; i < P; ++i) {
          for (auto x : eng.param(i)) v.push_back(bits(x));
        }
      }
      return v;
    };
    const int K = cfg.micro_batches;
    for (int t = 1; t <= cfg.steps; ++t) {
      const bool inject = t == cfg.inject_inf_step;
      const auto before = inject ? snapshot() : std::vector<std::uint64_t>{};
      const auto comm_before = c.traffic();
      for (int mb = 0; mb < K; ++mb) {
        if (cfg.declare_micro_batches) eng.begin_micro_batch(mb + 1 == K);
        // Forward: the hooks gather (ZeRO-3) and are no-ops otherwise.
        for (std::size_t u = 0; u < U; ++u) {
          eng.pre_forward(u);
          for (auto [b, e] = unit_params(u); b < e; ++b) {
            check(eng.param(b).size() == mc.sizes[b], "param(", b, ") has the wrong size");
          }
          eng.post_forward(u);
        }
        for (std::size_t u = U; u-- > 0;) {  // backward order
          eng.pre_backward(u);
          const auto [b, e] = unit_params(u);
          for (std::size_t i = e; i-- > b;) {
            g.resize(mc.sizes[i]);
            for (std::size_t k = 0; k < g.size(); ++k) {
              // as a framework would: gradients of the loss times the engine's loss scale
              g[k] = ref::grad_value(t, c.rank(), i, k, mb) * eng.loss_scale();
            }
            if (inject && c.rank() == cfg.inject_rank && mb == 0 && !g.empty()) g[0] = INFINITY;
            eng.grad_ready(i, g);
          }
          eng.post_backward(u);
        }
      }
      if (stage <= 1 && cfg.declare_micro_batches) {
        check(c.traffic().since(comm_before).total_bytes_sent() == 0, "stage ", stage,
              " communicated before the last micro-batch's step()");
      }
      const auto rep = eng.step();
      if constexpr (stage == 3) {
        // Only the persistent units, and with keep_gathered_buffers the buffers kept for the
        // next step's gathers (at most the window, which the peak check below bounds).
        const std::uint64_t kept = eng.parameters().spare_elems() * w;
        check(cfg.options.keep_gathered_buffers || kept == 0, "after step() ", kept,
              " bytes of gathered buffers are kept without keep_gathered_buffers");
        check(eng.memory().current(shardkit::memory_category::gathered_params) ==
                  persistent_live * w + kept,
              "after step() ", eng.memory().current(shardkit::memory_category::gathered_params),
              " bytes of gathered parameters are held; only the persistent units' ",
              persistent_live * w, " and ", kept, " bytes kept for reuse should be");
      }
      if (inject) {
        check(rep.skipped, "step ", t, " with an infinite gradient on rank ", cfg.inject_rank,
              " was not skipped");
        check(snapshot() == before, "a skipped step changed the engine's state");
        continue;  // the reference skips it too
      }
      check(!rep.skipped, "step ", t, " was skipped without an overflow");
      if (K == 1) {
        const std::uint64_t me = static_cast<std::uint64_t>(c.rank());
        std::uint64_t want = stage == 0 ? ref::facts_step_bytes(0, psi, nw, S, gw, me)
                                        : ref::facts_step_bytes(stage, n, S, w, gw) +
                                              ref::all_reduce_bytes(S, R, me / G, gw);
        if (stage == 3) {  // persistent and kept units skip one all-gather per step
          for (const auto& us : units) {
            if (us.persistent || us.kept) want -= (n - 1) * us.shard * w;
          }
        }
        check(rep.bytes_sent == want, "step ", t, " sent ", rep.bytes_sent,
              " bytes, the closed-form formula says ", want);
      }
      // The reference's gradient: per element, the data-parallel mean of what the ranks
      // contributed, with the 16-bit roundings the specification prescribes (local
      // accumulation in Grad for stages 0/1, reduce then accumulate for stages 2/3).
      std::vector<double> mean(psi);
      std::size_t flat = 0;
      for (std::size_t i = 0; i < P; ++i) {
        for (std::size_t k = 0; k < mc.sizes[i]; ++k, ++flat) {
          double total = 0;
          // Each shard group (G consecutive ranks; all N without hybrid sharding) reduces in
          // Grad, then the R replicas' results are summed and rounded once more.
          for (std::uint64_t q = 0; q < R; ++q) {
            const int r0 = static_cast<int>(q * G), r1 = static_cast<int>((q + 1) * G);
            double acc = 0;
            if (stage <= 1) {  // local accumulation, then one reduction
              for (int r = r0; r < r1; ++r) {
                double local = ref::grad_value(t, r, i, k, 0);
                for (int mb = 1; mb < K; ++mb) {
                  local = ref::round_to<Grad>(local + ref::grad_value(t, r, i, k, mb));
                }
                acc += local;
              }
              acc = ref::round_to<Grad>(acc);
            } else {  // reduce every micro-batch, accumulate in the shard
              for (int mb = 0; mb < K; ++mb) {
                double s = 0;
                for (int r = r0; r < r1; ++r) s += ref::grad_value(t, r, i, k, mb);
                acc = mb == 0 ? ref::round_to<Grad>(s)
                              : ref::round_to<Grad>(acc + ref::round_to<Grad>(s));
              }
            }
            total += acc;
          }
          total = ref::round_to<Grad>(total);
          double m = cfg.options.average_grads ? total / N : total;
          if (cfg.declare_micro_batches && cfg.options.average_grads) m /= K;
          mean[flat] = m;
        }
      }
      const double ref_norm = ref::l2_norm(mean), ref_inf = ref::inf_norm(mean);
      if (cfg.options.report_grad_norm) {
        check(std::fabs(rep.grad_norm - ref_norm) <= 1e-6 * ref_norm, "step ", t,
              " reports the gradient norm ", rep.grad_norm, "; the reference norm is ", ref_norm);
        check(std::fabs(rep.grad_inf_norm - ref_inf) <= 1e-6 * ref_inf, "step ", t,
              " reports the inf-norm ", rep.grad_inf_norm, "; the reference is ", ref_inf);
      }
      if (cfg.options.clip_grad_norm > 0.0f) {
        const double norm =
            cfg.options.clip_norm == shardkit::grad_norm_kind::l2 ? ref_norm : ref_inf;
        const double coef = std::min(1.0, cfg.options.clip_grad_norm / (norm + 1e-6));
        check(std::fabs(rep.clip_coef - coef) <= 1e-6 * coef, "step ", t, " clipped by ",
              rep.clip_coef, "; the reference clips by ", coef);
        for (auto& x : mean) x *= coef;
      }
      reference.step(mean, cfg.schedule ? cfg.schedule(reference.t + 1) : 1.0);
    }

    // Parameters: the working copy (full, on every rank) and the fp32 master.
    std::vector<float> master(psi);
    if constexpr (engine_t::has_master) {
      const auto& L = eng.layout();
      const std::size_t s_elems = L.shard_numel();
      std::vector<float> all(s_elems * (stage == 0 ? 1 : nw));
      if constexpr (stage == 0) {
        std::copy(eng.master_shard().begin(), eng.master_shard().end(), all.begin());
      } else {
        c.all_gather(eng.master_shard().data(), all.data(), s_elems);
      }
      std::size_t flat = 0;
      std::vector<std::size_t> param_start(P);
      for (std::size_t i = 0; i < P; ++i) {
        param_start[i] = flat;
        flat += mc.sizes[i];
      }
      for (std::size_t q = 0; q < L.ranks(); ++q) {
        for (const auto& pc : L.pieces(q)) {
          for (std::size_t j = 0; j < pc.count; ++j) {
            master[param_start[pc.param] + pc.param_offset + j] =
                all[q * s_elems + pc.shard_offset + j];
          }
        }
      }
    }
    std::size_t flat = 0;
    for (std::size_t i = 0; i < P; ++i) {
      // ZeRO-3 gathers a unit to read it (the hooks are no-ops in the other stages)
      if (i == 0 || eng.unit_of(i) != eng.unit_of(i - 1)) eng.pre_forward(eng.unit_of(i));
      const auto v = eng.param(i);
      check(v.size() == mc.sizes[i], "param(", i, ") has ", v.size(), " elements");
      for (std::size_t k = 0; k < v.size(); ++k, ++flat) {
        out.working_hash = mix_hash(out.working_hash, bits(v[k]));
        if constexpr (engine_t::has_master) {
          check(v[k].bits == W(master[flat]).bits, "working copy of p", i, "[", k,
                "] is not the rounded master");
          out.master_hash = mix_hash(out.master_hash, std::bit_cast<std::uint32_t>(master[flat]));
        } else {
          master[flat] = v[k];
        }
        const double err = std::fabs(static_cast<double>(master[flat]) - reference.p[flat]);
        out.max_err = std::max(out.max_err, err);
      }
      if (i + 1 == P || eng.unit_of(i + 1) != eng.unit_of(i)) eng.post_forward(eng.unit_of(i));
    }
    check(out.max_err <= cfg.tolerance, "parameters differ from the unsharded reference by ",
          out.max_err, " (tolerance ", cfg.tolerance, ")");

    // Ledger: bytes held equal docs/accounting.md's formulas with exact padding.
    const auto want = ref::facts_bytes(stage, psi, n, S, w, gw, engine_t::has_master ? 4 : 0,
                                       4 * Opt::state_count);
    const auto got = eng.measured_state_bytes();
    check(got.working_params == want.working && got.grads == want.grads &&
              got.master_params == want.master && got.optimizer_moments == want.moments,
          "ledger holds (", got.working_params, ", ", got.grads, ", ", got.master_params, ", ",
          got.optimizer_moments, ") bytes; the formula says (", want.working, ", ", want.grads,
          ", ", want.master, ", ", want.moments, ")");
    check(got == eng.expected_state_bytes(), "plan/formulas.hpp disagrees with the ledger");
    if constexpr (stage == 3) {
      // Gathered parameters never exceed (1 + prefetch) x the largest unit, plus the
      // persistent units and the units kept from forward to backward.
      std::uint64_t bound =
          (std::min<std::uint64_t>(1 + cfg.options.prefetch, transient) * largest_transient +
           fixed_live) *
          w;
      if (cfg.options.max_live_elems != 0) {
        bound = std::min<std::uint64_t>(bound, cfg.options.max_live_elems * w);
      }
      const auto peak = eng.memory().peak(shardkit::memory_category::gathered_params);
      check(peak <= bound, "gathered parameters peaked at ", peak, " bytes, above the bound ",
            bound);
      check(peak >= std::max(largest_transient, fixed_live) * w, "gathered parameters peaked at ",
            peak, " bytes, below the largest unit: the ledger missed a gather");
      check(eng.gathered_bytes_bound() == bound, "engine reports the bound as ",
            eng.gathered_bytes_bound(), ", expected ", bound);
      check(eng.memory().peak(shardkit::memory_category::grad_buckets) ==
                cfg.options.grad_buffers * largest_padded * gw,
            "staging peaked at ", eng.memory().peak(shardkit::memory_category::grad_buckets));
    }
    if constexpr (stage == 2) {
      const auto& mem = eng.memory();
      check(mem.peak(shardkit::memory_category::grads) == S * gw, "gradient storage peaked at ",
            mem.peak(shardkit::memory_category::grads), " bytes, more than the shard");
      check(mem.peak(shardkit::memory_category::grad_buckets) ==
                cfg.options.grad_buffers * largest_padded * gw,
            "staging buckets peaked at ", mem.peak(shardkit::memory_category::grad_buckets),
            " bytes, expected ", cfg.options.grad_buffers, " x ", largest_padded * gw);
    }
    // The communicator recorded exactly what the engine says it sent (the all_gather above
    // for the master check is outside the engine).
    c.barrier();  // every asynchronous collective this rank issued has completed
    auto sent = c.traffic().since(traffic0);
    shardkit::traffic_ledger sub;  // hybrid sharding: the shard and replica groups' collectives
    for (auto* sc : {eng.shard_comm(), eng.replica_comm()}) {
      if (sc == nullptr) continue;
      sc->barrier();
      for (auto k : {shardkit::collective::all_reduce, shardkit::collective::reduce_scatter,
                     shardkit::collective::all_gather}) {
        sub.record(k, sc->traffic().bytes_sent(k));
      }
    }
    const std::uint64_t extra =
        engine_t::has_master && stage != 0
            ? shardkit::ring_bytes_sent(shardkit::collective::all_gather,
                                        eng.layout().shard_numel(), 4, nw,
                                        static_cast<std::uint64_t>(c.rank()))
            : 0;
    check(sent.total_bytes_sent() + sub.total_bytes_sent() ==
              eng.traffic().total_bytes_sent() + eng.control_traffic().total_bytes_sent() + extra,
          "communicator recorded ", sent.total_bytes_sent(), " bytes, engine ",
          eng.traffic().total_bytes_sent(), " + control ",
          eng.control_traffic().total_bytes_sent());
    return out;
  });
}

inline void require_ok(const std::vector<outcome>& per_rank) {
  for (std::size_t r = 0; r < per_rank.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(per_rank[r].failure == "");
  }
}

//! Every rank holds the same full working parameters; returns their hash.
inline std::uint64_t agreed_working_hash(const std::vector<outcome>& per_rank) {
  for (const auto& o : per_rank) REQUIRE(o.working_hash == per_rank.front().working_hash);
  return per_rank.front().working_hash;
}

}  // namespace test
