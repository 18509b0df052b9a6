//! \file zero/full_grads.hpp
//! `full_grads`: the gradients of stages 0 and 1, kept whole. It owns one full gradient buffer
//! (Ψ elements over a 1-way layout for stage 0; N·S, padded, for stage 1), takes each
//! parameter's gradient (copied, then added for later micro-batches, accumulating locally), and
//! reduces once per step:
//!  - `full_grads_reduction::all_reduce` (stage 0): every rank gets the sum of all Ψ elements;
//!  - `full_grads_reduction::reduce_scatter` (stage 1): each rank gets the sum of its own slices,
//!    in place in the full buffer (the rest stays this rank's local gradient).
//! The gradient type `Grad` is the component's own (it need not be the working type): a full
//! fp32 gradient buffer reduced in fp32 under bf16 working parameters is `full_grads<Comm,
//! float>`.
//!
//!     shardkit::full_grads<shardkit::thread_comm, float> grads(
//!         comm, layout, comm.rank(), shardkit::full_grads_reduction::reduce_scatter, registry);
//!     grads.add(i, grad_tensor);      // for every parameter, in any order
//!     grads.reduce();                 // collective: the summed slices are ready
//!     opt.step(grads.gradients(), working, 1.0f / comm.size());
//!     grads.reset();                  // zero for the next step
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/volume.hpp>
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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! How full_grads reduces (see the file comment).
enum class full_grads_reduction : std::uint8_t {
  all_reduce,      //!< stage 0: every element on every rank
  reduce_scatter,  //!< stage 1: each rank's own slices
};

template <communicator Comm, float_storage Grad>
class full_grads {
 public:
  using memory_space = typename Comm::memory_space;
  using grad_type = Grad;

  //! Gradients of the parameters of `reg` laid out as `layout` (stage 0: a 1-way layout; stage
  //! 1: one group sharded over `comm`), this rank owning shard `shard_index`. `comm`, `layout`
  //! and `reg` must outlive the component; `ledger` and `log` may be null.
  full_grads(Comm& comm, const flat_layout& layout, std::size_t shard_index,
             full_grads_reduction mode, const param_registry& reg, memory_ledger* ledger = nullptr,
             collective_log* log = nullptr, space_ops<memory_space> ops = space_ops<memory_space>())
      : comm_(&comm),
        layout_(&layout),
        reg_(&reg),
        shard_index_(shard_index),
        mode_(mode),
        ledger_(ledger != nullptr ? ledger : &own_ledger_),
        log_(log),
        ops_(std::move(ops)),
        seen_(reg.size(), 0) {
    if (layout.num_params() != reg.size()) {
      detail::raise("full_grads: the layout has ", layout.num_params(),
                    " parameters, the registry ", reg.size());
    }
    if (mode == full_grads_reduction::all_reduce && layout.ranks() != 1) {
      detail::raise(
          "full_grads: the all-reduce mode keeps every element on every rank: it needs "
          "a 1-way layout (flat_layout(numels, starts, 1)), got one of ",
          layout.ranks(), " shards");
    }
    if (mode == full_grads_reduction::reduce_scatter &&
        layout.ranks() != static_cast<std::size_t>(comm.size())) {
      detail::raise("full_grads: a reduce-scatter layout of ", layout.ranks(),
                    " shards over a communicator of ", comm.size(), " ranks");
    }
    pieces_ = layout.pieces(mode == full_grads_reduction::all_reduce ? 0 : shard_index);
    [[maybe_unused]] auto on_stream = ops_.scope();
    // The optimizer reads the slices of pieces_: the first of them is staggered within a page
    // (core/memory.hpp), apart from the other buffers the fused step streams through.
    grads_ = buffer<Grad, memory_space>(layout.padded_numel(), ledger_, memory_category::grads,
                                        pieces_.empty() ? 0 : pieces_.front().full_offset);
  }

  full_grads(const full_grads&) = delete;
  full_grads& operator=(const full_grads&) = delete;
  ~full_grads() {
    try {
      ops_.synchronize();
    } catch (...) {  // a failed device is reported by the calls that use it
    }
  }

  //! Raises invalid_argument unless `g` can be parameter i's gradient (see
  //! param_registry::check_gradient).
  void check(std::size_t i, const any_tensor_view& g, const char* who = "full_grads::add") const {
    reg_->check_gradient(i, g, memory_kind_of<memory_space>, who);
  }

  //! Parameter i's gradient (fp32, bf16 or fp16, in this memory space): copied into the buffer
  //! the first time in a step, added after (micro-batches).
  //! `who` names the caller in messages.
  template <tensor G>
  void add(std::size_t i, const G& grad, const char* who = "full_grads::add") {
    add(i, erase(grad), who);
  }
  void add(std::size_t i, const any_tensor_view& g, const char* who = "full_grads::add") {
    check(i, g, who);
    const auto& p = layout_->param(i);
    if (p.numel == 0) return;
    Grad* dst = grads_.data() + p.offset;
    if (!seen_[i]) {
      ops_.convert_in(g.data, g.type, dst, p.numel);
      seen_[i] = 1;
    } else {
      ops_.accumulate_in(g.data, g.type, dst, p.numel);
    }
  }

  //! The buffer of parameter i, to write its gradient in place (counts as handed over).
  tensor_view<Grad, memory_space> view(std::size_t i) {
    reg_->check_param(i, "full_grads::view");
    const auto& p = layout_->param(i);
    seen_[i] = 1;
    return {grads_.data() + p.offset, p.numel};
  }

  //! Collective over the communicator: the step's reduction (see the file comment).
  void reduce() {
    if (mode_ == full_grads_reduction::all_reduce) {
      // The whole buffer: with an aligned layout the groups are padded, and a later group's
      // elements lie past Ψ (the padding is zero on every rank, so its sum stays zero).
      const std::size_t n = layout_->padded_numel();
      if (comm_->size() > 1 && n != 0) {
        ops_.before_collective();
        comm_->all_reduce(grads_.data(), grads_.data(), n, reduce_op::sum);
        if (log_) log_->record(*comm_, collective::all_reduce, n, sizeof(Grad), 0);
      }
      return;
    }
    std::vector<typename Comm::work_type> works;
    ops_.before_collective();
    for (std::size_t g = 0; g < layout_->num_groups(); ++g) {
      const auto& ge = layout_->group(g);
      if (ge.shard == 0) continue;
      Grad* base = grads_.data() + ge.offset;
      works.push_back(comm_->reduce_scatter_async(base, base + shard_index_ * ge.shard, ge.shard,
                                                  reduce_op::sum));
      if (log_) log_->record(*comm_, collective::reduce_scatter, ge.shard, sizeof(Grad), g);
    }
    for (auto& w : works) ops_.finish(w);
  }

  //! Hybrid sharding: all-reduces this rank's reduced slices across the replicas (collective
  //! over `replicas`).
  void reduce_replicas(Comm& replicas) {
    if (replicas.size() == 1) return;
    ops_.before_collective();
    for (std::size_t g = 0; g < layout_->num_groups(); ++g) {
      const auto& ge = layout_->group(g);
      if (ge.shard == 0) continue;
      Grad* p = grads_.data() + ge.offset + shard_index_ * ge.shard;
      replicas.all_reduce(p, p, ge.shard, reduce_op::sum);
      if (log_) log_->record(replicas, collective::all_reduce, ge.shard, sizeof(Grad), g);
    }
  }

  //! The gradient buffer, in full coordinates.
  flat_span<const Grad, memory_space> gradients() const noexcept {
    return flat_span<const Grad, memory_space>::full(grads_.data(), grads_.size());
  }

  //! Calls f(const Grad*, count) for every run of true elements this rank accounts for after
  //! reduce(): its chunk of the all-reduced gradient (all_reduce; chunks of comm/volume.hpp) or
  //! its own slices (reduce_scatter), so that over all ranks every element is visited once.
  template <class F>
  void for_each_owned(F&& f) const {
    if (mode_ == full_grads_reduction::all_reduce) {
      // This rank's chunk of the buffer (comm/volume.hpp), true elements only.
      const std::size_t n = layout_->padded_numel(), N = static_cast<std::size_t>(comm_->size());
      const std::size_t r = static_cast<std::size_t>(comm_->rank());
      const std::size_t lo = chunk_begin(n, N, r), hi = lo + chunk_size(n, N, r);
      for (const auto& pc : pieces_) {
        const std::size_t b = std::max(lo, pc.full_offset);
        const std::size_t e = std::min(hi, pc.full_offset + pc.count);
        if (b < e) f(grads_.data() + b, e - b);
      }
      return;
    }
    for (const auto& pc : layout_->pieces(shard_index_))
      f(grads_.data() + pc.full_offset, pc.count);
  }

  //! Zeroes the buffer for the next step.
  void reset() {
    {
      [[maybe_unused]] auto on_stream = ops_.scope();
      grads_.zero();
    }
    std::fill(seen_.begin(), seen_.end(), 0);
  }

  const flat_layout& layout() const noexcept { return *layout_; }
  const memory_ledger& memory() const noexcept { return *ledger_; }

 private:
  Comm* comm_;
  const flat_layout* layout_;
  const param_registry* reg_;
  std::size_t shard_index_;
  full_grads_reduction mode_;
  memory_ledger own_ledger_;
  memory_ledger* ledger_;
  collective_log* log_;
  space_ops<memory_space> ops_;
  buffer<Grad, memory_space> grads_;
  std::vector<unsigned char> seen_;
  std::vector<flat_layout::piece> pieces_;  // this rank's (all of them in all-reduce mode)
};

SHARDKIT_NAMESPACE_END
