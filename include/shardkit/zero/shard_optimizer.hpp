//! \file zero/shard_optimizer.hpp
//! `shard_optimizer`: ZeRO-1, the sharded optimizer, usable on its own. It owns the fp32 master
//! values (16-bit training) and the optimizer state of one rank's shard of a flat layout, steps
//! them from a gradient buffer the caller provides (reduced by shardkit's gradient components or
//! by the caller's own collective), and writes the rounded working parameters.
//!
//! A training loop that reduces its own gradients (any all-reduce; here the communicator's):
//!
//!     shardkit::flat_layout layout(numels, {}, comm.size());         // one group, N shards
//!     shardkit::shard_optimizer<shardkit::host_space, shardkit::adamw, shardkit::bf16> opt(
//!         layout, comm.rank(), param_groups_of_each_param, {shardkit::adam_options{.lr = 1e-3f}});
//!     for (std::size_t i = 0; i < numels.size(); ++i) opt.load(i, initial[i]);
//!     // each step: grads and working are full buffers of layout.padded_numel() elements
//!     comm.all_reduce(grads.data(), grads.data(), grads.size(), shardkit::reduce_op::sum);
//!     opt.step(shardkit::flat_span<const bf16>::full(grads.data(), grads.size()),
//!              shardkit::flat_span<bf16>::full(working.data(), working.size()), 1.0f / N);
//!     // this rank's slices of `working` are updated: all-gather them (in place)
//!
//! The optimizer steps only the true elements of its shard (padding is never touched). Stage 0
//! is the same class over a 1-way layout (shard 0 of flat_layout(numels, {}, 1)). The state is
//! exposed by element range for checkpoints: pieces() maps this rank's shard to parameters,
//! master() and state(s) are the shard's values in that order.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/flat_span.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/kernels/math.hpp>
#include <shardkit/zero/space_ops.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Optimizer options per parameter group (model_spec::add's param_group indexes them).
template <class Options>
struct param_groups {
  explicit param_groups(std::vector<Options> per_group) : options(std::move(per_group)) {}
  std::vector<Options> options;
};

//! Raises invalid_argument naming `who` and the group unless every group's options are valid:
//! at least one group, a finite non-negative learning rate, and the optimizer's own
//! Opt::validate (kernels/math.hpp) where it has one.
template <optimizer_policy Opt>
void validate_optimizer_groups(std::span<const typename Opt::options> groups, const char* who) {
  if (groups.empty()) detail::raise(who, ": at least one set of optimizer options is needed");
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& o = groups[g];
    if (!std::isfinite(o.lr) || o.lr < 0.0f) {
      detail::raise(who, ": learning rate of parameter group ", g,
                    " must be finite and non-negative, got ", o.lr);
    }
    if constexpr (requires { Opt::validate(o); }) {
      try {
        Opt::validate(o);
      } catch (const invalid_argument& e) {
        detail::raise(who, ": ", e.what(), " (parameter group ", g, ")");
      }
    }
  }
}

template <memory_space Space, optimizer_policy Opt, float_storage Working = bf16,
          float_storage Grad = Working>
class shard_optimizer {
  static_assert(space_ops<Space>::available,
                "shardkit::shard_optimizer: no operations for this memory space; for device "
                "memory include <shardkit/zero/space_ops_cuda.cuh> in a CUDA translation unit");

 public:
  using options_type = typename Opt::options;
  using memory_space = Space;
  //! A separate fp32 master copy exists when the working parameters are 16-bit.
  static constexpr bool has_master = !std::is_same_v<Working, float>;
  static constexpr std::size_t state_count = Opt::state_count;

  //! Steps shard `shard_index` of `layout` (the rank's index in the group it shards over; 0 for
  //! a 1-way layout). `param_group[i]` is parameter i's optimizer group, indexing `groups`. The
  //! master and state are allocated zeroed (load() sets the master) and recorded in `ledger`
  //! (this optimizer's own when null). `layout` must outlive the optimizer.
  shard_optimizer(const flat_layout& layout, std::size_t shard_index,
                  std::span<const std::size_t> param_group, param_groups<options_type> groups,
                  memory_ledger* ledger = nullptr, space_ops<Space> ops = {})
      : layout_(&layout),
        shard_index_(shard_index),
        groups_(std::move(groups.options)),
        ledger_(ledger != nullptr ? ledger : &own_ledger_),
        ops_(std::move(ops)) {
    if (shard_index >= layout.ranks()) {
      detail::raise("shard_optimizer: shard ", shard_index, " of a layout of ", layout.ranks(),
                    " shards");
    }
    if (param_group.size() != layout.num_params()) {
      detail::raise("shard_optimizer: ", param_group.size(), " parameter groups given for ",
                    layout.num_params(), " parameters");
    }
    validate_optimizer_groups<Opt>(groups_, "shard_optimizer");
    for (std::size_t i = 0; i < param_group.size(); ++i) {
      if (param_group[i] >= groups_.size()) {
        detail::raise("shard_optimizer: parameter #", i, " is in parameter group ", param_group[i],
                      " but only ", groups_.size(), " set(s) of optimizer options were given");
      }
    }
    pieces_ = layout.pieces(shard_index);
    // Runs of true elements with one parameter group each (merged where contiguous).
    for (const auto& pc : pieces_) {
      const std::size_t pg = param_group[pc.param];
      if (!runs_.empty()) {
        auto& last = runs_.back();
        if (last.group == pg && last.shard_offset + last.count == pc.shard_offset &&
            last.full_offset + last.count == pc.full_offset) {
          last.count += pc.count;
          continue;
        }
      }
      runs_.push_back(run{pc.shard_offset, pc.full_offset, pc.count, pg});
    }
    [[maybe_unused]] auto on_stream = ops_.scope();
    const std::size_t shard = layout.shard_numel();
    if constexpr (has_master) {
      master_ = buffer<float, Space>(shard, ledger_, memory_category::master_params);
    }
    for (std::size_t s = 0; s < state_count; ++s) {
      state_[s] = buffer<float, Space>(shard, ledger_, memory_category::optimizer_moments);
    }
  }

  shard_optimizer(const shard_optimizer&) = delete;
  shard_optimizer& operator=(const shard_optimizer&) = delete;
  ~shard_optimizer() {
    try {
      ops_.synchronize();  // device: nothing may still use the buffers when they are freed
    } catch (...) {        // a failed device is reported by the calls that use it
    }
  }

  //! Sets the master values of parameter i from `values` (the whole parameter, host memory,
  //! fp32/bf16/fp16 of dtype t): this rank keeps its pieces. With fp32 working parameters there
  //! is no master (the working buffer holds the values), and this does nothing.
  void load(std::size_t i, const void* values, dtype t) {
    load(i, 0, layout_->param(i).numel, values, t);
  }
  //! As above for elements [offset, offset + count) of parameter i only (`values` holds those
  //! count elements): what this rank owns of them is set. Sharded initialisation and
  //! checkpoints load this way, range by range.
  void load(std::size_t i, std::size_t offset, std::size_t count, const void* values, dtype t) {
    check_range(i, offset, count, "shard_optimizer::load");
    if constexpr (has_master) {
      for_each_owned(i, offset, count, [&](std::size_t at, std::size_t shard_at, std::size_t n) {
        const auto* from = static_cast<const std::byte*>(values) + (at - offset) * size_of(t);
        ops_.upload(from, t, master_.data() + shard_at, n);
      });
    } else {
      (void)values;
      (void)t;
    }
  }

  //! Sets optimizer state s of elements [offset, offset + count) of parameter i from `values`
  //! (those count elements, host memory, dtype t): what this rank owns of them (checkpoints).
  void load_state(std::size_t s, std::size_t i, std::size_t offset, std::size_t count,
                  const void* values, dtype t) {
    check_range(i, offset, count, "shard_optimizer::load_state");
    float* st = state(s).data();
    for_each_owned(i, offset, count, [&](std::size_t at, std::size_t shard_at, std::size_t n) {
      const auto* from = static_cast<const std::byte*>(values) + (at - offset) * size_of(t);
      ops_.upload(from, t, st + shard_at, n);
    });
  }

  //! Calls f(param_offset, shard_offset, n) for the parts of elements [offset, offset + count)
  //! of parameter i that this rank owns (in parameter order).
  template <class F>
  void for_each_owned(std::size_t i, std::size_t offset, std::size_t count, F&& f) const {
    for (const auto& pc : layout_->pieces_of(i)) {
      if (static_cast<std::size_t>(pc.rank) != shard_index_) continue;
      const std::size_t b = std::max(offset, pc.param_offset);
      const std::size_t e = std::min(offset + count, pc.param_offset + pc.count);
      if (b < e) f(b, pc.shard_offset + (b - pc.param_offset), e - b);
    }
  }

  //! Writes the rounded master into the slices of `working` this rank owns (what a step writes,
  //! without stepping): after a load of the master. Nothing with fp32 working parameters.
  void write_working(flat_span<Working, Space> working) {
    if constexpr (has_master) {
      working.check(*layout_, "shard_optimizer::write_working", "working-parameter");
      for (const auto& ru : runs_) {
        ops_.template convert_between<float, Working>(
            master_.data() + ru.shard_offset, working.data + offset(working.coords, ru), ru.count);
      }
    } else {
      (void)working;
    }
  }

  //! As above, from a host tensor of the parameter's size.
  template <tensor T>
  requires(!std::is_pointer_v<T>) void load(std::size_t i, const T& values) {
    const any_tensor_view v = erase(values);
    if (v.space != memory_kind::host || v.numel != layout_->param(i).numel) {
      detail::raise("shard_optimizer::load: parameter #", i, " needs a host tensor of ",
                    layout_->param(i).numel, " elements, got ", v.numel, " elements in ",
                    name(v.space), " memory");
    }
    load(i, v.data, v.type);
  }

  //! One optimizer step of this rank's shard: reads the gradients of its true elements from
  //! `grads` (full or shard coordinates of the layout), multiplies them by `grad_scale`
  //! (averaging over ranks and micro-batches, unscaling, clipping), updates master and state
  //! with each group's lr × `lr_scale`, and writes the rounded values into `working` (full or
  //! shard coordinates: the same slices). Counts as step steps() + 1.
  void step(flat_span<const Grad, Space> grads, flat_span<Working, Space> working, float grad_scale,
            float lr_scale = 1.0f) {
    bind(grads, working);
    begin_step(grad_scale, lr_scale);
    for (std::size_t p = 0; p < plans_.size(); ++p) step_part(p);
  }

  //! Cuts the step into parts at these shard offsets (ascending, each in (0, S)): part p steps
  //! the elements of the shard in [bound p-1, bound p) (0 and S at the ends). Every element is
  //! stepped once with the same arithmetic, so the parts in any order give the bits of one step;
  //! a caller that moves the shard in pieces (the offloaded optimizer) steps each piece as it
  //! arrives. Takes effect at the next bind().
  void set_step_parts(std::vector<std::size_t> bounds) {
    for (std::size_t i = 0; i < bounds.size(); ++i) {
      if (bounds[i] == 0 || bounds[i] >= layout_->shard_numel() ||
          (i > 0 && bounds[i] <= bounds[i - 1])) {
        detail::raise(
            "shard_optimizer::set_step_parts: part bounds must ascend strictly inside "
            "(0, ",
            layout_->shard_numel(), "), got ", bounds[i], " at #", i);
      }
    }
    part_bounds_ = std::move(bounds);
    plans_.clear();
  }
  //! Parts of the step (1 unless set_step_parts cut it).
  std::size_t step_parts() const noexcept { return part_bounds_.size() + 1; }

  //! Starts a step of the bound buffers (bind() first): checks the scales and fixes every group's
  //! constants; step_part(p) then steps part p. Counts as step steps() + 1.
  void begin_step(float grad_scale, float lr_scale = 1.0f) {
    if (plans_.empty()) detail::raise<usage_error>("shard_optimizer::begin_step: bind() first");
    if (!std::isfinite(lr_scale) || lr_scale < 0.0f) {
      detail::raise(
          "shard_optimizer::step: the learning-rate scale must be finite and "
          "non-negative, got ",
          lr_scale);
    }
    if (!std::isfinite(grad_scale)) {
      detail::raise("shard_optimizer::step: the gradient scale must be finite, got ", grad_scale);
    }
    ++steps_;
    constants_.clear();
    constants_.reserve(groups_.size());
    for (const auto& o : groups_)
      constants_.push_back(Opt::prepare(o, steps_, o.lr * lr_scale, grad_scale));
  }
  //! Steps part p of the step begun by begin_step().
  void step_part(std::size_t p) {
    if (p >= plans_.size()) {
      detail::raise("shard_optimizer::step_part: part ", p, " of ", plans_.size());
    }
    plans_[p].launch(std::span<const typename Opt::constants>(constants_));
  }

  //! Prepares the step for these buffers (step() does it when they change; a device plan is a
  //! table built once).
  void bind(flat_span<const Grad, Space> grads, flat_span<Working, Space> working) {
    grads.check(*layout_, "shard_optimizer::step", "gradient");
    working.check(*layout_, "shard_optimizer::step", "working-parameter");
    if (!plans_.empty() && grads.data == bound_grads_.data && grads.coords == bound_grads_.coords &&
        working.data == bound_working_.data && working.coords == bound_working_.coords) {
      return;
    }
    std::vector<std::vector<step_run<Opt, Grad, Working>>> tables(step_parts());
    for (const auto& whole : runs_) {
      // The run cut at the part bounds: elements [b, e) of the shard go to the part holding b.
      std::size_t b = whole.shard_offset;
      const std::size_t end = whole.shard_offset + whole.count;
      while (b < end) {
        const auto next = std::upper_bound(part_bounds_.begin(), part_bounds_.end(), b);
        const std::size_t part = static_cast<std::size_t>(next - part_bounds_.begin());
        const std::size_t e = next == part_bounds_.end() ? end : std::min(end, *next);
        run ru = whole;
        ru.shard_offset = b;
        ru.full_offset = whole.full_offset + (b - whole.shard_offset);
        ru.count = e - b;
        step_run<Opt, Grad, Working> sr;
        for (std::size_t s = 0; s < state_count; ++s)
          sr.state[s] = state_[s].data() + ru.shard_offset;
        sr.grads = grads.data + offset(grads.coords, ru);
        Working* w = working.data + offset(working.coords, ru);
        if constexpr (has_master) {
          sr.params = master_.data() + ru.shard_offset;
          sr.working = w;
        } else {
          sr.params = w;
        }
        sr.count = ru.count;
        sr.group = ru.group;
        tables[part].push_back(sr);
        b = e;
      }
    }
    [[maybe_unused]] auto on_stream = ops_.scope();
    plans_.clear();
    plans_.reserve(tables.size());
    for (const auto& t : tables) {
      plans_.push_back(ops_.template make_step_plan<Opt, Grad, Working>(
          std::span<const step_run<Opt, Grad, Working>>(t), groups_.size()));
    }
    bound_grads_ = grads;
    bound_working_ = working;
  }

  //! Steps taken (the t of Adam's bias correction for the next step is steps() + 1).
  std::uint64_t steps() const noexcept { return steps_; }
  //! Sets the step count (resuming from a checkpoint).
  void set_steps(std::uint64_t t) noexcept { steps_ = t; }

  //! The layout and the shard this optimizer steps.
  const flat_layout& layout() const noexcept { return *layout_; }
  std::size_t shard_index() const noexcept { return shard_index_; }
  //! The pieces of parameters this rank owns, in shard order (layout().pieces(shard_index())).
  std::span<const flat_layout::piece> pieces() const noexcept { return pieces_; }

  //! The fp32 master shard (S elements in shard order; 16-bit training only).
  tensor_view<float, Space> master() noexcept {
    static_assert(has_master,
                  "shard_optimizer::master(): training in fp32 keeps no separate master copy; "
                  "the working parameters are the fp32 values");
    return {master_.data(), master_.size()};
  }
  tensor_view<const float, Space> master() const noexcept {
    return const_cast<shard_optimizer*>(this)->master();
  }
  //! Optimizer state s of the shard (0 <= s < state_count; S elements in shard order).
  tensor_view<float, Space> state(std::size_t s) {
    if (s >= state_count) {
      detail::raise("shard_optimizer::state: ", Opt::name, " has ", state_count,
                    " state(s), asked for #", s);
    }
    return {state_[s].data(), state_[s].size()};
  }
  tensor_view<const float, Space> state(std::size_t s) const {
    return const_cast<shard_optimizer*>(this)->state(s);
  }

  //! Optimizer options of parameter group g.
  const options_type& options(std::size_t g = 0) const { return groups_.at(g); }
  //! The element-wise operations of this optimizer's memory space.
  const space_ops<Space>& ops() const noexcept { return ops_; }
  std::size_t num_groups() const noexcept { return groups_.size(); }
  //! Bytes this optimizer holds (the ledger it was given, or its own).
  const memory_ledger& memory() const noexcept { return *ledger_; }

 private:
  struct run {
    std::size_t shard_offset;
    std::size_t full_offset;
    std::size_t count;
    std::size_t group;
  };
  void check_range(std::size_t i, std::size_t offset, std::size_t count, const char* who) const {
    if (i >= layout_->num_params()) {
      detail::raise(who, ": parameter index ", i, " out of range (", layout_->num_params(),
                    " parameters)");
    }
    const std::size_t n = layout_->param(i).numel;
    if (offset > n || count > n - offset) {
      detail::raise(who, ": elements [", offset, ", ", offset, " + ", count, ") of parameter #", i,
                    " lie outside its ", n, " elements");
    }
  }
  static std::size_t offset(flat_coords c, const run& r) noexcept {
    return c == flat_coords::full ? r.full_offset : r.shard_offset;
  }

  const flat_layout* layout_;
  std::size_t shard_index_;
  std::vector<options_type> groups_;
  memory_ledger own_ledger_;
  memory_ledger* ledger_;
  space_ops<Space> ops_;
  std::vector<flat_layout::piece> pieces_;
  std::vector<run> runs_;
  std::conditional_t<has_master, buffer<float, Space>, std::byte> master_{};
  buffer<float, Space> state_[state_count > 0 ? state_count : 1];
  std::vector<std::size_t> part_bounds_;
  std::vector<typename space_ops<Space>::template step_plan<Opt, Grad, Working>> plans_;
  std::vector<typename Opt::constants> constants_;
  flat_span<const Grad, Space> bound_grads_{};
  flat_span<Working, Space> bound_working_{};
  std::uint64_t steps_ = 0;
};

SHARDKIT_NAMESPACE_END
