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
//!  - stage 3: a rank keeps only its shard of the working parameters. The framework calls
//!    pre_forward(u)/post_forward(u) and pre_backward(u)/post_backward(u) around each unit
//!    (model_spec::begin_unit); between them param(i) is a view into the unit's gathered full
//!    parameters. The engine gathers a unit when its forward or backward begins (or earlier:
//!    the next `prefetch` units, in the order of the previous step's hooks, are gathered
//!    asynchronously while the current one computes), releases it after, and reduce-scatters
//!    the unit's gradients as soon as all of them have been handed over. Units smaller than
//!    `persist_below` elements stay gathered. The hooks are no-ops in stages 0-2, so framework
//!    code can call them whatever the stage.
//! Every stage sums gradients in rank order with fp32 accumulation and runs the same fused
//! kernel, so stages 0, 1, 2 and 3 give bit-identical parameters at the same N.
//!
//! Views handed out by param(i) point into engine-owned buffers, so a framework's tensors can
//! alias them without copies (the design FSDP and Megatron use); under ZeRO-3 a view is valid
//! only between a unit's pre_* and post_* hooks, since the gathered buffer is freed after.
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/device.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/grad_stats.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/math.hpp>
#include <shardkit/plan/formulas.hpp>
#include <shardkit/zero/model.hpp>
#include <shardkit/zero/policies.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Dynamic loss scaling (for fp16 training): the framework multiplies its loss by
//! engine::loss_scale() before backward; the engine unscales inside the fused step, skips steps
//! whose gradients overflowed (on every rank, leaving all state untouched) and adapts the
//! scale: times backoff_factor after an overflow, times growth_factor after growth_interval
//! steps in a row without one, never below min_scale (reported in step_report when reached).
struct loss_scale_options {
  float init_scale = 65536.0f;
  float growth_factor = 2.0f;
  std::uint32_t growth_interval = 2000;
  float backoff_factor = 0.5f;
  float min_scale = 1.0f;
};

//! Which norm gradient clipping bounds.
enum class grad_norm_kind : std::uint8_t { l2, inf };

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
  //! ZeRO-2/3: treat parameters that received no gradient in a step as zero instead of raising
  //! usage_error at step().
  bool allow_missing_grads = false;
  //! ZeRO-3: units gathered ahead of use (0 = gather on demand only).
  std::size_t prefetch = 1;
  //! ZeRO-3: units with fewer elements than this stay gathered for the whole step.
  std::size_t persist_below = 0;
  //! ZeRO-3: most gathered parameter elements held at once (0 = no limit beyond the schedule's
  //! own bound). Prefetching stops short of it; a configuration whose largest unit plus the
  //! persistent units exceeds it is rejected at construction.
  std::size_t max_live_elems = 0;
  //! ZeRO-2/3: at step(), check with one 16-byte all-reduce that every rank issued the engine's
  //! collectives in the same order (same buckets/units); if not, raise usage_error on every rank
  //! and do not apply the step.
  bool check_schedule = true;
  //! ZeRO-3: record a timeline of gathers, waits and hooks (engine::trace()).
  bool trace = false;

  //! Clip the global gradient norm to this value (0 = no clipping). The norm is that of the
  //! averaged, unscaled gradient over all true parameter elements (padding excluded, each
  //! element once), computed exactly so every stage and rank count agrees bit for bit; the clip
  //! coefficient min(1, max / (norm + 1e-6)) is applied inside the fused step.
  float clip_grad_norm = 0.0f;
  //! The norm clip_grad_norm bounds.
  grad_norm_kind clip_norm = grad_norm_kind::l2;
  //! Compute and report the gradient norms (step_report::grad_norm, grad_inf_norm) even
  //! without clipping. Costs one read of the gradient shard per step.
  bool report_grad_norm = false;
  //! Dynamic loss scaling. Unset: on for fp16 working parameters, off otherwise.
  std::optional<loss_scale_options> loss_scale;
  //! Turn dynamic loss scaling off even for fp16.
  bool disable_loss_scale = false;

  //! Hybrid sharding (stages 1-3; FSDP's HYBRID_SHARD, ZeRO++'s hpZ): shard within groups of
  //! this many consecutive ranks and replicate across the N / G groups. Gradients are
  //! reduce-scattered inside the shard group and their shard all-reduced across the replicas;
  //! parameters are gathered inside the shard group. 0 (or N) = shard over all ranks. Needs a
  //! communicator with split(); N must be a multiple of G.
  std::size_t shard_group_size = 0;

  //! Device engines (a communicator of device memory, zero/engine_cuda.cuh): the stream the
  //! engine's kernels, allocations and frees run on (nullptr = the legacy default stream). The
  //! engine passes it to a communicator that has set_compute_stream. Ignored on the host.
  device_stream compute_stream = nullptr;
};

//! One entry of the ZeRO-3 timeline (engine_options::trace).
struct trace_event {
  enum class kind : std::uint8_t {
    gather_issued,     //!< all-gather of the unit started (on demand or as a prefetch)
    gather_completed,  //!< the all-gather finished (communicator's completion time)
    compute_started,   //!< pre_forward/pre_backward returned: the unit's parameters are usable
    compute_ended,     //!< post_forward/post_backward called
    grads_reduced,     //!< the unit's gradient reduce-scatter was issued
    released,          //!< the gathered parameters were freed
  };
  kind what;
  std::size_t unit;
  bool backward;  //!< in the backward phase
  std::chrono::steady_clock::time_point time;
};

//! What one call of step() did.
struct step_report {
  std::uint64_t step = 0;  //!< optimizer steps taken, this one included
  float lr = 0.0f;         //!< learning rate used
  std::uint64_t bytes_sent =
      0;  //!< data bytes this rank sent since the previous step() (or set-up)
  std::uint64_t control_bytes_sent = 0;  //!< bytes of the engine's small control collectives
  std::size_t micro_batches = 1;         //!< micro-batches accumulated into this step
  //! The step was skipped on every rank because a gradient was infinite or NaN (only detected
  //! when loss scaling, clipping or report_grad_norm needs a pass over the gradients).
  bool skipped = false;
  float grad_norm = NAN;      //!< L2 norm of the averaged, unscaled gradient (NaN: not computed)
  float grad_inf_norm = NAN;  //!< largest |element| of it (NaN: not computed)
  float clip_coef = 1.0f;     //!< factor the clipping applied
  float loss_scale = 1.0f;    //!< the loss scale to use for the next step
  bool loss_scale_at_minimum = false;  //!< an overflow happened with the scale at min_scale
};

//! Optimizer options per parameter group (model_spec::add's param_group indexes them).
template <class Options>
struct param_groups {
  explicit param_groups(std::vector<Options> per_group) : options(std::move(per_group)) {}
  std::vector<Options> options;
};

namespace detail {
//! The element-wise work of an engine whose buffers live in `Space`: conversions and
//! accumulation of gradients, the gradient statistics, the fused optimizer step, and the
//! ordering of that work against the collectives. One specialisation per memory space: the
//! host's below, the CUDA one in zero/engine_cuda.cuh (so that a device engine needs that
//! header). `available` tells the engine whether the specialisation was seen.
template <memory_space Space, float_storage Working, optimizer_policy Opt>
struct engine_kernels {
  static constexpr bool available = false;
};

//! One run of the fused step: `count` elements of this rank's shard, optimizer group `group`.
template <float_storage Working, optimizer_policy Opt>
struct engine_step_run {
  float* params = nullptr;  // fp32 master (16-bit training) or the fp32 working values
  float* state[Opt::state_count > 0 ? Opt::state_count : 1] = {};
  const Working* grads = nullptr;
  Working* working = nullptr;  // rounded working copy to write, or nullptr (fp32 training)
  std::size_t count = 0;
  std::size_t group = 0;
};

struct engine_no_scope {};

//! Host memory: the host kernels, called directly; collectives complete on return or wait().
template <float_storage Working, optimizer_policy Opt>
struct engine_kernels<host_space, Working, Opt> {
  static constexpr bool available = true;
  using step_run = engine_step_run<Working, Opt>;

  engine_kernels(device_stream /*compute*/, bool /*comm_orders_by_stream*/) noexcept {}

  engine_no_scope scope() const noexcept { return {}; }
  void before_collective() const noexcept {}
  template <class Work>
  void finish(Work& w) const {
    w.wait();
  }
  void synchronize() const noexcept {}

  // A framework's gradient (any float dtype) into a Working buffer: copy, or add.
  void convert_in(const void* src, dtype t, Working* dst, std::size_t n) const {
    host::convert(src, t, dst, dtype_of<Working>, n);
  }
  void accumulate_in(const void* src, dtype t, Working* dst, std::size_t n) const {
    host::accumulate(src, t, dst, n);
  }
  void accumulate(const Working* src, Working* dst, std::size_t n) const {
    host::accumulate(src, dst, n);
  }
  void fill_zero(Working* p, std::size_t n) const { std::fill_n(p, n, Working{}); }
  // Working values out into a framework tensor of dtype t (in this space).
  void convert_out(const Working* src, void* dst, dtype t, std::size_t n) const {
    host::convert(src, dtype_of<Working>, dst, t, n);
  }
  // Host values (initial parameters) into a buffer of this space.
  template <float_storage D>
  void upload(const void* src, dtype t, D* dst, std::size_t n) const {
    host::convert(src, t, dst, dtype_of<D>, n);
  }
  // Broadcast of host values from `root` through a communicator of this space.
  template <class Comm>
  void broadcast_host(Comm& comm, float* values, std::size_t n, int root) const {
    comm.broadcast(values, n, root);
  }
  // All-reduce of a small host array (the control messages).
  template <class Comm, class T>
  void all_reduce_host(Comm& comm, T* values, std::size_t n, reduce_op op) const {
    comm.all_reduce(values, values, n, op);
  }

  // Gradient statistics over the runs for_each(f) visits, f(const Working*, count).
  template <class ForEach>
  host::grad_stats grad_stats(ForEach&& for_each) const {
    host::grad_stats st;
    for_each([&](const Working* g, std::size_t n) { host::accumulate_stats(g, n, st); });
    return st;
  }
  template <class ForEach>
  std::uint64_t count_nonfinite(ForEach&& for_each) const {
    std::uint64_t nonfinite = 0;
    for_each([&](const Working* g, std::size_t n) { nonfinite += host::count_nonfinite(g, n); });
    return nonfinite;
  }

  void prepare_step(const std::vector<step_run>& /*runs*/, std::size_t /*groups*/) {}
  void step(const std::vector<step_run>& runs,
            const std::vector<typename Opt::constants>& k) const {
    for (const auto& r : runs) {
      float* st[Opt::state_count > 0 ? Opt::state_count : 1];
      for (std::size_t s = 0; s < Opt::state_count; ++s) st[s] = r.state[s];
      host::fused_step<Opt, Working, Working>(k[r.group], r.params, st, r.grads, r.working,
                                              r.count);
    }
  }
};

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
  static_assert(detail::engine_kernels<typename Comm::memory_space, Working, Optimizer>::available,
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
  using grad_type = Working;
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

  //! Builds the buffers for `model` and copies its initial values. Collective when
  //! options.broadcast_init is set, and under ZeRO-3 when units persist.
  engine(Comm& comm, const model_spec& model, optimizer_options opt = {},
         engine_options options = {})
      : engine(comm, model, param_groups<optimizer_options>({opt}), options) {}

  //! As above, with one set of optimizer options per parameter group: parameter i uses
  //! groups[model[i].param_group] (e.g. no weight decay for biases and norms):
  //!     engine e(comm, model, shardkit::param_groups<adam_options>({decay, no_decay}), eo);
  engine(Comm& comm, const model_spec& model, param_groups<optimizer_options> groups,
         engine_options options = {})
      : comm_(comm),
        rank_(comm.rank()),
        ranks_(comm.size()),
        groups_(std::move(groups.options)),
        options_(options),
        kern_(options.compute_stream, comm_orders_by_stream) {
    validate_options();
    if constexpr (!on_host) {
      if constexpr (requires { comm.set_compute_stream(options.compute_stream); }) {
        comm.set_compute_stream(options.compute_stream);
      }
    }
    [[maybe_unused]] auto on_compute =
        kern_.scope();  // device buffers are allocated in stream order
    for (std::size_t i = 0; i < model.size(); ++i) {
      if (model[i].param_group >= groups_.size()) {
        detail::raise("engine: parameter '", model[i].name, "' is in parameter group ",
                      model[i].param_group, " but only ", groups_.size(),
                      " set(s) of optimizer options were given");
      }
    }
    if (loss_scaling()) scale_ = scaler().init_scale;
    for (const auto& p : model.params()) names_.push_back(p.name);
    unit_names_ = model.unit_names();
    unit_starts_ = model.unit_starts();
    const auto numels = model.numels();
    if (!numels.empty() && unit_starts_.back() >= numels.size()) {
      detail::raise("engine: the last unit declared with begin_unit() has no parameters");
    }
    setup_hybrid(comm);
    if constexpr (!on_host) {
      if constexpr (requires { comm.set_compute_stream(options.compute_stream); }) {
        if (shard_comm_) shard_comm_->set_compute_stream(options.compute_stream);
        if (replica_comm_) replica_comm_->set_compute_stream(options.compute_stream);
      }
    }
    const std::size_t n = static_cast<std::size_t>(shard_size_);
    if constexpr (stage == 0) {
      layout_ = flat_layout(numels, {}, 1, 1);
    } else if constexpr (stage == 1) {
      layout_ = flat_layout(numels, {}, n, options_.alignment);
    } else if constexpr (stage == 2) {
      layout_ = options_.bucket_elems != 0
                    ? flat_layout::bucketed(numels, n, options_.bucket_elems, options_.alignment)
                    : flat_layout(numels, unit_starts_, n, options_.alignment);
    } else {
      layout_ = flat_layout(numels, unit_starts_, n, options_.alignment);  // groups = units
    }
    param_unit_.resize(numels.size());
    for (std::size_t u = 0; u < unit_starts_.size(); ++u) {
      const std::size_t end = u + 1 < unit_starts_.size() ? unit_starts_[u + 1] : numels.size();
      for (std::size_t i = unit_starts_[u]; i < end; ++i) param_unit_[i] = u;
    }
    param_groups_.reserve(numels.size());
    for (const auto& p : model.params()) param_groups_.push_back(p.param_group);

    const std::size_t full = layout_.padded_numel();
    const std::size_t shard = layout_.shard_numel();
    params_ = buffer<Working, memory_space>(shards_params ? shard : full, &memory_,
                                            memory_category::working_params);
    grads_ = buffer<Working, memory_space>(shards_grads ? shard : full, &memory_,
                                           memory_category::grads);
    if constexpr (has_master) {
      master_ = buffer<float, memory_space>(shard, &memory_, memory_category::master_params);
    }
    for (auto& st : state_) {
      st = buffer<float, memory_space>(shard, &memory_, memory_category::optimizer_moments);
    }
    seen_.assign(numels.size(), 0);
    if constexpr (shards_grads) {
      std::size_t largest = 0;
      for (const auto& g : layout_.groups()) largest = std::max(largest, g.padded);
      buckets_.resize(layout_.num_groups());
      for (std::size_t k = 0; k < options_.grad_buffers; ++k) {
        staging_.emplace_back();
        staging_.back().full =
            buffer<Working, memory_space>(largest, &memory_, memory_category::grad_buckets);
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
    if constexpr (shards_params) setup_units(model);
    kern_.synchronize();  // device engines: set-up complete before the first use
    sent_at_last_step_ = traffic_.total_bytes_sent();  // step reports exclude set-up traffic
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  ~engine() {
    if constexpr (shards_grads) {
      for (auto& st : staging_) drain_quietly(st.work);
    }
    if constexpr (shards_params) {
      for (auto& u : units_) drain_quietly(u.gather);
    }
    // Device engines: the buffers are freed after the members' destructors, on the thread's
    // current stream; nothing on the compute stream may still use them then.
    try {
      kern_.synchronize();
    } catch (...) {  // a failed device is reported by the calls that use it, never from here
    }
  }

  // ----------------------------------------------------------------------------------------
  // Parameters and gradients

  std::size_t num_params() const noexcept { return names_.size(); }
  const std::string& param_name(std::size_t i) const {
    check_index(i, "param_name");
    return names_[i];
  }

  //! The working values of parameter i. Stages 0-2: valid for the engine's lifetime, updated by
  //! step(). ZeRO-3: valid between its unit's pre_* and post_* hooks (usage_error otherwise).
  tensor_view<Working, memory_space> param(std::size_t i) {
    check_index(i, "param");
    const auto& p = layout_.param(i);
    if constexpr (shards_params)
      return {gathered_data(i, "param") + p.group_offset, p.numel};
    else
      return {params_.data() + p.offset, p.numel};
  }
  tensor_view<const Working, memory_space> param(std::size_t i) const {
    return const_cast<engine*>(this)->param(i);
  }

  //! The gradient buffer of parameter i, to write gradients in place (stages 0 and 1, which
  //! keep full gradients). Zeroed by step().
  tensor_view<Working, memory_space> grad(std::size_t i) {
    static_assert(!shards_grads,
                  "engine::grad(i) is a view into the full gradient buffer, which ZeRO-2 and "
                  "ZeRO-3 do not keep: hand each gradient to grad_ready(i, tensor) instead");
    check_index(i, "grad");
    const auto& p = layout_.param(i);
    seen_[i] = 1;
    return {grads_.data() + p.offset, p.numel};
  }

  //! Hands over the gradient of parameter i (fp32, bf16 or fp16, in the engine's memory space:
  //! host memory, or device memory for a device engine, whose work on it is enqueued on the
  //! compute stream; same size as the parameter). The first gradient of a parameter in a step is
  //! copied, later ones (micro- batches) are added. ZeRO-2/3 reduce-scatter a bucket (unit) as soon
  //! as all its parameters have their gradient. ZeRO-3: only between the unit's pre_backward and
  //! post_backward.
  template <tensor G>
  void grad_ready(std::size_t i, const G& grad) {
    check_index(i, "grad_ready");
    const any_tensor_view g = erase(grad);
    const auto& p = layout_.param(i);
    if (g.numel != p.numel) {
      detail::raise("engine::grad_ready: the gradient of parameter '", names_[i], "' (#", i,
                    ") has ", g.numel, " elements, expected ", p.numel, " (the parameter's size)");
    }
    if (g.space != memory_kind_of<memory_space>) {
      detail::raise("engine::grad_ready: the gradient of parameter '", names_[i], "' is in ",
                    name(g.space), " memory, expected ", name(memory_kind_of<memory_space>),
                    " memory");
    }
    if (g.type != dtype::f32 && g.type != dtype::bf16 && g.type != dtype::f16) {
      detail::raise("engine::grad_ready: the gradient of parameter '", names_[i], "' has ",
                    name(g.type), " elements, expected fp32, bf16 or fp16");
    }
    if constexpr (shards_params) {
      const auto& u = units_[param_unit_[i]];
      if (u.state != unit_state::backward) {
        detail::raise<usage_error>("engine::grad_ready: the gradient of parameter '", names_[i],
                                   "' arrived outside the backward of its unit '",
                                   unit_names_[param_unit_[i]], "' (call pre_backward(",
                                   param_unit_[i], ") first, post_backward after)");
      }
    }
    if (p.numel == 0) return;
    if constexpr (!shards_grads) {
      Working* dst = grads_.data() + p.offset;
      if (!seen_[i]) {
        kern_.convert_in(g.data, g.type, dst, p.numel);
        seen_[i] = 1;
      } else {
        kern_.accumulate_in(g.data, g.type, dst, p.numel);
      }
    } else {
      auto& b = buckets_[p.group];
      if (b.slot < 0) open_bucket(p.group, i);
      Working* dst = staging_[static_cast<std::size_t>(b.slot)].full.data() + p.group_offset;
      if (!seen_[i]) {
        kern_.convert_in(g.data, g.type, dst, p.numel);
        seen_[i] = 1;
        if (++b.reported == b.expected) launch_bucket(p.group);
      } else {
        kern_.accumulate_in(g.data, g.type, dst, p.numel);
      }
    }
  }

  //! Copies the working values of parameter i into `out` (any fp32/bf16/fp16 tensor of the
  //! parameter's size in the engine's memory space; on a device, enqueued on the compute
  //! stream), for frameworks whose tensors cannot alias the engine's buffers.
  //! ZeRO-3: only while the parameter's unit is gathered.
  template <tensor T>
  void copy_param_to(std::size_t i, T& out) const {
    check_index(i, "copy_param_to");
    const any_tensor_view o = erase(out);
    const auto& p = layout_.param(i);
    if (o.numel != p.numel || o.read_only || o.space != memory_kind_of<memory_space>) {
      detail::raise("engine::copy_param_to: parameter '", names_[i], "' needs a writable ",
                    name(memory_kind_of<memory_space>), " ", "tensor of ", p.numel,
                    " elements, got ", o.numel, o.read_only ? " read-only" : "", " elements in ",
                    name(o.space), " memory");
    }
    kern_.convert_out(param(i).data(), o.data, o.type, p.numel);
  }

  // ----------------------------------------------------------------------------------------
  // ZeRO-3 unit hooks (no-ops in stages 0-2)

  std::size_t num_units() const noexcept { return unit_starts_.size(); }
  const std::string& unit_name(std::size_t u) const {
    check_unit(u, "unit_name");
    return unit_names_[u];
  }
  //! The unit parameter i belongs to.
  std::size_t unit_of(std::size_t i) const {
    check_index(i, "unit_of");
    return param_unit_[i];
  }

  //! Before unit u's forward: its full parameters are gathered when this returns, and the
  //! next units' gathers are issued.
  void pre_forward(std::size_t u) { pre_hook(u, false); }
  //! After unit u's forward: its gathered parameters are released (unless it persists or was
  //! declared with reshard_after_forward = false).
  void post_forward(std::size_t u) { post_hook(u, false); }
  //! Before unit u's backward: gathers it again (if released) and prefetches the units whose
  //! backward comes next.
  void pre_backward(std::size_t u) { pre_hook(u, true); }
  //! After unit u's backward: all its gradients must have been handed over (grad_ready); its
  //! gathered parameters are released.
  void post_backward(std::size_t u) { post_hook(u, true); }

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
  float loss_scale() const noexcept { return scale_; }

  //! A learning-rate schedule: step t (1-based) uses each group's lr times schedule(t).
  void set_lr_schedule(std::function<float(std::uint64_t)> schedule) {
    schedule_ = std::move(schedule);
  }

  // ----------------------------------------------------------------------------------------
  // The step

  //! Reduces the gradients, steps the optimizer on this rank's shard and brings every rank's
  //! working parameters up to date. Collective: every rank calls it. Each parameter group uses
  //! its lr times the schedule's factor (1 without a schedule).
  step_report step() { return step(schedule_ ? schedule_(steps_ + 1) : 1.0f); }

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
    reduce_gradients();
    reduce_across_replicas();

    step_report rep;
    rep.micro_batches = std::max<std::size_t>(micro_batches_, 1);
    const control_result ctl = control_exchange();
    // The gradient the optimizer sees: the sum over ranks (and micro-batches) times `base`.
    double base = options_.average_grads ? 1.0 / static_cast<double>(ranks_) : 1.0;
    if (micro_batches_ > 0 && options_.average_grads) base /= static_cast<double>(micro_batches_);
    base /= static_cast<double>(scale_);
    if (ctl.have_norm) rep.grad_norm = static_cast<float>(std::sqrt(ctl.norm_squared) * base);
    if (ctl.have_inf_norm) rep.grad_inf_norm = static_cast<float>(ctl.max_abs * base);
    double coef = 1.0;
    if (options_.clip_grad_norm > 0.0f && ctl.nonfinite == 0) {
      const double norm = options_.clip_norm == grad_norm_kind::l2
                              ? std::sqrt(ctl.norm_squared) * base
                              : ctl.max_abs * base;
      coef = std::min(1.0, static_cast<double>(options_.clip_grad_norm) / (norm + 1e-6));
    }
    rep.clip_coef = static_cast<float>(coef);
    rep.skipped = ctl.nonfinite != 0;
    if (!rep.skipped) {
      ++steps_;
      run_optimizer(static_cast<float>(base * coef), lr_scale);
      gather_params();
    } else if constexpr (shards_params) {
      release_transient_units();
    }
    update_loss_scale(rep);
    reset_gradients();
    rep.step = steps_;
    rep.lr = groups_[0].lr * lr_scale;
    const std::uint64_t sent = traffic_.total_bytes_sent();
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
  const traffic_ledger& traffic() const noexcept { return traffic_; }
  //! Bytes of the engine's control collectives (schedule check), since construction.
  const traffic_ledger& control_traffic() const noexcept { return control_traffic_; }
  std::uint64_t steps_taken() const noexcept { return steps_; }
  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return ranks_; }
  //! Hybrid sharding: this rank's position in its shard group, the group's size G, and the
  //! number of replicas R = N / G (plain ZeRO: rank(), N and 1).
  int shard_rank() const noexcept { return shard_rank_; }
  int shard_size() const noexcept { return shard_size_; }
  int replicas() const noexcept { return ranks_ / shard_size_; }
  //! Hybrid sharding: the communicators of this rank's shard group and replica group (nullptr
  //! without hybrid sharding). Their traffic ledgers hold the engine's data collectives.
  Comm* shard_comm() noexcept { return shard_comm_ ? &*shard_comm_ : nullptr; }
  Comm* replica_comm() noexcept { return replica_comm_ ? &*replica_comm_ : nullptr; }
  //! Optimizer options of parameter group g.
  const optimizer_options& options(std::size_t g = 0) const { return groups_.at(g); }
  const engine_options& settings() const noexcept { return options_; }

  //! Model-state bytes per rank that plan/formulas.hpp predicts for this configuration.
  plan::state_bytes expected_state_bytes() const noexcept {
    return plan::model_state_bytes(stage, layout_.numel(), static_cast<std::uint64_t>(shard_size_),
                                   stage == 0 ? layout_.numel() : layout_.shard_numel(),
                                   precision());
  }
  //! Data bytes per rank per step (one micro-batch) predicted for this configuration.
  std::uint64_t expected_step_bytes_sent() const noexcept {
    if constexpr (shards_params) {
      const std::uint64_t n = static_cast<std::uint64_t>(shard_size_);
      std::uint64_t total = replica_bytes_per_step();
      for (std::size_t u = 0; u < units_.size(); ++u) {
        const std::uint64_t passes =
            units_[u].persistent ? 2 : (units_[u].reshard_after_forward ? 3 : 2);
        total += passes * (n - 1) * layout_.group(u).shard * sizeof(Working);
      }
      return total;
    } else {
      return plan::step_bytes_sent(stage, layout_.numel(),
                                   static_cast<std::uint64_t>(stage == 0 ? ranks_ : shard_size_),
                                   layout_.shard_numel(), sizeof(Working),
                                   static_cast<std::uint64_t>(stage == 0 ? rank_ : shard_rank_)) +
             replica_bytes_per_step();
    }
  }
  //! ZeRO-3: the most gathered-parameter bytes the schedule may hold at once:
  //! w·(min(1 + prefetch, transient units)·largest non-persistent unit + persistent units +
  //! units kept from forward to backward), each unit at its padded size N·S_u, and at most
  //! max_live_elems·w when set. 0 in stages 0-2.
  std::uint64_t gathered_bytes_bound() const noexcept {
    if constexpr (shards_params)
      return live_bound_elems() * sizeof(Working);
    else
      return 0;
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
  tensor_view<const float, memory_space> master_shard() const noexcept {
    static_assert(has_master,
                  "engine::master_shard(): training in fp32 keeps no separate master copy; the "
                  "working parameters are the fp32 values");
    return {master_.data(), master_.size()};
  }
  //! ZeRO-3: this rank's shard of the working parameters (S elements in shard order).
  tensor_view<const Working, memory_space> param_shard() const noexcept {
    static_assert(shards_params, "engine::param_shard(): only ZeRO-3 shards the parameters");
    return {params_.data(), params_.size()};
  }
  //! This rank's shard of optimizer state `s` (0 <= s < Optimizer::state_count).
  tensor_view<const float, memory_space> optimizer_state(std::size_t s) const {
    if (s >= Optimizer::state_count) {
      detail::raise("engine::optimizer_state: ", Optimizer::name, " has ", Optimizer::state_count,
                    " state(s), asked for #", s);
    }
    return {state_[s].data(), state_[s].size()};
  }

  //! ZeRO-3 timeline since construction or the last clear_trace() (engine_options::trace).
  const std::vector<trace_event>& trace() const noexcept { return trace_; }
  void clear_trace() noexcept { trace_.clear(); }

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
    buffer<Working, memory_space> full;
    buffer<Working, memory_space> scratch;  // reduce-scatter target of later micro-batches
    std::optional<work_type> work;
    std::size_t group = 0;
    bool filling = false;
    bool accumulate = false;
  };
  enum class unit_state : std::uint8_t {
    released,  // only the shard exists
    inflight,  // all-gather issued, not yet waited for
    ready,     // gathered, not inside a hook pair
    forward,   // between pre_forward and post_forward
    backward,  // between pre_backward and post_backward
  };
  struct unit_info {
    buffer<Working, memory_space> gathered;  // N·S_u while gathered or in flight
    std::optional<work_type> gather;
    unit_state state = unit_state::released;
    bool persistent = false;
    bool reshard_after_forward = true;
    bool kept = false;  // gathered since forward, kept for backward
    std::size_t completions_at_pre_backward = 0;
  };

  static void drain_quietly(std::optional<work_type>& w) noexcept {
    if (!w) return;
    try {
      w->wait();
    } catch (...) {  // reported to the caller of the collective's other users
    }
    w.reset();
  }

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
    if (groups_.empty()) detail::raise("engine: at least one set of optimizer options is needed");
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto& o = groups_[g];
      if (!std::isfinite(o.lr) || o.lr < 0.0f) {
        detail::raise("engine: learning rate of parameter group ", g,
                      " must be finite and non-negative, got ", o.lr);
      }
      if constexpr (requires {
                      o.beta1;
                      o.beta2;
                      o.eps;
                    }) {
        if (!(o.beta1 >= 0.0f && o.beta1 < 1.0f) || !(o.beta2 >= 0.0f && o.beta2 < 1.0f)) {
          detail::raise("engine: Adam betas must lie in [0, 1), got beta1 = ", o.beta1,
                        ", beta2 = ", o.beta2, " (parameter group ", g, ")");
        }
        if (!(o.eps > 0.0f)) {
          detail::raise("engine: Adam eps must be positive, got ", o.eps, " (parameter group ", g,
                        ")");
        }
      }
    }
    if (!(options_.clip_grad_norm >= 0.0f) || !std::isfinite(options_.clip_grad_norm)) {
      detail::raise(
          "engine: engine_options::clip_grad_norm must be finite and >= 0 (0 = off), "
          "got ",
          options_.clip_grad_norm);
    }
    if (options_.loss_scale) {
      const auto& l = *options_.loss_scale;
      if (!(l.min_scale > 0.0f && l.init_scale >= l.min_scale && std::isfinite(l.init_scale)) ||
          !(l.growth_factor >= 1.0f) || !(l.backoff_factor > 0.0f && l.backoff_factor < 1.0f) ||
          l.growth_interval == 0) {
        detail::raise(
            "engine: loss_scale_options need 0 < min_scale <= init_scale (finite), "
            "growth_factor >= 1, 0 < backoff_factor < 1 and growth_interval >= 1; got "
            "init ",
            l.init_scale, ", min ", l.min_scale, ", growth ", l.growth_factor, " every ",
            l.growth_interval, ", backoff ", l.backoff_factor);
      }
    }
  }

  bool loss_scaling() const noexcept {
    if (options_.disable_loss_scale) return false;
    return options_.loss_scale.has_value() || std::is_same_v<Working, fp16>;
  }
  loss_scale_options scaler() const noexcept {
    return options_.loss_scale ? *options_.loss_scale : loss_scale_options{};
  }
  bool needs_norm() const noexcept {
    return options_.report_grad_norm ||
           (options_.clip_grad_norm > 0.0f && options_.clip_norm == grad_norm_kind::l2);
  }
  bool needs_inf_norm() const noexcept {
    return options_.report_grad_norm ||
           (options_.clip_grad_norm > 0.0f && options_.clip_norm == grad_norm_kind::inf);
  }

  void update_loss_scale(step_report& rep) {
    if (!loss_scaling()) {
      rep.loss_scale = 1.0f;
      return;
    }
    const auto l = scaler();
    if (rep.skipped) {
      good_steps_ = 0;
      if (scale_ <= l.min_scale) rep.loss_scale_at_minimum = true;  // reported, not looped on
      scale_ = std::max(scale_ * l.backoff_factor, l.min_scale);
    } else if (++good_steps_ >= l.growth_interval) {
      good_steps_ = 0;
      const float grown = scale_ * l.growth_factor;
      if (std::isfinite(grown)) scale_ = grown;
    }
    rep.loss_scale = scale_;
  }

  void check_index(std::size_t i, const char* what) const {
    if (i >= names_.size()) {
      detail::raise("engine::", what, ": parameter index ", i, " out of range (", names_.size(),
                    " parameters registered)");
    }
  }
  void check_unit(std::size_t u, const char* what) const {
    if (u >= unit_starts_.size()) {
      detail::raise("engine::", what, ": unit ", u, " out of range (", unit_starts_.size(),
                    " units declared)");
    }
  }

  // Runs of this rank's true (non-padding) elements with one parameter group each.
  void build_runs() {
    const std::size_t r = stage == 0 ? 0 : static_cast<std::size_t>(shard_rank_);
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
    // The fused step's runs: pointers into the buffers, which never move after construction.
    for (const auto& ru : runs_) {
      step_run sr;
      for (std::size_t s = 0; s < Optimizer::state_count; ++s) {
        sr.state[s] = state_[s].data() + ru.shard_offset;
      }
      sr.grads = shards_grads ? grads_.data() + ru.shard_offset : grads_.data() + ru.full_offset;
      Working* working = params_.data() + (shards_params ? ru.shard_offset : ru.full_offset);
      if constexpr (has_master) {
        sr.params = master_.data() + ru.shard_offset;
        sr.working = working;
      } else {
        sr.params = working;
      }
      sr.count = ru.count;
      sr.group = ru.param_group;
      step_runs_.push_back(sr);
    }
    kern_.prepare_step(step_runs_, groups_.size());
  }

  void load_initial(const model_spec& model) {
    const std::size_t r = stage == 0 ? 0 : static_cast<std::size_t>(shard_rank_);
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
        kern_.broadcast_host(comm_, tmp.data(), p.numel, 0);
        traffic_.record(
            collective::broadcast,
            ring_bytes_sent(collective::broadcast, p.numel, sizeof(float),
                            static_cast<std::size_t>(ranks_), static_cast<std::size_t>(rank_)));
        src = tmp.data();
        type = dtype::f32;
      }
      if constexpr (!shards_params) {
        kern_.upload(src, type, params_.data() + p.offset, p.numel);
      }
      for (const auto& pc : layout_.pieces_of(i)) {
        if (static_cast<std::size_t>(pc.rank) != r) continue;
        const auto* from = static_cast<const std::byte*>(src) + pc.param_offset * size_of(type);
        if constexpr (has_master) {
          kern_.upload(from, type, master_.data() + pc.shard_offset, pc.count);
        }
        if constexpr (shards_params) {
          kern_.upload(from, type, params_.data() + pc.shard_offset, pc.count);
        }
      }
    }
  }

  // Hybrid sharding: split the communicator into this rank's shard group (G consecutive ranks)
  // and its replica group (the ranks at the same position in every shard group).
  void setup_hybrid(Comm& comm) {
    const std::size_t g = options_.shard_group_size;
    shard_rank_ = rank_;
    shard_size_ = ranks_;
    if (g == 0 || g == static_cast<std::size_t>(ranks_)) return;
    if constexpr (stage == 0) {
      detail::raise("engine: engine_options::shard_group_size = ", g,
                    " but stage 0 shards nothing; hybrid sharding applies to stages 1-3");
    } else if constexpr (!requires { comm.split(0, 0); }) {
      detail::raise("engine: hybrid sharding (shard_group_size = ", g,
                    ") needs a communicator with split(color, key)");
    } else {
      if (static_cast<std::size_t>(ranks_) % g != 0) {
        detail::raise("engine: engine_options::shard_group_size = ", g, " does not divide the ",
                      ranks_, " ranks (every shard group must have the same size)");
      }
      const int gi = static_cast<int>(g);
      shard_comm_.emplace(comm.split(rank_ / gi, rank_));
      replica_comm_.emplace(comm.split(rank_ % gi, rank_));
      shard_rank_ = rank_ % gi;
      shard_size_ = gi;
    }
  }

  // The communicator of data collectives: the shard group (all ranks without hybrid).
  Comm& data_comm() noexcept { return shard_comm_ ? *shard_comm_ : comm_; }

  // Hybrid sharding: the gradient shard is all-reduced across the replicas, once per step.
  void reduce_across_replicas() {
    if (!replica_comm_ || replica_comm_->size() == 1) return;
    auto& rc = *replica_comm_;
    kern_.before_collective();
    auto all_reduce = [&](Working* p, std::size_t count) {
      if (count == 0) return;
      rc.all_reduce(p, p, count, reduce_op::sum);
      traffic_.record(collective::all_reduce,
                      ring_bytes_sent(collective::all_reduce, count, sizeof(Working),
                                      static_cast<std::size_t>(rc.size()),
                                      static_cast<std::size_t>(rc.rank())));
      schedule_hash_ = detail_hash(schedule_hash_ ^ 0x5eedull ^ count);
    };
    if constexpr (shards_grads) {
      all_reduce(grads_.data(), grads_.size());
    } else {
      for (const auto& ge : layout_.groups()) {
        all_reduce(grads_.data() + ge.offset + static_cast<std::size_t>(shard_rank_) * ge.shard,
                   ge.shard);
      }
    }
  }

  // Bytes of the per-step replica all-reduce (0 without hybrid sharding).
  std::uint64_t replica_bytes_per_step() const noexcept {
    const std::size_t R = static_cast<std::size_t>(ranks_ / shard_size_);
    if (R <= 1) return 0;
    const std::size_t q = static_cast<std::size_t>(rank_ / shard_size_);
    std::uint64_t b = 0;
    if constexpr (shards_grads) {
      b = ring_bytes_sent(collective::all_reduce, layout_.shard_numel(), sizeof(Working), R, q);
    } else {
      for (const auto& ge : layout_.groups()) {
        b += ring_bytes_sent(collective::all_reduce, ge.shard, sizeof(Working), R, q);
      }
    }
    return b;
  }

  // Records a data collective on the shard group's communicator (all ranks without hybrid).
  void record(collective c, std::size_t count, std::size_t group) {
    traffic_.record(c, ring_bytes_sent(c, count, sizeof(Working),
                                       static_cast<std::size_t>(stage == 0 ? ranks_ : shard_size_),
                                       static_cast<std::size_t>(stage == 0 ? rank_ : shard_rank_)));
    schedule_hash_ = detail_hash(schedule_hash_ ^ (static_cast<std::uint64_t>(c) << 56) ^ group);
  }
  static std::uint64_t detail_hash(std::uint64_t z) noexcept {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  // ZeRO-2/3 buckets ------------------------------------------------------------------------

  void open_bucket(std::size_t g, std::size_t param) {
    staging_slot* sl = nullptr;
    for (auto& c : staging_) {
      if (!c.filling && !c.work) {
        sl = &c;
        break;
      }
    }
    if (sl == nullptr && !inflight_.empty()) {
      sl = &staging_[inflight_.front()];
      complete_slot(*sl);
    }
    if (sl == nullptr) {
      std::string open;
      for (const auto& c : staging_) open += (open.empty() ? "" : ", ") + std::to_string(c.group);
      detail::raise<usage_error>(
          "engine::grad_ready: the gradient of parameter '", names_[param], "' belongs to ",
          shards_params ? "unit " : "bucket ", g, ", but all ", staging_.size(),
          " staging buffer(s) hold incomplete ", shards_params ? "unit(s)" : "bucket(s)", " {",
          open,
          "}. Hand gradients over bucket by bucket (the last parameters first), raise "
          "engine_options::grad_buffers, or make buckets larger");
    }
    const auto& ge = layout_.group(g);
    if (options_.allow_missing_grads) {
      kern_.fill_zero(sl->full.data(), ge.padded);
    } else if (ge.padded > ge.numel) {
      kern_.fill_zero(sl->full.data() + ge.numel, ge.padded - ge.numel);
    }
    sl->filling = true;
    sl->group = g;
    buckets_[g].slot = static_cast<int>(sl - staging_.data());
    buckets_[g].reported = 0;
  }

  void launch_bucket(std::size_t g) {
    auto& b = buckets_[g];
    const std::size_t idx = static_cast<std::size_t>(b.slot);
    auto& sl = staging_[idx];
    const auto& ge = layout_.group(g);
    Working* target = grads_.data() + ge.shard_offset;
    sl.accumulate = b.completions > 0;
    if (sl.accumulate) {
      if (sl.scratch.size() < ge.shard) {
        std::size_t largest = 0;
        for (const auto& x : layout_.groups()) largest = std::max(largest, x.shard);
        [[maybe_unused]] auto on_compute = kern_.scope();
        sl.scratch =
            buffer<Working, memory_space>(largest, &memory_, memory_category::comm_scratch);
      }
      target = sl.scratch.data();
    }
    kern_.before_collective();
    sl.work.emplace(
        data_comm().reduce_scatter_async(sl.full.data(), target, ge.shard, reduce_op::sum));
    record(collective::reduce_scatter, ge.shard, g);
    if constexpr (shards_params) note(trace_event::kind::grads_reduced, g, true);
    sl.filling = false;
    inflight_.push_back(idx);
    ++b.completions;
    b.reported = 0;
    b.slot = -1;
    for (std::size_t i = ge.first_param; i < ge.end_param; ++i) seen_[i] = 0;
  }

  void complete_slot(staging_slot& sl) {
    if (!sl.work) return;
    auto w = std::move(*sl.work);
    sl.work.reset();
    std::erase(inflight_, static_cast<std::size_t>(&sl - staging_.data()));
    kern_.finish(w);  // device engines: later compute-stream work waits, the host does not
    if (sl.accumulate) {
      const auto& ge = layout_.group(sl.group);
      kern_.accumulate(sl.scratch.data(), grads_.data() + ge.shard_offset, ge.shard);
      sl.accumulate = false;
    }
  }

  // Names up to 8 parameters of group g that have no gradient in the current round.
  std::string missing_in(std::size_t g, std::size_t& listed) const {
    std::string missing;
    const auto& ge = layout_.group(g);
    for (std::size_t i = ge.first_param; i < ge.end_param && listed < 8; ++i) {
      if (!seen_[i] && layout_.param(i).numel != 0) {
        missing += (missing.empty() ? "'" : ", '") + names_[i] + "'";
        ++listed;
      }
    }
    return missing;
  }

  // ZeRO-3 units -----------------------------------------------------------------------------

  std::uint64_t unit_padded(std::size_t u) const { return layout_.group(u).padded; }

  // min(1 + D, U_t)·largest transient unit + persistent units + kept units (elements).
  std::uint64_t live_bound_elems() const {
    std::uint64_t largest = 0, fixed = 0, transient = 0;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].persistent) {
        fixed += unit_padded(u);
      } else {
        ++transient;
        largest = std::max(largest, unit_padded(u));
        if (!units_[u].reshard_after_forward) fixed += unit_padded(u);
      }
    }
    std::uint64_t bound =
        std::min<std::uint64_t>(1 + options_.prefetch, transient) * largest + fixed;
    if (options_.max_live_elems != 0)
      bound = std::min<std::uint64_t>(bound, options_.max_live_elems);
    return bound;
  }

  void setup_units(const model_spec& model) {
    const auto uopts = model.units_options();
    units_.resize(unit_starts_.size());
    std::uint64_t persistent_elems = 0, largest = 0;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      units_[u].reshard_after_forward = uopts[u].reshard_after_forward;
      units_[u].persistent = layout_.group(u).numel < options_.persist_below;
      if (units_[u].persistent)
        persistent_elems += unit_padded(u);
      else
        largest = std::max(largest, unit_padded(u));
    }
    if (options_.max_live_elems != 0 && largest + persistent_elems > options_.max_live_elems) {
      std::size_t big = 0;
      while (units_[big].persistent || unit_padded(big) != largest) ++big;
      detail::raise("engine: engine_options::max_live_elems = ", options_.max_live_elems,
                    " cannot hold unit '", unit_names_[big], "' (", largest,
                    " elements gathered, padded to N·S_u) plus the persistent units (",
                    persistent_elems,
                    " elements); raise the limit, split the unit, or lower "
                    "persist_below");
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
      forward_order_.push_back(u);
      backward_order_.push_back(units_.size() - 1 - u);
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].persistent) issue_gather(u, false);
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].persistent) finish_gather(u, false);
    }
  }

  std::uint64_t live_elems() const {
    std::uint64_t e = 0;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].state != unit_state::released) e += unit_padded(u);
    }
    return e;
  }
  // Non-persistent, non-kept units currently gathered or in flight.
  std::size_t live_transient() const {
    std::size_t c = 0;
    for (const auto& x : units_) {
      if (!x.persistent && !x.kept && x.state != unit_state::released) ++c;
    }
    return c;
  }

  void note(trace_event::kind k, std::size_t u, bool backward,
            std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now()) {
    if (options_.trace) trace_.push_back(trace_event{k, u, backward, t});
  }

  void issue_gather(std::size_t u, bool backward) {
    auto& x = units_[u];
    const auto& ge = layout_.group(u);
    {
      [[maybe_unused]] auto on_compute = kern_.scope();
      x.gathered =
          buffer<Working, memory_space>(ge.padded, &memory_, memory_category::gathered_params);
    }
    x.state = unit_state::inflight;
    if (ge.shard != 0) {
      kern_.before_collective();
      x.gather.emplace(data_comm().all_gather_async(params_.data() + ge.shard_offset,
                                                    x.gathered.data(), ge.shard));
      record(collective::all_gather, ge.shard, u);
    }
    note(trace_event::kind::gather_issued, u, backward);
  }

  void finish_gather(std::size_t u, bool backward) {
    auto& x = units_[u];
    if (x.state != unit_state::inflight) return;
    if (x.gather) {
      auto w = std::move(*x.gather);
      x.gather.reset();
      kern_.finish(w);
      if constexpr (requires { w.completion_time(); }) {
        note(trace_event::kind::gather_completed, u, backward, w.completion_time());
      } else {
        note(trace_event::kind::gather_completed, u, backward);
      }
    } else {
      note(trace_event::kind::gather_completed, u, backward);
    }
    x.state = unit_state::ready;
  }

  void release(std::size_t u, bool backward) {
    auto& x = units_[u];
    drain_quietly(x.gather);
    {
      [[maybe_unused]] auto on_compute = kern_.scope();  // freed after the compute that used it
      x.gathered.release();
    }
    x.state = unit_state::released;
    x.kept = false;
    note(trace_event::kind::released, u, backward);
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
    if (options_.prefetch == 0) return;
    std::size_t issued = 0;
    for (auto it = pos + 1; it != order.end() && issued < options_.prefetch; ++it) {
      const std::size_t v = *it;
      auto& x = units_[v];
      if (x.persistent || x.state != unit_state::released) {
        if (!x.persistent) ++issued;  // already live: counts toward the depth
        continue;
      }
      if (live_transient() >= 1 + options_.prefetch) break;
      if (options_.max_live_elems != 0 && live_elems() + unit_padded(v) > options_.max_live_elems) {
        break;
      }
      issue_gather(v, backward);
      ++issued;
    }
  }

  void pre_hook(std::size_t u, bool backward) {
    check_unit(u, backward ? "pre_backward" : "pre_forward");
    if constexpr (shards_params) {
      auto& x = units_[u];
      const char* hook = backward ? "pre_backward" : "pre_forward";
      if (x.state == unit_state::forward || x.state == unit_state::backward) {
        detail::raise<usage_error>(
            "engine::", hook, "(", u, "): unit '", unit_names_[u], "' is already in its ",
            x.state == unit_state::forward ? "forward" : "backward", " (gathered twice: call post_",
            x.state == unit_state::forward ? "forward" : "backward", "(", u, ") first)");
      }
      (backward ? seen_backward_ : seen_forward_).push_back(u);
      if (x.state == unit_state::released) {
        if (options_.max_live_elems != 0 &&
            live_elems() + unit_padded(u) > options_.max_live_elems) {
          detail::raise<usage_error>(
              "engine::", hook, "(", u, "): gathering unit '", unit_names_[u], "' (",
              unit_padded(u), " elements) would exceed max_live_elems = ", options_.max_live_elems,
              " with ", live_elems(),
              " elements already gathered; call the post_* hooks of finished units first");
        }
        issue_gather(u, backward);
      }
      finish_gather(u, backward);
      x.state = backward ? unit_state::backward : unit_state::forward;
      if (backward) {
        x.kept = false;
        x.completions_at_pre_backward = buckets_[u].completions;
      }
      prefetch_after(u, backward);
      note(trace_event::kind::compute_started, u, backward);
    }
  }

  void post_hook(std::size_t u, bool backward) {
    check_unit(u, backward ? "post_backward" : "post_forward");
    if constexpr (shards_params) {
      auto& x = units_[u];
      const auto want = backward ? unit_state::backward : unit_state::forward;
      if (x.state != want) {
        detail::raise<usage_error>("engine::", backward ? "post_backward" : "post_forward", "(", u,
                                   "): unit '", unit_names_[u], "' is not in its ",
                                   backward ? "backward" : "forward", " (call ",
                                   backward ? "pre_backward" : "pre_forward", "(", u, ") first)");
      }
      note(trace_event::kind::compute_ended, u, backward);
      if (backward) {
        auto& b = buckets_[u];
        if (b.expected > 0 && (b.slot >= 0 || b.completions == x.completions_at_pre_backward)) {
          if (!options_.allow_missing_grads) {
            std::size_t listed = 0;
            const std::string missing = missing_in(u, listed);
            detail::raise<usage_error>(
                "engine::post_backward(", u, "): unit '", unit_names_[u],
                "' finished its backward without the gradients of ", missing,
                listed == 8 ? ", ..." : "",
                " (hand every gradient to grad_ready() before post_backward, or set "
                "engine_options::allow_missing_grads)");
          }
          if (b.slot < 0) open_bucket(u, layout_.group(u).first_param);
          launch_bucket(u);
        }
        if (x.persistent)
          x.state = unit_state::ready;
        else
          release(u, true);
      } else {
        if (x.persistent) {
          x.state = unit_state::ready;
        } else if (!x.reshard_after_forward) {
          x.state = unit_state::ready;
          x.kept = true;
        } else {
          release(u, false);
        }
      }
    }
  }

  void check_units_done() {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      const auto& x = units_[u];
      if (x.state == unit_state::forward || x.state == unit_state::backward) {
        detail::raise<usage_error>(
            "engine::step: unit '", unit_names_[u], "' is still in its ",
            x.state == unit_state::forward ? "forward" : "backward", " (call post_",
            x.state == unit_state::forward ? "forward" : "backward", "(", u, ") before step())");
      }
    }
    if (options_.allow_missing_grads) return;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (buckets_[u].expected > 0 && buckets_[u].completions == 0) {
        detail::raise<usage_error>("engine::step: unit '", unit_names_[u],
                                   "' has not finished a backward in this step (call "
                                   "pre_backward(",
                                   u,
                                   "), hand over its gradients, "
                                   "post_backward(",
                                   u, ") before step())");
      }
    }
  }

  Working* gathered_data(std::size_t i, const char* what) {
    const std::size_t u = param_unit_[i];
    auto& x = units_[u];
    if (x.state == unit_state::released || x.state == unit_state::inflight) {
      detail::raise<usage_error>("engine::", what, "(", i, "): parameter '", names_[i],
                                 "' belongs to unit '", unit_names_[u],
                                 "', which is not gathered (ZeRO-3: use it between pre_forward(", u,
                                 ")/post_forward or pre_backward/post_backward)");
    }
    return x.gathered.data();
  }

  // Step phases ----------------------------------------------------------------------------

  void reduce_gradients() {
    if constexpr (stage == 0) {
      if (ranks_ > 1 && layout_.numel() != 0) {
        kern_.before_collective();
        comm_.all_reduce(grads_.data(), grads_.data(), layout_.numel(), reduce_op::sum);
        record(collective::all_reduce, layout_.numel(), 0);
      }
    } else if constexpr (stage == 1) {
      std::vector<work_type> works;
      kern_.before_collective();
      for (std::size_t g = 0; g < layout_.num_groups(); ++g) {
        const auto& ge = layout_.group(g);
        if (ge.shard == 0) continue;
        Working* base = grads_.data() + ge.offset;
        works.push_back(data_comm().reduce_scatter_async(
            base, base + static_cast<std::size_t>(shard_rank_) * ge.shard, ge.shard,
            reduce_op::sum));
        record(collective::reduce_scatter, ge.shard, g);
      }
      for (auto& w : works) kern_.finish(w);
    } else {
      // Every bucket must have been reduced at least once, and none may be half full.
      std::string missing;
      std::size_t listed = 0;
      for (std::size_t g = 0; g < buckets_.size(); ++g) {
        auto& b = buckets_[g];
        const bool incomplete = b.slot >= 0 || (b.completions == 0 && b.expected > 0);
        if (!incomplete) continue;
        if (options_.allow_missing_grads) {
          if (b.slot < 0) open_bucket(g, layout_.group(g).first_param);
          launch_bucket(g);
          continue;
        }
        const std::string m = missing_in(g, listed);
        if (!m.empty()) missing += (missing.empty() ? "" : ", ") + m;
      }
      if (!missing.empty()) {
        detail::raise<usage_error>(
            "engine::step: ZeRO-", stage,
            " needs every parameter's gradient through grad_ready() before step(); missing: ",
            missing, listed == 8 ? ", ..." : "",
            " (set engine_options::allow_missing_grads to treat them as zero)");
      }
      for (auto& sl : staging_) complete_slot(sl);
    }
  }

  struct control_result {
    bool have_norm = false;
    bool have_inf_norm = false;
    double norm_squared = 0.0;  // of the summed (unaveraged, scaled) gradient
    double max_abs = 0.0;
    std::uint64_t nonfinite = 0;
  };

  // Calls f(pointer, count) for every run of true gradient elements this rank accounts for:
  // its shard (stages 1-3) or its chunk of the all-reduced gradient (stage 0), so that over
  // all ranks every element is visited exactly once.
  template <class F>
  void for_each_owned_grad(F&& f) const {
    if constexpr (stage == 0) {
      const std::size_t n = layout_.numel(), N = static_cast<std::size_t>(ranks_);
      const std::size_t r = static_cast<std::size_t>(rank_);
      if (n != 0) f(grads_.data() + chunk_begin(n, N, r), chunk_size(n, N, r));
    } else {
      for (const auto& ru : runs_) {
        f(grads_.data() + (shards_grads ? ru.shard_offset : ru.full_offset), ru.count);
      }
    }
  }

  // The per-step control collectives: gradient statistics for clipping and overflow detection
  // (exact, so every stage agrees bit for bit), and the ZeRO-2/3 schedule check. One sum
  // all-reduce of 64-bit words, plus one max all-reduce when the inf-norm is needed; nothing
  // when no feature asks for them.
  control_result control_exchange() {
    control_result res;
    const bool stats = needs_norm() || needs_inf_norm();
    const bool overflow = stats || loss_scaling();
    const bool schedule = shards_grads && options_.check_schedule && ranks_ > 1;
    if (!overflow && !schedule) return res;
    host::grad_stats st;
    std::uint64_t nonfinite = 0;
    auto owned = [&](auto&& f) { for_each_owned_grad(f); };
    if (stats) {
      st = kern_.grad_stats(owned);
      nonfinite = st.nonfinite();
    } else if (overflow) {
      nonfinite = kern_.count_nonfinite(owned);
    }
    std::vector<std::uint64_t> msg;
    if (stats) msg.assign(st.words.begin(), st.words.begin() + host::grad_stats::bins);
    const std::size_t at_nonfinite = msg.size();
    msg.push_back(nonfinite);
    const std::size_t at_hash = msg.size();
    if (schedule) {
      msg.push_back(schedule_hash_);
      msg.push_back(schedule_hash_ * schedule_hash_);
    }
    if (ranks_ > 1) {
      kern_.all_reduce_host(comm_, msg.data(), msg.size(), reduce_op::sum);
      record_control(msg.size(), sizeof(std::uint64_t));
    }
    std::uint32_t max_bits = st.max_abs_bits;
    if (needs_inf_norm() && ranks_ > 1) {
      kern_.all_reduce_host(comm_, &max_bits, 1, reduce_op::max);
      record_control(1, sizeof(std::uint32_t));
    }
    if (schedule) {
      const std::uint64_t n = static_cast<std::uint64_t>(ranks_);
      if (msg[at_hash] != n * schedule_hash_ ||
          msg[at_hash + 1] != n * (schedule_hash_ * schedule_hash_)) {
        if constexpr (shards_params) release_transient_units();
        reset_gradients();
        detail::raise<usage_error>(
            "engine::step: the ranks issued the engine's collectives in different orders in this "
            "step (different buckets or units, or hooks called in a different order); the step "
            "was not applied. Every rank must hand over gradients and call the unit hooks in the "
            "same order");
      }
    }
    // Hybrid sharding: every replica holds the same shards, so the world-wide sums count each
    // element R times; the integer bins divide exactly.
    const std::uint64_t R = static_cast<std::uint64_t>(ranks_ / shard_size_);
    if (stage != 0 && R > 1) {
      for (std::size_t i = 0; i <= at_nonfinite; ++i) msg[i] /= R;
    }
    res.nonfinite = msg[at_nonfinite];
    if (stats) {
      host::grad_stats all;
      std::copy(msg.begin(), msg.begin() + host::grad_stats::bins, all.words.begin());
      res.norm_squared = all.norm_squared();
      res.have_norm = needs_norm();
    }
    if (needs_inf_norm()) {
      float f;
      std::memcpy(&f, &max_bits, sizeof f);
      res.max_abs = f;
      res.have_inf_norm = true;
    }
    return res;
  }

  void record_control(std::size_t count, std::size_t elem_bytes) {
    control_traffic_.record(
        collective::all_reduce,
        ring_bytes_sent(collective::all_reduce, count, elem_bytes, static_cast<std::size_t>(ranks_),
                        static_cast<std::size_t>(rank_)));
  }

  void run_optimizer(float grad_scale, float lr_scale) {
    std::vector<typename Optimizer::constants> k;
    k.reserve(groups_.size());
    for (const auto& o : groups_) {
      k.push_back(Optimizer::prepare(o, steps_, o.lr * lr_scale, grad_scale));
    }
    kern_.step(step_runs_, k);
  }

  // ZeRO-3: frees every gathered unit that is not persistent (prefetched but unused, or kept).
  void release_transient_units() {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (!units_[u].persistent && units_[u].state != unit_state::released) release(u, false);
    }
  }

  void gather_params() {
    if constexpr (stage == 1 || stage == 2) {
      std::vector<work_type> works;
      kern_.before_collective();
      for (std::size_t g = 0; g < layout_.num_groups(); ++g) {
        const auto& ge = layout_.group(g);
        if (ge.shard == 0) continue;
        Working* base = params_.data() + ge.offset;
        works.push_back(data_comm().all_gather_async(
            base + static_cast<std::size_t>(shard_rank_) * ge.shard, base, ge.shard));
        record(collective::all_gather, ge.shard, g);
      }
      for (auto& w : works) kern_.finish(w);
    } else if constexpr (stage == 3) {
      // Units prefetched but never used are released; persistent units are gathered anew.
      release_transient_units();
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
  }

  void reset_gradients() {
    {
      [[maybe_unused]] auto on_compute = kern_.scope();
      grads_.zero();
    }
    std::fill(seen_.begin(), seen_.end(), 0);
    if constexpr (shards_grads) {
      for (auto& sl : staging_) {
        drain_quietly(sl.work);
        sl.filling = false;
        sl.accumulate = false;
      }
      inflight_.clear();
      for (auto& b : buckets_) {
        b.completions = 0;
        b.reported = 0;
        b.slot = -1;
      }
    }
    if constexpr (shards_params) {
      if (!seen_forward_.empty()) forward_order_ = seen_forward_;
      if (!seen_backward_.empty()) backward_order_ = seen_backward_;
      seen_forward_.clear();
      seen_backward_.clear();
      forward_cursor_ = backward_cursor_ = 0;
    }
    schedule_hash_ = 0;
    micro_batches_ = 0;
    last_declared_ = false;
  }

  Comm& comm_;
  int rank_;
  int ranks_;
  int shard_rank_ = 0;                // position in the shard group (hybrid) or rank_
  int shard_size_ = 1;                // G (hybrid) or ranks_
  std::optional<Comm> shard_comm_;    // hybrid sharding only
  std::optional<Comm> replica_comm_;  // hybrid sharding only
  std::vector<optimizer_options> groups_;
  engine_options options_;
  using kernels = detail::engine_kernels<memory_space, Working, Optimizer>;
  using step_run = typename kernels::step_run;
  kernels kern_;  // the element-wise work in the buffers' memory space
  std::vector<std::string> names_;
  std::vector<std::string> unit_names_;
  std::vector<std::size_t> unit_starts_;
  std::vector<std::size_t> param_unit_;
  std::vector<std::size_t> param_groups_;
  flat_layout layout_;
  memory_ledger memory_;
  traffic_ledger traffic_;
  traffic_ledger control_traffic_;
  buffer<Working, memory_space> params_;
  buffer<Working, memory_space> grads_;
  [[no_unique_address]] detail::present_if<has_master, buffer<float, memory_space>> master_;
  buffer<float, memory_space> state_[Optimizer::state_count];
  std::vector<unsigned char> seen_;
  std::vector<run> runs_;
  std::vector<step_run> step_runs_;
  [[no_unique_address]] detail::present_if<shards_grads, std::vector<bucket_state>> buckets_;
  [[no_unique_address]] detail::present_if<shards_grads, std::vector<staging_slot>> staging_;
  [[no_unique_address]] detail::present_if<shards_grads, std::vector<std::size_t>> inflight_;
  [[no_unique_address]] detail::present_if<shards_params, std::vector<unit_info>> units_;
  std::vector<std::size_t> forward_order_, backward_order_;  // prefetch order (last step's)
  std::vector<std::size_t> seen_forward_, seen_backward_;    // this step's hook order
  std::size_t forward_cursor_ = 0, backward_cursor_ = 0;     // position in the orders
  std::vector<trace_event> trace_;
  std::uint64_t schedule_hash_ = 0;
  float scale_ = 1.0f;             // loss scale
  std::uint32_t good_steps_ = 0;   // steps since the last overflow
  std::size_t micro_batches_ = 0;  // declared in this step
  bool last_declared_ = false;
  std::function<float(std::uint64_t)> schedule_;
  std::uint64_t steps_ = 0;
  std::uint64_t sent_at_last_step_ = 0;
  std::uint64_t control_at_last_step_ = 0;
};

SHARDKIT_NAMESPACE_END
