//! \file zero/shard_params.hpp
//! `shard_params`: ZeRO-3's parameter sharding, usable on its own. A rank keeps only its shard
//! of the working parameters (S elements); each *unit* (a group of the layout: one layer or
//! block) is gathered to its full size around its use and released after. The unit state
//! machine:
//!
//!     released --issue--> inflight --wait--> ready --pre_*--> forward/backward --post_*-->
//!     released (or ready: persistent units, and units kept from forward to backward)
//!
//!  - pre_forward(u) / pre_backward(u): gathers u if it is not gathered (or waits for its
//!    prefetch), then issues the all-gathers of the next `prefetch` units in the order the
//!    hooks were called in the previous step (the declared order, backward reversed, in the
//!    first step), as far as `max_live_elems` allows;
//!  - post_forward(u) / post_backward(u): releases u, unless it persists (fewer elements than
//!    `persist_below`: gathered for the whole step) or was declared with
//!    reshard_after_forward = false (kept from its forward to its backward);
//!  - after_step(applied): releases what is still gathered, regathers the persistent units
//!    from the updated shard, and learns this step's hook order for the next step's prefetch.
//! Between pre_* and post_* view(i) is a view into the unit's gathered buffer. The gradients
//! are someone else's business (shard_grads::begin_group / end_group in the engine).
//!
//! A user's own loop (its own optimizer on the shard):
//!
//!     shardkit::flat_layout layout(numels, registry.unit_starts(), comm.size());
//!     shardkit::shard_params<shardkit::thread_comm, float> params(comm, layout, comm.rank(),
//!                                                                 registry);
//!     for (i ...) params.load(i, initial[i].data(), shardkit::dtype::f32);
//!     params.start();                                      // gathers persistent units
//!     for (u ...) { params.pre_forward(u); forward(params.view(...)); params.post_forward(u); }
//!     ...                                                  // backward alike, in reverse
//!     my_sgd(params.working());                            // step the shard (shard coords)
//!     params.after_step(true);
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
#include <shardkit/zero/accounting.hpp>
#include <shardkit/zero/collective_log.hpp>
#include <shardkit/zero/registry.hpp>
#include <shardkit/zero/space_ops.hpp>
#include <shardkit/zero/trace.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Settings of shard_params.
struct shard_params_options {
  //! Units gathered ahead of use (0 = gather on demand only).
  std::size_t prefetch = 1;
  //! Units with fewer elements than this stay gathered for the whole step.
  std::size_t persist_below = 0;
  //! Most gathered parameter elements held at once (0 = no limit beyond the schedule's own
  //! bound). Prefetching stops short of it; a configuration whose largest unit plus the
  //! persistent units exceeds it is rejected at construction.
  std::size_t max_live_elems = 0;
  //! Record a timeline of gathers, waits and hooks (trace()).
  bool trace = false;
  //! Host memory: keep the buffer of a released unit for the next gather of a unit of the same
  //! padded size, instead of freeing it and allocating a fresh one. malloc hands a freed
  //! buffer of megabytes back to the kernel (mmap'ed, or trimmed from a thread's heap), so a
  //! fresh one faults in page by page, and the kernel clears every page: on a ZeRO-3 step of
  //! 134M parameters on 4 thread ranks that was most of the step (benchmarks/README.md).
  //! Kept buffers stay counted as gathered_params (spare_elems() says how many of its elements
  //! are kept rather than gathered); together with the gathered units they never exceed the
  //! schedule's window (1 + prefetch transient units) or max_live_elems, so the live bound
  //! holds for what is held. They are freed after the last unit of the backward order, and by
  //! release_transient() and after_step(), so outside a forward and backward only the
  //! persistent units are held, as without reuse. Device memory always frees (its
  //! stream-ordered allocator reuses memory without faults, and a buffer may still be read by
  //! compute queued on another stream).
  bool reuse_buffers = true;
  //! Host memory, with reuse_buffers: the buffers kept at the end of a backward stay kept
  //! through the optimizer step for the next step's first gathers, instead of being freed
  //! after the last unit of the backward order and by release_transient() and after_step().
  //! A step then allocates no gathered buffer (each fresh one costs its page faults, on every
  //! step: benchmarks/README.md measures it). What is held never exceeds the same bound (the
  //! peak is what a forward holds), but outside a forward and backward it is up to the window
  //! (1 + prefetch buffers of the released units' size) besides the persistent units, counted
  //! as gathered_params (spare_elems()), rather than the persistent units alone. free_kept()
  //! frees them on demand.
  bool keep_buffers_between_steps = false;
};

template <communicator Comm, float_storage Working>
class shard_params {
 public:
  using memory_space = typename Comm::memory_space;
  using working_type = Working;
  using work_type = typename Comm::work_type;

  //! The units are the groups of `layout` (sharded over `comm`, this rank owning shard
  //! `shard_index`), the parameters those of `reg`. `comm`, `layout` and `reg` must outlive the
  //! component; `ledger` and `log` may be null. Not collective: start() is.
  shard_params(Comm& comm, const flat_layout& layout, std::size_t shard_index,
               const param_registry& reg, shard_params_options opts = {},
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
        trace_(opts.trace),
        units_(layout.num_groups()) {
    if (layout.num_groups() != reg.num_units()) {
      detail::raise("shard_params: the layout has ", layout.num_groups(),
                    " groups but the model declares ", reg.num_units(),
                    " units (ZeRO-3 gathers one unit per group)");
    }
    if (layout.ranks() != static_cast<std::size_t>(comm.size()) || shard_index >= layout.ranks()) {
      detail::raise("shard_params: shard ", shard_index, " of a layout of ", layout.ranks(),
                    " shards over a communicator of ", comm.size(), " ranks");
    }
    std::uint64_t persistent_elems = 0, largest = 0;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      units_[u].reshard_after_forward = reg.options_of_unit(u).reshard_after_forward;
      units_[u].persistent = layout.group(u).numel < opts.persist_below;
      if (units_[u].persistent)
        persistent_elems += padded(u);
      else
        largest = std::max(largest, padded(u));
    }
    if (opts.max_live_elems != 0 && largest + persistent_elems > opts.max_live_elems) {
      std::size_t big = 0;
      while (units_[big].persistent || padded(big) != largest) ++big;
      detail::raise("shard_params: max_live_elems = ", opts.max_live_elems, " cannot hold unit '",
                    reg.unit_name(big), "' (", largest,
                    " elements gathered, padded to N·S_u) plus the persistent units (",
                    persistent_elems,
                    " elements); raise the limit, split the unit, or lower persist_below");
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
      forward_order_.push_back(u);
      backward_order_.push_back(units_.size() - 1 - u);
    }
    [[maybe_unused]] auto on_stream = ops_.scope();
    shard_ = buffer<Working, memory_space>(layout.shard_numel(), ledger_,
                                           memory_category::working_params);
  }

  shard_params(const shard_params&) = delete;
  shard_params& operator=(const shard_params&) = delete;
  ~shard_params() {
    drain();
    try {
      ops_.synchronize();
    } catch (...) {  // a failed device is reported by the calls that use it
    }
  }

  //! Sets this rank's pieces of parameter i from `values` (the whole parameter, host memory,
  //! fp32/bf16/fp16 of dtype t).
  void load(std::size_t i, const void* values, dtype t) { load(i, 0, reg_->numel(i), values, t); }
  //! As above for elements [offset, offset + count) of parameter i only (`values` holds those
  //! count elements): this rank keeps what it owns of them.
  void load(std::size_t i, std::size_t offset, std::size_t count, const void* values, dtype t) {
    reg_->check_range(i, offset, count, "shard_params::load");
    for (const auto& pc : layout_->pieces_of(i)) {
      if (static_cast<std::size_t>(pc.rank) != shard_index_) continue;
      const std::size_t b = std::max(offset, pc.param_offset);
      const std::size_t e = std::min(offset + count, pc.param_offset + pc.count);
      if (b >= e) continue;
      const auto* from = static_cast<const std::byte*>(values) + (b - offset) * size_of(t);
      ops_.upload(from, t, shard_.data() + pc.shard_offset + (b - pc.param_offset), e - b);
    }
  }

  //! Collective: gathers the persistent units (call once after loading, before the first hook).
  void start() {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].persistent) issue_gather(u, false);
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].persistent) finish_gather(u, false);
    }
  }

  //! Before unit u's forward: its full parameters are gathered when this returns, and the next
  //! units' gathers are issued.
  void pre_forward(std::size_t u) { pre_hook(u, false); }
  //! After unit u's forward: releases it (unless it persists or is kept for backward).
  void post_forward(std::size_t u) {
    post_hook(u, false, [] {});
  }
  //! Before unit u's backward: gathers it again (if released) and prefetches the units whose
  //! backward comes next.
  void pre_backward(std::size_t u) { pre_hook(u, true); }
  //! After unit u's backward: releases it (unless it persists).
  void post_backward(std::size_t u) {
    post_hook(u, true, [] {});
  }
  //! As above, calling `before_release()` after the hook's checks and before the release: where
  //! a caller hands the unit's gradients on (the engine issues their reduce-scatter there).
  template <class F>
  void post_backward(std::size_t u, F&& before_release) {
    post_hook(u, true, before_release);
  }

  //! True between pre_backward(u) and post_backward(u).
  bool in_backward(std::size_t u) const { return units_.at(u).st == state::backward; }
  //! True between pre_forward(u) and post_forward(u).
  bool in_forward(std::size_t u) const { return units_.at(u).st == state::forward; }

  //! Parameter i, a view into its unit's gathered buffer: usage_error unless the unit is
  //! gathered (between its pre_* and post_* hooks, or persistent, or kept).
  tensor_view<Working, memory_space> view(std::size_t i, const char* who = "shard_params::view") {
    reg_->check_param(i, who);
    const std::size_t u = reg_->unit_of(i);
    auto& x = units_[u];
    if (x.st == state::released || x.st == state::inflight) {
      detail::raise<usage_error>(who, "(", i, "): parameter '", reg_->name(i),
                                 "' belongs to unit '", reg_->unit_name(u),
                                 "', which is not gathered (ZeRO-3: use it between pre_forward(", u,
                                 ")/post_forward or pre_backward/post_backward)");
    }
    const auto& p = layout_->param(i);
    return {x.gathered.data() + p.group_offset, p.numel};
  }

  tensor_view<const Working, memory_space> view(std::size_t i,
                                                const char* who = "shard_params::view") const {
    return const_cast<shard_params*>(this)->view(i, who);
  }

  //! This rank's shard of the working parameters (shard coordinates): what the optimizer
  //! writes into.
  flat_span<Working, memory_space> working() noexcept {
    return flat_span<Working, memory_space>::shard(shard_.data(), shard_.size());
  }
  tensor_view<const Working, memory_space> shard() const noexcept {
    return {shard_.data(), shard_.size()};
  }

  //! Raises usage_error naming a unit that is still inside its hooks (before a step).
  void check_idle(const char* who = "shard_params") const {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      const auto& x = units_[u];
      if (x.st == state::forward || x.st == state::backward) {
        const char* phase = x.st == state::forward ? "forward" : "backward";
        detail::raise<usage_error>(who, ": unit '", reg_->unit_name(u), "' is still in its ", phase,
                                   " (call post_", phase, "(", u, ") before the step)");
      }
    }
  }

  //! The step is over. Releases the units that are still gathered but not persistent
  //! (prefetched but unused, or kept); when `applied`, regathers the persistent units from the
  //! updated shard (collective). Then takes this step's hook order as the next step's prefetch
  //! order.
  void after_step(bool applied) {
    release_transient();
    if (applied) {
      for (std::size_t u = 0; u < units_.size(); ++u) {
        if (units_[u].persistent) {
          release(u, false);
          issue_gather(u, false);
        }
      }
      for (std::size_t u = 0; u < units_.size(); ++u) {
        if (units_[u].persistent) finish_gather(u, false);
      }
    }
    if (!seen_forward_.empty()) forward_order_ = seen_forward_;
    if (!seen_backward_.empty()) backward_order_ = seen_backward_;
    seen_forward_.clear();
    seen_backward_.clear();
    forward_cursor_ = backward_cursor_ = 0;
  }

  //! Frees every gathered unit that is not persistent, and the buffers kept for reuse (unless
  //! shard_params_options::keep_buffers_between_steps: then they stay, within the window).
  void release_transient() {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (!units_[u].persistent && units_[u].st != state::released) release(u, false);
    }
    if (!keeps_between_steps()) free_spares();
  }

  //! Frees the buffers kept for reuse now (shard_params_options::keep_buffers_between_steps
  //! keeps them from one step to the next); the next gathers allocate fresh ones.
  void free_kept() { free_spares(); }

  //! Elements of the buffers of released units kept for reuse (shard_params_options::
  //! reuse_buffers): counted as gathered_params, though no unit is gathered in them.
  std::uint64_t spare_elems() const noexcept {
    std::uint64_t e = 0;
    for (const auto& b : spares_) e += b.size();
    return e;
  }

  //! Unit u stays gathered for the whole step; unit u is released after its forward.
  bool persistent(std::size_t u) const { return units_.at(u).persistent; }
  bool reshard_after_forward(std::size_t u) const { return units_.at(u).reshard_after_forward; }

  //! The most gathered elements the schedule may hold at once (zero/accounting.hpp's bound).
  std::uint64_t live_bound_elems() const noexcept {
    std::uint64_t largest = 0, persistent_elems = 0, kept = 0, transient = 0;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].persistent) {
        persistent_elems += padded(u);
      } else {
        ++transient;
        largest = std::max(largest, padded(u));
        if (!units_[u].reshard_after_forward) kept += padded(u);
      }
    }
    return accounting::live_elems_bound(opts_.prefetch, transient, largest, persistent_elems, kept,
                                        opts_.max_live_elems);
  }

  const trace_log& trace() const noexcept { return trace_; }
  trace_log& trace() noexcept { return trace_; }
  const flat_layout& layout() const noexcept { return *layout_; }
  const memory_ledger& memory() const noexcept { return *ledger_; }

  //! Waits for every all-gather in flight, ignoring errors (they reach whoever waits).
  void drain() noexcept {
    for (auto& u : units_) drain_quietly(u.gather);
  }

 private:
  enum class state : std::uint8_t {
    released,  // only the shard exists
    inflight,  // all-gather issued, not yet waited for
    ready,     // gathered, not inside a hook pair
    forward,   // between pre_forward and post_forward
    backward,  // between pre_backward and post_backward
  };
  struct unit {
    buffer<Working, memory_space> gathered;  // G·S_u while gathered or in flight
    std::optional<work_type> gather;
    state st = state::released;
    bool persistent = false;
    bool reshard_after_forward = true;
    bool kept = false;  // gathered since forward, kept for backward
  };
  static void drain_quietly(std::optional<work_type>& w) noexcept {
    if (!w) return;
    try {
      w->wait();
    } catch (...) {  // reported to the collective's other users
    }
    w.reset();
  }

  std::uint64_t padded(std::size_t u) const { return layout_->group(u).padded; }

  std::uint64_t live_elems() const {
    std::uint64_t e = 0;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].st != state::released) e += padded(u);
    }
    return e;
  }
  // Non-persistent, non-kept units currently gathered or in flight.
  std::size_t live_transient() const {
    std::size_t c = 0;
    for (const auto& x : units_) {
      if (!x.persistent && !x.kept && x.st != state::released) ++c;
    }
    return c;
  }

  void issue_gather(std::size_t u, bool backward) {
    auto& x = units_[u];
    const auto& ge = layout_->group(u);
    x.gathered = take_buffer(u, ge.padded);
    x.st = state::inflight;
    if (ge.shard != 0) {
      ops_.before_collective();
      x.gather.emplace(
          comm_->all_gather_async(shard_.data() + ge.shard_offset, x.gathered.data(), ge.shard));
      if (log_) log_->record(*comm_, collective::all_gather, ge.shard, sizeof(Working), u);
    }
    trace_.note(trace_event::kind::gather_issued, u, backward);
  }

  void finish_gather(std::size_t u, bool backward) {
    auto& x = units_[u];
    if (x.st != state::inflight) return;
    if (x.gather) {
      auto w = std::move(*x.gather);
      x.gather.reset();
      ops_.finish(w);
      if constexpr (requires { w.completion_time(); }) {
        trace_.note(trace_event::kind::gather_completed, u, backward, w.completion_time());
      } else {
        trace_.note(trace_event::kind::gather_completed, u, backward);
      }
    } else {
      trace_.note(trace_event::kind::gather_completed, u, backward);
    }
    x.st = state::ready;
  }

  void release(std::size_t u, bool backward) {
    auto& x = units_[u];
    drain_quietly(x.gather);
    x.st = state::released;
    x.kept = false;
    // Kept while the buffers held for transient units (gathered ones and spares) stay within
    // the window; the bytes held do not change.
    if (reusing() && !x.persistent && x.gathered.size() != 0 &&
        live_transient() + spares_.size() < 1 + opts_.prefetch) {
      spares_.push_back(std::move(x.gathered));
    } else {
      [[maybe_unused]] auto on_stream = ops_.scope();  // freed after the compute that used it
      x.gathered.release();
    }
    trace_.note(trace_event::kind::released, u, backward);
  }

  bool reusing() const noexcept {
    return std::is_same_v<memory_space, host_space> && opts_.reuse_buffers;
  }
  bool keeps_between_steps() const noexcept {
    return reusing() && opts_.keep_buffers_between_steps;
  }

  // A buffer of `padded` elements for a gather of unit u: a kept one of that size, or a new one
  // (after freeing the kept ones, so that what is held stays within the window and
  // max_live_elems). A persistent unit is regathered (after_step) into a buffer the size of the
  // one it just released, which the bound counts apart from the window: the kept ones stay.
  buffer<Working, memory_space> take_buffer(std::size_t u, std::size_t padded) {
    for (std::size_t i = 0; i < spares_.size(); ++i) {
      if (spares_[i].size() != padded) continue;
      buffer<Working, memory_space> b = std::move(spares_[i]);
      if (i + 1 != spares_.size()) spares_[i] = std::move(spares_.back());
      spares_.pop_back();
      return b;
    }
    if (!units_[u].persistent) free_spares();
    [[maybe_unused]] auto on_stream = ops_.scope();
    return buffer<Working, memory_space>(padded, ledger_, memory_category::gathered_params);
  }

  void free_spares() {
    if (spares_.empty()) return;
    [[maybe_unused]] auto on_stream = ops_.scope();
    spares_.clear();
  }

  // Issues the gathers of the units that follow u in the previous step's hook order (the
  // declared order in the first step). A cursor follows the order, so units that appear several
  // times (micro-batches) prefetch what came after this occurrence.
  void prefetch_after(std::size_t u, bool backward) {
    const auto& order = backward ? backward_order_ : forward_order_;
    std::size_t& cursor = backward ? backward_cursor_ : forward_cursor_;
    auto pos = order.end();
    if (cursor < order.size())
      pos = std::find(order.begin() + static_cast<std::ptrdiff_t>(cursor), order.end(), u);
    if (pos == order.end()) pos = std::find(order.begin(), order.end(), u);
    if (pos == order.end()) return;
    cursor = static_cast<std::size_t>(pos - order.begin()) + 1;
    if (opts_.prefetch == 0) return;
    std::size_t issued = 0;
    for (auto it = pos + 1; it != order.end() && issued < opts_.prefetch; ++it) {
      const std::size_t v = *it;
      auto& x = units_[v];
      if (x.persistent || x.st != state::released) {
        if (!x.persistent) ++issued;  // already live: counts toward the depth
        continue;
      }
      if (live_transient() >= 1 + opts_.prefetch) break;
      if (opts_.max_live_elems != 0 && live_elems() + padded(v) > opts_.max_live_elems) break;
      issue_gather(v, backward);
      ++issued;
    }
  }

  void pre_hook(std::size_t u, bool backward) {
    const char* hook = backward ? "pre_backward" : "pre_forward";
    reg_->check_unit(u, hook);
    auto& x = units_[u];
    if (x.st == state::forward || x.st == state::backward) {
      const char* phase = x.st == state::forward ? "forward" : "backward";
      detail::raise<usage_error>(hook, "(", u, "): unit '", reg_->unit_name(u),
                                 "' is already in its ", phase, " (gathered twice: call post_",
                                 phase, "(", u, ") first)");
    }
    (backward ? seen_backward_ : seen_forward_).push_back(u);
    if (x.st == state::released) {
      if (opts_.max_live_elems != 0 && live_elems() + padded(u) > opts_.max_live_elems) {
        detail::raise<usage_error>(
            hook, "(", u, "): gathering unit '", reg_->unit_name(u), "' (", padded(u),
            " elements) would exceed max_live_elems = ", opts_.max_live_elems, " with ",
            live_elems(),
            " elements already gathered; call the post_* hooks of finished units "
            "first");
      }
      issue_gather(u, backward);
    }
    finish_gather(u, backward);
    x.st = backward ? state::backward : state::forward;
    if (backward) x.kept = false;
    prefetch_after(u, backward);
    trace_.note(trace_event::kind::compute_started, u, backward);
  }

  template <class F>
  void post_hook(std::size_t u, bool backward, F&& before_release) {
    const char* hook = backward ? "post_backward" : "post_forward";
    reg_->check_unit(u, hook);
    auto& x = units_[u];
    const auto want = backward ? state::backward : state::forward;
    if (x.st != want) {
      detail::raise<usage_error>(hook, "(", u, "): unit '", reg_->unit_name(u), "' is not in its ",
                                 backward ? "backward" : "forward", " (call ",
                                 backward ? "pre_backward" : "pre_forward", "(", u, ") first)");
    }
    trace_.note(trace_event::kind::compute_ended, u, backward);
    before_release();
    if (x.persistent) {
      x.st = state::ready;
    } else if (!backward && !x.reshard_after_forward) {
      x.st = state::ready;
      x.kept = true;
    } else {
      release(u, backward);
    }
    // The last unit of the backward order (the previous step's, or the declared one): no
    // gather follows in this backward, so the kept buffers go now, not at the step (unless
    // they are kept for the next step's first gathers).
    if (backward && backward_cursor_ >= backward_order_.size() && !keeps_between_steps())
      free_spares();
  }

  Comm* comm_;
  const flat_layout* layout_;
  const param_registry* reg_;
  std::size_t shard_index_;
  shard_params_options opts_;
  memory_ledger own_ledger_;
  memory_ledger* ledger_;
  collective_log* log_;
  space_ops<memory_space> ops_;
  trace_log trace_;
  buffer<Working, memory_space> shard_;
  std::vector<unit> units_;
  std::vector<buffer<Working, memory_space>> spares_;        // released units' buffers, for reuse
  std::vector<std::size_t> forward_order_, backward_order_;  // prefetch order (last step's)
  std::vector<std::size_t> seen_forward_, seen_backward_;    // this step's hook order
  std::size_t forward_cursor_ = 0, backward_cursor_ = 0;     // position in the orders
};

SHARDKIT_NAMESPACE_END
