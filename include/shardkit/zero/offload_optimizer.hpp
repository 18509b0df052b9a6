//! \file zero/offload_optimizer.hpp
//! `offload_optimizer`: the sharded optimizer (ZeRO-1, zero/shard_optimizer.hpp) with its fp32
//! master values and optimizer state in host memory (ZeRO-Offload), for stages 1-3. The
//! gradients and working parameters stay in the engine's memory space ("the device"); each step
//! moves this rank's gradient shard to the host, runs the fused step there on the host threads,
//! and moves the rounded working shard back, where the parameter component all-gathers it as
//! before. The engine selects it with the OffloadOptimizer policy (zero/policies.hpp):
//!
//!     using engine = shardkit::engine<Comm, shardkit::zero2_offload, shardkit::bf16>;
//!
//! The schedule, per group (bucket or unit) of the layout: every group's gradient slice is
//! enqueued on the copy queue (zero/copy_queue.hpp) in order; the host steps group g as soon as
//! its slice has arrived, then enqueues g's working slice back, so the copies of later groups
//! overlap the step of g and g's copy back overlaps the step of the next. The serial form
//! (every copy in, then the whole step, then every copy out) is kept for comparison. Both step
//! each element once with the kernel of the non-offloaded optimizer, so parameters, master and
//! state are bit-identical to it.
//!
//! Bytes: this component holds nothing in the engine's space. Its own ledger (memory()) holds,
//! in host memory, the master (m·S), the state (k·S) and the staging shards of the gradients
//! and of the working values (g·S + w·S, category offload_staging); with fp32 working values
//! the host working shard is the fp32 copy the step updates (there is no master), and it is
//! brought from the device each step, so it always equals what the device holds.
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
#include <shardkit/zero/copy_queue.hpp>
#include <shardkit/zero/shard_optimizer.hpp>
#include <shardkit/zero/space_ops.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! How an offloaded step orders its copies and its host step.
enum class offload_schedule {
  pipelined,  //!< group by group: the step of a group overlaps the copies of the others
  serial,     //!< every copy to the host, then the whole step, then every copy back
};

template <memory_space Space, optimizer_policy Opt, float_storage Working = bf16,
          float_storage Grad = Working>
class offload_optimizer {
  static_assert(copy_queue<Space>::available,
                "shardkit::offload_optimizer: no copy queue for this memory space");
  using host_optimizer = shard_optimizer<host_space, Opt, Working, Grad>;

 public:
  using options_type = typename Opt::options;
  //! Where the master and the state live (master(), state(s)).
  using memory_space = host_space;
  //! Where the gradients and working parameters live (step's buffers).
  using device_space = Space;
  static constexpr bool has_master = host_optimizer::has_master;
  static constexpr std::size_t state_count = Opt::state_count;
  static constexpr bool offloads = true;

  //! As shard_optimizer's constructor; the host step runs on `host_ops`'s threads. The master,
  //! state and staging are recorded in `host_ledger` (this optimizer's own when null).
  offload_optimizer(const flat_layout& layout, std::size_t shard_index,
                    std::span<const std::size_t> param_group, param_groups<options_type> groups,
                    space_ops<Space> ops, space_ops<host_space> host_ops,
                    memory_ledger* host_ledger = nullptr)
      : layout_(&layout),
        shard_index_(shard_index),
        ops_(std::move(ops)),
        ledger_(host_ledger != nullptr ? host_ledger : &own_ledger_),
        host_(layout, shard_index, param_group, std::move(groups), ledger_, std::move(host_ops)),
        grads_h_(layout.shard_numel(), ledger_, memory_category::offload_staging),
        working_h_(layout.shard_numel(), ledger_, memory_category::offload_staging) {
    std::vector<std::size_t> bounds;
    for (std::size_t g = 0; g < layout.num_groups(); ++g) {
      const auto& e = layout.group(g);
      const std::size_t before = shard_index * e.shard;
      const std::size_t n = e.numel > before ? std::min(e.shard, e.numel - before) : 0;
      if (n == 0) continue;  // only padding of this group on this rank
      if (e.shard_offset != 0) bounds.push_back(e.shard_offset);
      chunks_.push_back(chunk{e.shard_offset, e.offset + before, n, bounds.size()});
    }
    host_.set_step_parts(std::move(bounds));
    host_.bind(flat_span<const Grad>::shard(grads_h_.data(), grads_h_.size()),
               flat_span<Working>::shard(working_h_.data(), working_h_.size()));
    // A device's queue page-locks the host side of its copies (copy_queue_cuda.cuh).
    if constexpr (requires(copy_queue<Space> & q) { q.pin(nullptr, std::size_t{0}); }) {
      queue_.pin(grads_h_.data(), grads_h_.bytes());
      queue_.pin(working_h_.data(), working_h_.bytes());
    }
  }

  //! The engine's form: on a host engine the host step shares the engine's threads
  //! (engine_options::host_threads); `device_ledger` is unused (nothing is held there).
  offload_optimizer(const flat_layout& layout, std::size_t shard_index,
                    std::span<const std::size_t> param_group, param_groups<options_type> groups,
                    memory_ledger* /*device_ledger*/ = nullptr, space_ops<Space> ops = {})
      : offload_optimizer(layout, shard_index, param_group, std::move(groups), ops,
                          host_ops_for(ops)) {}

  offload_optimizer(const offload_optimizer&) = delete;
  offload_optimizer& operator=(const offload_optimizer&) = delete;
  ~offload_optimizer() { queue_.synchronize(); }

  //! The order of copies and step (pipelined by default).
  void set_schedule(offload_schedule s) noexcept { schedule_ = s; }
  offload_schedule schedule() const noexcept { return schedule_; }

  //! As shard_optimizer::step, on the device buffers `grads` and `working`: their slices of
  //! this rank's shard go to the host and back (file comment).
  void step(flat_span<const Grad, Space> grads, flat_span<Working, Space> working, float grad_scale,
            float lr_scale = 1.0f) {
    bind(grads, working);
    ops_.synchronize();  // the gradients are complete before the copies read them
    host_.begin_step(grad_scale, lr_scale);
    if (schedule_ == offload_schedule::pipelined) {
      std::vector<typename copy_queue<Space>::event> in;
      in.reserve(chunks_.size());
      for (const auto& c : chunks_) in.push_back(to_host(c, grads, working));
      for (std::size_t i = 0; i < chunks_.size(); ++i) {
        queue_.wait(in[i]);
        host_.step_part(chunks_[i].part);
        to_device(chunks_[i], working);
      }
    } else {
      for (const auto& c : chunks_) to_host(c, grads, working);
      queue_.synchronize();
      for (const auto& c : chunks_) host_.step_part(c.part);
      for (const auto& c : chunks_) to_device(c, working);
    }
    queue_.synchronize();
  }

  //! Checks that the buffers fit the layout (the step plan itself is the host's, fixed).
  void bind(flat_span<const Grad, Space> grads, flat_span<Working, Space> working) const {
    grads.check(*layout_, "offload_optimizer::step", "gradient");
    working.check(*layout_, "offload_optimizer::step", "working-parameter");
  }

  //! Writes the rounded master into this rank's slices of `working` (after a load).
  void write_working(flat_span<Working, Space> working) {
    if constexpr (has_master) {
      working.check(*layout_, "offload_optimizer::write_working", "working-parameter");
      host_.write_working(flat_span<Working>::shard(working_h_.data(), working_h_.size()));
      for (const auto& c : chunks_) to_device(c, working);
      queue_.synchronize();
    } else {
      (void)working;
    }
  }

  // What shard_optimizer offers, on the host copies.
  void load(std::size_t i, const void* values, dtype t) { host_.load(i, values, t); }
  void load(std::size_t i, std::size_t offset, std::size_t count, const void* values, dtype t) {
    host_.load(i, offset, count, values, t);
  }
  template <tensor T>
  requires(!std::is_pointer_v<T>) void load(std::size_t i, const T& values) {
    host_.load(i, values);
  }
  void load_state(std::size_t s, std::size_t i, std::size_t offset, std::size_t count,
                  const void* values, dtype t) {
    host_.load_state(s, i, offset, count, values, t);
  }
  template <class F>
  void for_each_owned(std::size_t i, std::size_t offset, std::size_t count, F&& f) const {
    host_.for_each_owned(i, offset, count, std::forward<F>(f));
  }
  std::uint64_t steps() const noexcept { return host_.steps(); }
  void set_steps(std::uint64_t t) noexcept { host_.set_steps(t); }
  const flat_layout& layout() const noexcept { return *layout_; }
  std::size_t shard_index() const noexcept { return shard_index_; }
  std::span<const flat_layout::piece> pieces() const noexcept { return host_.pieces(); }
  //! The fp32 master shard, in host memory.
  tensor_view<float, host_space> master() noexcept { return host_.master(); }
  tensor_view<const float, host_space> master() const noexcept { return host_.master(); }
  //! Optimizer state s of the shard, in host memory.
  tensor_view<float, host_space> state(std::size_t s) { return host_.state(s); }
  tensor_view<const float, host_space> state(std::size_t s) const { return host_.state(s); }
  const options_type& options(std::size_t g = 0) const { return host_.options(g); }
  std::size_t num_groups() const noexcept { return host_.num_groups(); }
  //! The host operations the step runs on.
  const space_ops<host_space>& ops() const noexcept { return host_.ops(); }
  //! Host bytes this optimizer holds: master, state, staging.
  const memory_ledger& memory() const noexcept { return *ledger_; }
  //! Copies made since construction (two per group and step; one more with fp32 working).
  std::uint64_t copies() const noexcept { return queue_.copies(); }

 private:
  struct chunk {
    std::size_t shard_offset;  // first element in the shard
    std::size_t full_offset;   // first element of this rank's slice in the full buffer
    std::size_t count;         // true elements (the slice without its padding)
    std::size_t part;          // the host step's part holding it
  };
  static space_ops<host_space> host_ops_for(const space_ops<Space>& ops) {
    if constexpr (std::is_same_v<Space, host_space>)
      return ops;
    else
      return {};
  }
  static std::size_t at(flat_coords k, const chunk& c) noexcept {
    return k == flat_coords::full ? c.full_offset : c.shard_offset;
  }
  typename copy_queue<Space>::event to_host(const chunk& c, flat_span<const Grad, Space> grads,
                                            flat_span<Working, Space> working) {
    if constexpr (!has_master) {  // the fp32 values the step updates: the device's
      queue_.to_host(working.data + at(working.coords, c), working_h_.data() + c.shard_offset,
                     c.count * sizeof(Working));
    }
    return queue_.to_host(grads.data + at(grads.coords, c), grads_h_.data() + c.shard_offset,
                          c.count * sizeof(Grad));
  }
  void to_device(const chunk& c, flat_span<Working, Space> working) {
    queue_.to_device(working_h_.data() + c.shard_offset, working.data + at(working.coords, c),
                     c.count * sizeof(Working));
  }

  const flat_layout* layout_;
  std::size_t shard_index_;
  space_ops<Space> ops_;
  memory_ledger own_ledger_;
  memory_ledger* ledger_;
  host_optimizer host_;
  buffer<Grad, host_space> grads_h_;
  buffer<Working, host_space> working_h_;
  std::vector<chunk> chunks_;
  offload_schedule schedule_ = offload_schedule::pipelined;
  copy_queue<Space> queue_;
};

SHARDKIT_NAMESPACE_END
