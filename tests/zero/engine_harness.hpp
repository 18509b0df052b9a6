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
  if (stage >= 2 && bucket != 0) {
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
    starts = mc.units;
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
  double tolerance = 1e-6;  // max |p - reference|
};

template <class World, class Policies, class W, class Opt>
std::vector<outcome> train(int N, const model_case& mc, const run_config& cfg) {
  using Comm = typename World::comm_type;
  using engine_t = shardkit::engine<Comm, Policies, W, Opt>;
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
    shardkit::model_spec model;
    std::size_t next_unit = 0;
    for (std::size_t i = 0; i < P; ++i) {
      if (next_unit < mc.units.size() && mc.units[next_unit] == i) {
        model.begin_unit();
        ++next_unit;
      }
      model.add("p" + std::to_string(i), init[i]);
    }
    engine_t eng(c, model, cfg.adam, cfg.options);
    const std::uint64_t psi = ref_p.size();
    ref::adam reference{cfg.adam.lr,  cfg.adam.beta1,           cfg.adam.beta2,
                        cfg.adam.eps, cfg.adam.weight_decay,    decoupled,
                        ref_p,        std::vector<double>(psi), std::vector<double>(psi)};

    // Shard size and per-group sizes from the specification, not from the engine.
    const std::uint64_t n = static_cast<std::uint64_t>(N);
    std::uint64_t S = 0, largest_padded = 0;
    for (auto [b, e] : expected_groups(stage, mc, cfg.options.bucket_elems)) {
      std::uint64_t psi_g = 0;
      for (std::size_t i = b; i < e; ++i) psi_g += mc.sizes[i];
      S += (psi_g + n - 1) / n;
      largest_padded = std::max(largest_padded, n * ((psi_g + n - 1) / n));
    }
    const std::uint64_t w = sizeof(W);
    const auto traffic0 = c.traffic();

    std::vector<float> g;
    for (int t = 1; t <= cfg.steps; ++t) {
      for (int mb = 0; mb < cfg.micro_batches; ++mb) {
        for (std::size_t i = P; i-- > 0;) {  // backward order
          g.resize(mc.sizes[i]);
          for (std::size_t k = 0; k < g.size(); ++k) g[k] = ref::grad_value(t, c.rank(), i, k, mb);
          eng.grad_ready(i, g);
        }
      }
      const auto rep = eng.step();
      if (cfg.micro_batches == 1) {
        const auto want =
            ref::facts_step_bytes(stage, psi, n, S, w, static_cast<std::uint64_t>(c.rank()));
        check(rep.bytes_sent == want, "step ", t, " sent ", rep.bytes_sent,
              " bytes, FACTS formula says ", want);
      }
      // The reference's gradient: per element, the data-parallel mean of what the ranks
      // contributed, with the 16-bit roundings the specification prescribes (local
      // accumulation in W for stages 0/1, reduce then accumulate for stage 2).
      std::vector<double> mean(psi);
      std::size_t flat = 0;
      for (std::size_t i = 0; i < P; ++i) {
        for (std::size_t k = 0; k < mc.sizes[i]; ++k, ++flat) {
          double total = 0;
          if (stage <= 1) {
            for (int r = 0; r < N; ++r) {
              double local = ref::grad_value(t, r, i, k, 0);
              for (int mb = 1; mb < cfg.micro_batches; ++mb) {
                local = ref::round_to<W>(local + ref::grad_value(t, r, i, k, mb));
              }
              total += local;
            }
            total = ref::round_to<W>(total);
          } else {
            for (int mb = 0; mb < cfg.micro_batches; ++mb) {
              double s = 0;
              for (int r = 0; r < N; ++r) s += ref::grad_value(t, r, i, k, mb);
              total = mb == 0 ? ref::round_to<W>(s) : ref::round_to<W>(total + ref::round_to<W>(s));
            }
          }
          mean[flat] = cfg.options.average_grads ? total / N : total;
        }
      }
      reference.step(mean);
    }

    // Parameters: the working copy (full, on every rank) and the fp32 master.
    std::vector<float> master(psi);
    if constexpr (engine_t::has_master) {
      const auto& L = eng.layout();
      const std::size_t s_elems = L.shard_numel();
      std::vector<float> all(s_elems * (stage == 0 ? 1 : n));
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
    }
    check(out.max_err <= cfg.tolerance, "parameters differ from the unsharded reference by ",
          out.max_err, " (tolerance ", cfg.tolerance, ")");

    // Ledger: bytes held equal FACTS.md's formulas with exact padding.
    const auto want =
        ref::facts_bytes(stage, psi, n, S, w, engine_t::has_master ? 4 : 0, 4 * Opt::state_count);
    const auto got = eng.measured_state_bytes();
    check(got.working_params == want.working && got.grads == want.grads &&
              got.master_params == want.master && got.optimizer_moments == want.moments,
          "ledger holds (", got.working_params, ", ", got.grads, ", ", got.master_params, ", ",
          got.optimizer_moments, ") bytes; FACTS says (", want.working, ", ", want.grads, ", ",
          want.master, ", ", want.moments, ")");
    check(got == eng.expected_state_bytes(), "plan/formulas.hpp disagrees with the ledger");
    if constexpr (stage == 2) {
      const auto& mem = eng.memory();
      check(mem.peak(shardkit::memory_category::grads) == S * w, "gradient storage peaked at ",
            mem.peak(shardkit::memory_category::grads), " bytes, more than the shard");
      check(mem.peak(shardkit::memory_category::grad_buckets) ==
                cfg.options.grad_buffers * largest_padded * w,
            "staging buckets peaked at ", mem.peak(shardkit::memory_category::grad_buckets),
            " bytes, expected ", cfg.options.grad_buffers, " x ", largest_padded * w);
    }
    // The communicator recorded exactly what the engine says it sent (the all_gather above
    // for the master check is outside the engine).
    const auto sent = c.traffic().since(traffic0);
    const std::uint64_t extra =
        engine_t::has_master && stage != 0
            ? shardkit::ring_bytes_sent(shardkit::collective::all_gather,
                                        eng.layout().shard_numel(), 4, n,
                                        static_cast<std::uint64_t>(c.rank()))
            : 0;
    check(sent.total_bytes_sent() == eng.traffic().total_bytes_sent() + extra,
          "communicator recorded ", sent.total_bytes_sent(), " bytes, engine ",
          eng.traffic().total_bytes_sent());
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
