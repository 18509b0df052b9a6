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
#include <cstddef>
#include <cstdint>
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

}  // namespace test::comp
