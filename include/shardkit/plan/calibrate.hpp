//! \file plan/calibrate.hpp
//! Calibration of the alpha-beta model of plan/time.hpp against measurement: a sweep that times
//! collectives on any Communicator, and its fit (plan/fit.hpp: one link, α and bandwidth, to the
//! samples, or one per collective and placement; what the fit absorbs is said there).
//!
//! **The sweep.** calibrate(comm, options) is collective: every rank of `comm` calls it with the
//! same options. After one untimed pass over every collective, placement and size (the first
//! collective timed after a pause ran slow for longer than its own warm-up calls), for
//! all-gather, reduce-scatter and all-reduce at buffer sizes from
//! options.min_bytes to options.max_bytes (×options.growth each, default 4; elements of
//! options.element, fp32 or bf16; the size is the whole array: all-gather's output,
//! reduce-scatter's input, all-reduce's buffer), it runs options.warmup untimed repetitions, then
//! options.reps timed ones, each a barrier followed by `iters` back-to-back calls (more for small
//! sizes, so a repetition moves at least options.bytes_per_rep); the time of a repetition is the
//! slowest rank's (an all-reduce with max; with options.after_last_arrival, from the last rank's
//! start to the first rank's return), and a sample's time is the median of the repetitions.
//! Every rank returns the same samples and the same fit. With options.cold_bytes, the calls take
//! turns on that many bytes of buffers, so that each finds its data out of cache; calibrated on one
//! reused buffer, the model predicted the engine benchmark's step 1.5–2.3× too fast on this
//! project's machine at the time.
//!
//! A training step finds its data elsewhere, though: it writes the gradients just before it
//! reduces them and the parameters just before it gathers them, issues most collectives
//! asynchronously, and runs some in place. options.fresh_input (each call's input written by
//! its rank, then the call timed alone), options.in_place (the in-place form of each collective
//! as well, in samples marked `in_place`, which fit_links_per_collective fits apart) and
//! options.asynchronous (the asynchronous form, waited for) time the collectives that way; with
//! cold_bytes 0 they describe a step whose data fits in the cache (benchmarks/time_model.cpp).
//!
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/reduce_op.hpp>
#include <shardkit/plan/fit.hpp>
#include <shardkit/plan/time.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace plan {

//! What calibrate() times.
struct sweep_options {
  std::size_t min_bytes = 4096;                   //!< smallest buffer, bytes (whole array)
  std::size_t max_bytes = std::size_t{16} << 20;  //!< largest buffer, bytes
  //! Each size this many times the one before (at least 2): 4 spans decades quickly, 2 samples
  //! the sizes in between too, where a host transport's cost per byte changes with the caches.
  std::size_t growth = 4;
  int reps = 5;    //!< repetitions per size (median taken), ≥ 1
  int warmup = 1;  //!< untimed calls per size before the repetitions
  std::size_t bytes_per_rep = std::size_t{1} << 20;  //!< small sizes repeat until this many bytes
  int max_iters = 64;                                //!< most calls in one repetition
  //! In and out buffers of this many bytes per rank together, which consecutive calls walk
  //! through (each starts where the previous one ended), so that every call finds its data out
  //! of cache as a training step's collectives do (the step streamed the optimizer's state in
  //! between); choose several times the last-level cache. 0: buffers of the largest size,
  //! through which the calls walk in the same way (a call of the largest size reuses the same
  //! bytes every time; smaller ones take turns on its parts, so sizes whose buffers fit in the
  //! cache together are timed in cache).
  std::size_t cold_bytes = 0;
  //! Each call's input written by its rank just before the call (untimed), as a training step
  //! writes the gradients it reduces and the parameters it gathers just before; each call is
  //! then timed alone (a barrier, the call; the slowest rank's time). A host communicator reads
  //! such data from the writer's caches: on this project's machine an in-place all-reduce of
  //! 16 MiB of bf16 over 2 thread ranks took about 1 ms on just-written data and 1.9 ms on data
  //! out of cache.
  bool fresh_input = false;
  //! Which placements to time: out of place (separate input and output arrays) and in place
  //! (see calibration_sample::in_place; fitted separately by fit_links_per_collective).
  bool out_of_place = true;
  bool in_place = false;
  //! Issue the asynchronous form of each collective and wait for it, as a step issues its
  //! reduce-scatters and all-gathers (on a thread communicator they run on the rank's progress
  //! thread, not on the caller's).
  bool asynchronous = false;
  //! Bytes each rank moves (reads plus writes, over an array of half as many) before each
  //! in-place all-gather (with gathered_bytes: before each run of them), before it writes the
  //! call's input; 0: none. The engine's step gathers in
  //! place (stages 1-2) right after its optimizer has streamed the rank's shard of master weights
  //! and moments, so the slices the call writes come out of cache; its other collectives follow the
  //! writes of their inputs. Pass the optimizer's bytes per rank and step (e.g. 28 bytes per shard
  //! element for AdamW with fp32 state: gradient read, three fp32 arrays read and written, working
  //! copy written). On this project's 2-core machines the step's in-place all-gathers took up
  //! to 2.5x as long as a sweep's without this (benchmarks/README.md, "As the step finds its
  //! data"). Needs fresh_input and in_place.
  std::size_t optimizer_bytes = 0;
  //! Bytes each rank contributes to the in-place all-gathers that follow one optimizer pass in
  //! the step (its shard of the working parameters: e.g. 2 bytes per shard element in bf16); 0:
  //! one all-gather per pass. The step streams the optimizer's bytes once and then gathers its
  //! units one after another (ZeRO-2: one call per unit; ZeRO-1: one call for the shard), so
  //! with optimizer_bytes each repetition of an in-place all-gather whose rank contributes c
  //! bytes is a run of gathered_bytes / c calls (1 to max_iters) after one pass, each written
  //! and timed alone, and its time their mean. Aging every call by the whole pass instead timed
  //! a ZeRO-2 step's per-unit gathers over MPI at 1.7x the step's on this project's Intel Xeon
  //! (benchmarks/README.md). Needs optimizer_bytes.
  std::size_t gathered_bytes = 0;
  //! Out-of-place all-gathers take turns on this many outputs of their own (1: the same one
  //! every call), as the engine's ZeRO-3 gathers a unit into a buffer an earlier unit released
  //! (engine_options::reuse_gathered_buffers) and holds prefetch + 1 of them; 0: they walk the
  //! buffers as the other calls do. The outputs are then as warm as the step's: on this
  //! project's 2-core machines the step's out-of-place all-gathers of 1 MiB per rank ran
  //! 1.3-2x faster than a sweep's that walk. At most 16.
  std::size_t gather_outputs = 0;
  //! Each out-of-place reduce-scatter's output zeroed by its rank before the call's input is
  //! written (untimed), as the engine zeroes its gradient shard at the end of every step and the
  //! next step's reduce-scatters (stages 2-3) write into it; without compute in between (a
  //! benchmark's step), those lines are still in the caches. Needs fresh_input.
  bool zero_reduce_outputs = false;
  //! What a repetition's time is. false: the slowest rank's, each rank timing from its own
  //! start (after the barrier) to its own return, which any ranks can measure. true: from the
  //! moment the last rank started to the moment the first rank returned, which leaves out how
  //! late each rank left the barrier and how late it returns: the time of a step's collective
  //! as benchmarks/time_model.cpp measures it. With more ranks than cores, when a rank starts
  //! and returns is the scheduler's, and the slowest rank's time counts it (on this project's
  //! 2-core machines, 4 thread ranks timed their per-unit calls 1.2-1.7x longer that way than
  //! the step's). Needs one clock for all ranks (std::chrono::steady_clock on one machine: thread
  //! ranks, or processes of one node); a first return before the last start (clocks that
  //! differ) raises calibration_error.
  bool after_last_arrival = false;
  //! Element type of the buffers: fp32 or bf16. Use the gradients' type of the steps to be
  //! predicted: a host communicator's reduction costs more per byte in bf16 (fp32 accumulation
  //! and rounding) than in fp32, and the fit charges that to β.
  dtype element = dtype::f32;
};

//! The samples of a sweep and their fit.
struct calibration {
  std::vector<calibration_sample> samples;
  link_fit fit;
};

//! Raises calibration_error unless `o` describes a sweep (named per field).
inline void check(const sweep_options& o, int rank) {
  if (o.element != dtype::f32 && o.element != dtype::bf16) {
    shardkit::detail::raise<calibration_error>("calibrate (rank ", rank, "): element type ",
                                               name(o.element), "; expected fp32 or bf16");
  }
  if (o.min_bytes < 4) {
    shardkit::detail::raise<calibration_error>("calibrate (rank ", rank, "): min_bytes ",
                                               o.min_bytes,
                                               " is below one fp32 element; expected at least 4");
  }
  if (o.max_bytes < 4 * o.min_bytes) {
    shardkit::detail::raise<calibration_error>(
        "calibrate (rank ", rank, "): max_bytes ", o.max_bytes, " is less than 4 x min_bytes ",
        o.min_bytes, "; expected at least two sizes (x4 apart)");
  }
  if (o.growth < 2) {
    shardkit::detail::raise<calibration_error>("calibrate (rank ", rank, "): growth ", o.growth,
                                               "; expected at least 2 (each size a multiple of "
                                               "the one before)");
  }
  if (!o.out_of_place && !o.in_place) {
    shardkit::detail::raise<calibration_error>(
        "calibrate (rank ", rank,
        "): neither out_of_place nor in_place is set; expected at least one placement to time");
  }
  if (o.optimizer_bytes != 0 && !(o.fresh_input && o.in_place)) {
    shardkit::detail::raise<calibration_error>(
        "calibrate (rank ", rank, "): optimizer_bytes ", o.optimizer_bytes,
        " is set without fresh_input and in_place; expected both (it ages the in-place "
        "all-gathers, each timed alone)");
  }
  if (o.gathered_bytes != 0 && o.optimizer_bytes == 0) {
    shardkit::detail::raise<calibration_error>(
        "calibrate (rank ", rank, "): gathered_bytes ", o.gathered_bytes,
        " is set without optimizer_bytes; expected both (the in-place all-gathers it groups "
        "follow one optimizer pass)");
  }
  if (o.zero_reduce_outputs && !o.fresh_input) {
    shardkit::detail::raise<calibration_error>(
        "calibrate (rank ", rank,
        "): zero_reduce_outputs is set without fresh_input; expected both (it prepares each "
        "reduce-scatter's output before the call is timed alone)");
  }
  if (o.gather_outputs > 16) {
    shardkit::detail::raise<calibration_error>("calibrate (rank ", rank, "): gather_outputs ",
                                               o.gather_outputs,
                                               "; expected 0 (walk the buffers) to 16");
  }
  if (o.reps < 1 || o.warmup < 0 || o.max_iters < 1) {
    shardkit::detail::raise<calibration_error>("calibrate (rank ", rank, "): reps ", o.reps,
                                               ", warmup ", o.warmup, ", max_iters ", o.max_iters,
                                               "; expected reps >= 1, warmup >= 0, max_iters >= 1");
  }
}

namespace detail {
template <class T, class Comm>
std::vector<calibration_sample> sweep(Comm& comm, const sweep_options& o);
}  // namespace detail

//! Times all-gather, reduce-scatter and all-reduce on `comm` (see the file comment): the samples
//! of calibrate(), unfitted. Collective: every rank calls it with the same options; every rank
//! returns the same samples. Throws calibration_error on a communicator of one rank.
template <communicator Comm>
std::vector<calibration_sample> measure_collectives(Comm& comm, const sweep_options& o = {}) {
  static_assert(host_accessible<typename Comm::memory_space>,
                "plan::calibrate: the sweep's buffers are host memory; calibrate a device "
                "communicator with its own timing");
  const int P = comm.size();
  check(o, comm.rank());
  if (P < 2) {
    shardkit::detail::raise<calibration_error>("calibrate (rank ", comm.rank(),
                                               "): the communicator has ", P,
                                               " rank; expected at least 2");
  }
  if (o.element == dtype::bf16) return detail::sweep<bf16>(comm, o);
  return detail::sweep<float>(comm, o);
}

namespace detail {
template <class T, class Comm>
std::vector<calibration_sample> sweep(Comm& comm, const sweep_options& o) {
  const int P = comm.size();
  const auto p = static_cast<std::size_t>(P);
  const auto me = static_cast<std::size_t>(comm.rank());
  // Element counts: whole arrays that P divides, so every rank's slice is the same.
  std::vector<std::size_t> sizes;
  for (std::size_t b = o.min_bytes; b <= o.max_bytes; b *= o.growth) {
    const std::size_t n = std::max<std::size_t>(p, (b / sizeof(T)) / p * p);
    if (sizes.empty() || n != sizes.back()) sizes.push_back(n);
  }
  const std::size_t largest = sizes.back();
  // In and out buffers of `arena` elements (cold_bytes: see sweep_options), which consecutive
  // calls walk through, each starting where the last one ended; the largest size alone without
  // cold_bytes (a call of that size then reuses the same bytes every time).
  const std::size_t arena = std::max(largest, o.cold_bytes / (2 * sizeof(T)) / p * p);
  // Laid out as the engine's buffers are (core/memory.hpp): 2 MiB-aligned from 2 MiB, fresh
  // mappings on huge pages, each rank's on its own slot of the stagger across threads; the
  // out-of-place all-gathers' outputs below transient, as ZeRO-3's gathered units. On
  // std::vector's 4 KiB pages, on a 2-core AMD EPYC, the sweep's 16 MiB in-place all-reduce
  // over 4 thread ranks took from 2.5 to 4.9 ms from one run to the next (the step's
  // 2.4-2.7 ms), and over MPI at N = 2 its in-place all-gather of 16 MiB 1.6-1.8 ms (the
  // step's 0.75-0.84 ms).
  buffer<T> in(arena, nullptr, memory_category::grad_buckets);
  buffer<T> out(arena, nullptr, memory_category::grads);  // zeroed
  std::fill_n(in.data(), arena, T(1.0f));
  std::size_t cursor = 0;

  // The buffers of the next call of n elements: where it reads, where it writes, and what this
  // rank writes first when the input is fresh (in place, the all-gather's input is the rank's
  // slice of its output and the reduce-scatter's output the rank's slice of its input).
  struct call_buffers {
    T* src;
    T* dst;
    T* written;
    std::size_t written_n;
  };
  // The out-of-place all-gathers' own outputs (gather_outputs), taken in turn.
  buffer<T> gathered(o.gather_outputs * largest, nullptr, memory_category::gathered_params);
  std::size_t turn = 0;
  auto buffers = [&](collective op, std::size_t n, bool in_place) {
    if (cursor + n > arena) cursor = 0;
    const std::size_t at = cursor;
    cursor += n;
    T* a = in.data() + at;
    T* b = out.data() + at;
    const std::size_t c = n / p;
    if (op == collective::all_gather && !in_place && o.gather_outputs != 0) {
      b = gathered.data() + (turn++ % o.gather_outputs) * largest;
    }
    if (op == collective::all_gather) {
      T* src = in_place ? b + me * c : a;
      return call_buffers{src, b, src, c};
    }
    if (op == collective::reduce_scatter) return call_buffers{a, in_place ? a + me * c : b, a, n};
    return call_buffers{a, in_place ? a : b, a, n};
  };
  auto issue = [&](collective op, std::size_t n, const call_buffers& x) {
    if (o.asynchronous) {
      switch (op) {
        case collective::all_gather:
          comm.all_gather_async(x.src, x.dst, n / p).wait();
          break;
        case collective::reduce_scatter:
          comm.reduce_scatter_async(x.src, x.dst, n / p, reduce_op::sum).wait();
          break;
        default:
          comm.all_reduce_async(x.src, x.dst, n, reduce_op::sum).wait();
          break;
      }
      return;
    }
    switch (op) {
      case collective::all_gather:
        comm.all_gather(x.src, x.dst, n / p);
        break;
      case collective::reduce_scatter:
        comm.reduce_scatter(x.src, x.dst, n / p, reduce_op::sum);
        break;
      default:
        comm.all_reduce(x.src, x.dst, n, reduce_op::sum);
        break;
    }
  };
  // The input a step would have just written (the value keeps repeated in-place sums finite).
  auto write = [&](const call_buffers& x) { std::fill_n(x.written, x.written_n, T(1.0f)); };
  // What the step's optimizer streams before its in-place all-gather (optimizer_bytes): read and
  // written, as the master weights and moments are (the values stay bounded).
  buffer<float> state(o.optimizer_bytes / (2 * sizeof(float)), nullptr,
                      memory_category::optimizer_moments);
  auto stream_state = [&] {
    for (float& v : state.span()) v = 0.5f * v + 1.0f;
  };
  using clock = std::chrono::steady_clock;
  // The time of one of `calls` calls that this rank started at t0 and saw end at t1
  // (after_last_arrival: see sweep_options).
  auto repetition_time = [&](clock::time_point t0, clock::time_point t1, int calls) {
    if (!o.after_last_arrival) {
      double s = std::chrono::duration<double>(t1 - t0).count() / calls;
      comm.all_reduce(&s, &s, 1, reduce_op::max);
      return s;
    }
    // The maximum over ranks of (start, −end): the last start and the first end.
    double v[2] = {std::chrono::duration<double>(t0.time_since_epoch()).count(),
                   -std::chrono::duration<double>(t1.time_since_epoch()).count()};
    comm.all_reduce(v, v, 2, reduce_op::max);
    const double s = (-v[1] - v[0]) / calls;
    if (!(s > 0)) {
      shardkit::detail::raise<calibration_error>(
          "calibrate (rank ", comm.rank(), "): after_last_arrival: the first rank returned ",
          -s * calls * 1e6,
          " us before the last one started; expected one clock for all ranks "
          "(ranks on one machine)");
    }
    return s;
  };
  auto median_of = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  std::vector<calibration_sample> samples;
  const collective ops[] = {collective::all_gather, collective::reduce_scatter,
                            collective::all_reduce};
  // One untimed pass over every collective, placement and size first: timed right after a
  // pause (the caller's other work), the first collective of a sweep ran 1.5-2x slow at every
  // size on this project's 2-core machines, for longer than its own warm-up calls.
  for (const bool in_place : {false, true}) {
    if (!(in_place ? o.in_place : o.out_of_place)) continue;
    for (const collective op : ops) {
      for (const std::size_t n : sizes) {
        comm.barrier();
        issue(op, n, buffers(op, n, in_place));
      }
    }
  }
  for (const bool in_place : {false, true}) {
    if (!(in_place ? o.in_place : o.out_of_place)) continue;
    for (const collective op : ops) {
      for (const std::size_t n : sizes) {
        const std::size_t bytes = n * sizeof(T);
        const int iters =
            o.fresh_input ? 1
                          : static_cast<int>(std::clamp<std::size_t>(
                                o.bytes_per_rep / bytes, 1, static_cast<std::size_t>(o.max_iters)));
        // Fresh inputs: the calls timed alone in a repetition, their mean its time. In-place
        // all-gathers come in runs after one optimizer pass (gathered_bytes), others one by one.
        const int calls = o.gathered_bytes != 0 && in_place && op == collective::all_gather
                              ? static_cast<int>(std::clamp<std::size_t>(
                                    o.gathered_bytes / (n / p * sizeof(T)), 1,
                                    static_cast<std::size_t>(o.max_iters)))
                              : 1;
        std::vector<double> reps;
        for (int rep = -o.warmup; rep < o.reps; ++rep) {
          double s = 0;
          if (o.fresh_input) {  // write, wait for every rank, time each call alone
            if (in_place && op == collective::all_gather) stream_state();
            for (int i = 0; i < calls; ++i) {
              const call_buffers x = buffers(op, n, in_place);
              if (o.zero_reduce_outputs && !in_place && op == collective::reduce_scatter) {
                std::fill_n(x.dst, n / p, T(0.0f));
              }
              write(x);
              comm.barrier();
              const auto t0 = clock::now();
              issue(op, n, x);
              s += repetition_time(t0, clock::now(), 1) / calls;
            }
          } else {
            comm.barrier();
            const auto t0 = clock::now();
            for (int i = 0; i < iters; ++i) issue(op, n, buffers(op, n, in_place));
            s = repetition_time(t0, clock::now(), iters);
          }
          if (rep >= 0) reps.push_back(s);
        }
        const std::uint64_t count = op == collective::all_reduce ? n : n / p;
        samples.push_back(
            {op, count, sizeof(T), static_cast<std::uint64_t>(P), median_of(reps), in_place});
      }
    }
  }
  return samples;
}
}  // namespace detail

//! measure_collectives(comm, o) and its fit_link(). Collective; every rank returns the same
//! result, or throws the same calibration_error when the samples cannot be fitted (e.g. times
//! that do not grow with size on a loaded machine).
template <communicator Comm>
calibration calibrate(Comm& comm, const sweep_options& o = {}) {
  calibration c;
  c.samples = measure_collectives(comm, o);
  c.fit = fit_link(c.samples);
  return c;
}

}  // namespace plan
SHARDKIT_NAMESPACE_END
