// A small model with real shapes (matrices, a 3-D tensor, a scalar, zero-size tensors), trained
// on thread ranks with deterministic gradients, for the safetensors tests (test_safetensors.cpp)
// and the helper program of the tool and interoperability tests (io_helper.cpp). capture() takes
// what one rank holds; assemble() puts the ranks together into the whole model, so that engines
// of different world sizes and stages can be compared bit for bit; state_hash() and
// values_hash() reduce a whole model to one number the scripts compare.
#pragma once

#include <shardkit/io/checksum.hpp>
#include <shardkit/io/export.hpp>
#include <shardkit/shardkit.hpp>

#include "support/reference.hpp"

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace iot {

struct param_def {
  std::string name;
  std::vector<std::size_t> shape;
  bool starts_unit = false;
  std::size_t group = 0;
};

inline std::size_t numel(const std::vector<std::size_t>& shape) {
  std::size_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

//! The model of these tests. Its names and shapes are also written out in
//! tests/io/ckpt_tool_check.cmake (what `shardkit-ckpt inspect` must print).
inline const std::vector<param_def>& shaped_model() {
  static const std::vector<param_def> m{
      {"embed.weight", {7, 5}, true, 0},     {"embed.scale", {}, false, 1},
      {"block0.weight", {4, 3, 2}, true, 0}, {"block0.empty", {3, 0}, false, 1},
      {"block0.bias", {13}, false, 1},       {"block1.weight", {16, 4}, true, 0},
      {"block1.none", {0}, false, 1},        {"head.weight", {1, 9}, true, 0},
  };
  return m;
}

//! Initial value of element k of parameter i (any float in [-1, 1), by global index).
inline float init_value(std::size_t i, std::size_t k) {
  return ref::init_value(i + 200, k);
}

//! The model, registered by shape with an initialiser (sharded initialisation).
inline shardkit::model_spec make_model(const std::vector<param_def>& defs = shaped_model()) {
  shardkit::model_spec m;
  for (std::size_t i = 0; i < defs.size(); ++i) {
    if (defs[i].starts_unit) m.begin_unit(defs[i].name.substr(0, defs[i].name.find('.')));
    m.add(
        defs[i].name, defs[i].shape,
        [i](std::size_t off, std::span<float> out) {
          for (std::size_t k = 0; k < out.size(); ++k) out[k] = init_value(i, off + k);
        },
        defs[i].group);
  }
  return m;
}

inline shardkit::param_groups<shardkit::adam_options> groups() {
  const shardkit::adam_options a{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.05f};
  const shardkit::adam_options b{.lr = 2e-2f, .beta1 = 0.8f, .beta2 = 0.95f};
  return shardkit::param_groups<shardkit::adam_options>({a, b});
}

template <int Stage, class W = shardkit::bf16>
using engine_t =
    shardkit::engine<shardkit::thread_comm, shardkit::stage<Stage>, W, shardkit::adamw>;

//! Calls f.template operator()<S>() for the run-time stage s (0 to 3).
template <class F>
decltype(auto) with_stage(int s, F&& f) {
  switch (s) {
    case 0:
      return f.template operator()<0>();
    case 1:
      return f.template operator()<1>();
    case 2:
      return f.template operator()<2>();
    default:
      return f.template operator()<3>();
  }
}

//! Runs `steps` steps from global step `first` with deterministic gradients (they depend on the
//! step, the rank, the parameter and the element).
template <class Engine>
void train(Engine& eng, int rank, int first, int steps) {
  const std::size_t U = eng.num_units();
  std::vector<float> g;
  for (int t = first; t < first + steps; ++t) {
    for (std::size_t u = 0; u < U; ++u) {
      eng.pre_forward(u);
      eng.post_forward(u);
    }
    for (std::size_t u = U; u-- > 0;) {
      eng.pre_backward(u);
      const std::size_t lo = eng.registry().unit_begin(u), hi = eng.registry().unit_end(u);
      for (std::size_t i = hi; i-- > lo;) {
        g.resize(eng.registry().numel(i));
        for (std::size_t k = 0; k < g.size(); ++k) {
          g[k] = ref::grad_value(static_cast<std::uint64_t>(t), rank, i, k);
        }
        eng.grad_ready(i, g);
      }
      eng.post_backward(u);
    }
    eng.step();
  }
}

template <class T>
std::uint32_t bits(T x) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(x);
  else
    return x.bits;
}

//! What one rank holds: its pieces (param, param_offset, count), their fp32 values (master, or
//! the working values in fp32 training) and both Adam moments, kind-major, as bits; and every
//! working value of every parameter, as bits (bf16 bits or fp32 bits).
struct rank_state {
  std::vector<std::uint64_t> pieces;
  std::vector<std::uint32_t> kinds;
  std::vector<std::uint32_t> working;
  std::uint64_t step = 0;
};

template <class Engine>
rank_state capture(Engine& eng) {
  rank_state out;
  auto& opt = eng.optimizer();
  const std::size_t P = eng.num_params();
  for (std::size_t i = 0; i < P; ++i) {
    if (i == 0 || eng.unit_of(i) != eng.unit_of(i - 1)) eng.pre_forward(eng.unit_of(i));
    for (auto x : eng.param(i)) out.working.push_back(bits(x));
    if (i + 1 == P || eng.unit_of(i + 1) != eng.unit_of(i)) eng.post_forward(eng.unit_of(i));
  }
  std::vector<std::size_t> start(P + 1, 0);
  for (std::size_t i = 0; i < P; ++i) start[i + 1] = start[i] + eng.registry().numel(i);
  std::vector<std::uint32_t> s0, s1;
  for (const auto& pc : opt.pieces()) {
    out.pieces.insert(out.pieces.end(), {pc.param, pc.param_offset, pc.count});
    for (std::size_t k = 0; k < pc.count; ++k) {
      if constexpr (Engine::has_master) {
        out.kinds.push_back(bits(opt.master()[pc.shard_offset + k]));
      } else {
        out.kinds.push_back(out.working[start[pc.param] + pc.param_offset + k]);
      }
      s0.push_back(bits(opt.state(0)[pc.shard_offset + k]));
      s1.push_back(bits(opt.state(1)[pc.shard_offset + k]));
    }
  }
  out.kinds.insert(out.kinds.end(), s0.begin(), s0.end());
  out.kinds.insert(out.kinds.end(), s1.begin(), s1.end());
  out.step = eng.steps_taken();
  return out;
}

//! The whole model: kinds[kind][param][element] (values, exp_avg, exp_avg_sq) and the working
//! values of every parameter (rank 0's; every rank must hold the same). `failure` says what
//! does not fit: replicas that differ, an element nobody holds.
struct whole_state {
  std::vector<std::vector<std::vector<std::uint32_t>>> kinds;
  std::vector<std::vector<std::uint32_t>> working;
  std::uint64_t step = 0;
  std::string failure;
};

inline whole_state assemble(const std::vector<rank_state>& ranks,
                            const std::vector<param_def>& defs = shaped_model()) {
  whole_state w;
  const std::size_t P = defs.size();
  std::vector<std::vector<std::vector<bool>>> seen(3);
  w.kinds.assign(3, {});
  for (std::size_t kd = 0; kd < 3; ++kd) {
    for (const auto& d : defs) {
      w.kinds[kd].emplace_back(numel(d.shape), 0u);
      seen[kd].emplace_back(numel(d.shape), false);
    }
  }
  auto fail = [&](const std::string& s) {
    if (w.failure.empty()) w.failure = s;
  };
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const auto& d = ranks[r];
    if (d.working != ranks[0].working) fail("rank " + std::to_string(r) + "'s working values");
    if (d.step != ranks[0].step) fail("rank " + std::to_string(r) + "'s step count");
    std::uint64_t total = 0;
    for (std::size_t q = 0; q < d.pieces.size(); q += 3) total += d.pieces[q + 2];
    if (d.kinds.size() != 3 * total) {
      fail("rank " + std::to_string(r) + " holds " + std::to_string(d.kinds.size()) + " values");
      continue;
    }
    std::uint64_t at = 0;
    for (std::size_t q = 0; q < d.pieces.size(); q += 3) {
      const std::size_t p = d.pieces[q], off = d.pieces[q + 1], n = d.pieces[q + 2];
      for (std::size_t kd = 0; kd < 3; ++kd) {
        for (std::size_t e = 0; e < n; ++e) {
          const std::uint32_t v = d.kinds[kd * total + at + e];
          if (seen[kd][p][off + e] && w.kinds[kd][p][off + e] != v) {
            fail("two replicas differ in parameter " + std::to_string(p));
          }
          w.kinds[kd][p][off + e] = v;
          seen[kd][p][off + e] = true;
        }
      }
      at += n;
    }
  }
  for (std::size_t kd = 0; kd < 3; ++kd) {
    for (std::size_t p = 0; p < P; ++p) {
      for (std::size_t e = 0; e < seen[kd][p].size(); ++e) {
        if (!seen[kd][p][e]) {
          fail("no rank holds element " + std::to_string(e) + " of parameter " + std::to_string(p));
        }
      }
    }
  }
  if (!ranks.empty()) {
    std::size_t at = 0;
    for (const auto& d : defs) {
      const std::size_t n = numel(d.shape);
      if (at + n > ranks[0].working.size()) {
        fail("rank 0 holds too few working values");
        break;
      }
      w.working.emplace_back(ranks[0].working.begin() + static_cast<std::ptrdiff_t>(at),
                             ranks[0].working.begin() + static_cast<std::ptrdiff_t>(at + n));
      at += n;
    }
    w.step = ranks[0].step;
  }
  return w;
}

//! A hash of names, shapes and one array of 32-bit words per parameter.
class hasher {
 public:
  void add(const void* p, std::size_t n) { s_.update(p, n); }
  void add_u64(std::uint64_t v) { add(&v, 8); }
  void add_param(const std::string& name, const std::vector<std::size_t>& shape) {
    add_u64(name.size());
    add(name.data(), name.size());
    add_u64(shape.size());
    for (auto d : shape) add_u64(d);
  }
  void add_words(const std::vector<std::uint32_t>& w) {
    add_u64(w.size());
    add(w.data(), w.size() * 4);
  }
  std::uint64_t digest() const { return s_.digest(); }

 private:
  shardkit::io::xxh64_stream s_;
};

//! Everything a checkpoint restores: the step, and per parameter its name, shape, fp32 values
//! and both Adam moments.
inline std::uint64_t state_hash(const whole_state& w,
                                const std::vector<param_def>& defs = shaped_model()) {
  hasher h;
  h.add_u64(w.step);
  for (std::size_t p = 0; p < defs.size(); ++p) {
    h.add_param(defs[p].name, defs[p].shape);
    for (std::size_t kd = 0; kd < 3; ++kd) h.add_words(w.kinds[kd][p]);
  }
  return h.digest();
}

//! Names, shapes and one kind of value per parameter (fp32 values, or bf16 working bits):
//! what a safetensors export holds; io_helper's st-hash computes the same from a file.
inline std::uint64_t values_hash(const std::vector<std::vector<std::uint32_t>>& values,
                                 const std::vector<param_def>& defs = shaped_model()) {
  hasher h;
  for (std::size_t p = 0; p < defs.size(); ++p) {
    h.add_param(defs[p].name, defs[p].shape);
    h.add_words(values[p]);
  }
  return h.digest();
}

}  // namespace iot
