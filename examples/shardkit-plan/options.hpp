// shardkit-plan's command line through CLI11: the flags of the planner and of --calibrate, their
// help text, and the structs they fill. Values go through the parsers of parse.hpp (counts,
// bytes, bandwidths, durations, headroom, dtypes, unit lists) from CLI11's option callbacks, so a
// bad value is a cli::bad_argument that names the flag, what was given and what was expected;
// CLI11's own errors (an unknown flag, a flag without its value) become the same. main() turns
// a bad_argument into exit status 2.
//
// The planner and --calibrate are two CLI::App: "--calibrate" anywhere on the command line
// selects the second (wants_calibrate), in which --ranks and --dtype describe what is timed.
// A flag given twice takes its last value; --help wins over any bad value.
//
// The link flags are resolved once all are parsed, whatever their order (cluster_flags):
// --alpha sets both latencies, --intra-alpha and --inter-alpha then override their own; a
// per-collective intra-node link (--intra-all-reduce-bw/-alpha, --intra-reduce-scatter-bw/-alpha,
// --intra-all-gather-bw/-alpha; plan::cluster::intra_all_reduce etc.) exists when either of its
// two flags is given, and takes the one not given from the intra-node link; an in-place one
// (--intra-all-reduce-in-place-bw/-alpha etc.; plan::cluster::intra_all_reduce_in_place)
// likewise, taking the one not given from the collective's own link (or the intra-node one).
#pragma once

#include <shardkit/plan/planner.hpp>

#include "calibrate.hpp"
#include "parse.hpp"
#include "samples_file.hpp"

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shardkit_plan {

namespace plan = shardkit::plan;

//! What the planner's flags ask for.
struct options {
  std::optional<std::uint64_t> params;
  std::optional<std::vector<std::uint64_t>> units;
  std::string units_source;  // "list" or "file NAME"
  std::optional<std::uint64_t> largest_unit;
  std::optional<std::uint64_t> ranks;
  std::optional<std::uint64_t> gpu_mem;
  shardkit::dtype dtype = shardkit::dtype::bf16;
  std::optional<shardkit::dtype> grad_dtype;  // none: the working dtype
  plan::optimizer_kind optimizer = plan::optimizer_kind::adamw;
  std::uint64_t hybrid = 0;
  std::uint64_t micro_batches = 1;
  std::uint64_t grad_buffers = 1;
  std::uint64_t alignment = 1;
  std::uint64_t prefetch = 1;
  std::uint64_t persist_below = 0;
  bool reshard = true;
  std::uint64_t max_live = 0;
  cli::headroom headroom;
  std::uint64_t activations = 0;
  plan::cluster cluster;  // gpus_per_node and the links, resolved from the link flags
  // --samples FILE: measured times (--calibrate --save-samples) that replace the links' where
  // a call's size lies among them
  std::optional<plan::sampled_times> measured;
  std::string measured_source;  // the file
  std::uint64_t rank = 0;
  bool exact = false;
  bool json = false;
  bool offload = false;
  std::optional<std::uint64_t> host_mem;
};

//! The link flags as given; apply() resolves them into a cluster.
struct cluster_flags {
  struct link_flags {
    std::optional<double> bw, alpha;
  };
  std::optional<double> alpha;  // --alpha: both networks
  link_flags intra, inter;
  link_flags all_reduce, reduce_scatter, all_gather;  // --intra-<collective>-bw / -alpha
  // --intra-<collective>-in-place-bw / -alpha
  link_flags all_reduce_in_place, reduce_scatter_in_place, all_gather_in_place;

  void apply(plan::cluster& c) const {
    if (intra.bw) c.intra.bytes_per_s = *intra.bw;
    if (inter.bw) c.inter.bytes_per_s = *inter.bw;
    if (alpha) c.intra.latency_s = c.inter.latency_s = *alpha;
    if (intra.alpha) c.intra.latency_s = *intra.alpha;
    if (inter.alpha) c.inter.latency_s = *inter.alpha;
    auto own = [](const link_flags& f, const plan::link& base) -> std::optional<plan::link> {
      if (!f.bw && !f.alpha) return std::nullopt;
      return plan::link{f.alpha.value_or(base.latency_s), f.bw.value_or(base.bytes_per_s)};
    };
    c.intra_all_reduce = own(all_reduce, c.intra);
    c.intra_reduce_scatter = own(reduce_scatter, c.intra);
    c.intra_all_gather = own(all_gather, c.intra);
    c.intra_all_reduce_in_place = own(all_reduce_in_place, c.intra_all_reduce.value_or(c.intra));
    c.intra_reduce_scatter_in_place =
        own(reduce_scatter_in_place, c.intra_reduce_scatter.value_or(c.intra));
    c.intra_all_gather_in_place = own(all_gather_in_place, c.intra_all_gather.value_or(c.intra));
  }
};

//! Whether the command line asks for the calibration mode.
inline bool wants_calibrate(int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--calibrate") return true;
  }
  return false;
}

namespace detail {

inline std::uint64_t at_least(std::string_view flag, std::string_view text, std::uint64_t v,
                              std::uint64_t lo) {
  if (v < lo) cli::fail(flag, text, "must be at least " + std::to_string(lo));
  return v;
}

inline plan::optimizer_kind parse_optimizer(std::string_view flag, std::string_view text) {
  if (text == "adamw") return plan::optimizer_kind::adamw;
  if (text == "adam") return plan::optimizer_kind::adam;
  if (text == "sgd" || text == "sgd_momentum") return plan::optimizer_kind::sgd_momentum;
  cli::fail(flag, text, "is not an optimizer shardkit ships; expected adamw, adam or sgd");
}

//! CLI11's help in the layout of this tool: the usage line(s), then each group of options
//! under its name; options of the group "" are not shown.
class help_formatter : public CLI::Formatter {
 public:
  explicit help_formatter(std::string usage) : usage_(std::move(usage)) { column_width(36); }

  std::string make_help(const CLI::App* app, std::string, CLI::AppFormatMode) const override {
    std::string out = usage_;
    for (const std::string& group : app->get_groups()) {
      if (group.empty()) continue;
      out += "  " + group + "\n";
      for (const CLI::Option* opt :
           app->get_options([&](const CLI::Option* o) { return o->get_group() == group; })) {
        out += make_option(opt, false);
      }
    }
    return out;
  }
  std::string make_option_name(const CLI::Option* opt, bool positional) const override {
    return "  " + CLI::Formatter::make_option_name(opt, positional);
  }

 private:
  std::string usage_;
};

//! An option whose text `set(flag, text)` parses (and may reject with a cli::bad_argument).
template <class Set>
CLI::Option* add_valued(CLI::App& app, const char* flag, const char* text, std::string desc,
                        Set set) {
  return app
      .add_option_function<std::string>(
          flag, [flag, set](const std::string& v) { set(std::string_view(flag), v); },
          std::move(desc))
      ->option_text(text);
}

//! What both apps share: the help layout with `usage` on top, "last value wins", unknown
//! arguments kept for run() to report, and the options that follow in `first_group`.
inline void configure(CLI::App& app, const char* usage, const char* first_group) {
  app.formatter(std::make_shared<help_formatter>(usage));
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.allow_extras();
  app.set_help_flag();  // add_help_flag() adds one that wins over bad values
  app.option_defaults()->group(first_group);
}

//! -h, --help: stops the parse where it stands, before any value is checked (CLI11 runs the
//! options' callbacks after the parse), so --help wins over bad values.
inline void add_help_flag(CLI::App& app) {
  app.add_flag_callback(
         "-h,--help", [] { throw CLI::CallForHelp(); }, "this text")
      ->trigger_on_parse();
}

//! Parses; false when --help was asked. CLI11's errors become cli::bad_argument; an argument
//! that is no flag of `app` is reported as `mode` + "unknown argument 'ARG'" + `expected`.
inline bool run(CLI::App& app, int argc, const char* const* argv, const std::string& mode,
                const std::string& expected) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return false;
  } catch (const CLI::ArgumentMismatch& e) {
    // Every option takes one value and takes the next argument whatever it is, so the value can
    // only be missing after the last argument.
    const std::string flag = argv[argc - 1];
    const CLI::Option* opt = app.get_option_no_throw(flag);
    if (opt == nullptr) throw cli::bad_argument(e.what());
    throw cli::bad_argument(flag + ": missing value; expected " + flag + " " +
                            opt->get_option_text());
  } catch (const CLI::ParseError& e) {
    throw cli::bad_argument(e.what());
  }
  const std::vector<std::string> extra = app.remaining();
  if (!extra.empty()) {
    const std::string& a = extra.front();
    if (a.size() > 1 && a[0] == '-') {
      throw cli::bad_argument(mode + "unknown argument '" + a + "'" + expected);
    }
    throw cli::bad_argument(mode + "unexpected argument '" + a + "'" + expected);
  }
  return true;
}

constexpr const char* plan_usage =
    "usage: shardkit-plan --params P | --units FILE|a,b,c   --ranks N   --gpu-mem BYTES\n";

//! The planner's flags, filling `o` and `net` (cluster_flags::apply() then resolves the links).
inline void add_plan_options(CLI::App& app, options& o, cluster_flags& net) {
  configure(app, plan_usage, "model");
  using sv = std::string_view;
  add_valued(app, "--params", "P", "parameters (7e9, 7G, 13000M)",
             [&o](sv f, sv v) { o.params = at_least(f, v, cli::parse_count(f, v), 1); });
  add_valued(app, "--units", "FILE|a,b,c",
             "unit (layer/block) sizes, from a file or inline; ZeRO-2 uses\n"
             "them as gradient buckets, ZeRO-3 gathers one unit at a time",
             [&o](sv f, sv v) { o.units = cli::parse_units(f, v, o.units_source); });
  add_valued(app, "--largest-unit", "L",
             "with --params: units of L parameters (and one of the rest)",
             [&o](sv f, sv v) { o.largest_unit = at_least(f, v, cli::parse_count(f, v), 1); });
  add_valued(app, "--dtype", "bf16|fp16|fp32",
             "working parameters and gradients (default bf16; 16-bit adds\n"
             "an fp32 master copy)",
             [&o](sv f, sv v) { o.dtype = cli::parse_dtype(f, v); });
  add_valued(app, "--grad-dtype", "bf16|fp16|fp32",
             "gradients in a type of their own (default: --dtype; fp32\n"
             "under bf16 is engine<..., bf16, Opt, float>)",
             [&o](sv f, sv v) { o.grad_dtype = cli::parse_dtype(f, v); });
  add_valued(app, "--optimizer", "adamw|adam|sgd", "sgd = SGD with momentum (default adamw)",
             [&o](sv f, sv v) { o.optimizer = parse_optimizer(f, v); });

  app.option_defaults()->group("set-up");
  add_valued(app, "--ranks", "N", "data-parallel ranks (GPUs)", [&o](sv f, sv v) {
    o.ranks = at_least(f, v, cli::parse_count(f, v), 1);
    if (*o.ranks > (1u << 24)) cli::fail(f, v, "is more ranks than the planner models (2^24)");
  });
  add_valued(app, "--hybrid", "G", "stages 1-3 shard within groups of G ranks, replicate N/G times",
             [&o](sv f, sv v) { o.hybrid = at_least(f, v, cli::parse_count(f, v), 1); });
  add_valued(app, "--micro-batches", "K", "forward/backward passes per optimizer step (default 1)",
             [&o](sv f, sv v) { o.micro_batches = at_least(f, v, cli::parse_count(f, v), 1); });
  add_valued(app, "--grad-buffers", "B", "ZeRO-2/3 gradient staging buffers (default 1)",
             [&o](sv f, sv v) { o.grad_buffers = at_least(f, v, cli::parse_count(f, v), 1); });
  add_valued(app, "--alignment", "A", "round each rank's slice up to A elements (default 1)",
             [&o](sv f, sv v) { o.alignment = at_least(f, v, cli::parse_count(f, v), 1); });
  add_valued(app, "--prefetch", "D", "ZeRO-3 units gathered ahead (default 1)",
             [&o](sv f, sv v) { o.prefetch = cli::parse_count(f, v); });
  add_valued(app, "--persist-below", "E",
             "ZeRO-3 units under E parameters stay gathered (default 0)",
             [&o](sv f, sv v) { o.persist_below = cli::parse_count(f, v); });
  app.add_flag_callback(
      "--no-reshard", [&o] { o.reshard = false; },
      "ZeRO-3 keeps units gathered from forward to backward");
  add_valued(app, "--max-live", "E", "ZeRO-3 limit on gathered parameters (default none)",
             [&o](sv f, sv v) { o.max_live = at_least(f, v, cli::parse_count(f, v), 1); });

  app.option_defaults()->group("memory");
  add_valued(app, "--gpu-mem", "BYTES", "memory per GPU (80GB = 80e9 bytes, 80GiB = 80 x 2^30)",
             [&o](sv f, sv v) { o.gpu_mem = at_least(f, v, cli::parse_bytes(f, v), 1); });
  add_valued(app, "--headroom", "X", "keep X free: a percentage (10%) or bytes (4GB); default 0",
             [&o](sv f, sv v) { o.headroom = cli::parse_headroom(f, v); });
  add_valued(app, "--activations", "BYTES", "activation memory per rank (default 0)",
             [&o](sv f, sv v) { o.activations = cli::parse_bytes(f, v); });

  app.option_defaults()->group("cluster (for the communication time)");
  add_valued(app, "--gpus-per-node", "G", "default 8", [&o](sv f, sv v) {
    o.cluster.gpus_per_node = at_least(f, v, cli::parse_count(f, v), 1);
  });
  auto bw = [&app](const char* flag, std::string desc, std::optional<double>& to) {
    add_valued(app, flag, "BW", std::move(desc),
               [&to](sv f, sv v) { to = cli::parse_bandwidth(f, v); });
  };
  auto latency = [&app](const char* flag, std::string desc, std::optional<double>& to) {
    add_valued(app, flag, "T", std::move(desc),
               [&to](sv f, sv v) { to = cli::parse_duration(f, v); });
  };
  bw("--intra-bw", "inside a node, per GPU and direction (default 450GB/s)", net.intra.bw);
  bw("--inter-bw", "between nodes, per GPU and direction (default 50GB/s)", net.inter.bw);
  latency("--alpha", "latency per message, both networks (default 5us)", net.alpha);
  latency("--intra-alpha", "latency per message inside a node (default --alpha)", net.intra.alpha);
  latency("--inter-alpha", "latency per message between nodes (default --alpha)", net.inter.alpha);
  bw("--intra-all-reduce-bw",
     "all-reduce's own link inside a node, in place of --intra-bw\n"
     "and --intra-alpha (--calibrate measures one per collective);\n"
     "the flag of the pair not given takes the intra-node value",
     net.all_reduce.bw);
  latency("--intra-all-reduce-alpha", "its latency", net.all_reduce.alpha);
  bw("--intra-reduce-scatter-bw", "reduce-scatter's own link, likewise", net.reduce_scatter.bw);
  latency("--intra-reduce-scatter-alpha", "its latency", net.reduce_scatter.alpha);
  bw("--intra-all-gather-bw", "all-gather's own link, likewise", net.all_gather.bw);
  latency("--intra-all-gather-alpha", "its latency", net.all_gather.alpha);
  bw("--intra-all-reduce-in-place-bw",
     "all-reduce's link when a step runs it in place (ZeRO-0's;\n"
     "--calibrate --in-place measures one per collective); the\n"
     "flag of the pair not given takes all-reduce's own link",
     net.all_reduce_in_place.bw);
  latency("--intra-all-reduce-in-place-alpha", "its latency", net.all_reduce_in_place.alpha);
  bw("--intra-reduce-scatter-in-place-bw", "reduce-scatter's in place, likewise",
     net.reduce_scatter_in_place.bw);
  latency("--intra-reduce-scatter-in-place-alpha", "its latency",
          net.reduce_scatter_in_place.alpha);
  bw("--intra-all-gather-in-place-bw", "all-gather's in place, likewise",
     net.all_gather_in_place.bw);
  latency("--intra-all-gather-in-place-alpha", "its latency", net.all_gather_in_place.alpha);
  add_valued(app, "--samples", "FILE",
             "times of one node's collectives measured by --calibrate\n"
             "--save-samples FILE: a call whose size lies among them\n"
             "takes the measured curve instead of the links above",
             [&o](sv f, sv v) {
               o.measured = read_samples(f, std::string(v));
               o.measured_source = std::string(v);
             });

  app.option_defaults()->group("output");
  add_valued(app, "--rank", "R", "report the bytes rank R sends (default 0)",
             [&o](sv f, sv v) { o.rank = cli::parse_count(f, v); });
  app.add_flag("--exact", o.exact, "bytes as exact integers instead of GB/MB/kB");
  app.add_flag("--offload", o.offload, "also GPU and host bytes with the optimizer in host memory");
  add_valued(app, "--host-mem", "BYTES", "host memory per rank for --offload (default: no limit)",
             [&o](sv f, sv v) { o.host_mem = cli::parse_bytes(f, v); });
  app.add_flag("--json", o.json, "one JSON object (keys documented in README.md)");
  add_help_flag(app);
}

constexpr const char* calibrate_usage =
    "usage: shardkit-plan --calibrate [--comm thread|mpi] [--ranks N] [--max-bytes B] [--reps K]\n"
    "                          [--dtype bf16|fp32] [--cold-bytes B] [--fresh-input]\n"
    "                          [--in-place] [--async] [--growth G] [--optimizer-bytes B]\n"
    "                          [--gathered-bytes B] [--gather-outputs K] [--zero-reduce-outputs]\n"
    "                          [--after-last-arrival] [--save-samples FILE]\n";

//! The flags of --calibrate, filling `o`.
inline void add_calibrate_options(CLI::App& app, calibrate_options& o) {
  configure(app, calibrate_usage,
            "calibration (prints the cluster flags above, measured on this machine)");
  using sv = std::string_view;
  const std::string calibrate =
      "time all-gather, reduce-scatter and all-reduce on N ranks of\n"
      "one node and fit --intra-alpha and --intra-bw to them, and\n"
      "one link per collective (--intra-all-reduce-bw etc.)";
  app.add_flag("--calibrate", calibrate);
  add_valued(app, "--comm", "thread|mpi",
             "in-process ranks, or the MPI world under mpiexec (the\n"
             "default under an MPI launcher)",
             [&o](sv f, sv v) {
               if (v != "thread" && v != "mpi") {
                 cli::fail(f, v, "is not a communicator; expected thread or mpi");
               }
               o.comm = std::string(v);
             });
  add_valued(app, "--ranks", "N", "in-process ranks to time (default 4; under MPI: the processes)",
             [&o](sv f, sv v) {
               o.ranks = cli::parse_count(f, v);
               o.ranks_given = true;
               if (o.ranks < 2 || o.ranks > 256)
                 cli::fail(f, v, "must be 2..256 ranks to calibrate on");
             });
  add_valued(app, "--max-bytes", "B",
             "largest buffer timed (default 16MiB; from 4KiB, x --growth apart)", [&o](sv f, sv v) {
               const std::uint64_t b = parse_plain_or_unit_bytes(f, v);
               if (b < 4 * o.sweep.min_bytes || b > (std::uint64_t{1} << 30)) {
                 cli::fail(f, v,
                           "must be 16KiB..1GiB (the sweep starts at 4KiB and needs two sizes)");
               }
               o.sweep.max_bytes = static_cast<std::size_t>(b);
             });
  add_valued(app, "--reps", "K", "repetitions per size, median taken (default 5)",
             [&o](sv f, sv v) {
               const std::uint64_t k = cli::parse_count(f, v);
               if (k < 1 || k > 1000) cli::fail(f, v, "must be 1..1000 repetitions");
               o.sweep.reps = static_cast<int>(k);
             });
  add_valued(app, "--dtype", "bf16|fp32", "element type timed, as the gradients (default bf16)",
             [&o](sv f, sv v) {
               o.sweep.element = cli::parse_dtype(f, v);
               if (o.sweep.element == shardkit::dtype::f16) {
                 cli::fail(f, v, "is not timed; expected bf16 or fp32");
               }
             });
  // 0, or bytes (plain or with a unit) up to 16 GiB.
  const auto zero_or_bytes = [](sv f, sv v) {
    const std::uint64_t b = v == "0" ? 0 : parse_plain_or_unit_bytes(f, v);
    if (b > (std::uint64_t{16} << 30)) cli::fail(f, v, "must be 0..16GiB");
    return static_cast<std::size_t>(b);
  };
  add_valued(app, "--cold-bytes", "B",
             "buffers per rank the calls take turns on, so that each finds\n"
             "its data out of cache as a training step's do (default\n"
             "256MiB; 0: one buffer reused, small sizes then time in cache)",
             [&o, zero_or_bytes](sv f, sv v) { o.sweep.cold_bytes = zero_or_bytes(f, v); });
  app.add_flag("--fresh-input", o.sweep.fresh_input,
               "each rank writes a call's input just before it (untimed), as\n"
               "a step writes the gradients it reduces; calls timed one by one");
  app.add_flag("--in-place", o.sweep.in_place,
               "time in place as well, and print the in-place links\n"
               "(--intra-all-reduce-in-place-bw etc.)");
  app.add_flag("--async", o.sweep.asynchronous,
               "issue the asynchronous collectives and wait, as the engine\n"
               "issues its reduce-scatters and all-gathers");
  add_valued(app, "--growth", "G",
             "each size G times the one before (default 4; 2 also times\n"
             "the sizes in between)",
             [&o](sv f, sv v) {
               const std::uint64_t g = cli::parse_count(f, v);
               if (g < 2 || g > 1024) cli::fail(f, v, "must be 2..1024");
               o.sweep.growth = static_cast<std::size_t>(g);
             });
  add_valued(app, "--optimizer-bytes", "B",
             "bytes each rank streams before every in-place all-gather,\n"
             "as the step's optimizer does before it gathers (e.g. 28 x\n"
             "the shard's elements for AdamW); needs --fresh-input and\n"
             "--in-place",
             [&o, zero_or_bytes](sv f, sv v) { o.sweep.optimizer_bytes = zero_or_bytes(f, v); });
  add_valued(app, "--gathered-bytes", "B",
             "bytes each rank contributes to the in-place all-gathers\n"
             "after one optimizer pass (its shard of the working\n"
             "parameters); each is then timed in a run of B / its bytes\n"
             "calls after one pass, as the step gathers its units one\n"
             "after another; needs --optimizer-bytes",
             [&o, zero_or_bytes](sv f, sv v) { o.sweep.gathered_bytes = zero_or_bytes(f, v); });
  add_valued(app, "--gather-outputs", "K",
             "out-of-place all-gathers take turns on K outputs of their\n"
             "own, as ZeRO-3 gathers into the buffers earlier units\n"
             "released (K = prefetch + 1; default 0: they walk the buffers)",
             [&o](sv f, sv v) {
               const std::uint64_t k = cli::parse_count(f, v);
               if (k > 16) cli::fail(f, v, "must be 0..16");
               o.sweep.gather_outputs = static_cast<std::size_t>(k);
             });
  app.add_flag("--zero-reduce-outputs", o.sweep.zero_reduce_outputs,
               "each rank zeroes an out-of-place reduce-scatter's output\n"
               "before the call, as the engine zeroes its gradient shard\n"
               "after every step; needs --fresh-input");
  app.add_flag("--after-last-arrival", o.sweep.after_last_arrival,
               "time each call from the last rank's start to the first\n"
               "rank's return instead of the slowest rank's own time (ranks\n"
               "of one machine: one clock)");
  add_valued(app, "--save-samples", "FILE",
             "also write the measured times to FILE, for the planner's\n"
             "--samples FILE",
             [&o](sv, sv v) { o.save_samples = std::string(v); });
  app.option_defaults()->group("");  // the planner's help lists --help
  add_help_flag(app);
}

}  // namespace detail

//! Parses the planner's command line into `o`; false when --help was asked (print help_text()).
//! Throws cli::bad_argument.
inline bool parse_plan_options(int argc, const char* const* argv, options& o) {
  CLI::App app{"", "shardkit-plan"};
  cluster_flags net;
  detail::add_plan_options(app, o, net);
  if (!detail::run(app, argc, argv, "", "; expected a flag that --help lists")) return false;
  net.apply(o.cluster);
  return true;
}

//! Parses a --calibrate command line into `o`; false when --help was asked. Throws
//! cli::bad_argument.
inline bool parse_calibrate_options(int argc, const char* const* argv, calibrate_options& o) {
  CLI::App app{"", "shardkit-plan"};
  detail::add_calibrate_options(app, o);
  if (!detail::run(app, argc, argv, "--calibrate: ",
                   "; expected --comm, --ranks, --max-bytes, --reps, --dtype, --cold-bytes, "
                   "--fresh-input, --in-place, --async, --growth, --optimizer-bytes, "
                   "--gathered-bytes, --gather-outputs, --zero-reduce-outputs, "
                   "--after-last-arrival or "
                   "--save-samples")) {
    return false;
  }
  if (o.sweep.optimizer_bytes != 0 && !(o.sweep.fresh_input && o.sweep.in_place)) {
    throw cli::bad_argument(
        "--calibrate: --optimizer-bytes needs --fresh-input and --in-place (it is streamed "
        "before each in-place all-gather, which is then timed alone)");
  }
  if (o.sweep.gathered_bytes != 0 && o.sweep.optimizer_bytes == 0) {
    throw cli::bad_argument(
        "--calibrate: --gathered-bytes needs --optimizer-bytes (it groups the in-place "
        "all-gathers that follow one optimizer pass)");
  }
  if (o.sweep.zero_reduce_outputs && !o.sweep.fresh_input) {
    throw cli::bad_argument(
        "--calibrate: --zero-reduce-outputs needs --fresh-input (the output is zeroed before "
        "each reduce-scatter, which is then timed alone)");
  }
  return true;
}

//! --help: the planner's flags, then --calibrate's.
inline std::string help_text() {
  CLI::App plan_app{"", "shardkit-plan"}, calibrate_app{"", "shardkit-plan"};
  options o;
  cluster_flags net;
  calibrate_options c;
  detail::add_plan_options(plan_app, o, net);
  detail::add_calibrate_options(calibrate_app, c);
  return plan_app.help() + "\n" + calibrate_app.help();
}

}  // namespace shardkit_plan
