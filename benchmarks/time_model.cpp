// The planner's time model against measurement: calibrate the alpha-beta model on this machine
// (plan/calibrate.hpp), then predict the communication time of one engine step for stages 0-3
// (plan::comm_time_per_step) and measure it.
//
//   shardkit_bench_time_model [--size=tiny|full] [--ranks 2,4] [--reps K] [--rounds R]
//                             [--min-bytes B] [--max-bytes B] [--growth G] [--cold-bytes B]
//                             [--async 0|1] [--age 0|1] [--age-runs 0|1] [--gather-outputs K]
//                             [--zero-outputs 0|1] [--arrival 0|1] [--samples 0|1]
//   mpiexec -np 4 shardkit_bench_time_model [--size=...] [--reps K]   (the MPI communicator)
//
// The model is benchmarks/engine.cpp's: L units, each a d x d weight and a d bias, bf16 working
// parameters and gradients, fp32 master, AdamW (d = 1024, L = 8 full; d = 64, L = 2 tiny). A step
// is what engine.cpp times: the unit hooks of a forward and a backward, every gradient handed
// over with grad_ready, then step(). There is no model compute.
//
// For each communicator size N (in-process ranks, or the MPI world):
//  --rounds R (default 45) times: 1.-3. below, so that the machine's drift reaches calibration and
//  measurement alike; printed: the links of the first round, pred/own of every round, and per
//  stage the medians over rounds. A round whose sweep cannot be fitted (times that do not grow
//  with size, on a busy machine) is named and left out; the run fails only if every round is.
//  1. calibrate: plan::measure_collectives sweeps all-gather, reduce-scatter and all-reduce of
//     bf16 (--min-bytes 4 KiB to --max-bytes, default the step's largest call and at least
//     16 MiB, x --growth 2; 11 repetitions), out of place and in place, as the step finds and
//     issues its collectives (sweep_options): each input written just before its call,
//     asynchronous (--async 0: not), the optimizer's bytes streamed before the in-place
//     all-gathers (--age 0: not), once before each run of them that gathers the rank's shard of
//     the working parameters, as the step's follow its optimizer (--age-runs 0: before each
//     call), out-of-place all-gathers on two outputs of their own as
//     ZeRO-3's with prefetch 1 (--gather-outputs K), out-of-place reduce-scatters' outputs
//     zeroed first as the engine zeroes its gradient shard after a step (--zero-outputs 0: not),
//     each call timed as the step's are below, from the last rank's start to the first rank's
//     return (--arrival 0: the slowest rank's own time), the other buffers reused (--cold-bytes
//     B: walked through B bytes). Fitted twice: one link for everything (plan::fit_link), and
//     one per collective and placement (plan::fit_links_per_collective).
//  2. predict: plan::comm_time_per_step for the model's units on a cluster of one node of N
//     GPUs: "one" with the single link, "pred" with the per-collective links, each call of the
//     step on the link of its placement (collective_call::in_place); "smp" with the samples
//     themselves where a call's size lies among them (plan::sampled_times), the links elsewhere.
//  3. measure, per stage, over --reps steps after one warm-up step, each the slowest rank's or
//     the collectives' own (below), median over steps:
//     - "own" (the comparison): each collective from the last rank's arrival to the first rank's
//       exit, summed, in steps run with timed_comm's serialize set: every asynchronous
//       collective completes at its issue, so the step's collectives run one after another and
//       overlap nothing, the model's assumption (plan/time.hpp). q1-q3: its quartiles over steps.
//       "own_last": to the last rank's exit instead (see after_last_arrival for why the first
//       exit: with more ranks than cores the last exit waits for a core). An MPI rank may leave
//       a collective before the others are done (no closing rendezvous): there the first exit
//       can come early, and the two bracket the collective's time.
//     - as the engine runs (asynchronous collectives overlapping the step's other work and each
//       other): "ovl_own" the same sum to the first exit (an asynchronous one counted from its
//       issue to its wait(), an over-estimate), "ovl_comm" the slowest rank's seconds inside the
//       communicator's calls (timed_comm: the blocked, exposed time), "ovl_w-o" the step's wall
//       time minus step_report::optimizer_seconds (an upper bound: it also counts the engine's
//       copies, casts and bookkeeping).
//     All include the engine's small control collectives (schedule check, overflow/norm
//     agreement), which the model does not count: they matter only where the data collectives are
//     tiny (--size=tiny).
//  Printed per N and stage (medians over rounds): the predictions, the measurements, pred/own
//  (and its range over rounds), smp/own ("smp": plan::comm_time_per_step with the calibration's
//  samples themselves, plan/sampled.hpp, where a call's size lies among them) and one/own, the
//  collectives issued against the model's count, and whether bytes_sent equals
//  plan::bytes_sent_per_step (a check that the model's list of collectives is the engine's).
//  Then, per stage, how sure those medians are: a distribution-free 95% interval of the median
//  of pred/own and of smp/own over the rounds (order statistics, median_ci95), and a verdict
//  against the target of 15%: met (the whole interval within 0.85-1.15), missed (none of it), or
//  open (it straddles a bound: the rounds do not decide). One round's ratio moves by 0.5-2x on
//  the 2-core machines, so a median of 15 rounds can land either side of a bound by chance.
//  Then per stage and kind of call (collective, placement, count): the calls per step, measured
//  and in the model's list (the engine's control collectives are not in it), the own time of
//  one call, the calibration's time at that size (interpolated between the samples around it,
//  log-log; nan beyond the largest sample) and the fitted link's: which calls the model misses,
//  and whether the miss is the fit's (pred differs from sample) or the calibration's (sample
//  differs from own: the step finds its data in another state than the sweep does).
//  --samples 1: every calibration sample's median over rounds and its range.
//
// Timings need an idle machine; this program checks nothing but that it runs (a smoke ctest
// runs --size=tiny).
#include <shardkit/comm/thread.hpp>
#include <shardkit/comm/timed.hpp>
#include <shardkit/plan/calibrate.hpp>
#include <shardkit/plan/comm.hpp>
#include <shardkit/plan/sampled.hpp>
#include <shardkit/plan/time.hpp>
#include <shardkit/zero/engine.hpp>

#if defined(SHARDKIT_BENCH_MPI)
#include <shardkit/comm/mpi.hpp>
#endif

#include "engine_model.hpp"
#include "time_model_config.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace plan = shardkit::plan;

using bench::model_shape;
using bench::time_model::config;
using bench::time_model::setup_of;
using bench::time_model::units_of;

//! The measurements of one stage on one communicator (the same on every rank).
struct stage_result {
  double in_comm = 0;        // median over steps of the slowest rank's seconds inside collectives
  double wall_opt = 0;       // median over steps of the slowest rank's wall − optimizer seconds
  double after_arrival = 0;  // median over steps of the collectives' own time, to the first exit
  double q1 = 0, q3 = 0;     // its first and third quartiles over steps
  double to_last_exit = 0;   // median over steps of the own time to the last exit
  std::uint64_t calls = 0;   // data and control collectives issued by rank 0 in one step
  std::uint64_t bytes_sent = 0;  // step_report::bytes_sent of rank 0
  //! The calls of one kind, size and placement: calls per step, and per step the mean own time
  //! of one of them (to the first exit).
  struct call_class {
    shardkit::collective op = shardkit::collective::barrier;
    std::size_t count = 0, elem_bytes = 0;
    bool in_place = false;
    std::uint64_t calls = 0;
    std::vector<double> per_call;  // per step
    double median_per_call = 0;
  };
  std::vector<call_class> classes;
};

//! The q-quantile of v (0 ≤ q ≤ 1), linear between order statistics.
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double x = q * static_cast<double>(v.size() - 1);
  const auto i = static_cast<std::size_t>(x);
  return i + 1 < v.size() ? v[i] + (x - static_cast<double>(i)) * (v[i + 1] - v[i]) : v[i];
}
double median(std::vector<double> v) {
  return quantile(std::move(v), 0.5);
}

//! The step's collectives' own time (collective), summed over the step's calls, two ways:
//! from the moment the last rank entered a call to the moment the first rank left it, and to the
//! moment the last rank left it (for an asynchronous call, its wait(); serialized, its issue).
//! Both leave out the time early ranks wait for late ones. The first exit marks the end of the
//! collective's work (a thread rank leaves only after every rank has done its part); the last
//! exit also counts the time a rank that is done waits for a core, which on ranks sharing cores
//! is the others' next work (N = 4 thread ranks on 2 cores: two ranks leave together, and the
//! other two 2-5 ms later, once the first two have run their optimizer for a time slice). Every
//! rank must have logged the same calls (the engine's schedule check sees to that); the ranks
//! share one steady clock (threads of a process, or processes of one machine).
struct own_times {
  double to_first_exit = 0;
  double to_last_exit = 0;
  std::vector<double> per_call;  // each call's own time to the first exit, in issue order
};

template <class Timed>
own_times after_last_arrival(Timed& tc) {
  const auto& log = tc.timing().log;
  std::uint64_t k[2] = {log.size(), ~static_cast<std::uint64_t>(log.size())};
  tc.inner().all_reduce(k, k, 2, shardkit::reduce_op::max);
  if (k[0] != log.size() || ~k[1] != log.size()) {
    throw std::runtime_error("time_model: the ranks logged different numbers of collectives");
  }
  std::vector<double> entered(log.size()), first(log.size()), last(log.size());
  for (std::size_t i = 0; i < log.size(); ++i) {
    entered[i] = log[i].entered;
    first[i] = last[i] = log[i].left;
  }
  tc.inner().all_reduce(entered.data(), entered.data(), log.size(), shardkit::reduce_op::max);
  tc.inner().all_reduce(first.data(), first.data(), log.size(), shardkit::reduce_op::min);
  tc.inner().all_reduce(last.data(), last.data(), log.size(), shardkit::reduce_op::max);
  own_times r;
  for (std::size_t i = 0; i < log.size(); ++i) {
    r.per_call.push_back(std::max(0.0, first[i] - entered[i]));
    r.to_first_exit += r.per_call.back();
    r.to_last_exit += std::max(0.0, last[i] - entered[i]);
  }
  return r;
}

//! One rank of `comm` runs `reps` timed engine steps of stage S (collective).
template <int S, class Comm>
stage_result measure_stage(Comm& comm, const config& c, bool serialize) {
  using timed = shardkit::timed_comm<Comm>;
  using engine_t = shardkit::engine<timed, shardkit::stage<S>, shardkit::bf16, shardkit::adamw>;
  const int rank = comm.rank();
  timed tc(comm.split(0, rank));  // a communicator of its own, owned by the timing wrapper
  const bench::model model(c.shape);
  const auto grads = model.grads(rank);
  engine_t e(tc, model.spec, shardkit::adam_options{.lr = 1e-4f});
  tc.timing().serialize = serialize;
  auto step = [&] { return bench::full_step_report(e, grads); };
  step();  // warm-up: first touch, ZeRO-3 learns its prefetch order
  stage_result r;
  std::vector<double> in_comm, wall_opt, after_arrival, to_last_exit;
  tc.timing().record = true;
  for (int rep = 0; rep < c.reps; ++rep) {
    tc.inner().barrier();  // untimed: not part of the step
    tc.timing().log.clear();
    const double c0 = tc.timing().total_seconds();
    const std::uint64_t n0 = tc.timing().total_calls();
    const auto t0 = std::chrono::steady_clock::now();
    const shardkit::step_report rep_ = step();
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double v[2] = {tc.timing().total_seconds() - c0, wall - rep_.optimizer_seconds};
    r.calls = tc.timing().total_calls() - n0;
    r.bytes_sent = rep_.bytes_sent;
    tc.inner().all_reduce(v, v, 2, shardkit::reduce_op::max);  // the slowest rank's
    in_comm.push_back(v[0]);
    wall_opt.push_back(v[1]);
    const own_times own = after_last_arrival(tc);
    after_arrival.push_back(own.to_first_exit);
    to_last_exit.push_back(own.to_last_exit);
    // Per kind, size and placement: the mean own time of one call in this step.
    const auto& log = tc.timing().log;
    std::vector<double> sum(r.classes.size(), 0.0);
    std::vector<std::uint64_t> n(r.classes.size(), 0);
    for (std::size_t i = 0; i < log.size(); ++i) {
      const auto& x = log[i];
      auto it = std::find_if(r.classes.begin(), r.classes.end(), [&](const auto& k) {
        return k.op == x.kind && k.count == x.count && k.elem_bytes == x.elem_bytes &&
               k.in_place == x.in_place;
      });
      if (it == r.classes.end()) {
        stage_result::call_class k;
        k.op = x.kind;
        k.count = x.count;
        k.elem_bytes = x.elem_bytes;
        k.in_place = x.in_place;
        it = r.classes.insert(r.classes.end(), std::move(k));
        sum.push_back(0.0);
        n.push_back(0);
      }
      const auto j = static_cast<std::size_t>(it - r.classes.begin());
      sum[j] += own.per_call[i];
      ++n[j];
    }
    for (std::size_t j = 0; j < r.classes.size(); ++j) {
      r.classes[j].calls = n[j];
      if (n[j] != 0) r.classes[j].per_call.push_back(sum[j] / static_cast<double>(n[j]));
    }
  }
  for (auto& k : r.classes) k.median_per_call = median(k.per_call);
  r.in_comm = median(in_comm);
  r.after_arrival = median(after_arrival);
  r.q1 = quantile(after_arrival, 0.25);
  r.q3 = quantile(after_arrival, 0.75);
  r.to_last_exit = median(to_last_exit);
  r.wall_opt = median(wall_opt);
  return r;
}

//! Calibration and the four stages on one communicator (collective); results on every rank.
struct run_result {
  std::vector<plan::calibration_sample> samples;
  stage_result serial[4];   // every collective completed at its issue (what the model predicts)
  stage_result overlap[4];  // as the engine runs (asynchronous collectives overlap)
};

//! c.rounds rounds, each a calibration followed by the stages, so that the machine's drift
//! reaches the calibration and the measurement alike.
template <class Comm>
std::vector<run_result> run_all(Comm& comm, const config& c) {
  std::vector<run_result> rounds(static_cast<std::size_t>(c.rounds));
  // The optimizer's bytes per rank and step (AdamW: 28 per shard element), streamed before the
  // sweep's in-place all-gathers as the step streams them before its own.
  plan::sweep_options sweep = c.sweep;
  const std::size_t shard = c.shape.params() / static_cast<std::size_t>(comm.size());
  if (c.age) sweep.optimizer_bytes = 28 * shard;
  // The working parameters' shard (bf16) the step gathers in place after that one pass.
  if (c.age && c.age_runs) sweep.gathered_bytes = sizeof(shardkit::bf16) * shard;
  for (run_result& r : rounds) {
    r.samples = plan::measure_collectives(comm, sweep);
    for (const bool serialize : {true, false}) {
      stage_result* out = serialize ? r.serial : r.overlap;
      out[0] = measure_stage<0>(comm, c, serialize);
      out[1] = measure_stage<1>(comm, c, serialize);
      out[2] = measure_stage<2>(comm, c, serialize);
      out[3] = measure_stage<3>(comm, c, serialize);
    }
  }
  return rounds;
}

//! The model's predictions for one round's calibration: per stage, with one link and with one
//! link per collective and placement. Throws calibration_error when the samples cannot be fitted.
struct prediction {
  plan::link_fit fit;
  plan::collective_fits per_op;
  plan::cluster per_op_cluster;  // the cluster with one link per collective and placement
  plan::sampled_times sampled;   // the samples themselves (plan/sampled.hpp)
  double one[4] = {}, per[4] = {}, smp[4] = {};
};

prediction predict(int N, const config& c, const run_result& r) {
  prediction p;
  p.fit = plan::fit_link(r.samples);
  p.per_op = plan::fit_links_per_collective(r.samples);
  const std::vector<plan::unit> units = units_of(c.shape);
  plan::cluster cl;
  cl.gpus_per_node = static_cast<std::uint64_t>(N);
  cl.intra = cl.inter = p.fit.fitted;
  plan::cluster cl_op = cl;  // one fitted link per collective and placement
  plan::set_per_collective_links(cl_op, p.per_op);
  p.per_op_cluster = cl_op;
  p.sampled = plan::sampled_times(r.samples);
  for (int st = 0; st < 4; ++st) {
    p.one[st] = plan::comm_time_per_step(setup_of(st, N), units, cl);
    p.per[st] = plan::comm_time_per_step(setup_of(st, N), units, cl_op);
    p.smp[st] = plan::comm_time_per_step(setup_of(st, N), units, cl_op, p.sampled);
  }
  return p;
}

//! Per stage, each kind of call: how often the step issued it against the model's list, its own
//! time per call measured, the calibration's time at its size (interpolated) and the fitted
//! link's; medians over rounds.
void report_calls(int N, const config& c, const std::vector<run_result>& rounds,
                  const std::vector<prediction>& preds) {
  const std::vector<plan::unit> units = units_of(c.shape);
  std::printf("  per call, medians over rounds (us); sample = the calibration at this size:\n");
  std::printf("  %-5s %-15s %-9s %10s %5s %5s %9s %9s %9s %10s %9s\n", "stage", "collective",
              "placement", "count", "calls", "model", "own", "sample", "pred", "sample/own",
              "pred/own");
  for (int st = 0; st < 4; ++st) {
    for (const auto& k : rounds[0].serial[st].classes) {
      std::uint64_t model_calls = 0;
      plan::for_each_collective(setup_of(st, N), units, [&](const auto& x) {
        if (x.op == k.op && x.count == k.count && x.elem_bytes == k.elem_bytes &&
            x.in_place == k.in_place) {
          model_calls += x.repeat;
        }
      });
      std::vector<double> own, smp, pred;
      for (std::size_t r = 0; r < rounds.size(); ++r) {
        for (const auto& q : rounds[r].serial[st].classes) {
          if (q.op == k.op && q.count == k.count && q.elem_bytes == k.elem_bytes &&
              q.in_place == k.in_place) {
            own.push_back(q.median_per_call);
          }
        }
        smp.push_back(
            preds[r]
                .sampled.at(k.op, k.count, k.elem_bytes, static_cast<std::uint64_t>(N), k.in_place)
                .value_or(std::nan("")));
        plan::placement where{static_cast<std::uint64_t>(N), static_cast<std::uint64_t>(N)};
        pred.push_back(plan::collective_time(k.op, k.count, k.elem_bytes, where,
                                             preds[r].per_op_cluster, plan::algorithm::ring,
                                             k.in_place));
      }
      const double o = median(own), sm = median(smp), pr = median(pred);
      std::printf("  %-5d %-15s %-9s %10zu %5llu %5llu %9.1f %9.1f %9.1f %10.3f %9.3f\n", st,
                  shardkit::name(k.op), k.in_place ? "in place" : "out", k.count,
                  static_cast<unsigned long long>(k.calls),
                  static_cast<unsigned long long>(model_calls), o * 1e6, sm * 1e6, pr * 1e6, sm / o,
                  pr / o);
    }
  }
}

//! Every calibration sample (collective, placement, size): its median over rounds and the
//! range, which shows how far one round's calibration can be from another's.
void report_samples(const std::vector<run_result>& rounds) {
  std::printf("  calibration samples over rounds (us):\n");
  std::printf("  %-15s %-9s %10s %9s %9s %9s\n", "collective", "placement", "count", "median",
              "min", "max");
  for (std::size_t i = 0; i < rounds[0].samples.size(); ++i) {
    const auto& x = rounds[0].samples[i];
    std::vector<double> t;
    for (const auto& r : rounds) {
      if (i < r.samples.size()) t.push_back(r.samples[i].seconds);
    }
    std::printf("  %-15s %-9s %10llu %9.1f %9.1f %9.1f\n", shardkit::name(x.op),
                x.in_place ? "in place" : "out", static_cast<unsigned long long>(x.count),
                median(t) * 1e6, *std::min_element(t.begin(), t.end()) * 1e6,
                *std::max_element(t.begin(), t.end()) * 1e6);
  }
}

//! Prints one communicator's results over the rounds. A round whose calibration cannot be fitted
//! (on a busy machine a sweep's times can fail to grow with size) is named and left out of the
//! medians; returns 1 when no round could be fitted.
int report(const char* comm_name, int N, const config& c, const std::vector<run_result>& all) {
  std::vector<run_result> rounds;
  std::vector<prediction> preds;
  std::vector<std::size_t> number;  // each kept round's number, from 1
  std::vector<std::string> failed;
  for (std::size_t k = 0; k < all.size(); ++k) {
    try {
      preds.push_back(predict(N, c, all[k]));
      rounds.push_back(all[k]);
      number.push_back(k + 1);
    } catch (const plan::calibration_error& e) {
      failed.push_back("  round " + std::to_string(k + 1) +
                       ": calibration failed, left out: " + e.what());
    }
  }
  std::printf("\n%s communicator, N = %d, %zu rounds", comm_name, N, all.size());
  if (!failed.empty()) std::printf(" (%zu left out)", failed.size());
  std::printf("\n");
  for (const std::string& f : failed) std::printf("%s\n", f.c_str());
  if (preds.empty()) {
    std::printf("  no round's calibration could be fitted\n");
    return 1;
  }
  // The links of the first kept round, to show what a calibration finds.
  const prediction& first = preds.front();
  std::printf(
      "  round %zu: one link alpha %.3g us, bandwidth %.4g GB/s (max relative error %.1f%%)\n",
      number.front(), first.fit.fitted.latency_s * 1e6, first.fit.fitted.bytes_per_s / 1e9,
      100.0 * first.fit.max_rel_error);
  for (const bool in_place : {false, true}) {
    for (const auto op : {shardkit::collective::all_reduce, shardkit::collective::reduce_scatter,
                          shardkit::collective::all_gather}) {
      const auto& f = first.per_op.of(op, in_place);
      if (!f) continue;
      std::printf(
          "    %s%s alone: alpha %.3g us, bandwidth %.4g GB/s (max relative error %.1f%%)\n",
          shardkit::name(op), in_place ? " in place" : "", f->fitted.latency_s * 1e6,
          f->fitted.bytes_per_s / 1e9, 100.0 * f->max_rel_error);
    }
  }
  std::printf("  pred/own | smp/own per round, stages 0-3:\n");
  for (std::size_t k = 0; k < rounds.size(); ++k) {
    std::printf("    round %zu:", number[k]);
    for (int st = 0; st < 4; ++st) {
      std::printf(" %6.3f", preds[k].per[st] / rounds[k].serial[st].after_arrival);
    }
    std::printf(" |");
    for (int st = 0; st < 4; ++st) {
      std::printf(" %6.3f", preds[k].smp[st] / rounds[k].serial[st].after_arrival);
    }
    std::printf("\n");
  }
  std::printf("  medians over rounds (us):\n");
  std::printf("  %-5s %9s %9s %9s %9s %15s %9s %8s %13s %8s %8s %9s %9s %9s %5s %5s %s\n", "stage",
              "one", "pred", "smp", "own", "own_q1-q3", "own_last", "pred/own", "range", "smp/own",
              "one/own", "ovl_own", "ovl_comm", "ovl_w-o", "calls", "model", "bytes_sent");
  // The medians' 95% intervals over rounds, and where each stands against 15% (printed after).
  std::vector<std::string> verdicts;
  const std::vector<plan::unit> units = units_of(c.shape);
  for (int st = 0; st < 4; ++st) {
    std::vector<double> one, per, smp, own, q1, q3, last, ratio, ratio_smp, ratio_one, o_own,
        o_comm, o_wo;
    bool bytes_ok = true;
    for (std::size_t k = 0; k < rounds.size(); ++k) {
      const stage_result& m = rounds[k].serial[st];
      const stage_result& o = rounds[k].overlap[st];
      one.push_back(preds[k].one[st]);
      per.push_back(preds[k].per[st]);
      smp.push_back(preds[k].smp[st]);
      ratio_smp.push_back(preds[k].smp[st] / m.after_arrival);
      own.push_back(m.after_arrival);
      q1.push_back(m.q1);
      q3.push_back(m.q3);
      last.push_back(m.to_last_exit);
      ratio.push_back(preds[k].per[st] / m.after_arrival);
      ratio_one.push_back(preds[k].one[st] / m.after_arrival);
      o_own.push_back(o.after_arrival);
      o_comm.push_back(o.in_comm);
      o_wo.push_back(o.wall_opt);
      const std::uint64_t want = plan::bytes_sent_per_step(setup_of(st, N), units, 0).total();
      bytes_ok = bytes_ok && m.bytes_sent == want && o.bytes_sent == want;
    }
    const plan::comm_bytes b = plan::bytes_sent_per_step(setup_of(st, N), units, 0);
    char quart[48], range[48];
    std::snprintf(quart, sizeof quart, "%.0f-%.0f", median(q1) * 1e6, median(q3) * 1e6);
    std::snprintf(range, sizeof range, "%.3f-%.3f", *std::min_element(ratio.begin(), ratio.end()),
                  *std::max_element(ratio.begin(), ratio.end()));
    std::printf(
        "  %-5d %9.0f %9.0f %9.0f %9.0f %15s %9.0f %8.3f %13s %8.3f %8.3f %9.0f %9.0f %9.0f %5llu "
        "%5llu %s\n",
        st, median(one) * 1e6, median(per) * 1e6, median(smp) * 1e6, median(own) * 1e6, quart,
        median(last) * 1e6, median(ratio), range, median(ratio_smp), median(ratio_one),
        median(o_own) * 1e6, median(o_comm) * 1e6, median(o_wo) * 1e6,
        static_cast<unsigned long long>(rounds[0].serial[st].calls),
        static_cast<unsigned long long>(b.calls()),
        bytes_ok ? "= model" : "DIFFERS from the model");
    const bench::time_model::median_interval ci = bench::time_model::median_ci95(ratio),
                                             ci_smp = bench::time_model::median_ci95(ratio_smp);
    char line[160];
    std::snprintf(line, sizeof line, "  %-5d %8.3f %6.3f-%-6.3f %-7s %8.3f %6.3f-%-6.3f %s", st,
                  median(ratio), ci.lo, ci.hi, bench::time_model::verdict_15(ci), median(ratio_smp),
                  ci_smp.lo, ci_smp.hi, bench::time_model::verdict_15(ci_smp));
    verdicts.emplace_back(line);
  }
  std::printf(
      "  within 15%%? the medians' distribution-free 95%% intervals over the %zu rounds (met: all "
      "of it within 0.85-1.15; missed: none of it; open: it straddles a bound%s):\n",
      rounds.size(), rounds.size() < 6 ? "; fewer than 6 rounds give no interval" : "");
  std::printf("  %-5s %8s %13s %-7s %8s %13s %s\n", "stage", "pred/own", "95% interval", "verdict",
              "smp/own", "95% interval", "verdict");
  for (const std::string& v : verdicts) std::printf("%s\n", v.c_str());
  report_calls(N, c, rounds, preds);
  if (c.samples) report_samples(rounds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
#if defined(SHARDKIT_BENCH_MPI)
    if (shardkit::launched_by_mpi()) {
      return shardkit::mpi_main(argc, argv, [&](shardkit::mpi_comm& comm) -> int {
        const config c = bench::time_model::parse(argc, argv);
        const std::vector<run_result> r = run_all(comm, c);
        int status = 0;
        if (comm.rank() == 0) {
          bench::time_model::header(c);
          status = report("mpi", comm.size(), c, r);
          std::fflush(stdout);
        }
        comm.broadcast(&status, 1, 0);  // the job's exit status is rank 0's
        return status;
      });
    }
#endif
    const config c = bench::time_model::parse(argc, argv);
    bench::time_model::header(c);
    int status = 0;
    for (const int N : c.ranks) {
      const auto results =
          shardkit::run_ranks(N, [&](shardkit::thread_comm& comm) { return run_all(comm, c); });
      status |= report("thread", N, c, results[0]);
      std::fflush(stdout);
    }
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardkit_bench_time_model: error: %s\n", e.what());
    return 1;
  }
}
