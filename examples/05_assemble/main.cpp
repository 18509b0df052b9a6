// shardkit example 05: ZeRO assembled from its parts, in a user's own training loop, without
// shardkit::engine. Ranks are in-process threads by default, or the processes of an MPI job when
// an MPI launcher started the program (shardkit::launched_by_mpi()).
//
//   (a) ZeRO-1 with the user's own gradient all-reduce: a plain all-reduce of a full padded fp32
//       gradient buffer (comm.all_reduce on threads, raw MPI_Allreduce under MPI) feeds
//       shard_optimizer, which steps this rank's shard; then the user all-gathers the bf16
//       working parameters (MPI_Allgather under MPI).
//   (b) ZeRO-3 parameter sharding: shard_params + shard_grads driven by the user's own unit hook
//       calls, and the user's OWN optimizer (plain SGD, written below) on the gradient shard and
//       the fp32 working shard.
//   (c) ZeRO over the data-parallel groups of a 2 x (N/2) mesh: comm.split() into two
//       data-parallel groups, each training a different model (as when ZeRO is combined with
//       tensor or pipeline parallelism: the ranks of one group hold the same model slice), one
//       engine per group.
//
// Every part is checked twice: bit for bit against shardkit's engine at the same stage (parts a
// and b: on the same ranks; part c: the engine of each group against the same engine on a world
// of its own N/2 ranks), and against an unsharded single-process reference computed here in
// double precision, within a stated bound. The model is MLP-shaped (a weight and a bias per
// layer) with synthetic, deterministic gradients: multiples of 1/64, whose fp32 sums over the
// ranks are exact in any order, so a user's all-reduce in whatever order MPI picks gives the
// same bits as shardkit's reduce-scatter.
//
//   shardkit_example_05_assemble [--part a|b|c|all] [--ranks N] [--steps K] [--json]
//   mpiexec -np 4 shardkit_example_05_assemble --part all --json
//
// Exit status: 0 when every check holds, 1 when one fails (a line starting with FAIL names
// it), 2 for bad arguments.
#include <shardkit/shardkit.hpp>

#include "../common/args.hpp"
#if defined(SHARDKIT_EXAMPLE_MPI)
#include <shardkit/comm/mpi.hpp>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace {

// ---- command line ------------------------------------------------------------------------------

struct config {
  std::string part = "all";
  int ranks = 4;
  bool ranks_given = false;
  int steps = 5;
  bool json = false;
  bool help = false;
};

struct usage_exit {
  std::string why;
};

[[noreturn]] void usage(const std::string& why) {
  throw usage_exit{why};
}

constexpr const char* usage_text =
    "usage: shardkit_example_05_assemble [--part a|b|c|all] [--ranks N] [--steps K] [--json]\n"
    "       mpiexec -np N shardkit_example_05_assemble [same options; --ranks N or none]\n"
    "  ZeRO assembled from shardkit's components in a user's own training loop:\n"
    "    a  ZeRO-1: the user's all-reduce of a full padded gradient buffer feeds\n"
    "       shard_optimizer, then the user's all-gather of the working parameters\n"
    "    b  ZeRO-3: shard_params + shard_grads driven by the user's hooks, the user's own SGD\n"
    "    c  ZeRO over the two data-parallel groups of a 2 x N/2 mesh (comm.split), a different\n"
    "       model and an engine in each group (N must be even)\n"
    "  Each part is compared bit for bit with shardkit's engine at the same stage and with an\n"
    "  unsharded double-precision reference. Defaults: --part all --ranks 4 --steps 5.\n"
    "  Exit status 0 when every check holds, 1 when one fails, 2 for bad arguments.\n";

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--part") {
      c.part = value();
      if (c.part != "a" && c.part != "b" && c.part != "c" && c.part != "all") {
        usage("--part must be a, b, c or all, got '" + c.part + "'");
      }
    } else if (a == "--ranks") {
      c.ranks = static_cast<int>(examples::parse_int(a, value(), 1, 64, usage));
      c.ranks_given = true;
    } else if (a == "--steps") {
      c.steps = static_cast<int>(examples::parse_int(a, value(), 1, 1000, usage));
    } else if (a == "--json") {
      c.json = true;
    } else if (a == "--help" || a == "-h") {
      c.help = true;
    } else {
      usage("unknown argument '" + a + "'");
    }
  }
  return c;
}

void check_ranks(const config& c) {
  if ((c.part == "c" || c.part == "all") && c.ranks % 2 != 0) {
    usage("part c runs on a 2 x N/2 mesh: it needs an even number of ranks, got " +
          std::to_string(c.ranks));
  }
}

// ---- the model and its synthetic gradients -----------------------------------------------------

std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

//! An MLP of the given widths: per layer a weight (in x out) and a bias (out), one unit each.
struct model_def {
  const char* name;
  std::vector<std::size_t> widths;
  std::uint64_t salt;  // tells the models' values apart

  std::vector<std::size_t> sizes() const {
    std::vector<std::size_t> s;
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      s.push_back(widths[l] * widths[l + 1]);
      s.push_back(widths[l + 1]);
    }
    return s;
  }
  //! Initial value of element k of parameter i, in [-0.5, 0.5).
  float init(std::size_t i, std::size_t k) const {
    return static_cast<float>(static_cast<double>(mix(salt ^ (i << 32) ^ k) >> 11) * 0x1.0p-53 -
                              0.5);
  }
  //! Gradient of element k of parameter i on data-parallel rank r at step t: a non-zero
  //! multiple of 1/64 in [-2, 2]. Sums over up to 64 ranks are exact in fp32.
  float grad(int t, int r, std::size_t i, std::size_t k) const {
    const std::uint64_t h = mix(salt * 7919 + (static_cast<std::uint64_t>(t) << 48) +
                                (static_cast<std::uint64_t>(r) << 40) + (i << 24) + k);
    int v = static_cast<int>(h % 257) - 128;
    if (v == 0) v = 1;
    return static_cast<float>(v) / 64.0f;
  }
};

const model_def model_ab{"MLP 24-16-10-3", {24, 16, 10, 3}, 1};
const model_def model_c0{"MLP 24-16-10 (data-parallel group 0)", {24, 16, 10}, 2};
const model_def model_c1{"MLP 12-20-5-7 (data-parallel group 1)", {12, 20, 5, 7}, 3};

//! The initial values of a model as tensors, and a model_spec (one unit per layer) viewing them.
struct model_values {
  std::vector<std::vector<float>> init;
  shardkit::model_spec spec;
  explicit model_values(const model_def& m) {
    const auto sizes = m.sizes();
    init.resize(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      for (std::size_t k = 0; k < sizes[i]; ++k) init[i].push_back(m.init(i, k));
      if (i % 2 == 0) spec.begin_unit("layer" + std::to_string(i / 2));
      spec.add((i % 2 == 0 ? "layer" + std::to_string(i / 2) + ".weight"
                           : "layer" + std::to_string(i / 2) + ".bias"),
               init[i]);
    }
  }
};

const shardkit::adam_options adam{
    .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.01f};
constexpr float sgd_lr = 0.03125f;  // 2^-5: lr·g is exact, so no rounding depends on how the
                                    // update is contracted into fused multiply-adds

// ---- the unsharded references (double precision, one process) ----------------------------------

//! The mean over `ranks` data-parallel ranks of the gradient of step t, unpadded, model order.
std::vector<double> mean_grad(const model_def& m, int t, int ranks) {
  std::vector<double> g;
  const auto sizes = m.sizes();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (std::size_t k = 0; k < sizes[i]; ++k) {
      double s = 0;
      for (int r = 0; r < ranks; ++r) s += m.grad(t, r, i, k);
      g.push_back(s / ranks);
    }
  }
  return g;
}

std::vector<double> initial(const model_def& m) {
  std::vector<double> p;
  const auto sizes = m.sizes();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (std::size_t k = 0; k < sizes[i]; ++k) p.push_back(m.init(i, k));
  }
  return p;
}

//! AdamW (decoupled weight decay) as docs/accounting.md states it, after `steps` steps.
std::vector<double> reference_adamw(const model_def& m, int ranks, int steps) {
  std::vector<double> p = initial(m), mo(p.size(), 0.0), v(p.size(), 0.0);
  for (int t = 1; t <= steps; ++t) {
    const std::vector<double> g = mean_grad(m, t, ranks);
    const double bc1 = 1 - std::pow(double(adam.beta1), t),
                 bc2 = 1 - std::pow(double(adam.beta2), t);
    for (std::size_t k = 0; k < p.size(); ++k) {
      mo[k] = adam.beta1 * mo[k] + (1 - double(adam.beta1)) * g[k];
      v[k] = adam.beta2 * v[k] + (1 - double(adam.beta2)) * g[k] * g[k];
      const double upd =
          (mo[k] / bc1) / (std::sqrt(v[k] / bc2) + adam.eps) + adam.weight_decay * p[k];
      p[k] -= adam.lr * upd;
    }
  }
  return p;
}

//! Plain SGD after `steps` steps.
std::vector<double> reference_sgd(const model_def& m, int ranks, int steps) {
  std::vector<double> p = initial(m);
  for (int t = 1; t <= steps; ++t) {
    const std::vector<double> g = mean_grad(m, t, ranks);
    for (std::size_t k = 0; k < p.size(); ++k) p[k] -= sgd_lr * g[k];
  }
  return p;
}

// Bounds on |fp32 parameter - double reference|: a few float roundings of values below 1 per
// step (Adam: about ten operations per element and step; SGD: one multiply and one subtract).
constexpr double adam_bound = 1e-5;
constexpr double sgd_bound = 1e-6;

// ---- results ----------------------------------------------------------------------------------

struct part_result {
  double vs_engine = 0;     // max |x - engine's x| over working parameters and fp32 values
  double mismatches = 0;    // elements whose bits differ from the engine's
  double vs_reference = 0;  // max |fp32 value - unsharded reference|
};

struct diff {
  part_result r;
  template <class T>
  void engine(T mine, T theirs) {
    const double a = static_cast<float>(mine), b = static_cast<float>(theirs);
    r.vs_engine = std::max(r.vs_engine, std::fabs(a - b));
    if (bits(mine) != bits(theirs)) r.mismatches += 1;
  }
  void reference(double mine, double want) {
    r.vs_reference = std::max(r.vs_reference, std::fabs(mine - want));
  }
  template <class T>
  static std::uint32_t bits(T x) {
    if constexpr (std::is_same_v<T, float>)
      return std::bit_cast<std::uint32_t>(x);
    else
      return x.bits;
  }
};

//! This rank's fp32 shard (S elements, shard order of `layout`) gathered from every rank of
//! `comm` and put in model order.
template <class Comm>
std::vector<float> gather_model_order(Comm& comm, const shardkit::flat_layout& layout,
                                      const float* shard) {
  const std::size_t S = layout.shard_numel();
  std::vector<float> all(S * layout.ranks()), out(layout.numel());
  comm.all_gather(shard, all.data(), S);
  std::vector<std::size_t> start(layout.num_params());
  for (std::size_t i = 0, flat = 0; i < layout.num_params(); ++i) {
    start[i] = flat;
    flat += layout.param(i).numel;
  }
  for (std::size_t q = 0; q < layout.ranks(); ++q) {
    for (const auto& pc : layout.pieces(q)) {
      for (std::size_t j = 0; j < pc.count; ++j) {
        out[start[pc.param] + pc.param_offset + j] = all[q * S + pc.shard_offset + j];
      }
    }
  }
  return out;
}

// ---- the user's collectives for part (a) --------------------------------------------------------

//! On threads: the communicator's own all-reduce and all-gather.
template <class Comm>
struct user_collectives {
  Comm& comm;
  void sum(float* x, std::size_t n) { comm.all_reduce(x, x, n, shardkit::reduce_op::sum); }
  void gather_in_place(shardkit::bf16* full, std::size_t count) {
    comm.all_gather(full + static_cast<std::size_t>(comm.rank()) * count, full, count);
  }
  const char* name() const { return "comm.all_reduce / comm.all_gather"; }
};

#if defined(SHARDKIT_EXAMPLE_MPI)
//! Under MPI: raw MPI calls on the user's own duplicate of the job's communicator. MPI may sum
//! in any order; the gradients' fp32 sums are exact, so every order gives the same bits.
template <>
struct user_collectives<shardkit::mpi_comm> {
  shardkit::mpi_comm& comm;
  MPI_Comm mine = MPI_COMM_NULL;
  explicit user_collectives(shardkit::mpi_comm& c) : comm(c) { MPI_Comm_dup(c.native(), &mine); }
  user_collectives(const user_collectives&) = delete;
  ~user_collectives() { MPI_Comm_free(&mine); }
  void sum(float* x, std::size_t n) {
    MPI_Allreduce(MPI_IN_PLACE, x, static_cast<int>(n), MPI_FLOAT, MPI_SUM, mine);
  }
  void gather_in_place(shardkit::bf16* full, std::size_t count) {
    static_assert(sizeof(shardkit::bf16) == sizeof(std::uint16_t));
    MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, full, static_cast<int>(count), MPI_UINT16_T,
                  mine);
  }
  const char* name() const { return "MPI_Allreduce / MPI_Allgather"; }
};
#endif

// ---- part (a): ZeRO-1 with the user's own all-reduce -------------------------------------------

template <class Comm>
part_result part_a(Comm& comm, int steps) {
  using namespace shardkit;
  const model_def& m = model_ab;
  const auto sizes = m.sizes();
  const std::size_t N = static_cast<std::size_t>(comm.size()),
                    r = static_cast<std::size_t>(comm.rank());
  model_values mv(m);

  // The user's buffers: one group sharded over the N ranks, full buffers of N·S elements
  // (padding at the end, zero). fp32 gradients, bf16 working parameters, fp32 master in the
  // optimizer.
  const flat_layout layout(sizes, {}, N);
  std::vector<float> grads(layout.padded_numel(), 0.0f);
  std::vector<bf16> working(layout.padded_numel(), bf16(0.0f));
  const std::vector<std::size_t> group_of_param(sizes.size(), 0);
  shard_optimizer<host_space, adamw, bf16, float> opt(layout, r, group_of_param,
                                                      param_groups<adam_options>({adam}));
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    opt.load(i, mv.init[i]);
    for (std::size_t k = 0; k < sizes[i]; ++k) {
      working[layout.param(i).offset + k] = bf16(mv.init[i][k]);
    }
  }
  user_collectives<Comm> coll(comm);
  const float scale = static_cast<float>(1.0 / static_cast<double>(N));  // the mean over ranks
  for (int t = 1; t <= steps; ++t) {
    // (forward and backward of the user's framework would run here, on `working`)
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      for (std::size_t k = 0; k < sizes[i]; ++k) {
        grads[layout.param(i).offset + k] = m.grad(t, static_cast<int>(r), i, k);
      }
    }
    coll.sum(grads.data(), grads.size());  // the user's own reduction: all of it, padding too
    opt.step(flat_span<const float>::full(grads.data(), grads.size()),
             flat_span<bf16>::full(working.data(), working.size()), scale);
    coll.gather_in_place(working.data(), layout.shard_numel());  // one group: S per rank
  }

  // shardkit's engine at the same stage, on the same ranks, with the same gradients.
  engine<Comm, zero1, bf16, adamw, float> eng(comm, mv.spec, adam);
  std::vector<float> g;
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t i = sizes.size(); i-- > 0;) {
      g.resize(sizes[i]);
      for (std::size_t k = 0; k < g.size(); ++k) g[k] = m.grad(t, static_cast<int>(r), i, k);
      eng.grad_ready(i, g);
    }
    eng.step();
  }
  diff d;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto v = eng.param(i);
    for (std::size_t k = 0; k < sizes[i]; ++k) d.engine(working[layout.param(i).offset + k], v[k]);
  }
  for (std::size_t j = 0; j < layout.shard_numel(); ++j) {
    d.engine(opt.master()[j], eng.master_shard()[j]);
  }
  const std::vector<float> master = gather_model_order(comm, layout, opt.master().data());
  const std::vector<double> want = reference_adamw(m, comm.size(), steps);
  for (std::size_t e = 0; e < want.size(); ++e) d.reference(master[e], want[e]);
  return d.r;
}

// ---- part (b): ZeRO-3 parameter sharding with the user's own optimizer -------------------------

template <class Comm>
part_result part_b(Comm& comm, int steps) {
  using namespace shardkit;
  const model_def& m = model_ab;
  const auto sizes = m.sizes();
  const std::size_t N = static_cast<std::size_t>(comm.size()),
                    r = static_cast<std::size_t>(comm.rank());
  model_values mv(m);
  const param_registry reg(mv.spec);
  // One unit per layer: each is gathered around its forward and its backward.
  const flat_layout layout(sizes, reg.unit_starts(), N);
  shard_params_options po;
  po.prefetch = 1;  // the next layer's all-gather overlaps this one
  shard_params<Comm, float> params(comm, layout, r, reg, po);
  shard_grads_options go;
  go.groups_are_units = true;
  shard_grads<Comm, float> grads(comm, layout, r, reg, go);
  for (std::size_t i = 0; i < sizes.size(); ++i) params.load(i, mv.init[i].data(), dtype::f32);
  params.start();
  const std::vector<flat_layout::piece> mine = layout.pieces(r);  // this rank's true elements
  const float scale = static_cast<float>(1.0 / static_cast<double>(N));
  std::vector<float> g;
  double checksum = 0;  // stands in for the forward's use of the parameters
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t u = 0; u < reg.num_units(); ++u) {  // forward
      params.pre_forward(u);
      for (std::size_t i = reg.unit_begin(u); i < reg.unit_end(u); ++i) {
        for (float x : params.view(i)) checksum += x;
      }
      params.post_forward(u);
    }
    for (std::size_t u = reg.num_units(); u-- > 0;) {  // backward, last layer first
      params.pre_backward(u);
      grads.begin_group(u);
      for (std::size_t i = reg.unit_end(u); i-- > reg.unit_begin(u);) {
        g.resize(sizes[i]);
        for (std::size_t k = 0; k < g.size(); ++k) g[k] = m.grad(t, static_cast<int>(r), i, k);
        grads.add(i, g);  // the unit's reduce-scatter starts with its last gradient
      }
      params.post_backward(u, [&] { grads.end_group(u); });
    }
    grads.finish();
    // The user's optimizer: plain SGD on the reduced gradient shard and the fp32 working shard
    // (both in shard coordinates), over this rank's true elements only.
    const float* gs = grads.gradients().data;
    float* ps = params.working().data;
    for (const auto& pc : mine) {
      for (std::size_t j = pc.shard_offset; j < pc.shard_offset + pc.count; ++j) {
        ps[j] = ps[j] - sgd_lr * (gs[j] * scale);
      }
    }
    params.after_step(true);  // the next gathers see the updated shard
    grads.reset();
  }
  (void)checksum;

  // shardkit's engine at stage 3 with its SGD (momentum 0, no weight decay: plain SGD).
  engine<Comm, zero3, float, sgd_momentum> eng(
      comm, mv.spec, sgd_options{.lr = sgd_lr, .momentum = 0.0f, .weight_decay = 0.0f});
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t u = 0; u < eng.num_units(); ++u) {
      eng.pre_forward(u);
      eng.post_forward(u);
    }
    for (std::size_t u = eng.num_units(); u-- > 0;) {
      eng.pre_backward(u);
      for (std::size_t i = reg.unit_end(u); i-- > reg.unit_begin(u);) {
        g.resize(sizes[i]);
        for (std::size_t k = 0; k < g.size(); ++k) g[k] = m.grad(t, static_cast<int>(r), i, k);
        eng.grad_ready(i, g);
      }
      eng.post_backward(u);
    }
    eng.step();
  }
  diff d;
  const auto mine_shard = params.shard();
  const auto engine_shard = eng.param_shard();
  for (std::size_t j = 0; j < layout.shard_numel(); ++j) d.engine(mine_shard[j], engine_shard[j]);
  for (std::size_t u = 0; u < reg.num_units(); ++u) {  // the gathered parameters, too
    params.pre_forward(u);
    eng.pre_forward(u);
    for (std::size_t i = reg.unit_begin(u); i < reg.unit_end(u); ++i) {
      const auto a = params.view(i), b = eng.param(i);
      for (std::size_t k = 0; k < sizes[i]; ++k) d.engine(a[k], b[k]);
    }
    params.post_forward(u);
    eng.post_forward(u);
  }
  params.after_step(false);
  const std::vector<float> all = gather_model_order(comm, layout, params.shard().data());
  const std::vector<double> want = reference_sgd(m, comm.size(), steps);
  for (std::size_t e = 0; e < want.size(); ++e) d.reference(all[e], want[e]);
  return d.r;
}

// ---- part (c): ZeRO over the data-parallel groups of a mesh ------------------------------------

//! What one rank's engine ends with: the bits of every working parameter and of its master shard,
//! and how far the master is from the model's unsharded reference.
struct engine_state {
  std::vector<std::uint32_t> working, master;
  double vs_reference = 0;
};

//! Trains `m` with ZeRO-3 (bf16 working parameters, fp32 gradients) on the ranks of `dp`.
template <class Comm>
engine_state train_data_parallel(Comm& dp, const model_def& m, int steps) {
  using namespace shardkit;
  const auto sizes = m.sizes();
  model_values mv(m);
  engine<Comm, zero3, bf16, adamw, float> eng(dp, mv.spec, adam);
  std::vector<float> g;
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t u = 0; u < eng.num_units(); ++u) {
      eng.pre_forward(u);
      eng.post_forward(u);
    }
    for (std::size_t u = eng.num_units(); u-- > 0;) {
      eng.pre_backward(u);
      for (std::size_t i = 2 * u + 2; i-- > 2 * u;) {
        g.resize(sizes[i]);
        for (std::size_t k = 0; k < g.size(); ++k) g[k] = m.grad(t, dp.rank(), i, k);
        eng.grad_ready(i, g);
      }
      eng.post_backward(u);
    }
    eng.step();
  }
  engine_state s;
  for (std::size_t u = 0; u < eng.num_units(); ++u) {
    eng.pre_forward(u);
    for (std::size_t i = 2 * u; i < 2 * u + 2; ++i) {
      for (auto x : eng.param(i)) s.working.push_back(x.bits);
    }
    eng.post_forward(u);
  }
  for (float x : eng.master_shard()) s.master.push_back(std::bit_cast<std::uint32_t>(x));
  const std::vector<float> master = gather_model_order(dp, eng.layout(), eng.master_shard().data());
  const std::vector<double> want = reference_adamw(m, dp.size(), steps);
  for (std::size_t e = 0; e < want.size(); ++e) {
    s.vs_reference = std::max(s.vs_reference, std::fabs(master[e] - want[e]));
  }
  return s;
}

//! The same engines on worlds of their own (N/2 in-process ranks each): what part (c)'s
//! data-parallel groups must reproduce bit for bit.
struct standalone_runs {
  std::vector<engine_state> group[2];
};
standalone_runs standalone(int ranks, int steps) {
  standalone_runs s;
  for (int c = 0; c < 2; ++c) {
    s.group[c] = shardkit::run_ranks(ranks / 2, [&](shardkit::thread_comm& w) {
      return train_data_parallel(w, c == 0 ? model_c0 : model_c1, steps);
    });
  }
  return s;
}

template <class Comm>
part_result part_c(Comm& comm, int steps, const standalone_runs& alone) {
  // The mesh: ranks 2q and 2q + 1 would share a model slice in tensor parallelism (position
  // r mod 2); the ranks at the same position form a data-parallel group, r mod 2 = its color.
  const int color = comm.rank() % 2;
  Comm dp = comm.split(color, comm.rank());  // collective: every rank of `comm`
  const engine_state mine = train_data_parallel(dp, color == 0 ? model_c0 : model_c1, steps);
  const engine_state& want = alone.group[color].at(static_cast<std::size_t>(dp.rank()));
  diff d;
  auto compare = [&](const std::vector<std::uint32_t>& a, const std::vector<std::uint32_t>& b,
                     bool is_bf16) {
    if (a.size() != b.size()) {
      d.r.mismatches += 1e9;
      return;
    }
    for (std::size_t e = 0; e < a.size(); ++e) {
      if (is_bf16) {
        shardkit::bf16 x, y;
        x.bits = static_cast<std::uint16_t>(a[e]);
        y.bits = static_cast<std::uint16_t>(b[e]);
        d.engine(x, y);
      } else {
        d.engine(std::bit_cast<float>(a[e]), std::bit_cast<float>(b[e]));
      }
    }
  };
  compare(mine.working, want.working, true);
  compare(mine.master, want.master, false);
  d.r.vs_reference = mine.vs_reference;
  return d.r;
}

// ---- running the parts -------------------------------------------------------------------------

struct part_info {
  char part;
  const char* what;
  int stage;
  double bound;
};
const part_info parts_info[3] = {
    {'a',
     "ZeRO-1 from shard_optimizer fed by the user's own all-reduce, then the user's all-gather", 1,
     adam_bound},
    {'b', "ZeRO-3 from shard_params + shard_grads driven by the user's hooks, the user's own SGD",
     3, sgd_bound},
    {'c', "ZeRO-3 engines over the two data-parallel groups of a 2 x N/2 mesh (comm.split)", 3,
     adam_bound},
};

//! One rank's part p (0, 1, 2).
template <class Comm>
part_result run_part(int p, Comm& comm, const config& c, const standalone_runs& alone) {
  switch (p) {
    case 0:
      return part_a(comm, c.steps);
    case 1:
      return part_b(comm, c.steps);
    default:
      return part_c(comm, c.steps, alone);
  }
}

std::vector<int> selected(const config& c) {
  if (c.part == "all") return {0, 1, 2};
  return {c.part[0] - 'a'};
}

//! Prints the results and returns the exit status.
int report(const config& c, const std::vector<int>& parts, const std::vector<part_result>& res,
           const char* comm_name, const char* collectives) {
  std::vector<std::string> failures;
  for (std::size_t j = 0; j < parts.size(); ++j) {
    const part_info& info = parts_info[parts[j]];
    const part_result& r = res[j];
    if (r.vs_engine != 0 || r.mismatches != 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf,
                    "FAIL: part %c: %.0f element(s) differ from the engine at stage %d (max "
                    "|diff| %.3g): not bit-identical",
                    info.part, r.mismatches, info.stage, r.vs_engine);
      failures.emplace_back(buf);
    }
    if (!(r.vs_reference <= info.bound)) {
      char buf[160];
      std::snprintf(buf, sizeof buf,
                    "FAIL: part %c: max |diff| from the unsharded reference %.3g exceeds %.3g",
                    info.part, r.vs_reference, info.bound);
      failures.emplace_back(buf);
    }
  }
  const bool ok = failures.empty();
  if (c.json) {
    std::printf("{\"example\": \"05_assemble\", \"comm\": \"%s\", \"ranks\": %d, \"steps\": %d,\n",
                comm_name, c.ranks, c.steps);
    std::printf(" \"parts\": [\n");
    for (std::size_t j = 0; j < parts.size(); ++j) {
      const part_info& info = parts_info[parts[j]];
      const part_result& r = res[j];
      std::printf(
          "  {\"part\": \"%c\", \"stage\": %d, \"what\": \"%s\",\n"
          "   \"max_abs_diff_vs_engine\": %.17g, \"engine_bit_mismatches\": %.0f,\n"
          "   \"max_abs_diff_vs_reference\": %.6g, \"reference_bound\": %.6g}%s\n",
          info.part, info.stage, info.what, r.vs_engine, r.mismatches, r.vs_reference, info.bound,
          j + 1 < parts.size() ? "," : "");
    }
    std::printf(" ],\n \"ok\": %s}\n", ok ? "true" : "false");
  } else {
    std::printf(
        "shardkit %s example 05: ZeRO assembled from its components, %d %s rank%s, %d "
        "steps\n",
        SHARDKIT_VERSION_STRING, c.ranks, comm_name, c.ranks == 1 ? "" : "s", c.steps);
    std::printf("(part a's own collectives: %s)\n\n", collectives);
    std::printf(
        "part  stage  max |diff| vs engine  bits differing  max |diff| vs reference  "
        "bound\n");
    for (std::size_t j = 0; j < parts.size(); ++j) {
      const part_info& info = parts_info[parts[j]];
      const part_result& r = res[j];
      std::printf("  %c     %d    %20.3g  %14.0f  %23.3g  %.0e\n", info.part, info.stage,
                  r.vs_engine, r.mismatches, r.vs_reference, info.bound);
    }
    std::printf("\n");
    for (int p : parts) std::printf("  %c: %s\n", parts_info[p].part, parts_info[p].what);
  }
  for (const auto& f : failures) std::fprintf(stderr, "%s\n", f.c_str());
  return ok ? 0 : 1;
}

//! Combines the ranks' results: the largest difference of any rank.
part_result worst(const part_result& a, const part_result& b) {
  return {std::max(a.vs_engine, b.vs_engine), std::max(a.mismatches, b.mismatches),
          std::max(a.vs_reference, b.vs_reference)};
}

int main_threads(int argc, char** argv) try {
  config c;
  try {
    c = parse(argc, argv);
    if (c.help) {
      std::fputs(usage_text, stdout);
      return 0;
    }
    check_ranks(c);
  } catch (const usage_exit& u) {
    std::fprintf(stderr, "error: %s\n%s", u.why.c_str(), usage_text);
    return 2;
  }
  const std::vector<int> parts = selected(c);
  const bool with_c = std::find(parts.begin(), parts.end(), 2) != parts.end();
  const standalone_runs alone = with_c ? standalone(c.ranks, c.steps) : standalone_runs{};
  std::vector<part_result> res;
  for (int p : parts) {
    const auto per_rank = shardkit::run_ranks(
        c.ranks, [&](shardkit::thread_comm& comm) { return run_part(p, comm, c, alone); });
    part_result w;
    for (const auto& r : per_rank) w = worst(w, r);
    res.push_back(w);
  }
  return report(c, parts, res, "thread", "comm.all_reduce / comm.all_gather");
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

#if defined(SHARDKIT_EXAMPLE_MPI)
// One rank per MPI process; rank 0 prints. A rank that fails ends the job (mpi_main).
int main_mpi(int& argc, char**& argv) {
  return shardkit::mpi_main(argc, argv, [&](shardkit::mpi_comm& comm) -> int {
    const bool printer = comm.rank() == 0;
    config c;
    try {
      c = parse(argc, argv);
      if (c.help) {
        if (printer) std::fputs(usage_text, stdout);
        return 0;
      }
      if (c.ranks_given && c.ranks != comm.size()) {
        usage("--ranks " + std::to_string(c.ranks) + " does not match the " +
              std::to_string(comm.size()) + " processes of this MPI job");
      }
      c.ranks = comm.size();
      check_ranks(c);
    } catch (const usage_exit& u) {  // every rank parses the same arguments: all exit with 2
      if (printer) std::fprintf(stderr, "error: %s\n%s", u.why.c_str(), usage_text);
      return 2;
    }
    const std::vector<int> parts = selected(c);
    const bool with_c = std::find(parts.begin(), parts.end(), 2) != parts.end();
    // Every process computes the standalone engines of part (c) in-process (small models).
    const standalone_runs alone = with_c ? standalone(c.ranks, c.steps) : standalone_runs{};
    std::vector<part_result> res;
    for (int p : parts) {
      part_result r = run_part(p, comm, c, alone);
      double v[3] = {r.vs_engine, r.mismatches, r.vs_reference};
      comm.all_reduce(v, v, 3, shardkit::reduce_op::max);
      res.push_back({v[0], v[1], v[2]});
    }
    int status = 0;
    if (printer) {
      status = report(c, parts, res, "mpi", "MPI_Allreduce / MPI_Allgather");
      std::fflush(stdout);
    }
    comm.broadcast(&status, 1, 0);
    return status;
  });
}
#endif

}  // namespace

int main(int argc, char** argv) {
#if defined(SHARDKIT_EXAMPLE_MPI)
  if (shardkit::launched_by_mpi()) return main_mpi(argc, argv);
#endif
  return main_threads(argc, argv);
}
