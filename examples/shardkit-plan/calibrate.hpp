// shardkit-plan --calibrate: times all-gather, reduce-scatter and all-reduce on this machine
// (plan/calibrate.hpp), fits the alpha-beta model's link to them, and one link to each
// collective alone, and prints the fitted values as the flags to pass back to shardkit-plan
// (--intra-alpha/--intra-bw, then --intra-all-reduce-alpha/-bw etc.), with a table of measured
// against fitted times. Its flags are parsed in options.hpp.
//
//   shardkit-plan --calibrate [--comm thread|mpi] [--ranks N] [--max-bytes B] [--reps K]
//                             [--dtype bf16|fp32] [--cold-bytes B] [--fresh-input]
//                             [--in-place] [--async]
//   mpiexec -np 4 shardkit-plan --calibrate          (the MPI world; --comm mpi is the default
//                                                     under an MPI launcher)
//
// The ranks are on one node here, so the fit is the intra-node link and --gpus-per-node is the
// number of ranks timed. Exit status as the planner's: 2 for bad arguments, 1 for other errors.
#pragma once

#include <shardkit/comm/thread.hpp>
#include <shardkit/plan/calibrate.hpp>

#if defined(SHARDKIT_PLAN_MPI)
#include <shardkit/comm/mpi.hpp>
#endif

#include "parse.hpp"
#include "samples_file.hpp"

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shardkit_plan {

namespace plan = shardkit::plan;

//! What the flags of --calibrate ask for (options.hpp parses them).
struct calibrate_options {
  std::string comm;  // "thread", "mpi" or empty (by launcher)
  std::uint64_t ranks = 4;
  bool ranks_given = false;
  // bf16: the planner's default --dtype.
  plan::sweep_options sweep{.cold_bytes = std::size_t{256} << 20, .element = shardkit::dtype::bf16};
  std::string save_samples;  // --save-samples FILE: the samples, for the planner's --samples
};

//! Bytes with a unit (64KiB, 16MiB) or a plain number of bytes (65536).
inline std::uint64_t parse_plain_or_unit_bytes(std::string_view flag, std::string_view text) {
  if (!text.empty() && std::isdigit(static_cast<unsigned char>(text.back()))) {
    return cli::parse_count(flag, text);
  }
  return cli::parse_bytes(flag, text);
}

//! "3.1us", "850ns", "1.2ms": a duration shardkit-plan's --*-alpha flags parse back.
inline std::string format_duration_flag(double s) {
  char buf[64];
  if (s == 0) return "0us";
  if (s < 1e-6) {
    std::snprintf(buf, sizeof buf, "%.4gns", s * 1e9);
  } else if (s < 1e-3) {
    std::snprintf(buf, sizeof buf, "%.4gus", s * 1e6);
  } else {
    std::snprintf(buf, sizeof buf, "%.4gms", s * 1e3);
  }
  return buf;
}

//! "5.2GB/s", "850MB/s": a bandwidth the --*-bw flags parse back.
inline std::string format_bandwidth_flag(double bytes_per_s) {
  char buf[64];
  if (bytes_per_s >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.4gGB/s", bytes_per_s / 1e9);
  } else if (bytes_per_s >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.4gMB/s", bytes_per_s / 1e6);
  } else {
    std::snprintf(buf, sizeof buf, "%.4gkB/s", bytes_per_s / 1e3);
  }
  return buf;
}

//! The flags that put a calibration of `ranks` ranks on one node into shardkit-plan: the one
//! link, then each collective's own link that `per` has (--intra-all-reduce-alpha/-bw etc.),
//! then its in-place one (--intra-all-reduce-in-place-alpha/-bw etc.).
inline std::string calibration_flags(const plan::link& l, std::uint64_t ranks,
                                     const plan::collective_fits& per = {}) {
  std::string flags = "--gpus-per-node " + std::to_string(ranks) + " --intra-alpha " +
                      format_duration_flag(l.latency_s) + " --intra-bw " +
                      format_bandwidth_flag(l.bytes_per_s);
  for (const bool in_place : {false, true}) {
    for (const auto& [name, op] :
         {std::pair{"all-reduce", shardkit::collective::all_reduce},
          std::pair{"reduce-scatter", shardkit::collective::reduce_scatter},
          std::pair{"all-gather", shardkit::collective::all_gather}}) {
      const auto& fit = per.of(op, in_place);
      if (!fit) continue;
      const std::string flag = std::string(" --intra-") + name + (in_place ? "-in-place" : "");
      flags += flag + "-alpha " + format_duration_flag(fit->fitted.latency_s) + flag + "-bw " +
               format_bandwidth_flag(fit->fitted.bytes_per_s);
    }
  }
  return flags;
}

//! The note --calibrate ends with when a fitted line lies more than 15% off the sweep's own time
//! at some size: one α-β line per collective cannot follow a host communicator's cost per byte
//! where the buffers leave the caches, and the planner predicts a step's calls of those sizes
//! that far off too (benchmarks/README.md measures it). Names the worst of the per-collective
//! fits (or the one link where there are none) and points to the samples, which the planner
//! reads off directly. `saving`: --save-samples was given. Empty when every fit is within 15%.
inline std::string fit_note(const plan::link_fit& one, const plan::collective_fits& per,
                            bool saving) {
  std::string worst = "the one link";
  double err = one.max_rel_error;
  bool any = false;
  for (const bool in_place : {false, true}) {
    for (const auto op : {shardkit::collective::all_reduce, shardkit::collective::reduce_scatter,
                          shardkit::collective::all_gather}) {
      const auto& f = per.of(op, in_place);
      if (!f) continue;
      if (!any || f->max_rel_error > err) {
        err = f->max_rel_error;
        worst = std::string("the ") + shardkit::name(op) + (in_place ? " in-place" : "") + " line";
      }
      any = true;
    }
  }
  if (!(err > 0.15)) return {};
  char pct[32];
  std::snprintf(pct, sizeof pct, "%.1f%%", 100.0 * err);
  return "note: " + worst + " lies up to " + pct +
         " off the sweep's own time at some size (one line per collective cannot follow a cost "
         "per byte that changes where the buffers leave the caches), and the planner's times "
         "for calls of such sizes are as far off; " +
         (saving ? std::string("pass the samples written below to the planner as --samples FILE")
                 : std::string("calibrate with --save-samples FILE and pass the planner "
                               "--samples FILE")) +
         " to read those calls' times off the measurements instead";
}

inline std::string human_time(double s) {
  char buf[64];
  if (s < 1e-3) {
    std::snprintf(buf, sizeof buf, "%.2f us", s * 1e6);
  } else {
    std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  }
  return buf;
}

//! Prints the measured samples against the fit, the flags, and fit_note's note where a line lies
//! more than 15% off (`saving`: --save-samples was given); when the samples cannot be fitted,
//! prints them with the reason and returns 1 (else 0).
inline int print_calibration(const std::vector<plan::calibration_sample>& samples, const char* comm,
                             std::uint64_t ranks, const plan::sweep_options& o,
                             bool saving = false) {
  std::printf(
      "shardkit-plan --calibrate: %s communicator, %llu ranks, %s, %zu B - %zu B buffers, "
      "median of %d%s%s%s%s\n",
      comm, static_cast<unsigned long long>(ranks), shardkit::name(o.element), o.min_bytes,
      o.max_bytes, o.reps, o.fresh_input ? ", inputs written before each call" : "",
      o.asynchronous ? ", asynchronous" : "",
      o.optimizer_bytes != 0 ? ", optimizer's bytes streamed before in-place all-gathers" : "",
      o.gather_outputs != 0 ? ", out-of-place all-gathers on their own outputs" : "");
  std::optional<plan::link_fit> fit;
  std::string why;
  try {
    fit = plan::fit_link(samples);
  } catch (const plan::calibration_error& e) {
    why = e.what();
  }
  std::printf("  %-24s %12s %13s %13s %8s\n", "collective", "bytes", "measured", "fitted", "error");
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    const std::uint64_t whole =
        (s.op == shardkit::collective::all_reduce ? s.count : s.count * s.ranks) * s.elem_bytes;
    const std::string what = std::string(shardkit::name(s.op)) + (s.in_place ? " in place" : "");
    if (fit) {
      const double m = fit->model_seconds[i];
      std::printf("  %-24s %12llu %13s %13s %+7.1f%%\n", what.c_str(),
                  static_cast<unsigned long long>(whole), human_time(s.seconds).c_str(),
                  human_time(m).c_str(), 100.0 * (m - s.seconds) / s.seconds);
    } else {
      std::printf("  %-24s %12llu %13s %13s %8s\n", what.c_str(),
                  static_cast<unsigned long long>(whole), human_time(s.seconds).c_str(), "-", "-");
    }
  }
  if (!fit) {
    std::fflush(stdout);
    std::fprintf(stderr,
                 "shardkit-plan: error: %s\n(on a busy machine small sizes are noisy: try a "
                 "larger --max-bytes or more --reps)\n",
                 why.c_str());
    return 1;
  }
  const auto& f = *fit;
  std::printf(
      "fit (least squares of relative errors): alpha %s, bandwidth %s; max relative error "
      "%.1f%%, rms %.1f%%\n",
      format_duration_flag(f.fitted.latency_s).c_str(),
      format_bandwidth_flag(f.fitted.bytes_per_s).c_str(), 100.0 * f.max_rel_error,
      100.0 * f.rms_rel_error);
  if (f.latency_fixed_at_zero) {
    std::printf("note: the two-parameter fit gave a negative alpha (%s); refitted with alpha = 0\n",
                human_time(f.unconstrained_latency_s).c_str());
  }
  // One link per collective (plan::cluster::intra_all_reduce etc.; the --intra-<collective>-*
  // flags), where each collective's samples can be fitted alone.
  plan::collective_fits per;
  try {
    per = plan::fit_links_per_collective(samples);
    for (const bool in_place : {false, true}) {
      for (const auto op : {shardkit::collective::all_reduce, shardkit::collective::reduce_scatter,
                            shardkit::collective::all_gather}) {
        const auto& one = per.of(op, in_place);
        if (!one) continue;
        std::printf(
            "  %s%s alone: alpha %s, bandwidth %s; max relative error %.1f%%\n", shardkit::name(op),
            in_place ? " in place" : "", format_duration_flag(one->fitted.latency_s).c_str(),
            format_bandwidth_flag(one->fitted.bytes_per_s).c_str(), 100.0 * one->max_rel_error);
      }
    }
  } catch (const plan::calibration_error& e) {
    std::printf("  per collective: %s\n", e.what());
  }
  std::printf(
      "flags for shardkit-plan (a node of %llu ranks like this one; the link, then each "
      "collective's own%s):\n  %s\n",
      static_cast<unsigned long long>(ranks), o.in_place ? ", then each one's in place" : "",
      calibration_flags(f.fitted, ranks, per).c_str());
  if (const std::string note = fit_note(f, per, saving); !note.empty()) {
    std::printf("%s\n", note.c_str());
  }
  return 0;
}

//! print_calibration, then the samples written to --save-samples's file where one was given
//! (returns 1, with the reason on stderr, when it cannot be written: under MPI only rank 0
//! writes, and every rank takes its status).
inline int report_calibration(const std::vector<plan::calibration_sample>& samples,
                              const char* comm, std::uint64_t ranks, const calibrate_options& o) {
  int status = print_calibration(samples, comm, ranks, o.sweep, !o.save_samples.empty());
  if (o.save_samples.empty()) return status;
  try {
    write_samples(o.save_samples, samples,
                  std::string(comm) + " communicator, " + std::to_string(ranks) + " ranks, " +
                      shardkit::name(o.sweep.element));
    std::printf("samples written to %s (shardkit-plan --samples %s reads them)\n",
                o.save_samples.c_str(), o.save_samples.c_str());
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "shardkit-plan: error: %s\n", e.what());
    status = 1;
  }
  return status;
}

#if defined(SHARDKIT_PLAN_MPI)
inline int calibrate_mpi(int argc, char** argv, const calibrate_options& o) {
  return shardkit::mpi_main(argc, argv, [&](shardkit::mpi_comm& comm) -> int {
    if (o.ranks_given && o.ranks != static_cast<std::uint64_t>(comm.size())) {
      if (comm.rank() == 0) {
        std::fprintf(stderr,
                     "shardkit-plan: error: --ranks %llu does not match the %d processes of this "
                     "MPI job; omit --ranks under mpiexec\n",
                     static_cast<unsigned long long>(o.ranks), comm.size());
      }
      return 2;
    }
    if (comm.size() < 2) {
      if (comm.rank() == 0) {
        std::fprintf(stderr,
                     "shardkit-plan: error: --calibrate needs at least 2 MPI processes, "
                     "got 1; run mpiexec -np 2 (or more)\n");
      }
      return 2;
    }
    const auto samples = plan::measure_collectives(comm, o.sweep);
    int status = 0;
    if (comm.rank() == 0) {
      status = report_calibration(samples, "mpi", static_cast<std::uint64_t>(comm.size()), o);
      std::fflush(stdout);
    }
    comm.broadcast(&status, 1, 0);  // the job's exit status is rank 0's
    return status;
  });
}
#endif

//! main() of the calibration mode, with its parsed flags.
inline int calibrate_main([[maybe_unused]] int argc, [[maybe_unused]] char** argv,
                          calibrate_options o) {
#if defined(SHARDKIT_PLAN_MPI)
  const bool under_mpi = shardkit::launched_by_mpi();
#else
  const bool under_mpi = false;
#endif
  if (o.comm.empty()) o.comm = under_mpi ? "mpi" : "thread";
  if (o.comm == "mpi") {
#if defined(SHARDKIT_PLAN_MPI)
    if (!under_mpi) {
      std::fprintf(stderr,
                   "shardkit-plan: error: --comm mpi: not started by an MPI launcher; "
                   "expected mpiexec -np N shardkit-plan --calibrate\n");
      return 2;
    }
    return calibrate_mpi(argc, argv, o);
#else
    std::fprintf(stderr,
                 "shardkit-plan: error: --comm mpi: this shardkit-plan was built without "
                 "MPI (shardkit::mpi); expected --comm thread\n");
    return 2;
#endif
  }
  try {
    const int n = static_cast<int>(o.ranks);
    const auto results = shardkit::run_ranks(
        n, [&](shardkit::thread_comm& comm) { return plan::measure_collectives(comm, o.sweep); });
    return report_calibration(results[0], "thread", o.ranks, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardkit-plan: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace shardkit_plan
