// Shared pieces of the component tests (test_shard_optimizer.cpp, test_grads_components.cpp,
// test_params_components.cpp, test_step_control.cpp, test_topology.cpp): each drives one ZeRO
// component the way a user's own training loop would, without the engine, and checks it against
// the independent unsharded reference (support/reference.hpp) and against layout sizes and byte
// counts computed here from the specification (docs/accounting.md), never from the library.
//
// Every rank function returns its first failed check (empty when all held), so tests assert
// after all ranks are done (World::run collects the results, also across MPI processes).
#pragma once

#include <shardkit/shardkit.hpp>

#include "support/reference.hpp"
#include "support/world.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace test::comp {

//! Records the first failed check of a rank.
struct checks {
  std::string failure;
  template <class... A>
  void operator()(bool ok, const A&... what) {
    if (ok || !failure.empty()) return;
    std::ostringstream s;
    (s << ... << what);
    failure = s.str();
  }
};

//! A model: parameter sizes and the parameter indices where units start (empty: one unit).
struct mcase {
  const char* name;
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> units;
};

inline std::vector<mcase> models() {
  return {
      {"uneven sizes with zero-size tensors in four units",
       {5, 0, 13, 1, 64, 3, 0, 7},
       {0, 2, 4, 6}},
      {"fewer elements than ranks", {1, 0, 2}, {0, 2}},
      {"a unit of empty parameters", {3, 0, 0, 9}, {0, 1, 3}},
      {"MLP 16-12-5", {16 * 12, 12, 12 * 5, 5}, {0, 2}},
  };
}

inline std::vector<std::size_t> unit_starts(const mcase& mc) {
  return mc.units.empty() ? std::vector<std::size_t>{0} : mc.units;
}

// ---- the flat layout, from the specification ---------------------------------------------------

//! One group as docs/accounting.md defines it: S_g = round_up(ceil(Ψ_g / N), alignment), the
//! group at N·Σ_{j<g} S_j in the full buffer and at Σ_{j<g} S_j in a rank's shard.
struct spec_group {
  std::size_t first = 0, end = 0;  // parameters [first, end)
  std::uint64_t psi = 0, shard = 0, full = 0, shard_off = 0;
  std::size_t nonempty = 0;  // parameters with elements
};

struct spec_layout {
  std::uint64_t ranks = 1, psi = 0, S = 0;
  std::vector<spec_group> groups;
  std::vector<std::size_t> group_of;       // per parameter
  std::vector<std::uint64_t> in_group;     // per parameter: first element within its group
  std::vector<std::uint64_t> flat_offset;  // per parameter: first element of the unpadded model

  std::uint64_t padded() const { return ranks * S; }
  const spec_group& group_of_param(std::size_t i) const { return groups[group_of[i]]; }
  //! Element k of parameter i in the full buffer.
  std::uint64_t full_offset(std::size_t i, std::size_t k) const {
    return group_of_param(i).full + in_group[i] + k;
  }
  //! The rank that owns element k of parameter i, and where it sits in that rank's shard.
  std::uint64_t owner(std::size_t i, std::size_t k) const {
    return (in_group[i] + k) / group_of_param(i).shard;
  }
  std::uint64_t shard_offset(std::size_t i, std::size_t k) const {
    const auto& g = group_of_param(i);
    const std::uint64_t j = in_group[i] + k;
    return g.shard_off + j - (j / g.shard) * g.shard;
  }
  std::uint64_t max_shard() const {
    std::uint64_t m = 0;
    for (const auto& g : groups) m = std::max(m, g.shard);
    return m;
  }
  std::uint64_t nonempty_groups() const {
    std::uint64_t n = 0;
    for (const auto& g : groups) n += g.psi != 0;
    return n;
  }
};

inline spec_layout make_spec(const std::vector<std::size_t>& sizes, std::vector<std::size_t> starts,
                             std::uint64_t N, std::uint64_t align = 1) {
  if (starts.empty()) starts.push_back(0);
  spec_layout L;
  L.ranks = N;
  L.group_of.resize(sizes.size());
  L.in_group.resize(sizes.size());
  L.flat_offset.resize(sizes.size());
  std::uint64_t flat = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    L.flat_offset[i] = flat;
    flat += sizes[i];
  }
  for (std::size_t g = 0; g < starts.size(); ++g) {
    spec_group e;
    e.first = starts[g];
    e.end = g + 1 < starts.size() ? starts[g + 1] : sizes.size();
    for (std::size_t i = e.first; i < e.end; ++i) {
      L.group_of[i] = g;
      L.in_group[i] = e.psi;
      e.psi += sizes[i];
      e.nonempty += sizes[i] != 0;
    }
    const std::uint64_t ceil = (e.psi + N - 1) / N;
    e.shard = (ceil + align - 1) / align * align;
    e.full = N * L.S;
    e.shard_off = L.S;
    L.S += e.shard;
    L.psi += e.psi;
    L.groups.push_back(e);
  }
  return L;
}

//! Gradient buckets of at least `bucket` elements, closed greedily from the last parameter
//! backwards (engine_options::bucket_elems); the first bucket takes what is left.
inline std::vector<std::size_t> bucket_starts(const std::vector<std::size_t>& sizes,
                                              std::size_t bucket) {
  std::vector<std::size_t> rev;
  std::size_t acc = 0;
  for (std::size_t i = sizes.size(); i-- > 1;) {
    acc += sizes[i];
    if (acc >= bucket) {
      rev.push_back(i);
      acc = 0;
    }
  }
  std::vector<std::size_t> s{0};
  s.insert(s.end(), rev.rbegin(), rev.rend());
  return s;
}

// ---- models, gradients, reference sums ---------------------------------------------------------

//! The initial values of a model (ref::init_value) and a model_spec viewing them. Keep it alive
//! while the spec is used.
struct model_values {
  std::vector<std::vector<float>> init;
  shardkit::model_spec spec;
  explicit model_values(const mcase& mc, std::vector<bool> keep_after_forward = {}) {
    init.resize(mc.sizes.size());
    const auto starts = unit_starts(mc);
    std::size_t next = 0;
    for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) init[i].push_back(ref::init_value(i, k));
      if (next < starts.size() && starts[next] == i) {
        const bool keep = next < keep_after_forward.size() && keep_after_forward[next];
        spec.begin_unit("u" + std::to_string(next),
                        shardkit::unit_options{.reshard_after_forward = !keep});
        ++next;
      }
      spec.add("p" + std::to_string(i), init[i], i % 2);
    }
  }
};

//! Rank r's gradient of parameter i in micro-batch mb of step t (ref::grad_value), as a tensor.
inline std::vector<float> grad_of(const mcase& mc, std::size_t i, std::uint64_t t, int r, int mb) {
  std::vector<float> g(mc.sizes[i]);
  for (std::size_t k = 0; k < g.size(); ++k) g[k] = ref::grad_value(t, r, i, k, mb);
  return g;
}

//! Per element of the unpadded model: the gradient summed over ranks [r0, r1) and K
//! micro-batches with the roundings the specification prescribes for gradients of type G:
//! local accumulation in G, then one reduction (fp32 accumulation, one rounding) when
//! `local_accumulation` (full_grads); otherwise one reduction per micro-batch accumulated into
//! the shard in G (shard_grads).
template <class G>
std::vector<double> reduced(const mcase& mc, std::uint64_t t, int r0, int r1, int K,
                            bool local_accumulation) {
  std::vector<double> out;
  for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
    for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
      double acc = 0;
      if (local_accumulation) {
        for (int r = r0; r < r1; ++r) {
          double local = ref::grad_value(t, r, i, k, 0);
          for (int mb = 1; mb < K; ++mb) {
            local = ref::round_to<G>(local + ref::grad_value(t, r, i, k, mb));
          }
          acc += local;
        }
        acc = ref::round_to<G>(acc);
      } else {
        for (int mb = 0; mb < K; ++mb) {
          double s = 0;
          for (int r = r0; r < r1; ++r) s += ref::grad_value(t, r, i, k, mb);
          acc = mb == 0 ? ref::round_to<G>(s) : ref::round_to<G>(acc + ref::round_to<G>(s));
        }
      }
      out.push_back(acc);
    }
  }
  return out;
}

//! The Adam(W) options of the component tests: parameter i uses group i % 2.
inline std::vector<shardkit::adam_options> adam_groups() {
  return {{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.05f},
          {.lr = 5e-3f, .beta1 = 0.8f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f}};
}

//! The unsharded double-precision reference of a model with adam_groups().
inline ref::adam reference_for(const mcase& mc, bool decoupled) {
  ref::adam a;
  a.decoupled = decoupled;
  for (const auto& o : adam_groups())
    a.groups.push_back({o.lr, o.beta1, o.beta2, o.eps, o.weight_decay});
  for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
    for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
      a.p.push_back(ref::init_value(i, k));
      a.group.push_back(i % 2);
    }
  }
  a.m.assign(a.p.size(), 0.0);
  a.v.assign(a.p.size(), 0.0);
  return a;
}

//! SGD with heavy-ball momentum (kernels/math.hpp's statement), unsharded, in double:
//! g = grad + wd·p; b = μ·b + g; p = p - lr·b. Sensitive to the gradient's scale, which Adam is
//! nearly blind to.
struct sgd_reference {
  struct hyper {
    double lr, momentum, weight_decay;
  };
  std::vector<hyper> groups;
  std::vector<std::size_t> group;
  std::vector<double> p, b;
  void step(const std::vector<double>& g) {
    for (std::size_t k = 0; k < p.size(); ++k) {
      const hyper& h = groups[group[k]];
      b[k] = h.momentum * b[k] + (g[k] + h.weight_decay * p[k]);
      p[k] -= h.lr * b[k];
    }
  }
};

inline std::vector<shardkit::sgd_options> sgd_groups() {
  return {{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f},
          {.lr = 0.02f, .momentum = 0.5f, .weight_decay = 0.0f}};
}

//! The options of parameter groups 0 and 1 for optimizer Opt, and its unsharded reference.
template <class Opt>
std::vector<typename Opt::options> groups_for() {
  if constexpr (std::is_same_v<Opt, shardkit::sgd_momentum>)
    return sgd_groups();
  else
    return adam_groups();
}
template <class Opt>
auto reference_of(const mcase& mc) {
  if constexpr (std::is_same_v<Opt, shardkit::sgd_momentum>) {
    sgd_reference s;
    for (const auto& o : sgd_groups()) s.groups.push_back({o.lr, o.momentum, o.weight_decay});
    for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
        s.p.push_back(ref::init_value(i, k));
        s.group.push_back(i % 2);
      }
    }
    s.b.assign(s.p.size(), 0.0);
    return s;
  } else {
    return reference_for(mc, std::is_same_v<Opt, shardkit::adamw>);
  }
}

template <class T>
std::uint64_t bits_of(T x) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(x);
  else
    return x.bits;
}

inline std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  return ref::hash(h ^ v) + v;
}

//! Every rank's messages contain `what` (for misuse checked on every rank).
inline void require_all_contain(const std::vector<std::string>& per_rank, const std::string& what) {
  REQUIRE(!per_rank.empty());
  for (std::size_t r = 0; r < per_rank.size(); ++r) {
    INFO("rank " << r);
    REQUIRE_THAT(per_rank[r], Catch::Contains(what));
  }
}

//! Runs fn(comm) on n ranks of World; returns each rank's exception message ("" for none).
template <class World, class F>
std::vector<std::string> errors_on(int n, F fn) {
  using Comm = typename World::comm_type;
  return World::run(n, [&](Comm& c) -> std::string {
    try {
      fn(c);
    } catch (const std::exception& e) {
      return e.what();
    }
    return {};
  });
}

//! The bytes rank r of N sends in a ring all-reduce / reduce-scatter / all-gather
//! (docs/accounting.md), e bytes per element.
inline std::uint64_t ar_bytes(std::uint64_t n, std::uint64_t N, std::uint64_t r, std::uint64_t e) {
  return ref::all_reduce_bytes(n, N, r, e);
}
inline std::uint64_t rs_or_ag_bytes(std::uint64_t count, std::uint64_t N, std::uint64_t e) {
  return N <= 1 ? 0 : (N - 1) * count * e;
}

// ---- ZeRO assembled by hand from the components -------------------------------------------------

struct outcome {
  std::string failure;
  std::uint64_t working_hash = 0;  // bits of every working parameter, in model order
  std::uint64_t master_hash = 0;   // bits of every fp32 master value (16-bit training)
};
inline auto fields(outcome& o) {
  return std::tie(o.failure, o.working_hash, o.master_hash);
}

struct assemble_config {
  int steps = 3;
  int micro_batches = 1;
  std::size_t alignment = 1;     // stages 1-3
  std::size_t bucket = 0;        // stage 2: bucket elements (0: the units are the buckets)
  std::size_t grad_buffers = 1;  // stages 2-3
  shardkit::shard_params_options params{};  // stage 3
  std::vector<bool> keep_after_forward;     // stage 3: units with reshard_after_forward = false
};

//! One rank of ZeRO stage `Stage` assembled from the components the way a user's own loop
//! would (the engine composes the same parts; zero/engine.hpp):
//!   stage 0: replicated_params + full_grads (all-reduce) + shard_optimizer over a 1-way layout;
//!   stage 1: replicated_params + full_grads (reduce-scatter) + shard_optimizer, one group;
//!   stage 2: replicated_params + shard_grads (buckets, or the units) + shard_optimizer;
//!   stage 3: shard_params + shard_grads (the units) + shard_optimizer, driven by unit hooks.
//! AdamW on adam_groups(); checks the parameters against the unsharded reference, the bytes
//! held against the specification's table (g = sizeof(G) for gradients, w = sizeof(W)), the
//! staging and gathered peaks, and the bytes each step sends.
template <int Stage, class W, class G, class Comm>
outcome assemble(Comm& c, const mcase& mc, const assemble_config& cfg) {
  using namespace shardkit;
  using params_t =
      std::conditional_t<Stage == 3, shard_params<Comm, W>, replicated_params<Comm, W>>;
  using grads_t = std::conditional_t<Stage >= 2, shard_grads<Comm, G>, full_grads<Comm, G>>;
  using opt_t = shard_optimizer<host_space, adamw, W, G>;
  outcome out;
  checks check;
  const int N = c.size(), r = c.rank(), K = cfg.micro_batches;
  const auto n = static_cast<std::uint64_t>(N);
  const std::size_t P = mc.sizes.size();
  const std::uint64_t w = sizeof(W), g = sizeof(G), m = std::is_same_v<W, float> ? 0 : 4;

  model_values mv(mc, cfg.keep_after_forward);
  const param_registry reg(mv.spec);
  std::vector<std::size_t> starts;  // the groups of the stage, from the specification
  if constexpr (Stage == 2) {
    starts = cfg.bucket != 0 ? bucket_starts(mc.sizes, cfg.bucket) : unit_starts(mc);
  } else if constexpr (Stage == 3) {
    starts = unit_starts(mc);
  }
  const std::uint64_t ranks = Stage == 0 ? 1 : n;
  const spec_layout L = make_spec(mc.sizes, starts, ranks, Stage == 0 ? 1 : cfg.alignment);
  const flat_layout layout =
      Stage == 2 && cfg.bucket != 0
          ? flat_layout::bucketed(mc.sizes, static_cast<std::size_t>(ranks), cfg.bucket,
                                  cfg.alignment)
          : flat_layout(mc.sizes, Stage >= 2 ? reg.unit_starts() : std::span<const std::size_t>{},
                        static_cast<std::size_t>(ranks), Stage == 0 ? 1 : cfg.alignment);
  check(layout.shard_numel() == L.S && layout.num_groups() == L.groups.size(), "the layout has ",
        layout.num_groups(), " groups and S = ", layout.shard_numel(), "; the specification says ",
        L.groups.size(), " and ", L.S);
  const std::size_t shard = Stage == 0 ? 0 : static_cast<std::size_t>(r);

  memory_ledger mem;
  auto make_params = [&] {
    if constexpr (Stage == 3)
      return params_t(c, layout, shard, reg, cfg.params, &mem);
    else
      return params_t(c, layout, shard, reg, &mem);
  };
  auto make_grads = [&] {
    if constexpr (Stage >= 2) {
      shard_grads_options o;
      o.grad_buffers = cfg.grad_buffers;
      o.groups_are_units = Stage == 3;
      return grads_t(c, layout, shard, reg, o, &mem);
    } else {
      return grads_t(
          c, layout, shard,
          Stage == 0 ? full_grads_reduction::all_reduce : full_grads_reduction::reduce_scatter, reg,
          &mem);
    }
  };
  params_t params = make_params();
  grads_t grads = make_grads();
  opt_t opt(layout, shard, reg.param_groups(), param_groups<adam_options>(adam_groups()), &mem);
  for (std::size_t i = 0; i < P; ++i) {
    params.load(i, mv.init[i].data(), dtype::f32);
    opt.load(i, mv.init[i]);
  }
  params.start();

  // Units from the specification (stage 3): persistent, kept from forward to backward.
  const std::size_t U = reg.num_units();
  std::vector<bool> persistent(U, false), kept(U, false);
  std::uint64_t largest = 0, fixed = 0, persistent_elems = 0, transient = 0;
  for (std::size_t u = 0; u < U && Stage == 3; ++u) {
    const auto& gu = L.groups[u];
    persistent[u] = gu.psi < cfg.params.persist_below;
    kept[u] = !persistent[u] && u < cfg.keep_after_forward.size() && cfg.keep_after_forward[u];
    if (persistent[u]) {
      persistent_elems += n * gu.shard;
      fixed += n * gu.shard;
    } else {
      ++transient;
      largest = std::max(largest, n * gu.shard);
      if (kept[u]) fixed += n * gu.shard;
    }
  }

  auto reference = reference_for(mc, true);
  const float scale = 1.0f / static_cast<float>(N);
  for (int t = 1; t <= cfg.steps; ++t) {
    c.barrier();
    const traffic_ledger before = c.traffic();
    for (int mb = 0; mb < K; ++mb) {
      for (std::size_t u = 0; u < U; ++u) {
        params.pre_forward(u);
        for (std::size_t i = reg.unit_begin(u); i < reg.unit_end(u); ++i) {
          check(params.view(i).size() == mc.sizes[i], "view(", i, ") has the wrong size");
        }
        params.post_forward(u);
      }
      for (std::size_t u = U; u-- > 0;) {
        params.pre_backward(u);
        if constexpr (Stage == 3) grads.begin_group(u);
        for (std::size_t i = reg.unit_end(u); i-- > reg.unit_begin(u);) {
          grads.add(i, grad_of(mc, i, static_cast<std::uint64_t>(t), r, mb));
        }
        if constexpr (Stage == 3) {
          params.post_backward(u, [&] { grads.end_group(u); });
        } else {
          params.post_backward(u);
        }
      }
    }
    if constexpr (Stage >= 2)
      grads.finish();
    else
      grads.reduce();
    params.check_idle();
    opt.step(grads.gradients(), params.working(), scale);
    params.after_step(true);
    grads.reset();
    c.barrier();  // every asynchronous collective of the step has completed
    const std::uint64_t sent = c.traffic().since(before).total_bytes_sent();

    // Bytes sent (docs/accounting.md): gradients at g bytes, working parameters at w bytes.
    std::uint64_t want = 0;
    if (Stage == 0) {
      want = L.psi != 0 ? ar_bytes(L.psi, n, static_cast<std::uint64_t>(r), g) : 0;
    } else {
      for (std::size_t q = 0; q < L.groups.size(); ++q) {
        const std::uint64_t s = L.groups[q].shard;
        const std::uint64_t rounds = Stage == 1 ? 1 : static_cast<std::uint64_t>(K);
        if (Stage <= 2) {
          want += rounds * rs_or_ag_bytes(s, n, g) + rs_or_ag_bytes(s, n, w);
        } else {
          const std::uint64_t gathers = persistent[q] ? 1 : (kept[q] ? 1 : 2) * K;
          want += K * rs_or_ag_bytes(s, n, g) + gathers * rs_or_ag_bytes(s, n, w);
        }
      }
    }
    check(sent == want, "step ", t, " sent ", sent, " bytes; the specification says ", want);
    std::vector<double> mean = reduced<G>(mc, static_cast<std::uint64_t>(t), 0, N, K, Stage <= 1);
    for (auto& x : mean) x /= N;
    reference.step(mean);
  }

  // Parameters: every rank's working copy against the fp32 master and the reference.
  std::vector<float> master(L.S * ranks);
  if constexpr (opt_t::has_master) {
    if (Stage == 0) {
      std::copy(opt.master().begin(), opt.master().end(), master.begin());
    } else {
      c.all_gather(opt.master().data(), master.data(), L.S);
    }
  }
  for (std::size_t u = 0; u < U; ++u) {
    params.pre_forward(u);
    for (std::size_t i = reg.unit_begin(u); i < reg.unit_end(u); ++i) {
      const auto v = params.view(i);
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
        const float value = opt_t::has_master ? master[L.owner(i, k) * L.S + L.shard_offset(i, k)]
                                              : static_cast<float>(v[k]);
        const double want = reference.p[L.flat_offset[i] + k];
        check(std::fabs(value - want) <= 1e-6, "p", i, "[", k, "] = ", value,
              ", the reference says ", want);
        check(bits_of(v[k]) == bits_of(from_float<W>(value)), "working p", i, "[", k,
              "] is not the rounded master");
        out.working_hash = mix(out.working_hash, bits_of(v[k]));
        out.master_hash = mix(out.master_hash, std::bit_cast<std::uint32_t>(value));
      }
    }
    params.post_forward(u);
  }
  params.after_step(false);

  // Bytes held (the specification's table, with g bytes per gradient element).
  const std::uint64_t S = L.S, psi = L.psi;
  const std::uint64_t want_w = Stage == 0 ? w * psi : Stage == 3 ? w * S : w * n * S;
  const std::uint64_t want_g = Stage == 0 ? g * psi : Stage == 1 ? g * n * S : g * S;
  const std::uint64_t want_m = Stage == 0 ? m * psi : m * S;
  const std::uint64_t want_k = Stage == 0 ? 8 * psi : 8 * S;
  using mc_t = memory_category;
  check(mem.current(mc_t::working_params) == want_w && mem.current(mc_t::grads) == want_g &&
            mem.current(mc_t::master_params) == want_m &&
            mem.current(mc_t::optimizer_moments) == want_k,
        "the ledger holds (", mem.current(mc_t::working_params), ", ", mem.current(mc_t::grads),
        ", ", mem.current(mc_t::master_params), ", ", mem.current(mc_t::optimizer_moments),
        ") bytes; the specification says (", want_w, ", ", want_g, ", ", want_m, ", ", want_k, ")");
  if (Stage >= 2) {
    const std::uint64_t B = cfg.grad_buffers, smax = L.max_shard();
    const std::uint64_t later = static_cast<std::uint64_t>(K - 1) * L.nonempty_groups();
    check(mem.peak(mc_t::grad_buckets) == B * g * n * smax, "staging peaked at ",
          mem.peak(mc_t::grad_buckets), " bytes; B·g·N·max S_g = ", B * g * n * smax);
    check(mem.peak(mc_t::comm_scratch) == std::min(B, later) * g * smax, "scratch peaked at ",
          mem.peak(mc_t::comm_scratch),
          " bytes; min(B, (K-1)·U)·g·max S_g = ", std::min(B, later) * g * smax);
    check(mem.peak(mc_t::grads) == want_g, "gradient storage peaked above the shard");
  }
  if (Stage == 3) {
    // At most min(1 + D, U_t) transient units gathered at once, plus the persistent and kept
    // ones; at least the largest unit was gathered at some point.
    std::uint64_t bound =
        (std::min<std::uint64_t>(1 + cfg.params.prefetch, transient) * largest + fixed) * w;
    if (cfg.params.max_live_elems != 0) {
      bound = std::min<std::uint64_t>(bound, cfg.params.max_live_elems * w);
    }
    const std::uint64_t peak = mem.peak(mc_t::gathered_params);
    check(peak <= bound, "gathered parameters peaked at ", peak, " bytes, above the bound ", bound);
    check(peak >= std::max(largest, fixed) * w, "gathered parameters peaked at ", peak,
          " bytes, less than a unit: the ledger missed a gather");
    check(mem.current(mc_t::gathered_params) == persistent_elems * w, "after the step ",
          mem.current(mc_t::gathered_params), " gathered bytes are held; the persistent units' ",
          persistent_elems * w, " should be");
  } else {
    check(mem.peak(mc_t::gathered_params) == 0, "stage ", Stage, " gathered parameters");
  }
  out.failure = check.failure;
  return out;
}

}  // namespace test::comp
