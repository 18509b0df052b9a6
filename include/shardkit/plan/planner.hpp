//! \file plan/planner.hpp
//! "Which stage fits?": for one model, set-up and cluster, the bytes each rank holds and sends
//! and the predicted communication time of every ZeRO stage, whether it fits in a GPU's memory,
//! and the lowest stage that does. Includes the rest of plan/.
//!
//!     namespace plan = shardkit::plan;
//!     constexpr plan::unit model[] = {{7'000'000'000}};  // one entry per unit or bucket
//!     constexpr plan::setup s{.ranks = 8};               // bf16 + fp32 master + AdamW
//!     constexpr auto report = plan::plan_all(s, model, plan::cluster{}, {80'000'000'000});
//!     static_assert(report.recommended == 1 &&
//!                   report.stages[1].memory.total() == 38'500'000'000);
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/plan/comm.hpp>
#include <shardkit/plan/formulas.hpp>
#include <shardkit/plan/memory.hpp>
#include <shardkit/plan/model.hpp>
#include <shardkit/plan/time.hpp>

#include <array>
#include <cstdint>
#include <span>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

//! The memory of one GPU and how much of it to leave free.
struct gpu_budget {
  std::uint64_t memory_bytes = 0;    //!< bytes of memory per GPU
  std::uint64_t headroom_bytes = 0;  //!< bytes kept free (CUDA context, fragmentation, ...)
  //! Bytes a rank may use: memory − headroom (0 when the headroom is larger).
  constexpr std::uint64_t usable() const noexcept {
    return memory_bytes > headroom_bytes ? memory_bytes - headroom_bytes : 0;
  }
};

//! Everything the planner predicts for one stage.
struct stage_plan {
  setup config;                      //!< the set-up, with `stage` set
  layout_summary layout;             //!< sizes of the flat layout
  memory_bytes memory;               //!< bytes held per rank, by category
  comm_bytes sent;                   //!< bytes sent per step by the rank asked for
  double ring_time_s = 0.0;          //!< communication per step, flat rings (plan/time.hpp)
  double hierarchical_time_s = 0.0;  //!< communication per step, two-level collectives
  std::uint64_t live_elems = 0;      //!< ZeRO-3: bound on gathered elements (0 otherwise)
  bool live_ok = true;               //!< ZeRO-3: live_elems within setup::max_live_elems
  bool fits = false;                 //!< memory.total() ≤ budget.usable() and live_ok
};

//! Plans stage `s.stage` for `units` on cluster `c`, with bytes sent by rank `rank`.
//! Preconditions: invalid_reason(s) and placement_problem(s, c) are null, rank < s.ranks.
constexpr stage_plan plan_stage(const setup& s, std::span<const unit> units, const cluster& c,
                                const gpu_budget& budget, std::uint64_t rank = 0) {
  stage_plan p;
  p.config = s;
  p.layout = summarize(s, units);
  p.memory = memory_per_rank(s, p.layout);
  p.sent = bytes_sent_per_step(s, units, rank);
  p.ring_time_s = comm_time_per_step(s, units, c, algorithm::ring);
  p.hierarchical_time_s = comm_time_per_step(s, units, c, algorithm::hierarchical);
  p.live_elems = live_elems(s, p.layout);
  p.live_ok = live_limit_ok(s, p.layout);
  p.fits = p.live_ok && p.memory.total() <= budget.usable();
  return p;
}

//! Stages 0-3 side by side and the recommendation.
struct plan_report {
  std::array<stage_plan, 4> stages{};  //!< stages[i] is stage i
  int recommended = -1;                //!< the lowest stage that fits; -1 when none does
};

//! Plans every stage with the set-up `base` (its `stage` is ignored; a hybrid shard group
//! applies to stages 1-3) and recommends the lowest stage that fits: lower stages communicate
//! no more (stage 3 sends 1.5× as much) and keep more state local.
constexpr plan_report plan_all(setup base, std::span<const unit> units, const cluster& c,
                               const gpu_budget& budget, std::uint64_t rank = 0) {
  plan_report r;
  for (int st = 0; st <= 3; ++st) {
    base.stage = st;
    r.stages[static_cast<std::size_t>(st)] = plan_stage(base, units, c, budget, rank);
    if (r.recommended < 0 && r.stages[static_cast<std::size_t>(st)].fits) r.recommended = st;
  }
  return r;
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
