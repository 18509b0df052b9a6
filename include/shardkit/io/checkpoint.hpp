//! \file io/checkpoint.hpp
//! Sharded checkpoints of an engine: save, asynchronous save, and load with resharding
//! (docs/checkpoints.md has the format and the guarantees).
//!
//!     shardkit::io::save(eng, "ckpt/step-1000");                 // collective: every rank
//!     auto pending = shardkit::io::save_async(eng, "ckpt/step-2000");  // returns after a copy
//!     ... train on ...
//!     pending.wait();                                             // collective: now visible
//!     shardkit::io::load(eng2, "ckpt/step-2000");                 // any world size, any stage
//!
//! Save. Every element is written once (io/plan.hpp: the first replica's ranks write their
//! shard, unpadded; at stage 0 the ranks share the model), as fp32: the master values (or the
//! working values where there is no master) and each optimizer state, into one checksummed
//! block file per writing rank (io/block_file.hpp), in `<dir>.partial`; rank 0 then writes the
//! manifest (io/manifest.hpp), syncs everything, and puts the directory in the place of `<dir>`
//! atomically (io/file.hpp's replace_directory). A crash at any moment leaves `<dir>` either as
//! it was or complete; a failure on any rank (a full disk, a read-only directory) raises on every
//! rank, naming the rank and the file, and removes the partial directory.
//!
//! Load. Every rank reads the manifest, checks that it describes the engine's model (names and
//! shapes) and optimizer, then reads only the ranges of the files that intersect its own shard
//! (in the engine's layout, whatever the saving one was), verifying the checksum of every block
//! it reads. Master and optimizer state are set bit for bit, the working parameters are the
//! rounded master (as after a step), and the step count and loss scaler are restored: training
//! on continues exactly as if it had never stopped (at the same world size and stage, bit for
//! bit). A failure on any rank raises on every rank; the engine's state is then partly loaded
//! and the engine must not be used.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/io/block_file.hpp>
#include <shardkit/io/file.hpp>
#include <shardkit/io/manifest.hpp>
#include <shardkit/io/plan.hpp>
#include <shardkit/kernels/math.hpp>
#include <shardkit/zero/fingerprint.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace io {

//! Settings of a save.
struct save_options {
  //! Bytes per checksummed block of the data files.
  std::size_t block_bytes = std::size_t{1} << 20;
  //! Called on rank 0 (and on writing ranks for "rank file written") at the moments of a save:
  //! "partial directory created", "rank file written", "manifest written", "before replace",
  //! "after replace". A test throws from it to simulate a crash there.
  std::function<void(std::string_view moment)> on_moment;
};

//! What load() found besides what it loaded.
struct load_report {
  std::uint64_t step = 0;         //!< the step count restored
  std::uint64_t saved_world = 0;  //!< world size and stage of the saving engine
  std::uint64_t saved_stage = 0;
  std::vector<std::string> notes;  //!< differences that were allowed (hyper-parameters, units)
};

namespace detail {

//! The names of the optimizer's states, as the manifest lists them.
template <class Opt>
std::vector<std::string> kinds_of() {
  std::vector<std::string> k{"values"};
  for (std::size_t s = 0; s < Opt::state_count; ++s) {
    if constexpr (std::is_same_v<Opt, adam> || std::is_same_v<Opt, adamw>) {
      k.push_back(s == 0 ? "exp_avg" : "exp_avg_sq");
    } else if constexpr (std::is_same_v<Opt, sgd_momentum>) {
      k.push_back("momentum_buffer");
    } else {
      k.push_back(shardkit::detail::concat("state", s));
    }
  }
  return k;
}

template <class Opt>
std::vector<std::pair<std::string, double>> describe(const typename Opt::options& o) {
  std::vector<std::pair<std::string, double>> out;
  if constexpr (requires { Opt::describe(o); }) {
    for (const auto& [k, v] : Opt::describe(o)) out.emplace_back(k, v);
  } else {
    out.emplace_back("lr", o.lr);
  }
  return out;
}

inline std::string rank_file_name(std::size_t rank) {
  char b[32];
  std::snprintf(b, sizeof b, "rank-%05zu.bin", rank);
  return b;
}

//! The model, training and layout parts of the manifest of `e` now.
template <class Engine>
manifest describe_engine(const Engine& e) {
  using Opt = typename Engine::optimizer_type;
  const auto& reg = e.registry();
  manifest m;
  m.fingerprint = combined(model_fingerprint(reg));
  for (std::size_t i = 0; i < reg.size(); ++i) {
    manifest::param p;
    p.name = reg.name(i);
    for (auto d : reg.shape(i)) p.shape.push_back(d);
    p.group = reg.param_group(i);
    p.unit = reg.unit_of(i);
    m.params.push_back(std::move(p));
  }
  for (std::size_t u = 0; u < reg.num_units(); ++u) {
    m.units.push_back(
        {reg.unit_name(u), reg.unit_begin(u), reg.options_of_unit(u).reshard_after_forward});
  }
  m.working_dtype = name(dtype_of<typename Engine::working_type>);
  m.grad_dtype = name(dtype_of<typename Engine::grad_type>);
  m.optimizer = Opt::name;
  for (std::size_t g = 0; g < e.optimizer().num_groups(); ++g) {
    m.group_options.push_back(describe<Opt>(e.optimizer().options(g)));
  }
  m.step = e.steps_taken();
  m.loss_scaling = e.control().loss_scaling();
  m.loss_scale = e.loss_scale();
  m.good_steps = e.control().good_steps();
  m.world_size = static_cast<std::uint64_t>(e.ranks());
  m.stage = static_cast<std::uint64_t>(Engine::stage);
  m.shard_group_size = static_cast<std::uint64_t>(Engine::stage == 0 ? 1 : e.shard_size());
  m.alignment = e.layout().alignment();
  m.kinds = kinds_of<Opt>();
  return m;
}

//! Copies the values of `pieces` (kind-major: values, then each state) to host memory.
template <class Engine>
void copy_out(Engine& e, const std::vector<flat_layout::piece>& pieces, float* out) {
  auto& opt = e.optimizer();
  const auto& ops = e.space();
  const std::uint64_t total = elements_of(pieces);
  std::size_t at = 0;
  for (const auto& pc : pieces) {
    if constexpr (Engine::has_master) {
      ops.download(opt.master().data() + pc.shard_offset, out + at, dtype::f32, pc.count);
    } else {
      const auto w = e.parameters().working();
      ops.download(w.data + w.offset_of(pc), out + at, dtype::f32, pc.count);
    }
    for (std::size_t s = 0; s < Engine::optimizer_type::state_count; ++s) {
      ops.download(opt.state(s).data() + pc.shard_offset, out + (s + 1) * total + at, dtype::f32,
                   pc.count);
    }
    at += pc.count;
  }
}

}  // namespace detail

//! Reads elements of (param, kind) ranges of a checkpoint from its files, opening each file
//! once and verifying every block it reads (what load() and the offline tools use).
class range_reader {
 public:
  range_reader(const manifest& m, std::string dir) : m_(m), dir_(std::move(dir)) {
    for (std::size_t k = 0; k < m.ranges.size(); ++k) {
      index_[{m.ranges[k].param, m.ranges[k].kind}].push_back(k);
    }
    for (auto& [key, v] : index_) {
      std::sort(v.begin(), v.end(), [&](std::size_t a, std::size_t b) {
        return m.ranges[a].param_offset < m.ranges[b].param_offset;
      });
    }
  }
  //! Elements [offset, offset + count) of (param, kind) into `out` (fp32).
  void read(std::uint64_t param, std::uint64_t kind, std::uint64_t offset, std::uint64_t count,
            float* out) {
    const auto& v = index_.at({param, kind});
    for (const std::size_t k : v) {
      const auto& r = m_.ranges[k];
      const std::uint64_t b = std::max(offset, r.param_offset);
      const std::uint64_t e = std::min(offset + count, r.param_offset + r.count);
      if (b >= e) continue;
      reader(r.file).read(r.offset + (b - r.param_offset) * 4, static_cast<std::size_t>(e - b) * 4,
                          out + (b - offset));
    }
  }

 private:
  block_file_reader& reader(std::uint64_t f) {
    auto it = files_.find(f);
    if (it == files_.end()) {
      const auto& fe = m_.files[f];
      const std::string path = dir_ + "/" + fe.name;
      if (!exists(path)) {
        throw format_error(shardkit::detail::concat("checkpoint '", dir_, "' is missing '", fe.name,
                                                    "' (written by rank ", fe.rank, ")"));
      }
      auto r = std::make_unique<block_file_reader>(path);
      if (r->data_bytes() != fe.data_bytes) {
        throw format_error(shardkit::detail::concat("'", path, "' holds ", r->data_bytes(),
                                                    " data bytes; the manifest says ",
                                                    fe.data_bytes));
      }
      it = files_.emplace(f, std::move(r)).first;
    }
    return *it->second;
  }

  const manifest& m_;
  std::string dir_;
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::vector<std::size_t>> index_;
  std::map<std::uint64_t, std::unique_ptr<block_file_reader>> files_;
};

template <class Engine>
class pending_save;

//! Starts a save of `e` into directory `dir` (see the file comment). Collective: every rank
//! calls it. Returns once this rank's shard is copied to host staging (ledger: io_staging); a
//! thread writes it while training continues. Call wait() on every rank to finish.
template <class Engine>
pending_save<Engine> save_async(Engine& e, const std::string& dir, save_options opts = {});

//! A save in progress (save_async). wait() finishes it; it is collective: every rank calls it.
template <class Engine>
class pending_save {
 public:
  pending_save() = default;
  pending_save(pending_save&&) noexcept = default;
  pending_save& operator=(pending_save&&) noexcept = default;
  pending_save(const pending_save&) = delete;
  pending_save& operator=(const pending_save&) = delete;
  //! A save never waited for is abandoned: its writer thread is joined, the checkpoint does not
  //! appear (only `<dir>.partial` may remain).
  ~pending_save() {
    if (state_ && state_->writer.joinable()) state_->writer.join();
  }

  bool pending() const noexcept { return state_ != nullptr; }
  const std::string& directory() const noexcept { return state_->dir; }

  //! Collective: waits for this rank's file, agrees with every rank, and (rank 0) writes the
  //! manifest and puts the checkpoint in place. Raises on every rank if any rank failed.
  void wait() {
    if (!state_) return;
    auto st = std::move(state_);
    if (st->writer.joinable()) st->writer.join();
    Engine& e = *st->engine;
    auto& world = e.topo().world();
    st->staging.release();
    detail::agreement mine;
    if (!st->error.empty()) {
      mine.failed = 1;
      mine.message = st->error;
    } else {
      mine.values[0] = st->info.data_bytes;
      mine.values[1] = st->info.file_bytes;
      mine.values[2] = st->info.xxh64;
    }
    auto all = detail::agree(world, e.space(), mine);
    std::string failed = detail::failures(all);
    if (failed.empty() && world.rank() == 0) {
      try {
        finish_on_rank0(*st, all);
      } catch (const std::exception& x) {
        failed = x.what();
      }
    }
    detail::agreement done;
    if (!failed.empty() && world.rank() == 0) {
      done.failed = 1;
      done.message = failed;
      try {
        remove_all(st->tmp);
      } catch (...) {  // the reason is already in the message
      }
    }
    const auto last = detail::agree(world, e.space(), done);
    if (last[0].failed != 0) {
      throw io_error(shardkit::detail::concat("checkpoint save to '", st->dir,
                                              "' failed; the previous contents of '", st->dir,
                                              "' are unchanged: ", last[0].message));
    }
  }

 private:
  friend pending_save save_async<Engine>(Engine& e, const std::string& dir, save_options opts);

  struct state {
    Engine* engine = nullptr;
    std::string dir, tmp;
    save_options opts;
    manifest m;  // model, training and layout at the moment of save_async
    std::vector<std::vector<flat_layout::piece>> pieces;  // of every rank
    buffer<float, host_space> staging;
    std::thread writer;
    block_file_info info;
    std::string error;
  };

  void finish_on_rank0(state& st, const std::vector<detail::agreement>& all) {
    manifest& m = st.m;
    const std::size_t kinds = m.kinds.size();
    for (std::size_t q = 0; q < st.pieces.size(); ++q) {
      if (st.pieces[q].empty()) continue;
      const std::uint64_t file = m.files.size();
      m.files.push_back(
          {detail::rank_file_name(q), q, all[q].values[1], all[q].values[0], all[q].values[2]});
      const std::uint64_t total = elements_of(st.pieces[q]);
      std::uint64_t at = 0;
      for (const auto& pc : st.pieces[q]) {
        for (std::size_t k = 0; k < kinds; ++k) {
          m.ranges.push_back({pc.param, k, file, (k * total + at) * 4, pc.param_offset, pc.count});
        }
        at += pc.count;
      }
    }
    const std::string text = to_json(m);
    {
      file f = file::create(st.tmp + "/manifest.json");
      f.write_at(text.data(), text.size(), 0);
      f.sync();
      f.close();
    }
    if (st.opts.on_moment) st.opts.on_moment("manifest written");
    sync_directory(st.tmp);
    if (st.opts.on_moment) st.opts.on_moment("before replace");
    replace_directory(st.tmp, st.dir);
    if (st.opts.on_moment) st.opts.on_moment("after replace");
  }

  std::unique_ptr<state> state_;
};

template <class Engine>
pending_save<Engine> save_async(Engine& e, const std::string& dir, save_options opts) {
  auto& world = e.topo().world();
  const std::size_t N = static_cast<std::size_t>(world.size());
  const std::size_t me = static_cast<std::size_t>(world.rank());
  const std::size_t G = Engine::stage == 0 ? 1 : static_cast<std::size_t>(e.shard_size());
  auto st = std::make_unique<typename pending_save<Engine>::state>();
  st->engine = &e;
  st->dir = dir;
  st->tmp = dir + ".partial";
  st->opts = opts;
  // rank 0 prepares the partial directory; nobody writes before it exists
  detail::agreement prep;
  if (me == 0) {
    try {
      if (dir.empty()) shardkit::detail::raise("checkpoint save: empty directory name");
      make_directories(parent_of(dir));
      remove_all(st->tmp);
      make_directory(st->tmp);
      if (opts.on_moment) opts.on_moment("partial directory created");
    } catch (const std::exception& x) {
      prep.failed = 1;
      prep.message = x.what();
    }
  }
  const auto ready = detail::agree(world, e.space(), prep);
  if (ready[0].failed != 0) {
    throw io_error(shardkit::detail::concat("checkpoint save to '", dir,
                                            "' could not start; the previous contents of '", dir,
                                            "' are unchanged: rank 0: ", ready[0].message));
  }
  st->m = detail::describe_engine(e);
  for (std::size_t q = 0; q < N; ++q) {
    st->pieces.push_back(saved_pieces(e.layout(), Engine::stage, N, G, q));
  }
  const auto& mine = st->pieces[me];
  if (!mine.empty()) {
    const std::size_t kinds = st->m.kinds.size();
    st->staging = buffer<float, host_space>(elements_of(mine) * kinds, &e.memory(),
                                            memory_category::io_staging);
    detail::copy_out(e, mine, st->staging.data());
    auto* s = st.get();
    s->writer = std::thread([s, me] {
      try {
        block_file_writer w(s->tmp + "/" + detail::rank_file_name(me), s->opts.block_bytes);
        w.append(s->staging.data(), s->staging.bytes());
        s->info = w.finish();
        if (s->opts.on_moment) s->opts.on_moment("rank file written");
      } catch (const std::exception& x) {
        s->error = x.what();
      }
    });
  }
  pending_save<Engine> p;
  p.state_ = std::move(st);
  return p;
}

//! Saves `e` into directory `dir` and returns when the checkpoint is in place on every rank.
template <class Engine>
void save(Engine& e, const std::string& dir, save_options opts = {}) {
  save_async(e, dir, std::move(opts)).wait();
}

namespace detail {

//! Raises format_error unless manifest `m` describes the model and optimizer of `e`.
template <class Engine>
void check_compatible(const Engine& e, const manifest& m, const std::string& dir,
                      load_report& rep) {
  using Opt = typename Engine::optimizer_type;
  const auto& reg = e.registry();
  auto bad = [&](const std::string& what) {
    throw format_error(shardkit::detail::concat("checkpoint '", dir, "' ", what));
  };
  if (m.params.size() != reg.size()) {
    bad(shardkit::detail::concat("holds ", m.params.size(), " parameters; the engine's model has ",
                                 reg.size(), " (a checkpoint of another model?)"));
  }
  for (std::size_t i = 0; i < reg.size(); ++i) {
    std::vector<std::uint64_t> shape(reg.shape(i).begin(), reg.shape(i).end());
    if (m.params[i].name != reg.name(i) || m.params[i].shape != shape) {
      auto fmt = [](const auto& s) {
        std::string t = "[";
        for (std::size_t k = 0; k < s.size(); ++k) t += (k ? ", " : "") + std::to_string(s[k]);
        return t + "]";
      };
      bad(shardkit::detail::concat("is of another model: its parameter #", i, " is '",
                                   m.params[i].name, "' ", fmt(m.params[i].shape),
                                   ", the engine's is '", reg.name(i), "' ", fmt(shape)));
    }
  }
  if (m.optimizer != Opt::name) {
    bad(shardkit::detail::concat("holds the state of optimizer '", m.optimizer,
                                 "'; the engine's is '", Opt::name, "'"));
  }
  if (m.kinds != kinds_of<Opt>()) bad("holds other optimizer states than the engine's optimizer");
  if (m.fingerprint != combined(model_fingerprint(reg))) {
    rep.notes.push_back("the model's units or parameter groups differ from the saved ones");
  }
  for (std::size_t g = 0; g < e.optimizer().num_groups() && g < m.group_options.size(); ++g) {
    auto ours = describe<Opt>(e.optimizer().options(g));
    auto saved = m.group_options[g];
    std::sort(ours.begin(), ours.end());
    std::sort(saved.begin(), saved.end());
    if (ours != saved) {
      rep.notes.push_back(
          shardkit::detail::concat("parameter group ", g,
                                   " has other hyper-parameters than the saved ones (the engine's "
                                   "are used)"));
    }
  }
}

}  // namespace detail

//! Loads checkpoint `dir` into `e` (see the file comment). Collective: every rank calls it.
template <class Engine>
load_report load(Engine& e, const std::string& dir) {
  auto& world = e.topo().world();
  load_report rep;
  detail::agreement mine;
  try {
    const manifest m = read_manifest(dir);
    detail::check_compatible(e, m, dir, rep);
    rep.step = m.step;
    rep.saved_world = m.world_size;
    rep.saved_stage = m.stage;
    range_reader in(m, dir);
    auto& opt = e.optimizer();
    constexpr std::size_t block = std::size_t{1} << 18;
    buffer<float, host_space> staging(block, &e.memory(), memory_category::io_staging);
    for (const auto& pc : opt.pieces()) {
      for (std::size_t at = 0; at < pc.count; at += block) {
        const std::size_t n = std::min(block, pc.count - at);
        const std::size_t off = pc.param_offset + at;
        for (std::size_t k = 0; k < m.kinds.size(); ++k) {
          in.read(pc.param, k, off, n, staging.data());
          if (k != 0) {
            opt.load_state(k - 1, pc.param, off, n, staging.data(), dtype::f32);
          } else if constexpr (Engine::has_master) {
            opt.load(pc.param, off, n, staging.data(), dtype::f32);
          } else {
            e.parameters().load(pc.param, off, n, staging.data(), dtype::f32);
          }
        }
      }
    }
    opt.write_working(e.parameters().working());
    opt.set_steps(m.step);
    if (e.control().loss_scaling() && m.loss_scaling) {
      e.control().set_scale_state(static_cast<float>(m.loss_scale),
                                  static_cast<std::uint32_t>(m.good_steps));
    }
  } catch (const std::exception& x) {
    mine.failed = 1;
    mine.message = x.what();
  }
  const auto all = detail::agree(world, e.space(), mine);
  const std::string failed = detail::failures(all);
  if (!failed.empty()) {
    throw format_error(
        shardkit::detail::concat("checkpoint load from '", dir,
                                 "' failed (the engine's state is now partly loaded: "
                                 "build a new engine): ",
                                 failed));
  }
  e.parameters().after_step(true);  // collective: every rank's working slices, everywhere
  return rep;
}

}  // namespace io
SHARDKIT_NAMESPACE_END
