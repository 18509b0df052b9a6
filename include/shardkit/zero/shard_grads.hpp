//! \file zero/shard_grads.hpp
//! `shard_grads`: ZeRO-2's gradient sharding, usable on its own. It owns this rank's gradient
//! shard (S elements) and `grad_buffers` staging buffers of one group (bucket or unit) each. A
//! gradient handed over is copied into its group's staging buffer; when every parameter of the
//! group has one, the group's reduce-scatter is issued at once, asynchronously, into the shard
//! (so communication overlaps the rest of the backward). Later micro-batches of the same step
//! reduce-scatter into a scratch slice that is added to the shard when it completes. finish()
//! waits for everything and names the parameters whose gradients never came.
//!
//! The gradient type `Grad` is the component's own: bf16 working parameters with fp32 gradients
//! reduced in fp32 on the wire are `shard_grads<Comm, float>`.
//!
//!     shardkit::flat_layout layout = shardkit::flat_layout::bucketed(numels, comm.size(), 1 <<
//!     20); shardkit::shard_grads<shardkit::thread_comm, shardkit::bf16> grads(comm, layout,
//!                                                                     comm.rank(), registry);
//!     for (each gradient as backward produces it) grads.add(i, grad);   // buckets launch
//!     grads.finish();                  // every bucket reduced; names missing gradients
//!     opt.step(grads.gradients(), working, 1.0f / comm.size());         // shard coordinates
//!     grads.reset();
//!
//! For ZeRO-3, begin_group(u)/end_group(u) bracket a unit's backward: end_group requires every
//! gradient of the unit since begin_group and issues its reduce-scatter.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/flat_span.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/zero/collective_log.hpp>
#include <shardkit/zero/registry.hpp>
#include <shardkit/zero/space_ops.hpp>
#include <shardkit/zero/trace.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Settings of shard_grads.
struct shard_grads_options {
  //! Staging buffers of one group each. 1 keeps a rank at its gradient shard plus one group of
  //! full gradients; 2 lets one group fill while another is being reduced.
  std::size_t grad_buffers = 1;
  //! Treat parameters that received no gradient in a step as zero instead of raising
  //! usage_error at finish() / end_group().
  bool allow_missing_grads = false;
  //! Where to note each group's reduce-scatter (trace_event::grads_reduced); may be null.
  trace_log* trace = nullptr;
  //! The groups are the model's units (ZeRO-3): messages name them as units, not buckets.
  bool groups_are_units = false;
};

template <communicator Comm, float_storage Grad>
class shard_grads {
 public:
  using memory_space = typename Comm::memory_space;
  using grad_type = Grad;
  using work_type = typename Comm::work_type;

  //! Gradients of the parameters of `reg` in the groups of `layout` (sharded over `comm`), this
  //! rank owning shard `shard_index`. `comm`, `layout` and `reg` must outlive the component;
  //! `ledger` and `log` may be null.
  shard_grads(Comm& comm, const flat_layout& layout, std::size_t shard_index,
              const param_registry& reg, shard_grads_options opts = {},
              memory_ledger* ledger = nullptr, collective_log* log = nullptr,
              space_ops<memory_space> ops = space_ops<memory_space>())
      : comm_(&comm),
        layout_(&layout),
        reg_(&reg),
        shard_index_(shard_index),
        opts_(opts),
        ledger_(ledger != nullptr ? ledger : &own_ledger_),
        log_(log),
        ops_(std::move(ops)),
        seen_(reg.size(), 0),
        groups_(layout.num_groups()) {
    if (opts.grad_buffers == 0) {
      detail::raise("shard_grads: grad_buffers must be at least 1, got 0");
    }
    if (layout.num_params() != reg.size()) {
      detail::raise("shard_grads: the layout has ", layout.num_params(),
                    " parameters, the registry ", reg.size());
    }
    if (layout.ranks() != static_cast<std::size_t>(comm.size()) || shard_index >= layout.ranks()) {
      detail::raise("shard_grads: shard ", shard_index, " of a layout of ", layout.ranks(),
                    " shards over a communicator of ", comm.size(), " ranks");
    }
    std::size_t largest = 0;
    for (const auto& g : layout.groups()) largest = std::max(largest, g.padded);
    for (std::size_t g = 0; g < layout.num_groups(); ++g) {
      const auto& ge = layout.group(g);
      for (std::size_t i = ge.first_param; i < ge.end_param; ++i) {
        if (layout.param(i).numel != 0) ++groups_[g].expected;
      }
    }
    pieces_ = layout.pieces(shard_index);
    [[maybe_unused]] auto on_stream = ops_.scope();
    shard_ = buffer<Grad, memory_space>(layout.shard_numel(), ledger_, memory_category::grads);
    slots_.resize(opts.grad_buffers);
    for (auto& sl : slots_) {
      sl.full = buffer<Grad, memory_space>(largest, ledger_, memory_category::grad_buckets);
    }
  }

  shard_grads(const shard_grads&) = delete;
  shard_grads& operator=(const shard_grads&) = delete;
  ~shard_grads() {
    drain();
    try {
      ops_.synchronize();
    } catch (...) {  // a failed device is reported by the calls that use it
    }
  }

  //! Raises invalid_argument unless `g` can be parameter i's gradient.
  void check(std::size_t i, const any_tensor_view& g, const char* who = "shard_grads::add") const {
    reg_->check_gradient(i, g, memory_kind_of<memory_space>, who);
  }

  //! Parameter i's gradient (fp32, bf16 or fp16, in this memory space). The first gradient of a
  //! parameter in a round is copied, later ones added. Returns true when it completed its group
  //! and the group's reduce-scatter was issued.
  //! `who` names the caller in messages.
  template <tensor G>
  bool add(std::size_t i, const G& grad, const char* who = "shard_grads::add") {
    return add(i, erase(grad), who);
  }
  bool add(std::size_t i, const any_tensor_view& g, const char* who = "shard_grads::add") {
    check(i, g, who);
    const auto& p = layout_->param(i);
    if (p.numel == 0) return false;
    auto& b = groups_[p.group];
    if (b.slot < 0) open(p.group, i, who);
    Grad* dst = slots_[static_cast<std::size_t>(b.slot)].full.data() + p.group_offset;
    if (!seen_[i]) {
      ops_.convert_in(g.data, g.type, dst, p.numel);
      seen_[i] = 1;
      if (++b.reported == b.expected) {
        launch(p.group);
        return true;
      }
    } else {
      ops_.accumulate_in(g.data, g.type, dst, p.numel);
    }
    return false;
  }

  //! ZeRO-3: unit g's backward begins.
  void begin_group(std::size_t g) { groups_.at(g).rounds_at_begin = groups_.at(g).rounds; }

  //! ZeRO-3: unit g's backward has ended. Every gradient of the unit must have come since
  //! begin_group(g) (usage_error naming the missing ones, unless allow_missing_grads); the
  //! group's reduce-scatter is issued if the last gradient did not issue it already. Returns
  //! true when it issued one.
  bool end_group(std::size_t g, const char* who = "shard_grads::end_group") {
    auto& b = groups_.at(g);
    if (b.expected == 0 || (b.slot < 0 && b.rounds != b.rounds_at_begin)) return false;
    if (!opts_.allow_missing_grads) {
      std::size_t listed = 0;
      const std::string missing = missing_in(g, listed);
      detail::raise<usage_error>(who, ": ", label(g),
                                 " finished its backward without the gradients of ", missing,
                                 listed == 8 ? ", ..." : "",
                                 " (hand every gradient of it over before its backward ends, or "
                                 "set allow_missing_grads)");
    }
    if (b.slot < 0) open(g, layout_->group(g).first_param, who);
    launch(g);
    return true;
  }

  //! Issues group g's reduce-scatter now, with whatever it holds (missing gradients count as
  //! zero): for allow_missing_grads.
  void flush(std::size_t g, const char* who = "shard_grads::flush") {
    auto& b = groups_.at(g);
    if (b.slot < 0) open(g, layout_->group(g).first_param, who);
    launch(g);
  }

  //! The step's end of communication: every group must have been reduced at least once in this
  //! step and none may be half full (usage_error naming the missing gradients, unless
  //! allow_missing_grads, which issues them as they are); then waits for every reduce-scatter
  //! and adds the micro-batch scratch into the shard. `who` names the caller in messages.
  void finish(const char* who = "shard_grads::finish") {
    std::string missing;
    std::size_t listed = 0;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      auto& b = groups_[g];
      const bool incomplete = b.slot >= 0 || (b.rounds == 0 && b.expected > 0);
      if (!incomplete) continue;
      if (opts_.allow_missing_grads) {
        flush(g, who);
        continue;
      }
      const std::string m = missing_in(g, listed);
      if (!m.empty()) missing += (missing.empty() ? "" : ", ") + m;
    }
    if (!missing.empty()) {
      detail::raise<usage_error>(who,
                                 " needs the gradient of every parameter before the step "
                                 "(grad_ready, or shard_grads::add); missing: ",
                                 missing, listed == 8 ? ", ..." : "",
                                 " (set allow_missing_grads to treat them as zero)");
    }
    // In issue order: later micro-batches add into the shard after the earlier ones, whatever
    // staging buffer they went through (16-bit sums depend on the order).
    while (!inflight_.empty()) complete(slots_[inflight_.front()]);
  }

  //! Hybrid sharding: all-reduces the shard across the replicas (collective over `replicas`).
  void reduce_replicas(Comm& replicas) {
    if (replicas.size() == 1 || shard_.size() == 0) return;
    ops_.before_collective();
    replicas.all_reduce(shard_.data(), shard_.data(), shard_.size(), reduce_op::sum);
    if (log_) log_->record(replicas, collective::all_reduce, shard_.size(), sizeof(Grad), 0);
  }

  //! The reduced gradient shard, in shard coordinates (valid after finish()).
  flat_span<const Grad, memory_space> gradients() const noexcept {
    return flat_span<const Grad, memory_space>::shard(shard_.data(), shard_.size());
  }

  //! Calls f(const Grad*, count) for every run of true elements of this rank's shard.
  template <class F>
  void for_each_owned(F&& f) const {
    for (const auto& pc : layout_->pieces(shard_index_))
      f(shard_.data() + pc.shard_offset, pc.count);
  }

  //! Reduce-scatters of group g issued in this step.
  std::size_t rounds(std::size_t g) const { return groups_.at(g).rounds; }
  //! Parameters of group g that have elements (0: the group needs no gradient).
  std::size_t expected(std::size_t g) const { return groups_.at(g).expected; }

  //! Zeroes the shard and forgets the step's gradients (waits for any reduce-scatter in flight).
  void reset() {
    {
      [[maybe_unused]] auto on_stream = ops_.scope();
      shard_.zero();
    }
    std::fill(seen_.begin(), seen_.end(), 0);
    for (auto& sl : slots_) {
      drain_quietly(sl.work);
      sl.filling = false;
      sl.accumulate = false;
    }
    inflight_.clear();
    for (auto& b : groups_) {
      b.rounds = 0;
      b.reported = 0;
      b.slot = -1;
    }
  }

  //! Waits for every reduce-scatter in flight, ignoring errors (they reach whoever waits).
  void drain() noexcept {
    for (auto& sl : slots_) drain_quietly(sl.work);
  }

  const flat_layout& layout() const noexcept { return *layout_; }
  const memory_ledger& memory() const noexcept { return *ledger_; }

 private:
  struct group_state {
    std::size_t expected = 0;         // parameters with elements
    std::size_t reported = 0;         // of them, handed over in the current round
    std::size_t rounds = 0;           // reduce-scatters issued in this step
    std::size_t rounds_at_begin = 0;  // at begin_group
    int slot = -1;                    // staging slot while filling
  };
  struct slot {
    buffer<Grad, memory_space> full;
    buffer<Grad, memory_space> scratch;  // reduce-scatter target of later micro-batches
    std::optional<work_type> work;
    std::size_t group = 0;
    bool filling = false;
    bool accumulate = false;
  };

  static void drain_quietly(std::optional<work_type>& w) noexcept {
    if (!w) return;
    try {
      w->wait();
    } catch (...) {  // reported to the collective's other users
    }
    w.reset();
  }

  // "unit 'name'" when the groups are units, else "bucket g".
  std::string label(std::size_t g) const {
    if (opts_.groups_are_units && g < reg_->num_units()) return "unit '" + reg_->unit_name(g) + "'";
    return "bucket " + std::to_string(g);
  }
  const char* group_word() const { return opts_.groups_are_units ? "unit" : "bucket"; }

  void open(std::size_t g, std::size_t param, const char* who) {
    slot* sl = nullptr;
    for (auto& c : slots_) {
      if (!c.filling && !c.work) {
        sl = &c;
        break;
      }
    }
    if (sl == nullptr && !inflight_.empty()) {
      sl = &slots_[inflight_.front()];
      complete(*sl);
    }
    if (sl == nullptr) {
      std::string open;
      for (const auto& c : slots_) open += (open.empty() ? "" : ", ") + std::to_string(c.group);
      const char* word = group_word();
      detail::raise<usage_error>(who, ": the gradient of parameter '", reg_->name(param),
                                 "' belongs to ", word, " ", g, ", but all ", slots_.size(),
                                 " staging buffer(s) hold incomplete ", word, "(s) {", open,
                                 "}. Hand gradients over ", word, " by ", word,
                                 " (the last parameters first), raise grad_buffers, or make "
                                 "buckets larger");
    }
    const auto& ge = layout_->group(g);
    if (opts_.allow_missing_grads) {
      ops_.fill_zero(sl->full.data(), ge.padded);
    } else if (ge.padded > ge.numel) {
      ops_.fill_zero(sl->full.data() + ge.numel, ge.padded - ge.numel);
    }
    sl->filling = true;
    sl->group = g;
    groups_[g].slot = static_cast<int>(sl - slots_.data());
    groups_[g].reported = 0;
  }

  void launch(std::size_t g) {
    auto& b = groups_[g];
    const std::size_t idx = static_cast<std::size_t>(b.slot);
    auto& sl = slots_[idx];
    const auto& ge = layout_->group(g);
    Grad* target = shard_.data() + ge.shard_offset;
    sl.accumulate = b.rounds > 0;
    if (sl.accumulate) {
      if (sl.scratch.size() < ge.shard) {
        std::size_t largest = 0;
        for (const auto& x : layout_->groups()) largest = std::max(largest, x.shard);
        [[maybe_unused]] auto on_stream = ops_.scope();
        sl.scratch = buffer<Grad, memory_space>(largest, ledger_, memory_category::comm_scratch);
      }
      target = sl.scratch.data();
    }
    ops_.before_collective();
    sl.work.emplace(comm_->reduce_scatter_async(sl.full.data(), target, ge.shard, reduce_op::sum));
    if (log_) log_->record(*comm_, collective::reduce_scatter, ge.shard, sizeof(Grad), g);
    if (opts_.trace != nullptr) opts_.trace->note(trace_event::kind::grads_reduced, g, true);
    sl.filling = false;
    inflight_.push_back(idx);
    ++b.rounds;
    b.reported = 0;
    b.slot = -1;
    for (std::size_t i = ge.first_param; i < ge.end_param; ++i) seen_[i] = 0;
  }

  void complete(slot& sl) {
    if (!sl.work) return;
    auto w = std::move(*sl.work);
    sl.work.reset();
    std::erase(inflight_, static_cast<std::size_t>(&sl - slots_.data()));
    ops_.finish(w);  // device: later compute-stream work waits, the host does not
    if (sl.accumulate) {
      const auto& ge = layout_->group(sl.group);
      ops_.accumulate(sl.scratch.data(), shard_.data() + ge.shard_offset, ge.shard);
      sl.accumulate = false;
    }
  }

  // Names up to 8 parameters of group g that have no gradient in the current round.
  std::string missing_in(std::size_t g, std::size_t& listed) const {
    std::string missing;
    const auto& ge = layout_->group(g);
    for (std::size_t i = ge.first_param; i < ge.end_param && listed < 8; ++i) {
      if (!seen_[i] && layout_->param(i).numel != 0) {
        missing += (missing.empty() ? "'" : ", '") + reg_->name(i) + "'";
        ++listed;
      }
    }
    return missing;
  }

  Comm* comm_;
  const flat_layout* layout_;
  const param_registry* reg_;
  std::size_t shard_index_;
  shard_grads_options opts_;
  memory_ledger own_ledger_;
  memory_ledger* ledger_;
  collective_log* log_;
  space_ops<memory_space> ops_;
  std::vector<unsigned char> seen_;
  std::vector<group_state> groups_;
  buffer<Grad, memory_space> shard_;
  std::vector<slot> slots_;
  std::vector<std::size_t> inflight_;       // slots with a reduce-scatter, in issue order
  std::vector<flat_layout::piece> pieces_;  // this rank's
};

SHARDKIT_NAMESPACE_END
