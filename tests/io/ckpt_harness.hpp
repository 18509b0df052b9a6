// Shared harness of the checkpoint tests: trains an engine of any stage on N ranks of a World
// with deterministic gradients (micro-batches, loss scaling), optionally loads a checkpoint
// first and saves one after, and returns exactly what each rank holds (its pieces' fp32 values
// and optimizer states as bits, the working parameters as bits, the step and the loss scale).
// assemble() puts the ranks' pieces together into the whole model, so that runs of different
// world sizes and stages can be compared element by element, bit for bit.
#pragma once

#include <shardkit/io/checkpoint.hpp>
#include <shardkit/shardkit.hpp>

#include "support/reference.hpp"
#include "support/world.hpp"

#include <bit>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace ckpt {

//! What one rank holds after a run.
struct dump {
  std::string failure;
  std::vector<std::uint64_t> pieces;   // (param, param_offset, count) per owned piece
  std::vector<std::uint32_t> kinds;    // kind-major: values, then each state, over the pieces
  std::vector<std::uint32_t> working;  // every working element of every parameter, as bits
  std::uint64_t step = 0;
  std::uint32_t scale_bits = 0;
  std::vector<std::string> notes;  // load_report::notes
};
inline auto fields(dump& d) {
  return std::tie(d.failure, d.pieces, d.kinds, d.working, d.step, d.scale_bits, d.notes);
}

struct config {
  std::vector<std::size_t> sizes{5, 0, 13, 1, 64, 3, 0, 7};
  std::vector<std::size_t> units{0, 2, 4, 6};
  int micro_batches = 1;
  bool loss_scaling = false;
  std::size_t shard_group_size = 0;
  int first_step = 1;  // global index of the first step run (gradients depend on it)
  int steps = 2;
  std::string load_dir;  // load this checkpoint after construction
  std::string save_dir;  // save here after the steps
  bool async_save = false;
  int steps_during_save = 0;  // async: steps taken between save_async and wait()
  std::function<void(std::string_view)> on_moment;  // save_options::on_moment
};

template <class T>
std::uint32_t bits(T x) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(x);
  else
    return x.bits;
}

//! Trains, loads and saves as `cfg` says on N ranks of World (see the file comment).
template <class World, class Policies, class W>
std::vector<dump> run(int n, const config& cfg) {
  using Comm = typename World::comm_type;
  using engine_t = shardkit::engine<Comm, Policies, W, shardkit::adamw>;
  return World::run(n, [&](Comm& c) -> dump {
    dump out;
    const std::size_t P = cfg.sizes.size();
    std::vector<std::vector<float>> init(P);
    for (std::size_t i = 0; i < P; ++i) {
      for (std::size_t k = 0; k < cfg.sizes[i]; ++k) init[i].push_back(ref::init_value(i, k));
    }
    shardkit::model_spec model;
    std::size_t next_unit = 0;
    for (std::size_t i = 0; i < P; ++i) {
      if (next_unit < cfg.units.size() && cfg.units[next_unit] == i) {
        model.begin_unit("u" + std::to_string(next_unit));
        ++next_unit;
      }
      model.add("p" + std::to_string(i), init[i], i % 2);
    }
    shardkit::engine_options eo;
    eo.shard_group_size = Policies::stage == 0 ? 0 : cfg.shard_group_size;
    if (cfg.loss_scaling) {
      eo.loss_scale = shardkit::loss_scale_options{.init_scale = 64.0f, .growth_interval = 1};
    }
    const shardkit::adam_options a{
        .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.05f};
    const shardkit::adam_options b{.lr = 2e-2f, .beta1 = 0.8f, .beta2 = 0.95f};
    engine_t eng(c, model, shardkit::param_groups<shardkit::adam_options>({a, b}), eo);
    if (!cfg.load_dir.empty()) out.notes = shardkit::io::load(eng, cfg.load_dir).notes;
    const std::size_t U = eng.num_units();
    auto unit_params = [&](std::size_t u) {
      const std::size_t lo = eng.registry().unit_begin(u), hi = eng.registry().unit_end(u);
      return std::pair{lo, hi};
    };
    std::vector<float> g;
    auto train = [&](int from, int count) {
      for (int t = from; t < from + count; ++t) {
        for (int mb = 0; mb < cfg.micro_batches; ++mb) {
          if (cfg.micro_batches > 1) eng.begin_micro_batch(mb + 1 == cfg.micro_batches);
          for (std::size_t u = 0; u < U; ++u) {
            eng.pre_forward(u);
            eng.post_forward(u);
          }
          for (std::size_t u = U; u-- > 0;) {
            eng.pre_backward(u);
            const auto [lo, hi] = unit_params(u);
            for (std::size_t i = hi; i-- > lo;) {
              g.resize(cfg.sizes[i]);
              for (std::size_t k = 0; k < g.size(); ++k) {
                g[k] = ref::grad_value(static_cast<std::uint64_t>(t), c.rank(), i, k, mb) *
                       eng.loss_scale();
              }
              eng.grad_ready(i, g);
            }
            eng.post_backward(u);
          }
        }
        eng.step();
      }
    };
    train(cfg.first_step, cfg.steps);
    if (!cfg.save_dir.empty()) {
      shardkit::io::save_options so;
      so.on_moment = cfg.on_moment;
      if (cfg.async_save) {
        auto pending = shardkit::io::save_async(eng, cfg.save_dir, so);
        // training goes on; none of it may reach the checkpoint
        train(cfg.first_step + cfg.steps, cfg.steps_during_save);
        pending.wait();
      } else {
        shardkit::io::save(eng, cfg.save_dir, so);
      }
    }
    // What this rank holds.
    auto& opt = eng.optimizer();
    std::vector<std::uint32_t> state_bits[3];
    for (const auto& pc : opt.pieces()) {
      out.pieces.insert(out.pieces.end(), {pc.param, pc.param_offset, pc.count});
      for (std::size_t k = 0; k < pc.count; ++k) {
        if constexpr (engine_t::has_master) {
          state_bits[0].push_back(bits(opt.master()[pc.shard_offset + k]));
        }
        state_bits[1].push_back(bits(opt.state(0)[pc.shard_offset + k]));
        state_bits[2].push_back(bits(opt.state(1)[pc.shard_offset + k]));
      }
    }
    if constexpr (engine_t::has_master) out.kinds = state_bits[0];
    for (std::size_t i = 0; i < P; ++i) {
      if (i == 0 || eng.unit_of(i) != eng.unit_of(i - 1)) eng.pre_forward(eng.unit_of(i));
      for (auto x : eng.param(i)) out.working.push_back(bits(x));
      if constexpr (!engine_t::has_master) {
        // fp32: the values kind is the working copy of this rank's pieces
        (void)0;
      }
      if (i + 1 == P || eng.unit_of(i + 1) != eng.unit_of(i)) eng.post_forward(eng.unit_of(i));
    }
    if constexpr (!engine_t::has_master) {
      std::vector<std::size_t> start(P + 1, 0);
      for (std::size_t i = 0; i < P; ++i) start[i + 1] = start[i] + cfg.sizes[i];
      for (std::size_t q = 0; q < out.pieces.size(); q += 3) {
        for (std::size_t k = 0; k < out.pieces[q + 2]; ++k) {
          out.kinds.push_back(out.working[start[out.pieces[q]] + out.pieces[q + 1] + k]);
        }
      }
    }
    out.kinds.insert(out.kinds.end(), state_bits[1].begin(), state_bits[1].end());
    out.kinds.insert(out.kinds.end(), state_bits[2].begin(), state_bits[2].end());
    out.step = eng.steps_taken();
    out.scale_bits = std::bit_cast<std::uint32_t>(eng.loss_scale());
    return out;
  });
}

//! The whole model: [kind][parameter][element] bits, from the ranks' pieces. Elements held by
//! several ranks (replicas) must agree; every element must be held by someone.
struct whole {
  std::vector<std::vector<std::vector<std::uint32_t>>> kinds;
  std::vector<std::uint32_t> working;  // of rank 0 (every rank holds the same)
  std::string failure;
};
inline whole assemble(const std::vector<dump>& ranks, const std::vector<std::size_t>& sizes) {
  whole w;
  w.kinds.assign(3, {});
  for (auto& k : w.kinds) {
    for (auto n : sizes) k.emplace_back(n, 0u);
  }
  std::vector<std::vector<std::vector<bool>>> seen(3);
  for (auto& k : seen) {
    for (auto n : sizes) k.emplace_back(n, false);
  }
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const dump& d = ranks[r];
    if (!d.failure.empty() && w.failure.empty()) w.failure = d.failure;
    if (d.working != ranks[0].working && w.failure.empty()) {
      w.failure = "rank " + std::to_string(r) + " holds other working parameters than rank 0";
    }
    std::uint64_t total = 0;
    for (std::size_t q = 0; q < d.pieces.size(); q += 3) total += d.pieces[q + 2];
    std::uint64_t at = 0;
    for (std::size_t q = 0; q < d.pieces.size(); q += 3) {
      const std::size_t p = d.pieces[q], off = d.pieces[q + 1], n = d.pieces[q + 2];
      for (std::size_t kd = 0; kd < 3; ++kd) {
        for (std::size_t e = 0; e < n; ++e) {
          const std::uint32_t v = d.kinds[kd * total + at + e];
          if (seen[kd][p][off + e] && w.kinds[kd][p][off + e] != v && w.failure.empty()) {
            w.failure = "two replicas hold different values of parameter " + std::to_string(p);
          }
          w.kinds[kd][p][off + e] = v;
          seen[kd][p][off + e] = true;
        }
      }
      at += n;
    }
  }
  for (std::size_t kd = 0; kd < 3; ++kd) {
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      for (std::size_t e = 0; e < sizes[p]; ++e) {
        if (!seen[kd][p][e] && w.failure.empty()) {
          w.failure =
              "no rank holds element " + std::to_string(e) + " of parameter " + std::to_string(p);
        }
      }
    }
  }
  w.working = ranks.empty() ? std::vector<std::uint32_t>{} : ranks[0].working;
  return w;
}

//! Runs `f` once for the whole World: in the process of the thread World, on the first process
//! of an MPI job (the others wait), for what touches the shared files of a test.
template <class World, class F>
void once(F&& f) {
#if defined(SHARDKIT_TEST_MPI)
  if constexpr (std::is_same_v<World, test::mpi_world>) {
    std::string error;
    if (World::world().rank() == 0) {
      try {
        f();
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    World::world().barrier();
    if (!error.empty()) throw std::runtime_error(error);
    return;
  }
#endif
  f();
}

//! A directory for test `name` under the system's temporary directory, shared by the ranks
//! (and the processes of an MPI job), distinct per World.
template <class World>
std::string test_dir(const std::string& name) {
  const auto base = std::filesystem::temp_directory_path() / "shardkit-io-tests" / World::name;
  std::filesystem::create_directories(base);
  return (base / name).string();
}

}  // namespace ckpt
