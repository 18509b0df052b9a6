//! \file zero/engine_reports.hpp
//! What an engine reports of itself against the closed forms of zero/accounting.hpp: the
//! model-state bytes and step traffic the formulas predict for its configuration, ZeRO-3's bound
//! on gathered bytes, and the bytes its ledger measures. A base of engine (the CRTP keeps them
//! members: eng.expected_state_bytes()); it reads the engine only through its public accessors.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/zero/accounting.hpp>

#include <cstddef>
#include <cstdint>

SHARDKIT_NAMESPACE_BEGIN

template <class Engine>
class engine_reports {
 public:
  //! Bytes per element of each kind of model state: working parameters, gradients, fp32 master
  //! (0 in fp32 training) and optimizer state.
  static constexpr accounting::precision precision() noexcept {
    using W = typename Engine::working_type;
    using G = typename Engine::grad_type;
    return {sizeof(W), sizeof(G), Engine::has_master ? 4u : 0u,
            4 * Engine::optimizer_type::state_count};
  }

  //! The optimizer's master and state are in host memory (OffloadOptimizer).
  static constexpr bool offloaded = requires { Engine::optimizer_component::offloads; };

  //! Model-state bytes per rank that zero/accounting.hpp predicts for this configuration, in
  //! the engine's ledger (memory()): with the optimizer offloaded, no master and no state.
  accounting::state_bytes expected_state_bytes() const noexcept {
    const auto& e = self();
    const auto& l = e.layout();
    accounting::state_bytes b = accounting::model_state_bytes(
        Engine::stage, l.numel(), static_cast<std::uint64_t>(e.shard_size()),
        Engine::stage == 0 ? l.numel() : l.shard_numel(), precision());
    if constexpr (offloaded) b.master_params = b.optimizer_moments = 0;
    return b;
  }

  //! With the optimizer offloaded: the host bytes its ledger (optimizer().memory()) holds.
  accounting::offload_host_bytes expected_host_bytes() const noexcept {
    static_assert(offloaded, "engine::expected_host_bytes(): only with OffloadOptimizer");
    return accounting::offloaded_host_bytes(self().layout().shard_numel(), precision());
  }

  //! Data bytes per rank per step (one micro-batch) that zero/accounting.hpp predicts for this
  //! configuration.
  std::uint64_t expected_step_bytes_sent() const noexcept {
    const auto& e = self();
    const auto& l = e.layout();
    accounting::step_shape s;
    s.stage = Engine::stage;
    s.ranks = static_cast<std::uint64_t>(e.ranks());
    s.shard_ranks = Engine::stage == 0 ? 1 : static_cast<std::uint64_t>(e.shard_size());
    s.psi = l.numel();
    s.shard = Engine::stage == 0 ? l.numel() : l.shard_numel();
    s.grad_bytes = precision().grad_bytes;
    s.working_bytes = precision().working_bytes;
    auto group = [&](std::size_t g) {
      const auto& ge = l.group(g);
      accounting::group_shape x{ge.numel, ge.shard, false, true};
      if constexpr (Engine::shards_params) {
        x.persistent = e.parameters().persistent(g);
        x.reshard_after_forward = e.parameters().reshard_after_forward(g);
      }
      return x;
    };
    return accounting::step_bytes_sent(s, l.num_groups(), group,
                                       static_cast<std::uint64_t>(e.rank()));
  }

  //! ZeRO-3: the most gathered-parameter bytes the schedule may hold at once:
  //! w·(min(1 + prefetch, transient units)·largest non-persistent unit + persistent units +
  //! units kept from forward to backward), each unit at its padded size N·S_u, and at most
  //! max_live_elems·w when set. 0 in stages 0-2.
  std::uint64_t gathered_bytes_bound() const noexcept {
    if constexpr (Engine::shards_params)
      return self().parameters().live_bound_elems() * precision().working_bytes;
    else
      return 0;
  }

  //! Model-state bytes held now, measured by the ledger.
  accounting::state_bytes measured_state_bytes() const noexcept {
    const memory_ledger& m = self().memory();
    return {m.current(memory_category::working_params), m.current(memory_category::grads),
            m.current(memory_category::master_params),
            m.current(memory_category::optimizer_moments)};
  }

 private:
  const Engine& self() const noexcept { return static_cast<const Engine&>(*this); }
};

SHARDKIT_NAMESPACE_END
