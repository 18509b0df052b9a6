//! \file zero/engine.hpp
//! The ZeRO engine: one per rank. It owns the flat parameter, gradient, master and optimizer
//! buffers of one rank, runs the collectives of its stage through a Communicator, and applies
//! the fused optimizer step to the rank's shard.
//!
//!     using engine = shardkit::engine<shardkit::thread_comm, shardkit::zero2, shardkit::bf16>;
//!     engine eng(comm, model, shardkit::adam_options{.lr = 1e-3f});
//!     for (step ...) {
//!       forward(eng.param(i)...);               // views of the working parameters
//!       backward(...);                          // for each gradient as it becomes ready:
//!       eng.grad_ready(i, grad_tensor);         //   ZeRO-2 reduce-scatters full buckets at once
//!       eng.step();                             // reduce, optimizer on the shard, gather
//!     }
//!
//! Stage semantics (N ranks, Ψ parameters, S the padded shard of core/layout.hpp):
//!  - stage 0: full gradients, all-reduced at step(); every rank steps all Ψ elements.
//!  - stage 1: full gradients, reduce-scattered at step(); each rank steps its shard; the
//!    working parameters are all-gathered.
//!  - stage 2: gradients are copied into a staging bucket as they arrive; a complete bucket is
//!    reduce-scattered at once (asynchronously) into the rank's gradient shard, so a rank holds
//!    its shard plus `grad_buffers` buckets of full gradients. step() steps the shard and
//!    all-gathers the working parameters.
//! Every stage sums gradients in rank order with fp32 accumulation and runs the same fused
//! kernel, so stages 0, 1 and 2 give bit-identical parameters at the same N.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/math.hpp>
#include <shardkit/plan/formulas.hpp>
#include <shardkit/zero/model.hpp>
#include <shardkit/zero/policies.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Settings of an engine that do not change its type.
struct engine_options {
  //! ZeRO-2: gradient bucket size in elements; buckets close greedily from the last parameter
  //! backwards. 0 = one bucket per declared unit (or one for the whole model).
  std::size_t bucket_elems = 0;
  //! ZeRO-2: staging buffers of one bucket each. 1 keeps a rank at its gradient shard plus one
  //! bucket of full gradients; 2 lets one bucket fill while another is being reduced.
  std::size_t grad_buffers = 1;
  //! Round each rank's slice of every group up to a multiple of this many elements.
  std::size_t alignment = 1;
  //! Divide summed gradients by the number of ranks (the data-parallel mean).
  bool average_grads = true;
  //! At construction, give every rank rank 0's initial parameter values.
  bool broadcast_init = false;
  //! ZeRO-2: treat parameters that received no gradient in a step as zero instead of raising
  //! usage_error at step().
  bool allow_missing_grads = false;
};

//! What one call of step() did.
struct step_report {
  std::uint64_t step = 0;        //!< optimizer steps taken, this one included
  float lr = 0.0f;               //!< learning rate used
  std::uint64_t bytes_sent = 0;  //!< bytes this rank's engine sent since the previous step()
};

namespace detail {
struct absent {};
template <bool B, class T>
using present_if = std::conditional_t<B, T, absent>;
}  // namespace detail

template <communicator Comm, class Policies = zero0, float_storage Working = bf16,
          optimizer_policy Optimizer = adamw>
class engine {
  static_assert(is_policy_set<Policies>,
                "shardkit::engine<Comm, Policies, ...>: Policies must be shardkit::policies<...> "
                "(or one of the aliases zero0, zero1, zero2, zero3, stage<N>)");
  static_assert(!Policies::shard_params,
                "shardkit::engine: ZeRO-3 (ShardParams) is not available in this release");
  static_assert(host_accessible<typename Comm::memory_space>,
                "shardkit::engine: this engine runs on host memory; include the CUDA engine "
                "header for a communicator of device memory");

 public:
  static constexpr int stage = Policies::stage;
  static constexpr bool shards_optimizer = Policies::shard_optimizer;
  static constexpr bool shards_grads = Policies::shard_grads;
  //! A separate fp32 master copy exists when the working parameters are 16-bit.
  static constexpr bool has_master = !std::is_same_v<Working, float>;

  using comm_type = Comm;
  using working_type = Working;
  using grad_type = Working;
  using optimizer_type = Optimizer;
  using optimizer_options = typename Optimizer::options;
  using work_type = typename Comm::work_type;

  //! Builds the buffers for `model` and copies its initial values. Collective when
  //! options.broadcast_init is set.
  engine(Comm& comm, const model_spec& model, optimizer_options opt = {},
         engine_options options = {})
      : comm_(comm), rank_(comm.rank()), ranks_(comm.size()), opt_(opt), options_(options) {
    validate_options();
    for (const auto& p : model.params()) names_.push_back(p.name);
    const auto numels = model.numels();
    const auto starts = model.unit_starts();
    if (!numels.empty() && starts.back() >= numels.size()) {
      detail::raise("engine: the last unit declared with begin_unit() has no parameters");
    }
    const std::size_t n = static_cast<std::size_t>(ranks_);
    if constexpr (stage == 0) {
      layout_ = flat_layout(numels, {}, 1, 1);
    } else if constexpr (stage == 1) {
      layout_ = flat_layout(numels, {}, n, options_.alignment);
    } else {
      layout_ = options_.bucket_elems != 0
                    ? flat_layout::bucketed(numels, n, options_.bucket_elems, options_.alignment)
                    : flat_layout(numels, starts, n, options_.alignment);
    }
    param_groups_.reserve(numels.size());
    for (const auto& p : model.params()) param_groups_.push_back(p.param_group);

    const std::size_t full = layout_.padded_numel();
    const std::size_t shard = layout_.shard_numel();
    params_ = buffer<Working>(full, &memory_, memory_category::working_params);
    grads_ = buffer<Working>(shards_grads ? shard : full, &memory_, memory_category::grads);
    if constexpr (has_master) {
      master_ = buffer<float>(shard, &memory_, memory_category::master_params);
    }
    for (auto& s : state_) s = buffer<float>(shard, &memory_, memory_category::optimizer_moments);
    seen_.assign(numels.size(), 0);
    if constexpr (shards_grads) {
      std::size_t largest = 0;
      for (const auto& g : layout_.groups()) largest = std::max(largest, g.padded);
      buckets_.resize(layout_.num_groups());
      for (std::size_t k = 0; k < options_.grad_buffers; ++k) {
        staging_.emplace_back();
        staging_.back().full = buffer<Working>(largest, &memory_, memory_category::grad_buckets);
      }
      for (std::size_t g = 0; g < layout_.num_groups(); ++g) {
        const auto& ge = layout_.group(g);
        for (std::size_t i = ge.first_param; i < ge.end_param; ++i) {
          if (numels[i] != 0) ++buckets_[g].expected;
        }
      }
    }
    build_runs();
    load_initial(model);
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  ~engine() {
    if constexpr (shards_grads) {
      for (auto& s : staging_) {
        if (s.work) {
          try {
            s.work->wait();
          } catch (...) {  // the error was or will be reported by the collective's other users
          }
        }
      }
    }
  }

  // ----------------------------------------------------------------------------------------
  // Parameters and gradients

  std::size_t num_params() const noexcept { return names_.size(); }
  const std::string& param_name(std::size_t i) const {
    check_index(i, "param_name");
    return names_[i];
  }

  //! The working values of parameter i (valid for the engine's lifetime; updated by step()).
  tensor_view<Working> param(std::size_t i) {
    check_index(i, "param");
    const auto& p = layout_.param(i);
    return {params_.data() + p.offset, p.numel};
  }
  tensor_view<const Working> param(std::size_t i) const {
    check_index(i, "param");
    const auto& p = layout_.param(i);
    return {params_.data() + p.offset, p.numel};
  }

  //! The gradient buffer of parameter i, to write gradients in place (stages 0 and 1, which
  //! keep full gradients). Zeroed by step().
  tensor_view<Working> grad(std::size_t i) {
    static_assert(!shards_grads,
                  "engine::grad(i) is a view into the full gradient buffer, which ZeRO-2 and "
                  "ZeRO-3 do not keep: hand each gradient to grad_ready(i, tensor) instead");
    check_index(i, "grad");
    const auto& p = layout_.param(i);
    seen_[i] = 1;
    return {grads_.data() + p.offset, p.numel};
  }

  //! Hands over the gradient of parameter i (fp32, bf16 or fp16, host memory, same size as the
  //! parameter). The first gradient of a parameter in a step is copied, later ones (micro-
  //! batches) are added. ZeRO-2 reduce-scatters a bucket as soon as all its parameters have
  //! their gradient.
  template <tensor G>
  void grad_ready(std::size_t i, const G& grad) {
    check_index(i, "grad_ready");
    const any_tensor_view g = erase(grad);
    const auto& p = layout_.param(i);
    if (g.numel != p.numel) {
      detail::raise("engine::grad_ready: the gradient of parameter '", names_[i], "' (#", i,
                    ") has ", g.numel, " elements, expected ", p.numel, " (the parameter's size)");
    }
    if (g.space != memory_kind::host) {
      detail::raise("engine::grad_ready: the gradient of parameter '", names_[i], "' is in ",
                    name(g.space), " memory, expected host memory");
    }
    if (g.type != dtype::f32 && g.type != dtype::bf16 && g.type != dtype::f16) {
      detail::raise("engine::grad_ready: the gradient of parameter '", names_[i], "' has ",
                    name(g.type), " elements, expected fp32, bf16 or fp16");
    }
    if (p.numel == 0) return;
    if constexpr (!shards_grads) {
      Working* dst = grads_.data() + p.offset;
      if (!seen_[i]) {
        host::convert(g.data, g.type, dst, dtype_of<Working>, p.numel);
        seen_[i] = 1;
      } else {
        host::accumulate(g.data, g.type, dst, p.numel);
      }
    } else {
      auto& b = buckets_[p.group];
      if (b.slot < 0) open_bucket(p.group, i);
      Working* dst = staging_[static_cast<std::size_t>(b.slot)].full.data() + p.group_offset;
      if (!seen_[i]) {
        host::convert(g.data, g.type, dst, dtype_of<Working>, p.numel);
        seen_[i] = 1;
        if (++b.reported == b.expected) launch_bucket(p.group);
      } else {
        host::accumulate(g.data, g.type, dst, p.numel);
      }
    }
  }

  //! Copies the working values of parameter i into `out` (any fp32/bf16/fp16 host tensor of
  //! the parameter's size), for frameworks whose tensors cannot alias the engine's buffers.
  template <tensor T>
  void copy_param_to(std::size_t i, T& out) const {
    check_index(i, "copy_param_to");
    const any_tensor_view o = erase(out);
    const auto& p = layout_.param(i);
    if (o.numel != p.numel || o.read_only || o.space != memory_kind::host) {
      detail::raise("engine::copy_param_to: parameter '", names_[i], "' needs a writable host ",
                    "tensor of ", p.numel, " elements, got ", o.numel,
                    o.read_only ? " read-only" : "", " elements in ", name(o.space), " memory");
    }
    host::convert(params_.data() + p.offset, dtype_of<Working>, o.data, o.type, p.numel);
  }

  // ----------------------------------------------------------------------------------------
  // The step

  //! Reduces the gradients, steps the optimizer on this rank's shard and brings every rank's
  //! working parameters up to date. Collective: every rank calls it. Uses options.lr.
  step_report step() { return step(lr_of(opt_)); }

  //! As step(), with the learning rate `lr` for this step (learning-rate schedules).
  step_report step(float lr) {
    if (!std::isfinite(lr) || lr < 0.0f) {
      detail::raise("engine::step: learning rate must be finite and non-negative, got ", lr);
    }
    reduce_gradients();
    const float grad_scale = options_.average_grads ? 1.0f / static_cast<float>(ranks_) : 1.0f;
    ++steps_;
    const auto k = Optimizer::prepare(opt_, steps_, lr, grad_scale);
    run_optimizer(k);
    gather_params();
    reset_gradients();
    const std::uint64_t sent = traffic_.total_bytes_sent();
    const step_report rep{steps_, lr, sent - sent_at_last_step_};
    sent_at_last_step_ = sent;
    return rep;
  }

  // ----------------------------------------------------------------------------------------
  // Introspection

  const flat_layout& layout() const noexcept { return layout_; }
  //! Bytes this rank holds, by category (current and peak).
  const memory_ledger& memory() const noexcept { return memory_; }
  //! Bytes this engine's collectives sent from this rank (ring volumes), since construction.
  const traffic_ledger& traffic() const noexcept { return traffic_; }
  std::uint64_t steps_taken() const noexcept { return steps_; }
  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return ranks_; }
  const optimizer_options& options() const noexcept { return opt_; }

  //! Model-state bytes per rank that plan/formulas.hpp predicts for this configuration.
  plan::state_bytes expected_state_bytes() const noexcept {
    return plan::model_state_bytes(stage, layout_.numel(), static_cast<std::uint64_t>(ranks_),
                                   stage == 0 ? layout_.numel() : layout_.shard_numel(),
                                   precision());
  }
  //! Bytes per rank per step that plan/formulas.hpp predicts for this configuration.
  std::uint64_t expected_step_bytes_sent() const noexcept {
    return plan::step_bytes_sent(stage, layout_.numel(), static_cast<std::uint64_t>(ranks_),
                                 layout_.shard_numel(), sizeof(Working),
                                 static_cast<std::uint64_t>(rank_));
  }
  //! Model-state bytes held now, measured by the ledger.
  plan::state_bytes measured_state_bytes() const noexcept {
    return {memory_.current(memory_category::working_params),
            memory_.current(memory_category::grads),
            memory_.current(memory_category::master_params),
            memory_.current(memory_category::optimizer_moments)};
  }
  static constexpr plan::precision precision() noexcept {
    return {sizeof(Working), sizeof(Working), has_master ? 4u : 0u, 4 * Optimizer::state_count};
  }

  //! This rank's fp32 master shard (S elements in shard order: layout().pieces(rank) maps them
  //! to parameters). Only with 16-bit working parameters; in fp32 the working copy is the
  //! master.
  tensor_view<const float> master_shard() const noexcept {
    static_assert(has_master,
                  "engine::master_shard(): training in fp32 keeps no separate master "
                  "copy; the working parameters (param(i)) are the fp32 values");
    return {master_.data(), master_.size()};
  }
  //! This rank's shard of optimizer state `s` (0 <= s < Optimizer::state_count).
  tensor_view<const float> optimizer_state(std::size_t s) const {
    if (s >= Optimizer::state_count) {
      detail::raise("engine::optimizer_state: ", Optimizer::name, " has ", Optimizer::state_count,
                    " state(s), asked for #", s);
    }
    return {state_[s].data(), state_[s].size()};
  }

 private:
  struct run {
    std::size_t shard_offset;  // into master / state / gradient shard
    std::size_t full_offset;   // into the full working / gradient buffer
    std::size_t count;
    std::size_t param_group;
  };
  struct bucket_state {
    std::size_t expected = 0;     // parameters with elements
    std::size_t reported = 0;     // of them, handed over in the current round
    std::size_t completions = 0;  // rounds reduced in this step
    int slot = -1;                // staging slot while filling
  };
  struct staging_slot {
    buffer<Working> full;
    buffer<Working> scratch;  // reduce-scatter target of later micro-batches
    std::optional<work_type> work;
    std::size_t group = 0;
    bool filling = false;
    bool accumulate = false;
  };

  static float lr_of(const optimizer_options& o) { return o.lr; }

  void validate_options() const {
    if (options_.grad_buffers == 0) {
      detail::raise("engine: engine_options::grad_buffers must be at least 1, got 0");
    }
    if (options_.alignment == 0) {
      detail::raise("engine: engine_options::alignment must be at least 1 element, got 0");
    }
    if (ranks_ < 1 || rank_ < 0 || rank_ >= ranks_) {
      detail::raise("engine: communicator reports rank ", rank_, " of ", ranks_);
    }
    if (!std::isfinite(opt_.lr) || opt_.lr < 0.0f) {
      detail::raise("engine: learning rate must be finite and non-negative, got ", opt_.lr);
    }
    if constexpr (requires {
                    opt_.beta1;
                    opt_.beta2;
                    opt_.eps;
                  }) {
      if (!(opt_.beta1 >= 0.0f && opt_.beta1 < 1.0f) ||
          !(opt_.beta2 >= 0.0f && opt_.beta2 < 1.0f)) {
        detail::raise("engine: Adam betas must lie in [0, 1), got beta1 = ", opt_.beta1,
                      ", beta2 = ", opt_.beta2);
      }
      if (!(opt_.eps > 0.0f)) detail::raise("engine: Adam eps must be positive, got ", opt_.eps);
    }
  }

  void check_index(std::size_t i, const char* what) const {
    if (i >= names_.size()) {
      detail::raise("engine::", what, ": parameter index ", i, " out of range (", names_.size(),
                    " parameters registered)");
    }
  }

  // Runs of this rank's true (non-padding) elements with one parameter group each.
  void build_runs() {
    const std::size_t r = stage == 0 ? 0 : static_cast<std::size_t>(rank_);
    for (const auto& pc : layout_.pieces(r)) {
      const std::size_t pg = param_groups_[pc.param];
      if (!runs_.empty()) {
        auto& last = runs_.back();
        if (last.param_group == pg && last.shard_offset + last.count == pc.shard_offset &&
            last.full_offset + last.count == pc.full_offset) {
          last.count += pc.count;
          continue;
        }
      }
      runs_.push_back(run{pc.shard_offset, pc.full_offset, pc.count, pg});
    }
  }

  void load_initial(const model_spec& model) {
    const std::size_t r = stage == 0 ? 0 : static_cast<std::size_t>(rank_);
    std::vector<float> tmp;
    for (std::size_t i = 0; i < model.size(); ++i) {
      const auto& mp = model[i];
      const auto& p = layout_.param(i);
      if (!mp.initial || p.numel == 0) continue;
      const void* src = mp.initial->data;
      dtype type = mp.initial->type;
      if (options_.broadcast_init && ranks_ > 1) {
        tmp.resize(p.numel);
        host::convert(src, type, tmp.data(), dtype::f32, p.numel);
        comm_.broadcast(tmp.data(), p.numel, 0);
        src = tmp.data();
        type = dtype::f32;
      }
      host::convert(src, type, params_.data() + p.offset, dtype_of<Working>, p.numel);
      if constexpr (has_master) {
        for (const auto& pc : layout_.pieces_of(i)) {
          if (static_cast<std::size_t>(pc.rank) != r) continue;
          host::convert(static_cast<const std::byte*>(src) + pc.param_offset * size_of(type), type,
                        master_.data() + pc.shard_offset, dtype::f32, pc.count);
        }
      }
    }
  }

  void record(collective c, std::size_t count) {
    traffic_.record(c, ring_bytes_sent(c, count, sizeof(Working), static_cast<std::size_t>(ranks_),
                                       static_cast<std::size_t>(rank_)));
  }

  // ZeRO-2 buckets -------------------------------------------------------------------------

  void open_bucket(std::size_t g, std::size_t param) {
    staging_slot* s = nullptr;
    for (auto& c : staging_) {
      if (!c.filling && !c.work) {
        s = &c;
        break;
      }
    }
    if (s == nullptr && !inflight_.empty()) {
      s = &staging_[inflight_.front()];
      complete_slot(*s);
    }
    if (s == nullptr) {
      std::string open;
      for (const auto& c : staging_) open += (open.empty() ? "" : ", ") + std::to_string(c.group);
      detail::raise<usage_error>(
          "engine::grad_ready: the gradient of parameter '", names_[param], "' belongs to bucket ",
          g, ", but all ", staging_.size(), " staging buffer(s) hold incomplete bucket(s) {", open,
          "}. Hand gradients over bucket by bucket (the last parameters first), raise "
          "engine_options::grad_buffers, or make buckets larger");
    }
    const auto& ge = layout_.group(g);
    if (options_.allow_missing_grads) {
      std::fill_n(s->full.data(), ge.padded, Working{});
    } else if (ge.padded > ge.numel) {
      std::fill_n(s->full.data() + ge.numel, ge.padded - ge.numel, Working{});
    }
    s->filling = true;
    s->group = g;
    buckets_[g].slot = static_cast<int>(s - staging_.data());
    buckets_[g].reported = 0;
  }

  void launch_bucket(std::size_t g) {
    auto& b = buckets_[g];
    const std::size_t idx = static_cast<std::size_t>(b.slot);
    auto& s = staging_[idx];
    const auto& ge = layout_.group(g);
    Working* target = grads_.data() + ge.shard_offset;
    s.accumulate = b.completions > 0;
    if (s.accumulate) {
      if (s.scratch.size() < ge.shard) {
        std::size_t largest = 0;
        for (const auto& x : layout_.groups()) largest = std::max(largest, x.shard);
        s.scratch = buffer<Working>(largest, &memory_, memory_category::comm_scratch);
      }
      target = s.scratch.data();
    }
    s.work.emplace(comm_.reduce_scatter_async(s.full.data(), target, ge.shard, reduce_op::sum));
    record(collective::reduce_scatter, ge.shard);
    s.filling = false;
    inflight_.push_back(idx);
    ++b.completions;
    b.reported = 0;
    b.slot = -1;
    for (std::size_t i = ge.first_param; i < ge.end_param; ++i) seen_[i] = 0;
  }

  void complete_slot(staging_slot& s) {
    if (!s.work) return;
    auto w = std::move(*s.work);
    s.work.reset();
    std::erase(inflight_, static_cast<std::size_t>(&s - staging_.data()));
    w.wait();
    if (s.accumulate) {
      const auto& ge = layout_.group(s.group);
      host::accumulate(s.scratch.data(), grads_.data() + ge.shard_offset, ge.shard);
      s.accumulate = false;
    }
  }

  // Step phases ----------------------------------------------------------------------------

  void reduce_gradients() {
    if constexpr (stage == 0) {
      if (ranks_ > 1 && layout_.numel() != 0) {
        comm_.all_reduce(grads_.data(), grads_.data(), layout_.numel(), reduce_op::sum);
        record(collective::all_reduce, layout_.numel());
      }
    } else if constexpr (stage == 1) {
      std::vector<work_type> works;
      for (const auto& g : layout_.groups()) {
        if (g.shard == 0) continue;
        Working* base = grads_.data() + g.offset;
        works.push_back(comm_.reduce_scatter_async(
            base, base + static_cast<std::size_t>(rank_) * g.shard, g.shard, reduce_op::sum));
        record(collective::reduce_scatter, g.shard);
      }
      for (auto& w : works) w.wait();
    } else {
      // Every bucket must have been reduced at least once, and none may be half full.
      std::string missing;
      std::size_t listed = 0;
      for (std::size_t g = 0; g < buckets_.size(); ++g) {
        auto& b = buckets_[g];
        const auto& ge = layout_.group(g);
        const bool incomplete = b.slot >= 0 || (b.completions == 0 && b.expected > 0);
        if (!incomplete) continue;
        if (options_.allow_missing_grads) {
          if (b.slot < 0) open_bucket(g, ge.first_param);
          launch_bucket(g);
          continue;
        }
        for (std::size_t i = ge.first_param; i < ge.end_param && listed < 8; ++i) {
          if (!seen_[i] && layout_.param(i).numel != 0) {
            missing += (missing.empty() ? "'" : ", '") + names_[i] + "'";
            ++listed;
          }
        }
      }
      if (!missing.empty()) {
        detail::raise<usage_error>(
            "engine::step: ZeRO-2 needs every parameter's gradient through grad_ready() before "
            "step(); missing: ",
            missing, listed == 8 ? ", ..." : "",
            " (set engine_options::allow_missing_grads to treat them as zero)");
      }
      for (auto& s : staging_) complete_slot(s);
    }
  }

  void run_optimizer(const typename Optimizer::constants& k) {
    for (const auto& r : runs_) {
      float* state[Optimizer::state_count];
      for (std::size_t s = 0; s < Optimizer::state_count; ++s) {
        state[s] = state_[s].data() + r.shard_offset;
      }
      const Working* g =
          shards_grads ? grads_.data() + r.shard_offset : grads_.data() + r.full_offset;
      if constexpr (has_master) {
        host::fused_step<Optimizer>(k, master_.data() + r.shard_offset, state, g,
                                    params_.data() + r.full_offset, r.count);
      } else {
        host::fused_step<Optimizer, Working, Working>(k, params_.data() + r.full_offset, state, g,
                                                      static_cast<Working*>(nullptr), r.count);
      }
    }
  }

  void gather_params() {
    if constexpr (stage == 1 || stage == 2) {
      std::vector<work_type> works;
      for (const auto& g : layout_.groups()) {
        if (g.shard == 0) continue;
        Working* base = params_.data() + g.offset;
        works.push_back(comm_.all_gather_async(base + static_cast<std::size_t>(rank_) * g.shard,
                                               base, g.shard));
        record(collective::all_gather, g.shard);
      }
      for (auto& w : works) w.wait();
    }
  }

  void reset_gradients() {
    grads_.zero();
    std::fill(seen_.begin(), seen_.end(), 0);
    if constexpr (shards_grads) {
      for (auto& b : buckets_) {
        b.completions = 0;
        b.reported = 0;
        b.slot = -1;
      }
    }
  }

  Comm& comm_;
  int rank_;
  int ranks_;
  optimizer_options opt_;
  engine_options options_;
  std::vector<std::string> names_;
  std::vector<std::size_t> param_groups_;
  flat_layout layout_;
  memory_ledger memory_;
  traffic_ledger traffic_;
  buffer<Working> params_;
  buffer<Working> grads_;
  [[no_unique_address]] detail::present_if<has_master, buffer<float>> master_;
  buffer<float> state_[Optimizer::state_count];
  std::vector<unsigned char> seen_;
  std::vector<run> runs_;
  [[no_unique_address]] detail::present_if<shards_grads, std::vector<bucket_state>> buckets_;
  [[no_unique_address]] detail::present_if<shards_grads, std::vector<staging_slot>> staging_;
  [[no_unique_address]] detail::present_if<shards_grads, std::vector<std::size_t>> inflight_;
  std::uint64_t steps_ = 0;
  std::uint64_t sent_at_last_step_ = 0;
};

SHARDKIT_NAMESPACE_END
