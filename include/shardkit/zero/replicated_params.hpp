//! \file zero/replicated_params.hpp
//! `replicated_params`: the working parameters of stages 0-2, whole on every rank. It owns the
//! full working buffer (Ψ elements over a 1-way layout for stage 0; N·S, padded, for stages 1
//! and 2). Its unit hooks are no-ops, so framework code can call them whatever the stage; after
//! a step whose optimizer updated only this rank's slices (stages 1 and 2), after_step(true)
//! all-gathers every group in place so each rank holds the whole model again.
//!
//!     shardkit::replicated_params<shardkit::thread_comm, shardkit::bf16> params(comm, layout,
//!                                                                            comm.rank(), reg);
//!     opt.step(grads, params.working(), scale);     // writes this rank's slices
//!     params.after_step(true);                      // collective: all-gather
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/flat_span.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/zero/collective_log.hpp>
#include <shardkit/zero/registry.hpp>
#include <shardkit/zero/space_ops.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

template <communicator Comm, float_storage Working>
class replicated_params {
 public:
  using memory_space = typename Comm::memory_space;
  using working_type = Working;

  //! The parameters of `reg` laid out as `layout` (1-way for stage 0, or sharded over `comm`),
  //! this rank owning shard `shard_index`. `comm`, `layout` and `reg` must outlive the
  //! component; `ledger` and `log` may be null.
  replicated_params(Comm& comm, const flat_layout& layout, std::size_t shard_index,
                    const param_registry& reg, memory_ledger* ledger = nullptr,
                    collective_log* log = nullptr,
                    space_ops<memory_space> ops = space_ops<memory_space>())
      : comm_(&comm),
        layout_(&layout),
        reg_(&reg),
        shard_index_(shard_index),
        ledger_(ledger != nullptr ? ledger : &own_ledger_),
        log_(log),
        ops_(std::move(ops)) {
    if (layout.ranks() != 1 && layout.ranks() != static_cast<std::size_t>(comm.size())) {
      detail::raise("replicated_params: a layout of ", layout.ranks(),
                    " shards over a communicator of ", comm.size(), " ranks");
    }
    if (shard_index >= layout.ranks()) {
      detail::raise("replicated_params: shard index ", shard_index, " of a layout of ",
                    layout.ranks(), " shards (expected 0 to ", layout.ranks() - 1, ")");
    }
    [[maybe_unused]] auto on_stream = ops_.scope();
    // The optimizer writes this rank's slices: the first of them is staggered within a page
    // (core/memory.hpp), apart from the other buffers the fused step streams through.
    const auto mine = layout.pieces(shard_index);
    params_ = buffer<Working, memory_space>(layout.padded_numel(), ledger_,
                                            memory_category::working_params,
                                            mine.empty() ? 0 : mine.front().full_offset);
  }

  replicated_params(const replicated_params&) = delete;
  replicated_params& operator=(const replicated_params&) = delete;
  ~replicated_params() {
    try {
      ops_.synchronize();
    } catch (...) {  // a failed device is reported by the calls that use it
    }
  }

  //! Sets parameter i from `values` (the whole parameter, host memory, fp32/bf16/fp16 of t).
  void load(std::size_t i, const void* values, dtype t) { load(i, 0, reg_->numel(i), values, t); }
  //! As above for elements [offset, offset + count) of parameter i only.
  void load(std::size_t i, std::size_t offset, std::size_t count, const void* values, dtype t) {
    reg_->check_range(i, offset, count, "replicated_params::load");
    const auto& p = layout_->param(i);
    if (count != 0) ops_.upload(values, t, params_.data() + p.offset + offset, count);
  }
  //! Nothing to gather at the start.
  void start() noexcept {}

  //! No-ops: the parameters are always whole.
  void pre_forward(std::size_t u) const { reg_->check_unit(u, "pre_forward"); }
  void post_forward(std::size_t u) const { reg_->check_unit(u, "post_forward"); }
  void pre_backward(std::size_t u) const { reg_->check_unit(u, "pre_backward"); }
  void post_backward(std::size_t u) const { reg_->check_unit(u, "post_backward"); }
  void check_idle(const char* = nullptr) const noexcept {}

  //! Parameter i (valid for the component's lifetime).
  tensor_view<Working, memory_space> view(std::size_t i,
                                          const char* who = "replicated_params::view") {
    reg_->check_param(i, who);
    const auto& p = layout_->param(i);
    return {params_.data() + p.offset, p.numel};
  }

  tensor_view<const Working, memory_space> view(std::size_t i,
                                                const char* who = "replicated_params::view") const {
    reg_->check_param(i, who);
    const auto& p = layout_->param(i);
    return {params_.data() + p.offset, p.numel};
  }

  //! The full working buffer (full coordinates): what the optimizer writes into.
  flat_span<Working, memory_space> working() noexcept {
    return flat_span<Working, memory_space>::full(params_.data(), params_.size());
  }

  //! After a step: when `applied` and the layout is sharded, all-gathers every group so that
  //! each rank's updated slices reach every rank (collective).
  void after_step(bool applied) {
    if (!applied || layout_->ranks() == 1) return;
    std::vector<typename Comm::work_type> works;
    ops_.before_collective();
    for (std::size_t g = 0; g < layout_->num_groups(); ++g) {
      const auto& ge = layout_->group(g);
      if (ge.shard == 0) continue;
      Working* base = params_.data() + ge.offset;
      works.push_back(comm_->all_gather_async(base + shard_index_ * ge.shard, base, ge.shard));
      if (log_) log_->record(*comm_, collective::all_gather, ge.shard, sizeof(Working), g);
    }
    for (auto& w : works) ops_.finish(w);
  }

  const flat_layout& layout() const noexcept { return *layout_; }
  const memory_ledger& memory() const noexcept { return *ledger_; }

 private:
  Comm* comm_;
  const flat_layout* layout_;
  const param_registry* reg_;
  std::size_t shard_index_;
  memory_ledger own_ledger_;
  memory_ledger* ledger_;
  collective_log* log_;
  space_ops<memory_space> ops_;
  buffer<Working, memory_space> params_;
};

SHARDKIT_NAMESPACE_END
