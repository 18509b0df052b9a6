//! \file zero/gathered_parameters.hpp
//! `gathered_parameters`: scoped access to whole parameters of an engine at any stage, ZeRO-3
//! included (DeepSpeed's GatheredParameters). A collective scope: on every rank it gathers the
//! fp32 values (the master, or the working values in fp32 training) of the named parameters, or
//! of all, into host memory and hands out views of them; when the scope was opened for writing,
//! commit() writes each rank's values back into the shards (master, optimizer-visible values and
//! the working copy, which is re-gathered as after a step), so every rank sees the change.
//!
//!     {
//!       shardkit::gathered_parameters full(eng, {i, j});          // every rank, same list
//!       std::printf("%f\n", full.values(i)[0]);                    // whole parameter i
//!     }
//!     {
//!       shardkit::gathered_parameters full(eng, {}, shardkit::gather_mode::write_back);
//!       reinit(full.values(k));                                    // the same on every rank
//!       full.commit();                                             // collective
//!     }
//!
//! Every rank must open the same scope (same parameters, same mode) at the same point, as for
//! any collective. The scope starts with a small exchange of what each rank asked for, so ranks
//! that disagree get a usage_error naming the difference; a rank that does not enter the scope
//! at all is caught like any other collective mismatch (at once on the thread communicator, by
//! the communicator's timeout elsewhere), and reported as not having entered it. Memory: the
//! gathered groups of the named parameters (each group at its padded size), in host memory,
//! counted in the ledger as io_staging while the scope lives.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/hash.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/memory.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <map>
#include <span>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Whether a gathered_parameters scope may write back.
enum class gather_mode : std::uint8_t { read_only, write_back };

template <class Engine>
class gathered_parameters {
 public:
  //! Collective: gathers parameters `params` (all when empty) of `e` on every rank.
  gathered_parameters(Engine& e, std::vector<std::size_t> params = {},
                      gather_mode mode = gather_mode::read_only)
      : e_(&e), mode_(mode), params_(std::move(params)) {
    const auto& reg = e.registry();
    if (params_.empty()) {
      for (std::size_t i = 0; i < reg.size(); ++i) params_.push_back(i);
    }
    std::sort(params_.begin(), params_.end());
    params_.erase(std::unique(params_.begin(), params_.end()), params_.end());
    for (auto i : params_) reg.check_param(i, "gathered_parameters");
    agree_on_scope();
    gather();
  }
  gathered_parameters(Engine& e, std::initializer_list<std::size_t> params,
                      gather_mode mode = gather_mode::read_only)
      : gathered_parameters(e, std::vector<std::size_t>(params), mode) {}

  gathered_parameters(const gathered_parameters&) = delete;
  gathered_parameters& operator=(const gathered_parameters&) = delete;
  //! Discards the gathered values (a write-back scope not committed writes nothing back).
  ~gathered_parameters() = default;

  //! The whole parameter i (fp32, host memory, its registered element order). In a read_only
  //! scope changes to it are simply discarded.
  std::span<float> values(std::size_t i) {
    const auto it = where_.find(i);
    if (it == where_.end()) {
      e_->registry().check_param(i, "gathered_parameters::values");
      detail::raise("gathered_parameters::values: parameter '", e_->registry().name(i),
                    "' was not gathered by this scope");
    }
    return {it->second, e_->registry().numel(i)};
  }
  std::span<const float> values(std::size_t i) const {
    return const_cast<gathered_parameters*>(this)->values(i);
  }

  //! Collective: writes the values back (each rank the elements it owns), updates the working
  //! copy and re-gathers it as a step does. Only for write_back scopes; once.
  void commit() {
    if (mode_ != gather_mode::write_back) {
      detail::raise<usage_error>("gathered_parameters::commit: the scope was opened read_only");
    }
    if (committed_) detail::raise<usage_error>("gathered_parameters::commit: called twice");
    committed_ = true;
    auto& opt = e_->optimizer();
    for (auto i : params_) {
      const float* v = where_.at(i);
      if constexpr (Engine::has_master) {
        opt.load(i, 0, e_->registry().numel(i), v, dtype::f32);
      } else {
        e_->parameters().load(i, 0, e_->registry().numel(i), v, dtype::f32);
      }
    }
    opt.write_working(e_->parameters().working());
    e_->parameters().after_step(true);
  }

 private:
  // One all-gather of what each rank asked for: the parameters' hash, their count and the mode.
  void agree_on_scope() {
    stable_hash h;
    for (auto i : params_) h.u64(i);
    const std::uint64_t mine[3] = {h.value(), params_.size(), static_cast<std::uint64_t>(mode_)};
    auto& world = e_->topo().world();
    std::vector<std::uint64_t> all(3 * static_cast<std::size_t>(world.size()));
    try {
      e_->space().all_gather_host(world, mine, all.data(), 3);
    } catch (const comm_error& x) {
      detail::raise<usage_error>(
          "gathered_parameters: not every rank entered the scope at this "
          "point (every rank must open it, with the same parameters): ",
          x.what());
    }
    for (std::size_t q = 0; q < static_cast<std::size_t>(world.size()); ++q) {
      if (all[3 * q] != mine[0] || all[3 * q + 1] != mine[1] || all[3 * q + 2] != mine[2]) {
        detail::raise<usage_error>(
            "gathered_parameters: rank ", q, " asked for ", all[3 * q + 1], " parameter(s)",
            all[3 * q + 2] == 1 ? " to write back" : " to read", ", rank ", world.rank(), " for ",
            mine[1], mine[2] == 1 ? " to write back" : " to read",
            (all[3 * q + 1] == mine[1] ? " (a different set)" : ""),
            "; every rank must open the same scope");
      }
    }
  }

  void gather() {
    const auto& reg = e_->registry();
    const auto& layout = e_->layout();
    std::size_t total = 0;
    for (auto i : params_) total += reg.numel(i);
    host_ = buffer<float, host_space>(total, &e_->memory(), memory_category::io_staging);
    std::size_t at = 0;
    for (auto i : params_) {
      where_[i] = host_.data() + at;
      at += reg.numel(i);
    }
    // What holds the values of this rank: a shard (gathered per group) or the whole model.
    constexpr bool local = Engine::stage == 0 || (!Engine::has_master && !Engine::shards_params);
    if constexpr (local) {
      for (auto i : params_) copy_local(i);
    } else {
      std::vector<std::size_t> groups;
      for (auto i : params_) groups.push_back(layout.param(i).group);
      std::sort(groups.begin(), groups.end());
      groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
      auto& comm = e_->topo().shard_group();
      const auto& ops = e_->space();
      for (auto g : groups) {
        const auto& ge = layout.group(g);
        buffer<float, typename Engine::memory_space> full;
        {
          [[maybe_unused]] auto on_stream = ops.scope();
          full = buffer<float, typename Engine::memory_space>(ge.padded, &e_->memory(),
                                                              memory_category::io_staging);
        }
        const float* shard = shard_values() + ge.shard_offset;
        ops.before_collective();
        comm.all_gather(shard, full.data(), ge.shard);
        for (auto i : params_) {
          const auto& p = layout.param(i);
          if (p.group != g) continue;
          ops.download(full.data() + p.group_offset, where_[i], dtype::f32, p.numel);
        }
        [[maybe_unused]] auto on_stream = ops.scope();
        full.release();
      }
    }
  }

  // The fp32 shard the values come from (sharded stages).
  const float* shard_values() const {
    if constexpr (Engine::has_master) {
      return e_->optimizer().master().data();
    } else {
      return e_->parameters().working().data;  // fp32 ZeRO-3: the working shard
    }
  }

  // The values of parameter i where this rank holds all of it.
  void copy_local(std::size_t i) {
    const auto& p = e_->layout().param(i);
    if constexpr (Engine::has_master) {
      e_->space().download(e_->optimizer().master().data() + p.offset, where_[i], dtype::f32,
                           p.numel);
    } else {
      const auto w = e_->parameters().working();
      e_->space().download(w.data + p.offset, where_[i], dtype::f32, p.numel);
    }
  }

  Engine* e_;
  gather_mode mode_;
  std::vector<std::size_t> params_;
  buffer<float, host_space> host_;
  std::map<std::size_t, float*> where_;
  bool committed_ = false;
};

SHARDKIT_NAMESPACE_END
