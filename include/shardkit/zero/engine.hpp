//! \file zero/engine.hpp
//! The ZeRO engine: one per rank, the composition of the components a policy set selects at
//! compile time (docs/architecture.md draws the data flow):
//!
//!   | part                   | stage 0             | stage 1             | stage 2      | stage 3
//!   |
//!   |------------------------|---------------------|---------------------|--------------|--------------|
//!   | parameters             | replicated_params   | replicated_params   | replicated   |
//!   shard_params | | gradients              | full_grads (AR)     | full_grads (RS)     |
//!   shard_grads  | shard_grads  | | optimizer              | shard_optimizer over a 1-way layout,
//!   or over the shard group      | | step control, topology | step_control, topology (hybrid shard
//!   and replica groups)          |
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
//!  - stage 3: a rank keeps only its shard of the working parameters. The framework calls
//!    pre_forward(u)/post_forward(u) and pre_backward(u)/post_backward(u) around each unit
//!    (model_spec::begin_unit); between them param(i) is a view into the unit's gathered full
//!    parameters. The engine gathers a unit when its forward or backward begins (or earlier:
//!    the next `prefetch` units, in the order of the previous step's hooks), releases it after,
//!    and reduce-scatters the unit's gradients as soon as all of them have been handed over.
//!    Units smaller than `persist_below` elements stay gathered. The hooks are no-ops in stages
//!    0-2, so framework code can call them whatever the stage.
//! Every stage sums gradients in rank order with fp32 accumulation and runs the same fused
//! kernel, so stages 0, 1, 2 and 3 give bit-identical parameters at the same N.
//!
//! The gradient type is the fifth template argument (default: the working type): bf16 working
//! parameters with fp32 gradients reduced in fp32 are engine<Comm, zero2, bf16, adamw, float>.
//!
//! Views handed out by param(i) point into engine-owned buffers, so a framework's tensors can
//! alias them without copies (the design FSDP and Megatron use); under ZeRO-3 a view is valid
//! only between a unit's pre_* and post_* hooks, since the gathered buffer is freed after.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/math.hpp>
#include <shardkit/zero/accounting.hpp>
#include <shardkit/zero/collective_log.hpp>
#include <shardkit/zero/engine_options.hpp>
#include <shardkit/zero/engine_reports.hpp>
#include <shardkit/zero/full_grads.hpp>
#include <shardkit/zero/initial_values.hpp>
#include <shardkit/zero/model.hpp>
#include <shardkit/zero/offload_optimizer.hpp>
#include <shardkit/zero/policies.hpp>
#include <shardkit/zero/registry.hpp>
#include <shardkit/zero/replicated_params.hpp>
#include <shardkit/zero/shard_grads.hpp>
#include <shardkit/zero/shard_optimizer.hpp>
#include <shardkit/zero/shard_params.hpp>
#include <shardkit/zero/space_ops.hpp>
#include <shardkit/zero/step_control.hpp>
#include <shardkit/zero/topology.hpp>
#include <shardkit/zero/trace.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

namespace detail {
//! The components a policy set selects (see the file comment).
template <class Comm, class Policies, class Working, class Opt, class Grad>
struct engine_parts {
  using space = typename Comm::memory_space;
  using params = std::conditional_t<Policies::shard_params, shard_params<Comm, Working>,
                                    replicated_params<Comm, Working>>;
  using grads =
      std::conditional_t<Policies::shard_grads, shard_grads<Comm, Grad>, full_grads<Comm, Grad>>;
  using optimizer =
      std::conditional_t<Policies::offload_optimizer, offload_optimizer<space, Opt, Working, Grad>,
                         shard_optimizer<space, Opt, Working, Grad>>;
};
}  // namespace detail

template <communicator Comm, class Policies = zero0, float_storage Working = bf16,
          optimizer_policy Optimizer = adamw, float_storage Grad = Working>
class engine : public engine_reports<engine<Comm, Policies, Working, Optimizer, Grad>> {
  static_assert(is_policy_set<Policies>,
                "shardkit::engine<Comm, Policies, ...>: Policies must be shardkit::policies<...> "
                "(or one of the aliases zero0, zero1, zero2, zero3, stage<N>)");
  static_assert(space_ops<typename Comm::memory_space>::available,
                "shardkit::engine: no kernels for the communicator's memory space; for a "
                "communicator of device memory (thread_cuda_comm, nccl_communicator) include "
                "<shardkit/zero/engine_cuda.cuh> in a CUDA translation unit");

 public:
  static constexpr int stage = Policies::stage;
  static constexpr bool shards_optimizer = Policies::shard_optimizer;
  static constexpr bool shards_grads = Policies::shard_grads;
  static constexpr bool shards_params = Policies::shard_params;
  //! A separate fp32 master copy exists when the working parameters are 16-bit.
  static constexpr bool has_master = !std::is_same_v<Working, float>;

  using comm_type = Comm;
  using working_type = Working;
  using grad_type = Grad;
  using optimizer_type = Optimizer;
  using optimizer_options = typename Optimizer::options;
  using work_type = typename Comm::work_type;
  //! Where the engine's buffers live: the communicator's memory space.
  using memory_space = typename Comm::memory_space;
  static constexpr bool on_host = host_accessible<memory_space>;
  //! The communicator orders its collectives after the compute stream's work by itself.
  static constexpr bool comm_orders_by_stream = requires(Comm & c, device_stream s) {
    c.set_compute_stream(s);
  };
  //! The components (zero/*.hpp), each usable on its own.
  using parts = detail::engine_parts<Comm, Policies, Working, Optimizer, Grad>;
  using params_component = typename parts::params;
  using grads_component = typename parts::grads;
  //! shard_optimizer, or offload_optimizer (master and state in host memory) with
  //! OffloadOptimizer; optimizer_view: its master and state, in its memory space.
  using optimizer_component = typename parts::optimizer;
  using optimizer_view = tensor_view<const float, typename optimizer_component::memory_space>;
  using control_component = step_control<memory_space>;

  //! Builds the buffers for `model` and copies its initial values. Collective: the ranks first
  //! agree on the model and the options (a named error on every rank when one rank's input is
  //! invalid or they differ), hybrid sharding splits the communicator, options.broadcast_init
  //! broadcasts, ZeRO-3 gathers persistent units.
  engine(Comm& comm, const model_spec& model, optimizer_options opt = {},
         engine_options options = {})
      : engine(comm, model, param_groups<optimizer_options>({opt}), options) {}

  //! As above, with one set of optimizer options per parameter group: parameter i uses
  //! groups[model[i].param_group] (e.g. no weight decay for biases and norms):
  //!     engine e(comm, model, shardkit::param_groups<adam_options>({decay, no_decay}), eo);
  engine(Comm& comm, const model_spec& model, param_groups<optimizer_options> groups,
         engine_options options = {})
      : registry_(detail::agreed_registry<Optimizer, Working, Grad>(
            comm, stage, model, options, std::span<const optimizer_options>(groups.options))),
        options_(options),
        ops_(detail::make_space_ops<memory_space>(options, comm_orders_by_stream)),
        control_(detail::control_options(options, std::is_same_v<Working, fp16>), ops_),
        topology_(stream_set(comm, options.compute_stream),
                  stage == 0 ? 0 : options.shard_group_size),
        layout_(make_layout()),
        params_(make_params()),
        grads_(make_grads()),
        optimizer_(layout_, shard_index(), registry_.param_groups(), std::move(groups), &memory_,
                   ops_) {
    topology_.set_compute_stream(options.compute_stream);
    // The ranks' agreement on the model and the options (detail::agreed_registry).
    log_.record(comm, collective::all_gather, 1 + max_fingerprint_fields, sizeof(std::uint64_t), 0);
    {
      [[maybe_unused]] auto on_stream = ops_.scope();  // device tables in stream order
      optimizer_.bind(grads_.gradients(), params_.working());
    }
    load_initial(model);
    params_.start();
    ops_.synchronize();  // device engines: set-up complete before the first use
    log_.reset_sequence();
    sent_at_last_step_ = log_.traffic().total_bytes_sent();  // step reports exclude set-up
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  ~engine() {
    // The components drain their collectives and wait for the device in their own destructors.
    try {
      ops_.synchronize();
    } catch (...) {  // a failed device is reported by the calls that use it, never from here
    }
  }

  // ----------------------------------------------------------------------------------------
  // Parameters and gradients

  std::size_t num_params() const noexcept { return registry_.size(); }
  const std::string& param_name(std::size_t i) const {
    registry_.check_param(i, "engine::param_name");
    return registry_.name(i);
  }

  //! The working values of parameter i. Stages 0-2: valid for the engine's lifetime, updated by
  //! step(). ZeRO-3: valid between its unit's pre_* and post_* hooks (usage_error otherwise).
  tensor_view<Working, memory_space> param(std::size_t i) {
    registry_.check_param(i, "engine::param");
    return params_.view(i, "engine::param");
  }
  tensor_view<const Working, memory_space> param(std::size_t i) const {
    registry_.check_param(i, "engine::param");
    return params_.view(i, "engine::param");
  }

  //! The gradient buffer of parameter i, to write gradients in place (stages 0 and 1, which
  //! keep full gradients). Zeroed by step().
  tensor_view<Grad, memory_space> grad(std::size_t i) {
    static_assert(!shards_grads,
                  "engine::grad(i) is a view into the full gradient buffer, which ZeRO-2 and "
                  "ZeRO-3 do not keep: hand each gradient to grad_ready(i, tensor) instead");
    registry_.check_param(i, "engine::grad");
    return grads_.view(i);
  }

  //! Hands over the gradient of parameter i (fp32, bf16 or fp16, in the engine's memory space:
  //! host memory, or device memory for a device engine, whose work on it is enqueued on the
  //! compute stream; same size as the parameter). The first gradient of a parameter in a step is
  //! copied, later ones (micro-batches) are added. ZeRO-2/3 reduce-scatter a bucket (unit) as
  //! soon as all its parameters have their gradient. ZeRO-3: only between the unit's
  //! pre_backward and post_backward.
  template <tensor G>
  void grad_ready(std::size_t i, const G& grad) {
    registry_.check_param(i, "engine::grad_ready");
    const any_tensor_view g = erase(grad);
    grads_.check(i, g, "engine::grad_ready");
    if constexpr (shards_params) {
      const std::size_t u = registry_.unit_of(i);
      if (!params_.in_backward(u)) {
        detail::raise<usage_error>(
            "engine::grad_ready: the gradient of parameter '", registry_.name(i),
            "' arrived outside the backward of its unit '", registry_.unit_name(u),
            "' (call pre_backward(", u, ") first, post_backward after)");
      }
    }
    grads_.add(i, g, "engine::grad_ready");
  }

  //! Copies the working values of parameter i into `out` (any fp32/bf16/fp16 tensor of the
  //! parameter's size in the engine's memory space; on a device, enqueued on the compute
  //! stream), for frameworks whose tensors cannot alias the engine's buffers.
  //! ZeRO-3: only while the parameter's unit is gathered.
  template <tensor T>
  void copy_param_to(std::size_t i, T& out) const {
    registry_.check_param(i, "engine::copy_param_to");
    const any_tensor_view o = erase(out);
    const std::size_t n = registry_.numel(i);
    if (o.numel != n || o.read_only || o.space != memory_kind_of<memory_space>) {
      detail::raise("engine::copy_param_to: parameter '", registry_.name(i), "' needs a writable ",
                    name(memory_kind_of<memory_space>), " ", "tensor of ", n, " elements, got ",
                    o.numel, o.read_only ? " read-only" : "", " elements in ", name(o.space),
                    " memory");
    }
    ops_.convert_out(param(i).data(), o.data, o.type, n);
  }

  // ----------------------------------------------------------------------------------------
  // ZeRO-3 unit hooks (no-ops in stages 0-2)

  std::size_t num_units() const noexcept { return registry_.num_units(); }
  const std::string& unit_name(std::size_t u) const {
    registry_.check_unit(u, "engine::unit_name");
    return registry_.unit_name(u);
  }
  //! The unit parameter i belongs to.
  std::size_t unit_of(std::size_t i) const {
    registry_.check_param(i, "engine::unit_of");
    return registry_.unit_of(i);
  }

  //! Before unit u's forward: its full parameters are gathered when this returns, and the
  //! next units' gathers are issued.
  void pre_forward(std::size_t u) { params_.pre_forward(u); }
  //! After unit u's forward: its gathered parameters are released (unless it persists or was
  //! declared with reshard_after_forward = false).
  void post_forward(std::size_t u) { params_.post_forward(u); }
  //! Before unit u's backward: gathers it again (if released) and prefetches the units whose
  //! backward comes next.
  void pre_backward(std::size_t u) {
    params_.pre_backward(u);
    if constexpr (shards_params) grads_.begin_group(u);
  }
  //! After unit u's backward: all its gradients must have been handed over (grad_ready); its
  //! gradients' reduce-scatter is issued and its gathered parameters are released.
  void post_backward(std::size_t u) {
    if constexpr (shards_params) {
      params_.post_backward(u, [&] { grads_.end_group(u, post_backward_name(u).c_str()); });
    } else {
      params_.post_backward(u);
    }
  }

  // ----------------------------------------------------------------------------------------
  // Gradient accumulation, loss scaling, learning-rate schedule

  //! Declares the start of a micro-batch; `last` marks the final one before step(). With
  //! declared micro-batches the step averages over them too (the mean over the global batch of
  //! N ranks x K micro-batches, when average_grads). Stages 0 and 1 accumulate locally and
  //! communicate once, at step(); stages 2 and 3 keep no full gradient buffer to accumulate
  //! into (it would cost the 2Ψ bytes they exist to save), so they reduce-scatter every
  //! micro-batch into the gradient shard. Without any call, every gradient handed over in a
  //! step is summed and the step counts as one micro-batch.
  void begin_micro_batch(bool last) {
    if (last_declared_) {
      detail::raise<usage_error>(
          "engine::begin_micro_batch: the previous micro-batch was "
          "declared the last of the step; call step() first");
    }
    ++micro_batches_;
    last_declared_ = last;
  }

  //! The scale the framework multiplies its loss by before backward (1 without loss scaling).
  float loss_scale() const noexcept { return control_.loss_scale(); }

  //! A learning-rate schedule: step t (1-based) uses each group's lr times schedule(t).
  void set_lr_schedule(std::function<float(std::uint64_t)> schedule) {
    schedule_ = std::move(schedule);
  }

  // ----------------------------------------------------------------------------------------
  // The step

  //! Reduces the gradients, steps the optimizer on this rank's shard and brings every rank's
  //! working parameters up to date. Collective: every rank calls it. Each parameter group uses
  //! its lr times the schedule's factor (1 without a schedule).
  step_report step() { return step(schedule_ ? schedule_(optimizer_.steps() + 1) : 1.0f); }

  //! As step(), with the learning rates of this step scaled by `lr_scale` instead of the
  //! schedule.
  step_report step(float lr_scale) {
    if (!std::isfinite(lr_scale) || lr_scale < 0.0f) {
      detail::raise("engine::step: the learning-rate scale must be finite and non-negative, got ",
                    lr_scale);
    }
    if (micro_batches_ > 0 && !last_declared_) {
      detail::raise<usage_error>("engine::step: ", micro_batches_,
                                 " micro-batch(es) were begun but none was declared the last "
                                 "(begin_micro_batch(true))");
    }
    if constexpr (shards_params) check_units_done();
    if constexpr (shards_grads) {
      grads_.finish(stage == 2 ? "engine::step: ZeRO-2" : "engine::step: ZeRO-3");
    } else {
      grads_.reduce();
    }
    if (Comm* rc = topology_.replica_group()) grads_.reduce_replicas(*rc);

    step_report rep;
    rep.micro_batches = std::max<std::size_t>(micro_batches_, 1);
    const control_result ctl = control_.template exchange<Grad>(
        topology_.world(), [&](auto&& f) { grads_.for_each_owned(f); }, shards_grads,
        log_.sequence_hash(), stage != 0 ? static_cast<std::uint64_t>(topology_.replicas()) : 1,
        control_traffic_);
    if (!ctl.schedule_ok) {
      params_.after_step(false);
      reset();
      detail::raise<usage_error>(
          "engine::step: the ranks issued the engine's collectives in different orders in this "
          "step (different buckets or units, or hooks called in a different order); the step "
          "was not applied. Every rank must hand over gradients and call the unit hooks in the "
          "same order");
    }
    // The gradient the optimizer sees: the sum over ranks (and micro-batches) times `base`.
    double base = options_.average_grads ? 1.0 / static_cast<double>(topology_.ranks()) : 1.0;
    if (micro_batches_ > 0 && options_.average_grads) base /= static_cast<double>(micro_batches_);
    base /= static_cast<double>(control_.loss_scale());
    const double multiplier = control_.decide(ctl, base, rep);
    if (!rep.skipped) {
      const auto t0 = std::chrono::steady_clock::now();
      optimizer_.step(grads_.gradients(), params_.working(), static_cast<float>(multiplier),
                      lr_scale);
      rep.optimizer_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      params_.after_step(true);
    } else {
      params_.after_step(false);
    }
    control_.update_scale(rep);
    reset();
    rep.step = optimizer_.steps();
    rep.lr = optimizer_.options(0).lr * lr_scale;
    const std::uint64_t sent = log_.traffic().total_bytes_sent();
    const std::uint64_t control = control_traffic_.total_bytes_sent();
    rep.bytes_sent = sent - sent_at_last_step_;
    rep.control_bytes_sent = control - control_at_last_step_;
    sent_at_last_step_ = sent;
    control_at_last_step_ = control;
    return rep;
  }

  // ----------------------------------------------------------------------------------------
  // Introspection

  const flat_layout& layout() const noexcept { return layout_; }
  //! Bytes this rank holds, by category (current and peak).
  const memory_ledger& memory() const noexcept { return memory_; }
  memory_ledger& memory() noexcept { return memory_; }
  //! Bytes this engine's data collectives sent from this rank (ring volumes), since
  //! construction.
  const traffic_ledger& traffic() const noexcept { return log_.traffic(); }
  //! Bytes of the engine's control collectives (schedule check), since construction.
  const traffic_ledger& control_traffic() const noexcept { return control_traffic_; }
  std::uint64_t steps_taken() const noexcept { return optimizer_.steps(); }
  int rank() const noexcept { return topology_.rank(); }
  int ranks() const noexcept { return topology_.ranks(); }
  //! Hybrid sharding: this rank's position in its shard group, the group's size G, and the
  //! number of replicas R = N / G (plain ZeRO: rank(), N and 1).
  int shard_rank() const noexcept { return topology_.shard_rank(); }
  int shard_size() const noexcept { return topology_.shard_size(); }
  int replicas() const noexcept { return topology_.replicas(); }
  //! Hybrid sharding: the communicators of this rank's shard group and replica group (nullptr
  //! without hybrid sharding). Their traffic ledgers hold the engine's data collectives.
  Comm* shard_comm() noexcept { return topology_.shard_comm(); }
  Comm* replica_comm() noexcept { return topology_.replica_group(); }
  //! Optimizer options of parameter group g.
  const optimizer_options& options(std::size_t g = 0) const { return optimizer_.options(g); }
  const engine_options& settings() const noexcept { return options_; }

  //! The components, for what the engine does not wrap (checkpoints read and write the
  //! optimizer's state by range; a framework may drive a component directly).
  optimizer_component& optimizer() noexcept { return optimizer_; }
  const optimizer_component& optimizer() const noexcept { return optimizer_; }
  grads_component& gradients() noexcept { return grads_; }
  params_component& parameters() noexcept { return params_; }
  const params_component& parameters() const noexcept { return params_; }
  control_component& control() noexcept { return control_; }
  const control_component& control() const noexcept { return control_; }
  topology<Comm>& topo() noexcept { return topology_; }
  const topology<Comm>& topo() const noexcept { return topology_; }
  const param_registry& registry() const noexcept { return registry_; }
  //! The element-wise operations of the engine's memory space (uploads, downloads, the small
  //! host-array collectives).
  const space_ops<memory_space>& space() const noexcept { return ops_; }

  //! This rank's fp32 master shard (S elements in shard order: layout().pieces(rank) maps them
  //! to parameters). Only with 16-bit working parameters; in fp32 the working copy is the
  //! master.
  optimizer_view master_shard() const noexcept {
    static_assert(has_master,
                  "engine::master_shard(): training in fp32 keeps no separate master copy; the "
                  "working parameters are the fp32 values");
    return optimizer_.master();
  }
  //! ZeRO-3: this rank's shard of the working parameters (S elements in shard order).
  tensor_view<const Working, memory_space> param_shard() const noexcept {
    static_assert(shards_params, "engine::param_shard(): only ZeRO-3 shards the parameters");
    return params_.shard();
  }
  //! This rank's shard of optimizer state `s` (0 <= s < Optimizer::state_count).
  optimizer_view optimizer_state(std::size_t s) const {
    if (s >= Optimizer::state_count) {
      detail::raise("engine::optimizer_state: ", Optimizer::name, " has ", Optimizer::state_count,
                    " state(s), asked for #", s);
    }
    return optimizer_.state(s);
  }

  //! ZeRO-3 timeline since construction or the last clear_trace() (engine_options::trace).
  const std::vector<trace_event>& trace() const noexcept {
    if constexpr (shards_params)
      return params_.trace().events();
    else
      return no_trace_;
  }
  void clear_trace() noexcept {
    if constexpr (shards_params) params_.trace().clear();
  }

 private:
  static Comm& stream_set(Comm& comm, device_stream s) {
    if constexpr (!on_host && comm_orders_by_stream) comm.set_compute_stream(s);
    (void)s;
    return comm;
  }

  std::size_t shard_index() const noexcept {
    return stage == 0 ? 0 : static_cast<std::size_t>(topology_.shard_rank());
  }

  flat_layout make_layout() const {
    const auto numels = registry_.numels();
    const std::size_t n = static_cast<std::size_t>(topology_.shard_size());
    if constexpr (stage == 0) {
      return flat_layout(numels, {}, 1, 1);
    } else if constexpr (stage == 1) {
      return flat_layout(numels, {}, n, options_.alignment);
    } else if constexpr (stage == 2) {
      return options_.bucket_elems != 0
                 ? flat_layout::bucketed(numels, n, options_.bucket_elems, options_.alignment)
                 : flat_layout(numels, registry_.unit_starts(), n, options_.alignment);
    } else {
      return flat_layout(numels, registry_.unit_starts(), n, options_.alignment);  // units
    }
  }

  params_component make_params() {
    if constexpr (shards_params) {
      const shard_params_options o{.prefetch = options_.prefetch,
                                   .persist_below = options_.persist_below,
                                   .max_live_elems = options_.max_live_elems,
                                   .trace = options_.trace,
                                   .reuse_buffers = options_.reuse_gathered_buffers,
                                   .keep_buffers_between_steps = options_.keep_gathered_buffers};
      return params_component(topology_.shard_group(), layout_, shard_index(), registry_, o,
                              &memory_, &log_, ops_);
    } else {
      return params_component(topology_.shard_group(), layout_, shard_index(), registry_, &memory_,
                              &log_, ops_);
    }
  }

  grads_component make_grads() {
    if constexpr (shards_grads) {
      shard_grads_options o;
      o.grad_buffers = options_.grad_buffers;
      o.allow_missing_grads = options_.allow_missing_grads;
      if constexpr (shards_params) {
        o.trace = &params_.trace();
        o.groups_are_units = true;
      }
      return grads_component(topology_.shard_group(), layout_, shard_index(), registry_, o,
                             &memory_, &log_, ops_);
    } else {
      return grads_component(
          topology_.shard_group(), layout_, shard_index(),
          stage == 0 ? full_grads_reduction::all_reduce : full_grads_reduction::reduce_scatter,
          registry_, &memory_, &log_, ops_);
    }
  }

  void load_initial(const model_spec& model) {
    load_initial_values<shards_params>(model, registry_, layout_, shard_index(), topology_.world(),
                                       options_.broadcast_init, params_, optimizer_, ops_, log_,
                                       memory_);
  }

  void check_units_done() {
    params_.check_idle("engine::step");
    if constexpr (shards_params) {
      // The optimizer runs with the persistent units held (and, with keep_gathered_buffers, the
      // kept buffers): prefetched units the backward did not use are freed here.
      params_.release_transient();
      if (options_.allow_missing_grads) return;
      for (std::size_t u = 0; u < registry_.num_units(); ++u) {
        if (grads_.expected(u) == 0 || grads_.rounds(u) != 0) continue;
        detail::raise<usage_error>("engine::step: unit '", registry_.unit_name(u),
                                   "' has not finished a backward in this step (call "
                                   "pre_backward(",
                                   u, "), hand over its gradients, post_backward(", u,
                                   ") before step())");
      }
    }
  }

  static std::string post_backward_name(std::size_t u) {
    return "engine::post_backward(" + std::to_string(u) + ")";
  }

  void reset() {
    grads_.reset();
    log_.reset_sequence();
    micro_batches_ = 0;
    last_declared_ = false;
  }

  param_registry registry_;
  engine_options options_;
  space_ops<memory_space> ops_;
  control_component control_;
  topology<Comm> topology_;
  flat_layout layout_;
  memory_ledger memory_;
  collective_log log_;
  traffic_ledger control_traffic_;
  params_component params_;
  grads_component grads_;
  optimizer_component optimizer_;
  std::size_t micro_batches_ = 0;  // declared in this step
  bool last_declared_ = false;
  std::function<float(std::uint64_t)> schedule_;
  std::uint64_t sent_at_last_step_ = 0;
  std::uint64_t control_at_last_step_ = 0;
  inline static const std::vector<trace_event> no_trace_{};
};

SHARDKIT_NAMESPACE_END
