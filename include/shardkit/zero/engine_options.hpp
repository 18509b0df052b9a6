//! \file zero/engine_options.hpp
//! `engine_options`: the settings of an engine that do not change its type. The engine hands
//! each group of them to the component it configures: the layout (bucket_elems, alignment),
//! the topology (shard_group_size), shard_grads (grad_buffers, allow_missing_grads),
//! shard_params (prefetch, persist_below, max_live_elems, trace), step_control (clipping,
//! norms, loss scaling, check_schedule) and the engine itself (average_grads, broadcast_init,
//! compute_stream, host_threads). Options a stage does not use are ignored by it, as each field
//! says.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/device.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/kernels/math.hpp>
#include <shardkit/zero/fingerprint.hpp>
#include <shardkit/zero/registry.hpp>
#include <shardkit/zero/shard_optimizer.hpp>
#include <shardkit/zero/step_control.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>

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
  //! ZeRO-3, host memory: keep the buffers of released units for the next gathers of units of
  //! the same size within a step, instead of freeing and allocating one per gather
  //! (shard_params_options::reuse_buffers: the same bound on what is held, counted as
  //! gathered_params; freed after the backward). Off only to measure what it saves.
  bool reuse_gathered_buffers = true;
  //! ZeRO-3, host memory, with reuse_gathered_buffers: keep those buffers through step() for
  //! the next step's first gathers instead of freeing them after the backward
  //! (shard_params_options::keep_buffers_between_steps). Faster (a step allocates no gathered
  //! buffer), at the cost of holding up to 1 + prefetch gathered buffers outside the forward and
  //! backward too; the bound on what is held (gathered_bytes_bound()) is unchanged.
  bool keep_gathered_buffers = false;
  //! ZeRO-2/3: at step(), check with one small all-reduce (24 bytes; shared with the overflow
  //! count when loss scaling or clipping needs one) that every rank issued the engine's
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

  //! Host engines: threads that run this rank's optimizer step, its casts of gradients and
  //! parameters and its gradient statistics (1 = the thread that calls the engine). The engine
  //! keeps a persistent host::thread_team of this many threads (the caller is one of them).
  //! Results are the same bits for any number. Ignored by device engines.
  std::size_t host_threads = 1;
  //! Host engines: run that work on this executor instead (a framework's thread pool behind
  //! host::executor, or a thread_team shared with other code); overrides host_threads.
  std::shared_ptr<host::executor> host_executor;
};

namespace detail {

//! Checks what must hold before an engine issues any collective (a hybrid topology's splits),
//! so that a rank that fails fails before the others wait for it: the options, the rank, the
//! optimizer's parameter groups and their hyper-parameters. Returns `o`.
template <optimizer_policy Opt>
const engine_options& checked_engine_options(const engine_options& o, int stage, int rank,
                                             int ranks, const param_registry& reg,
                                             std::span<const typename Opt::options> groups) {
  if (o.grad_buffers == 0) raise("engine: engine_options::grad_buffers must be at least 1, got 0");
  if (o.host_threads == 0) {
    raise("engine: engine_options::host_threads must be at least 1 (the calling thread), got 0");
  }
  if (o.alignment == 0) {
    raise("engine: engine_options::alignment must be at least 1 element, got 0");
  }
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    raise("engine: communicator reports rank ", rank, " of ", ranks);
  }
  validate_optimizer_groups<Opt>(groups, "engine");
  for (std::size_t i = 0; i < reg.size(); ++i) {
    if (reg.param_group(i) >= groups.size()) {
      raise("engine: parameter '", reg.name(i), "' is in parameter group ", reg.param_group(i),
            " but only ", groups.size(), " set(s) of optimizer options were given");
    }
  }
  const std::size_t g = o.shard_group_size;
  if (stage == 0 && g != 0 && g != static_cast<std::size_t>(ranks)) {
    raise("engine: engine_options::shard_group_size = ", g,
          " but stage 0 shards nothing; hybrid sharding applies to stages 1-3");
  }
  if (stage != 0 && g != 0 && static_cast<std::size_t>(ranks) % g != 0) {
    raise("engine: engine_options::shard_group_size = ", g, " does not divide the ", ranks,
          " ranks (every shard group must have the same size)");
  }
  return o;
}

//! The fields of the options every rank of an engine must agree on (the engine compares them
//! across ranks at construction, with the model's: zero/fingerprint.hpp): stage, element types,
//! optimizer and every hyper-parameter of every parameter group, and every option that changes
//! the collectives or the arithmetic. Not compared: trace, compute_stream, the host threads
//! and executor, reuse_gathered_buffers and keep_gathered_buffers (local matters: they change
//! neither).
template <optimizer_policy Opt>
fingerprint options_fingerprint(const engine_options& o, int stage, int ranks, dtype working,
                                dtype grad, std::span<const typename Opt::options> groups) {
  auto one = [](auto... v) {
    stable_hash h;
    (h.u64(static_cast<std::uint64_t>(v)), ...);
    return h.value();
  };
  stable_hash opt;
  opt.str(Opt::name).u64(Opt::state_count).u64(groups.size());
  for (const auto& g : groups) {
    opt.f32(g.lr);
    if constexpr (requires { Opt::describe(g); }) {
      for (const auto& [name, value] : Opt::describe(g)) {
        opt.str(name).u64(std::bit_cast<std::uint64_t>(static_cast<double>(value)));
      }
    }
  }
  stable_hash clip, scaling;
  clip.f32(o.clip_grad_norm).u64(static_cast<std::uint64_t>(o.clip_norm));
  scaling.u64(o.disable_loss_scale ? 1 : 0).u64(o.loss_scale.has_value() ? 1 : 0);
  if (o.loss_scale) {
    const auto& l = *o.loss_scale;
    scaling.f32(l.init_scale).f32(l.growth_factor).u64(l.growth_interval);
    scaling.f32(l.backoff_factor).f32(l.min_scale);
  }
  return {{"ranks", one(ranks)},
          {"stage", one(stage)},
          {"working type", one(working)},
          {"gradient type", one(grad)},
          {"optimizer and its options per parameter group", opt.value()},
          {"bucket_elems", one(o.bucket_elems)},
          {"grad_buffers", one(o.grad_buffers)},
          {"alignment", one(o.alignment)},
          {"average_grads", one(o.average_grads)},
          {"broadcast_init", one(o.broadcast_init)},
          {"allow_missing_grads", one(o.allow_missing_grads)},
          {"prefetch", one(o.prefetch)},
          {"persist_below", one(o.persist_below)},
          {"max_live_elems", one(o.max_live_elems)},
          {"check_schedule", one(o.check_schedule)},
          {"clipping (clip_grad_norm, clip_norm)", clip.value()},
          {"report_grad_norm", one(o.report_grad_norm)},
          {"loss scaling (loss_scale, disable_loss_scale)", scaling.value()},
          {"shard_group_size", one(o.shard_group_size)}};
}

//! The element-wise operations of an engine in memory space Space: on the host, on the threads
//! host_executor or host_threads ask for; elsewhere on the compute stream.
template <memory_space Space>
space_ops<Space> make_space_ops(const engine_options& o, bool comm_orders_by_stream) {
  if constexpr (std::is_same_v<Space, host_space>) {
    (void)comm_orders_by_stream;
    if (o.host_executor) return space_ops<host_space>(o.host_executor);
    return space_ops<host_space>::with_threads(o.host_threads);
  } else {
    return space_ops<Space>(o.compute_stream, comm_orders_by_stream);
  }
}

//! The step_control settings among the engine's options.
inline step_control_options control_options(const engine_options& o, bool fp16_working) {
  step_control_options c;
  c.clip_grad_norm = o.clip_grad_norm;
  c.clip_norm = o.clip_norm;
  c.report_grad_norm = o.report_grad_norm;
  c.loss_scale = o.loss_scale;
  c.disable_loss_scale = o.disable_loss_scale;
  c.fp16 = fp16_working;
  c.check_schedule = o.check_schedule;
  return c;
}

//! Collective, first thing an engine does: builds the registry of `model` and checks the
//! options on this rank, then has every rank agree (agree_across_ranks) on the model's and the
//! options' fingerprints. A rank whose input is invalid raises its own error and every other
//! rank an error naming it; ranks given different models or settings all raise naming what
//! differs. Returns the registry.
template <optimizer_policy Opt, float_storage Working, float_storage Grad, class Comm>
param_registry agreed_registry(Comm& comm, int stage, const model_spec& model,
                               const engine_options& o,
                               std::span<const typename Opt::options> groups) {
  param_registry reg;
  // Through the space's staging: a device communicator takes no host buffers.
  using Space = typename Comm::memory_space;
  const auto ops = [&] {
    if constexpr (std::is_same_v<Space, host_space>)
      return space_ops<host_space>();  // the calling thread: no team for eight words
    else
      return make_space_ops<Space>(o, false);
  }();
  const auto gather = [&](const std::uint64_t* in, std::uint64_t* out, std::size_t n) {
    ops.all_gather_host(comm, in, out, n);
  };
  const auto same_rank = [](int r) { return r; };
  agree_across_ranks(
      comm, "engine",
      [&] {
        reg = param_registry(model);
        checked_engine_options<Opt>(o, stage, comm.rank(), comm.size(), reg, groups);
        (void)step_control<host_space>(control_options(o, std::is_same_v<Working, fp16>));
        fingerprint fp = model_fingerprint(reg);
        for (auto& f : options_fingerprint<Opt>(o, stage, comm.size(), dtype_of<Working>,
                                                dtype_of<Grad>, groups)) {
          fp.push_back(std::move(f));
        }
        return fp;
      },
      same_rank, gather);
  return reg;
}

}  // namespace detail

SHARDKIT_NAMESPACE_END
