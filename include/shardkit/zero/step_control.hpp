//! \file zero/step_control.hpp
//! `step_control`: what decides a step besides the optimizer. Once per step, after the
//! gradients are reduced, it runs one *control exchange* over all ranks: the exact gradient
//! statistics of the elements each rank owns (for clipping, the reported norms and overflow
//! detection), the count of non-finite gradients, and the schedule check (every rank must have
//! issued the same sequence of data collectives). It is one all-reduce of 64-bit words (sum),
//! plus one max all-reduce when the inf-norm is needed, and nothing when no feature asks for it.
//! From the result it derives whether the step is skipped (a non-finite gradient), the gradient
//! multiplier (averaging, unscaling, clipping), and the next loss scale (dynamic loss scaling).
//!
//! The norm is exact: integer bins (kernels/host/grad_stats.hpp), so every stage, rank count
//! and hybrid layout computes the same bits.
#pragma once

#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/kernels/host/grad_stats.hpp>
#include <shardkit/zero/space_ops.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
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

//! What one call of step() did.
struct step_report {
  std::uint64_t step = 0;  //!< optimizer steps taken, this one included
  float lr = 0.0f;         //!< learning rate used (parameter group 0)
  std::uint64_t bytes_sent =
      0;  //!< data bytes this rank sent since the previous step() (or set-up)
  std::uint64_t control_bytes_sent = 0;  //!< bytes of the engine's small control collectives
  std::size_t micro_batches = 1;         //!< micro-batches accumulated into this step
  //! The step was skipped on every rank because a gradient was infinite or NaN (only detected
  //! when loss scaling, clipping or report_grad_norm needs a pass over the gradients).
  bool skipped = false;
  //! L2 norm of the averaged, unscaled gradient (NaN: not computed; +inf when an element is
  //! infinite or NaN, and the step is skipped).
  float grad_norm = NAN;
  float grad_inf_norm = NAN;  //!< largest |element| of it (NaN: not computed; +inf as above)
  float clip_coef = 1.0f;     //!< factor the clipping applied
  float loss_scale = 1.0f;    //!< the loss scale to use for the next step
  bool loss_scale_at_minimum = false;  //!< an overflow happened with the scale at min_scale
  //! Wall time of the optimizer's update of this rank's shard (0 when skipped; a device engine:
  //! the time to enqueue it, the device runs it later); the rest of
  //! step() is communication (the gradients' last reductions, the control exchange, the
  //! parameters' all-gather) and bookkeeping.
  double optimizer_seconds = 0.0;
};

//! Settings of step_control (the engine's engine_options fields of the same names).
struct step_control_options {
  //! Clip the global gradient norm to this value (0 = no clipping).
  float clip_grad_norm = 0.0f;
  grad_norm_kind clip_norm = grad_norm_kind::l2;
  //! Compute and report the gradient norms even without clipping.
  bool report_grad_norm = false;
  //! Dynamic loss scaling; unset: on when `fp16` below, off otherwise.
  std::optional<loss_scale_options> loss_scale;
  bool disable_loss_scale = false;
  //! The working parameters are fp16 (loss scaling is on unless disabled).
  bool fp16 = false;
  //! Compare the ranks' collective sequences at every step.
  bool check_schedule = true;
};

//! The outcome of one control exchange.
struct control_result {
  bool have_norm = false;
  bool have_inf_norm = false;
  double norm_squared = 0.0;  //!< of the summed (unaveraged, scaled) gradient
  double max_abs = 0.0;
  std::uint64_t nonfinite = 0;
  bool schedule_ok = true;  //!< every rank issued the same sequence of collectives
};

template <memory_space Space>
class step_control {
 public:
  explicit step_control(step_control_options opts = {}, space_ops<Space> ops = {})
      : opts_(std::move(opts)), ops_(std::move(ops)) {
    validate();
    if (loss_scaling()) scale_ = scaler().init_scale;
  }

  //! The loss scale the framework multiplies its loss by before backward (1 without loss
  //! scaling).
  float loss_scale() const noexcept { return scale_; }
  bool loss_scaling() const noexcept {
    if (opts_.disable_loss_scale) return false;
    return opts_.loss_scale.has_value() || opts_.fp16;
  }
  bool needs_norm() const noexcept {
    return opts_.report_grad_norm ||
           (opts_.clip_grad_norm > 0.0f && opts_.clip_norm == grad_norm_kind::l2);
  }
  bool needs_inf_norm() const noexcept {
    return opts_.report_grad_norm ||
           (opts_.clip_grad_norm > 0.0f && opts_.clip_norm == grad_norm_kind::inf);
  }
  const step_control_options& options() const noexcept { return opts_; }

  //! The control exchange (collective over `world`). `for_each_owned(f)` visits the runs of
  //! reduced gradient elements this rank accounts for, f(const G*, count), so that over all
  //! ranks every element is visited `replicas` times (hybrid sharding: once per replica; the
  //! integer sums divide exactly). `schedule` says whether to compare `sequence_hash` across
  //! ranks. The exchange's bytes are recorded in `control_traffic`.
  template <float_storage G, class Comm, class ForEach>
  control_result exchange(Comm& world, ForEach&& for_each_owned, bool schedule,
                          std::uint64_t sequence_hash, std::uint64_t replicas,
                          traffic_ledger& control_traffic) {
    control_result res;
    const int ranks = world.size();
    const bool stats = needs_norm() || needs_inf_norm();
    const bool overflow = stats || loss_scaling();
    schedule = schedule && opts_.check_schedule && ranks > 1;
    if (!overflow && !schedule) return res;
    host::grad_stats st;
    std::uint64_t nonfinite = 0;
    if (stats) {
      st = ops_.template grad_stats<G>(for_each_owned);
      nonfinite = st.nonfinite();
    } else if (overflow) {
      nonfinite = ops_.template count_nonfinite<G>(for_each_owned);
    }
    std::vector<std::uint64_t> msg;
    if (stats) msg.assign(st.words.begin(), st.words.begin() + host::grad_stats::bins);
    const std::size_t at_nonfinite = msg.size();
    msg.push_back(nonfinite);
    const std::size_t at_hash = msg.size();
    if (schedule) {
      msg.push_back(sequence_hash);
      msg.push_back(sequence_hash * sequence_hash);
    }
    auto record = [&](std::size_t count, std::size_t elem_bytes) {
      control_traffic.record(
          collective::all_reduce,
          ring_bytes_sent(collective::all_reduce, count, elem_bytes,
                          static_cast<std::size_t>(ranks), static_cast<std::size_t>(world.rank())));
    };
    if (ranks > 1) {
      ops_.all_reduce_host(world, msg.data(), msg.size(), reduce_op::sum);
      record(msg.size(), sizeof(std::uint64_t));
    }
    std::uint32_t max_bits = st.max_abs_bits;
    if (needs_inf_norm() && ranks > 1) {
      ops_.all_reduce_host(world, &max_bits, 1, reduce_op::max);
      record(1, sizeof(std::uint32_t));
    }
    if (schedule) {
      const std::uint64_t n = static_cast<std::uint64_t>(ranks);
      res.schedule_ok = msg[at_hash] == n * sequence_hash &&
                        msg[at_hash + 1] == n * (sequence_hash * sequence_hash);
    }
    if (replicas > 1) {
      for (std::size_t i = 0; i <= at_nonfinite; ++i) msg[i] /= replicas;
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

  //! Fills the report's norms, clip coefficient and skip flag from an exchange whose gradient
  //! sum is multiplied by `base` (1 / (ranks · micro-batches · loss scale) when averaging), and
  //! returns the gradient multiplier of the optimizer step: base · clip coefficient.
  double decide(const control_result& ctl, double base, step_report& rep) const {
    // A non-finite element makes every norm infinite (the sums above count only finite ones).
    const double inf = std::numeric_limits<double>::infinity();
    if (ctl.have_norm) {
      rep.grad_norm =
          static_cast<float>(ctl.nonfinite != 0 ? inf : std::sqrt(ctl.norm_squared) * base);
    }
    if (ctl.have_inf_norm) {
      rep.grad_inf_norm = static_cast<float>(ctl.nonfinite != 0 ? inf : ctl.max_abs * base);
    }
    double coef = 1.0;
    if (opts_.clip_grad_norm > 0.0f && ctl.nonfinite == 0) {
      const double norm = opts_.clip_norm == grad_norm_kind::l2 ? std::sqrt(ctl.norm_squared) * base
                                                                : ctl.max_abs * base;
      coef = std::min(1.0, static_cast<double>(opts_.clip_grad_norm) / (norm + 1e-6));
    }
    rep.clip_coef = static_cast<float>(coef);
    rep.skipped = ctl.nonfinite != 0;
    return base * coef;
  }

  //! Adapts the loss scale after a step (skipped or not) and reports the next one.
  void update_scale(step_report& rep) {
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

  //! The loss scaler's state (for checkpoints): the scale and the steps since the last overflow.
  std::uint32_t good_steps() const noexcept { return good_steps_; }
  void set_scale_state(float scale, std::uint32_t good_steps) {
    if (!(scale > 0.0f) || !std::isfinite(scale)) {
      detail::raise("step_control: a loss scale must be finite and positive, got ", scale);
    }
    scale_ = scale;
    good_steps_ = good_steps;
  }

 private:
  loss_scale_options scaler() const noexcept {
    return opts_.loss_scale ? *opts_.loss_scale : loss_scale_options{};
  }

  void validate() const {
    if (!(opts_.clip_grad_norm >= 0.0f) || !std::isfinite(opts_.clip_grad_norm)) {
      detail::raise("step_control: clip_grad_norm must be finite and >= 0 (0 = off), got ",
                    opts_.clip_grad_norm);
    }
    if (opts_.loss_scale) {
      const auto& l = *opts_.loss_scale;
      if (!(l.min_scale > 0.0f && l.init_scale >= l.min_scale && std::isfinite(l.init_scale)) ||
          !(l.growth_factor >= 1.0f) || !(l.backoff_factor > 0.0f && l.backoff_factor < 1.0f) ||
          l.growth_interval == 0) {
        detail::raise(
            "step_control: loss_scale_options need 0 < min_scale <= init_scale (finite), "
            "growth_factor >= 1, 0 < backoff_factor < 1 and growth_interval >= 1; got init ",
            l.init_scale, ", min ", l.min_scale, ", growth ", l.growth_factor, " every ",
            l.growth_interval, ", backoff ", l.backoff_factor);
      }
    }
  }

  step_control_options opts_;
  space_ops<Space> ops_;
  float scale_ = 1.0f;
  std::uint32_t good_steps_ = 0;
};

SHARDKIT_NAMESPACE_END
