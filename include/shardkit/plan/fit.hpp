//! \file plan/fit.hpp
//! A least-squares fit of the alpha-beta model of plan/time.hpp to timed collectives: one link
//! (α, bandwidth) to all samples, or one per collective and placement. plan/calibrate.hpp times
//! the samples on a communicator; plan/sampled.hpp reads times off them without a fit.
//!
//! **The fit.** time.hpp's flat-ring time of every collective is linear in (α, β):
//!
//!     t = a·α + b·β,   reduce-scatter, all-gather, all-to-all: a = P−1,  b = (P−1)·c·e
//!                      all-reduce:                             a = 2(P−1), b = 2(P−1)·⌈n/P⌉·e
//!                      broadcast:                              a = P−1,  b = n·e
//!                      barrier:                                a = P−1,  b = 0
//!
//! (ring_coefficients()). Sizes of a sweep span four decades (4 KiB–64 MiB), and what the planner
//! needs is a small *relative* error at every size, so the fit minimises the sum of squared
//! relative errors Σ((a_i·α + b_i·β − t_i) / t_i)²: least squares with weights 1/t_i². An
//! unweighted fit would let the largest sizes decide alone and could miss the latency of small
//! messages by orders of magnitude. It is solved exactly (2×2 normal equations on columns scaled
//! to unit norm).
//!
//! A negative α (the latency is below what the samples resolve, or noise) is not clamped
//! silently: the fit is repeated with α fixed at 0 (the best β alone) and the result says so
//! (`latency_fixed_at_zero`, with the unconstrained α in `unconstrained_latency_s`). A β that is
//! not positive (times that do not grow with size) cannot be a bandwidth: calibration_error.
//! Inputs are checked: every sample has P ≥ 2, a positive finite time, a known collective with
//! bytes to move for a bandwidth term, and the samples have at least two distinct message sizes
//! (b/a, the bytes of one ring step); otherwise α and β cannot be told apart.
//!
//! What the fit absorbs: the model counts only messages and bytes; the communicator's own
//! arithmetic (shardkit reduces on the host in rank order), copies and synchronisation land in
//! α and β. That is what makes the calibrated model predict this communicator, and also why a
//! calibration is only valid for the communicator, rank count and machine it was measured on.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/plan/time.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

//! A calibration input that cannot be fitted; the message says what was wrong and what was
//! expected.
class calibration_error : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

//! One timed collective: `count` elements of `elem_bytes` bytes on `ranks` ranks took `seconds`
//! (count as in collective_time: per rank for reduce-scatter/all-gather/all-to-all, the whole
//! array for all-reduce/broadcast).
struct calibration_sample {
  collective op = collective::all_reduce;
  std::uint64_t count = 0;
  std::uint64_t elem_bytes = 4;
  std::uint64_t ranks = 2;
  double seconds = 0.0;
  bool in_place = false;  //!< run in place (see cluster::intra_all_reduce_in_place)
};

//! The fitted link and how well it explains the samples.
struct link_fit {
  link fitted;                         //!< α and bandwidth (1/β)
  bool latency_fixed_at_zero = false;  //!< the unconstrained α was negative: refitted with α = 0
  double unconstrained_latency_s = 0;  //!< α of the two-parameter fit (negative when fixed)
  double max_rel_error = 0;            //!< max over samples of |model − measured| / measured
  double rms_rel_error = 0;            //!< root mean square of the relative errors
  std::vector<double> model_seconds;   //!< the fitted model's time of each sample, in order
};

namespace detail {
inline std::string describe_sample(std::size_t i, const calibration_sample& s) {
  return shardkit::detail::concat("sample ", i, " (", name(s.op), s.in_place ? " in place" : "",
                                  ", count ", s.count, ", ", s.elem_bytes, "-byte elements, ",
                                  s.ranks, " ranks, ", s.seconds, " s)");
}
}  // namespace detail

//! Least-squares fit of (α, β) to `samples`, weighted by 1/t² (relative errors; see the file
//! comment). Throws calibration_error naming the sample and what was expected when the samples
//! cannot determine a link.
inline link_fit fit_link(std::span<const calibration_sample> samples) {
  using detail::describe_sample;
  if (samples.size() < 2) {
    shardkit::detail::raise<calibration_error>(
        "fit_link: ", samples.size(), " sample(s); expected at least 2 with different sizes");
  }
  std::vector<ring_terms> terms;
  terms.reserve(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    if (s.ranks < 2) {
      shardkit::detail::raise<calibration_error>(
          "fit_link: ", describe_sample(i, s), " has ", s.ranks,
          " rank(s); expected at least 2 (one rank sends nothing)");
    }
    if (!(s.seconds > 0) || !std::isfinite(s.seconds)) {
      shardkit::detail::raise<calibration_error>(
          "fit_link: ", describe_sample(i, s),
          " has a time that is not a positive finite number of "
          "seconds");
    }
    if (s.op == collective::barrier || s.count == 0 || s.elem_bytes == 0) {
      shardkit::detail::raise<calibration_error>(
          "fit_link: ", describe_sample(i, s),
          " moves no bytes; expected an all-gather, reduce-scatter, "
          "all-reduce, all-to-all or broadcast of at least 1 element");
    }
    terms.push_back(ring_coefficients(s.op, s.count, s.elem_bytes, s.ranks));
  }
  // At least two distinct message sizes (bytes per ring step, b/a), or α and β are collinear.
  const double first = terms[0].b / terms[0].a;
  const bool distinct = std::any_of(terms.begin(), terms.end(), [&](const ring_terms& t) {
    return std::abs(t.b / t.a - first) > 1e-9 * first;
  });
  if (!distinct) {
    shardkit::detail::raise<calibration_error>(
        "fit_link: every sample has the same message size (", first,
        " bytes per ring step); expected at least 2 distinct sizes to tell latency from "
        "bandwidth");
  }
  // Rows (a_i/t_i, b_i/t_i) against 1: ordinary least squares on the relative errors. Columns
  // scaled to unit norm (a is ~1, b up to ~1e8) before solving the 2x2 normal equations.
  double na = 0, nb = 0;
  for (std::size_t i = 0; i < terms.size(); ++i) {
    const double t = samples[i].seconds;
    na += (terms[i].a / t) * (terms[i].a / t);
    nb += (terms[i].b / t) * (terms[i].b / t);
  }
  na = std::sqrt(na);
  nb = std::sqrt(nb);
  double saa = 0, sab = 0, sbb = 0, sa1 = 0, sb1 = 0;
  for (std::size_t i = 0; i < terms.size(); ++i) {
    const double t = samples[i].seconds;
    const double xa = terms[i].a / t / na, xb = terms[i].b / t / nb;
    saa += xa * xa;
    sab += xa * xb;
    sbb += xb * xb;
    sa1 += xa;
    sb1 += xb;
  }
  const double det = saa * sbb - sab * sab;
  link_fit r;
  double alpha = 0, beta = 0;
  if (det > 1e-14) {
    alpha = (sbb * sa1 - sab * sb1) / det / na;
    beta = (saa * sb1 - sab * sa1) / det / nb;
  } else {  // numerically collinear
    shardkit::detail::raise<calibration_error>(
        "fit_link: the message sizes are too close to tell latency from bandwidth; expected "
        "sizes that differ by a factor of at least 2 or so");
  }
  r.unconstrained_latency_s = alpha;
  if (alpha < 0) {  // the best fit with α = 0: β = Σ x_b / Σ x_b² (scaled)
    r.latency_fixed_at_zero = true;
    alpha = 0;
    beta = sb1 / sbb / nb;
  }
  if (!(beta > 0) || !std::isfinite(beta)) {
    shardkit::detail::raise<calibration_error>(
        "fit_link: the fitted time per byte is ", beta,
        " s, not positive: the measured times do not grow with size; expected samples whose "
        "time increases with the bytes moved (check the sizes and the timer)");
  }
  r.fitted = link{alpha, 1.0 / beta};
  double sq = 0;
  r.model_seconds.reserve(terms.size());
  for (std::size_t i = 0; i < terms.size(); ++i) {
    const double m = terms[i].a * alpha + terms[i].b * beta;
    const double rel = std::abs(m - samples[i].seconds) / samples[i].seconds;
    r.model_seconds.push_back(m);
    r.max_rel_error = std::max(r.max_rel_error, rel);
    sq += rel * rel;
  }
  r.rms_rel_error = std::sqrt(sq / static_cast<double>(terms.size()));
  return r;
}

//! One fitted link per collective and placement: fit_link over the samples of each of
//! all-reduce, reduce-scatter and all-gather, out of place and in place, on its own (unset: no
//! samples of it). A communicator whose collectives are not all rings of one link (the thread
//! communicator's one-pass all-reduce) fits one link badly and these well;
//! cluster::intra_all_reduce etc. take them (set_per_collective_links). Throws
//! calibration_error as fit_link does, naming the collective and placement.
struct collective_fits {
  std::optional<link_fit> all_reduce, reduce_scatter, all_gather;
  std::optional<link_fit> all_reduce_in_place, reduce_scatter_in_place, all_gather_in_place;

  std::optional<link_fit>& of(collective op, bool in_place) {
    if (op == collective::all_reduce) return in_place ? all_reduce_in_place : all_reduce;
    if (op == collective::reduce_scatter) {
      return in_place ? reduce_scatter_in_place : reduce_scatter;
    }
    return in_place ? all_gather_in_place : all_gather;
  }
  const std::optional<link_fit>& of(collective op, bool in_place) const {
    return const_cast<collective_fits&>(*this).of(op, in_place);
  }
};

inline collective_fits fit_links_per_collective(std::span<const calibration_sample> samples) {
  collective_fits f;
  for (const bool in_place : {false, true}) {
    for (const collective op :
         {collective::all_reduce, collective::reduce_scatter, collective::all_gather}) {
      std::vector<calibration_sample> mine;
      for (const auto& s : samples) {
        if (s.op == op && s.in_place == in_place) mine.push_back(s);
      }
      if (mine.empty()) continue;
      link_fit r;
      try {
        r = fit_link(mine);
      } catch (const calibration_error& e) {
        shardkit::detail::raise<calibration_error>("the ", name(op), in_place ? " in-place" : "",
                                                   " samples alone: ", e.what());
      }
      f.of(op, in_place) = std::move(r);
    }
  }
  return f;
}

//! Makes `c` use the links of `f` inside a node, collective by collective and placement by
//! placement (the others keep c.intra, or the collective's out-of-place link).
inline void set_per_collective_links(cluster& c, const collective_fits& f) {
  if (f.all_reduce) c.intra_all_reduce = f.all_reduce->fitted;
  if (f.reduce_scatter) c.intra_reduce_scatter = f.reduce_scatter->fitted;
  if (f.all_gather) c.intra_all_gather = f.all_gather->fitted;
  if (f.all_reduce_in_place) c.intra_all_reduce_in_place = f.all_reduce_in_place->fitted;
  if (f.reduce_scatter_in_place) {
    c.intra_reduce_scatter_in_place = f.reduce_scatter_in_place->fitted;
  }
  if (f.all_gather_in_place) c.intra_all_gather_in_place = f.all_gather_in_place->fitted;
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
