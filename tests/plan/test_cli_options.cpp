// The command line of the shardkit-plan tool through CLI11 (examples/shardkit-plan/options.hpp),
// without running its main: the flags reach the options and the cluster (the per-collective
// intra-node links included, and the model's times change as the library computes them), bad
// arguments are cli::bad_argument naming the flag, and --calibrate's printed flags parse back.
#include <shardkit/plan/planner.hpp>
#include <shardkit/plan/sampled.hpp>

#include "shardkit-plan/options.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace plan = shardkit::plan;
using Catch::Contains;

namespace {

//! argv of "shardkit-plan" followed by `args`.
struct command_line {
  std::vector<std::string> words;
  std::vector<const char*> argv;
  explicit command_line(std::vector<std::string> args) : words(std::move(args)) {
    words.insert(words.begin(), "shardkit-plan");
    for (const auto& w : words) argv.push_back(w.c_str());
  }
  int argc() const { return static_cast<int>(argv.size()); }
};

shardkit_plan::options parse(std::vector<std::string> args) {
  const command_line cl(std::move(args));
  shardkit_plan::options o;
  REQUIRE(shardkit_plan::parse_plan_options(cl.argc(), cl.argv.data(), o));
  return o;
}

std::string parse_error(std::vector<std::string> args) {
  const command_line cl(std::move(args));
  shardkit_plan::options o;
  try {
    (void)shardkit_plan::parse_plan_options(cl.argc(), cl.argv.data(), o);
  } catch (const cli::bad_argument& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("shardkit-plan options: the flags reach the options, the defaults stay the planner's") {
  const auto d = parse({});
  CHECK_FALSE(d.params);
  CHECK_FALSE(d.ranks);
  CHECK(d.dtype == shardkit::dtype::bf16);
  CHECK(d.optimizer == plan::optimizer_kind::adamw);
  CHECK(d.reshard);
  CHECK(d.cluster.gpus_per_node == 8);
  CHECK(d.cluster.intra.bytes_per_s == 450e9);
  CHECK(d.cluster.inter.bytes_per_s == 50e9);
  CHECK(d.cluster.intra.latency_s == 5e-6);
  CHECK_FALSE(d.cluster.intra_all_reduce);
  CHECK_FALSE(d.cluster.intra_reduce_scatter);
  CHECK_FALSE(d.cluster.intra_all_gather);

  const auto o =
      parse({"--params",     "7e9",    "--ranks",       "8",    "--gpu-mem",       "80GB",
             "--optimizer",  "sgd",    "--grad-dtype",  "fp32", "--headroom",      "10%",
             "--no-reshard", "--json", "--hybrid",      "4",    "--intra-bw",      "100GB/s",
             "--alpha",      "2us",    "--inter-alpha", "7us",  "--gpus-per-node", "4"});
  CHECK(*o.params == 7'000'000'000);
  CHECK(*o.ranks == 8);
  CHECK(*o.gpu_mem == 80'000'000'000);
  CHECK(o.optimizer == plan::optimizer_kind::sgd_momentum);
  CHECK(*o.grad_dtype == shardkit::dtype::f32);
  CHECK(o.headroom.of(1000) == 100);
  CHECK_FALSE(o.reshard);
  CHECK(o.json);
  CHECK(o.hybrid == 4);
  CHECK(o.cluster.gpus_per_node == 4);
  CHECK(o.cluster.intra.bytes_per_s == Approx(100e9));
  CHECK(o.cluster.intra.latency_s == Approx(2e-6));
  CHECK(o.cluster.inter.latency_s == Approx(7e-6));

  // A flag given twice takes its last value; --alpha and --intra-alpha in either order.
  const auto twice =
      parse({"--ranks", "2", "--ranks", "4", "--intra-alpha", "1us", "--alpha", "3us"});
  CHECK(*twice.ranks == 4);
  CHECK(twice.cluster.intra.latency_s == Approx(1e-6));
  CHECK(twice.cluster.inter.latency_s == Approx(3e-6));
}

TEST_CASE("shardkit-plan options: per-collective intra-node links") {
  const auto o = parse({"--intra-all-reduce-bw", "12GB/s", "--intra-all-reduce-alpha", "3us",
                        "--intra-reduce-scatter-bw", "20GB/s", "--intra-all-gather-alpha", "9us",
                        "--intra-bw", "100GB/s", "--intra-alpha", "1us"});
  REQUIRE(o.cluster.intra_all_reduce);
  CHECK(o.cluster.intra_all_reduce->bytes_per_s == Approx(12e9));
  CHECK(o.cluster.intra_all_reduce->latency_s == Approx(3e-6));
  // The value not given comes from the intra-node link, whatever the order of the flags.
  REQUIRE(o.cluster.intra_reduce_scatter);
  CHECK(o.cluster.intra_reduce_scatter->bytes_per_s == Approx(20e9));
  CHECK(o.cluster.intra_reduce_scatter->latency_s == Approx(1e-6));
  REQUIRE(o.cluster.intra_all_gather);
  CHECK(o.cluster.intra_all_gather->bytes_per_s == Approx(100e9));
  CHECK(o.cluster.intra_all_gather->latency_s == Approx(9e-6));
  CHECK(o.cluster.intra.bytes_per_s == Approx(100e9));
}

TEST_CASE("shardkit-plan options: in-place intra-node links") {
  const auto o =
      parse({"--intra-all-reduce-in-place-bw", "30GB/s", "--intra-all-reduce-bw", "12GB/s",
             "--intra-all-reduce-alpha", "3us", "--intra-all-gather-in-place-alpha", "2us",
             "--intra-bw", "100GB/s", "--intra-alpha", "1us"});
  REQUIRE(o.cluster.intra_all_reduce_in_place);
  CHECK(o.cluster.intra_all_reduce_in_place->bytes_per_s == Approx(30e9));
  // The value not given comes from the collective's own link, whatever the order of the flags.
  CHECK(o.cluster.intra_all_reduce_in_place->latency_s == Approx(3e-6));
  // ... or from the intra-node link where the collective has none.
  REQUIRE(o.cluster.intra_all_gather_in_place);
  CHECK(o.cluster.intra_all_gather_in_place->latency_s == Approx(2e-6));
  CHECK(o.cluster.intra_all_gather_in_place->bytes_per_s == Approx(100e9));
  CHECK_FALSE(o.cluster.intra_all_gather);
  CHECK_FALSE(o.cluster.intra_reduce_scatter_in_place);
}

TEST_CASE("shardkit-plan options: a per-collective link changes the time as the library's does") {
  const auto o = parse({"--intra-all-reduce-bw", "1GiB/s", "--intra-all-reduce-alpha", "0s",
                        "--intra-reduce-scatter-bw", "2GB/s"});
  plan::cluster expected;
  expected.intra_all_reduce = plan::link{0.0, 1073741824.0};
  expected.intra_reduce_scatter = plan::link{5e-6, 2e9};
  plan::setup s;
  s.ranks = 4;
  for (int stage = 0; stage <= 3; ++stage) {
    s.stage = stage;
    const double got = plan::comm_time_per_step(s, std::uint64_t{1} << 20, o.cluster);
    const double want = plan::comm_time_per_step(s, std::uint64_t{1} << 20, expected);
    const double plain = plan::comm_time_per_step(s, std::uint64_t{1} << 20, plan::cluster{});
    INFO("stage " << stage);
    CHECK(got == want);
    CHECK(got != plain);  // stage 0 all-reduces, stages 1-3 reduce-scatter
  }
  s.stage = 0;  // one all-reduce of 2^20 bf16 on 4 ranks: 6 steps of 2^19 bytes at 2^30 B/s
  CHECK(plan::comm_time_per_step(s, std::uint64_t{1} << 20, o.cluster) == 6.0 / 2048);
}

TEST_CASE("shardkit-plan options: --samples reads what --save-samples wrote, and plans with it") {
  // Samples of a known curve at 2 ranks: reduce-scatters, all-reduces in place.
  std::vector<plan::calibration_sample> written;
  for (std::uint64_t n = 1024; n <= (std::uint64_t{1} << 22); n *= 2) {
    for (const bool in_place : {false, true}) {
      written.push_back(
          {shardkit::collective::reduce_scatter, n, 2, 2, 1e-5 + n * 3e-10, in_place});
    }
    written.push_back({shardkit::collective::all_reduce, 2 * n, 2, 2, 2e-5 + n * 1e-9, true});
  }
  const std::string path = "shardkit_plan_samples_test.txt";
  shardkit_plan::write_samples(path, written, "test");
  const auto o = parse({"--samples", path.c_str(), "--gpus-per-node", "2"});
  REQUIRE(o.measured);
  CHECK(o.measured_source == path);
  // Every sample comes back exactly (17 significant digits), sorted.
  REQUIRE(o.measured->samples().size() == written.size());
  for (const auto& w : written) {
    const auto got = o.measured->at(w.op, w.count, w.elem_bytes, w.ranks, w.in_place);
    REQUIRE(got);
    CHECK(*got == w.seconds);
  }
  // The planner's times: the library's plan_all with the samples.
  plan::setup s;
  s.ranks = 2;
  const plan::unit model[] = {{std::uint64_t{1} << 20}};
  const plan::gpu_budget budget{std::uint64_t{1} << 30, 0};
  const auto with = plan::plan_all(s, model, o.cluster, *o.measured, budget);
  const auto without = plan::plan_all(s, model, o.cluster, budget);
  for (int st = 0; st <= 3; ++st) {
    INFO("stage " << st);
    const auto& a = with.stages[static_cast<std::size_t>(st)];
    CHECK(a.ring_time_s == plan::comm_time_per_step(a.config, model, o.cluster, *o.measured));
    CHECK(a.ring_time_s != without.stages[static_cast<std::size_t>(st)].ring_time_s);
    CHECK(a.memory.total() == without.stages[static_cast<std::size_t>(st)].memory.total());
  }
  std::remove(path.c_str());
  CHECK_THAT(parse_error({"--samples", path.c_str()}), Contains("is not a readable file"));
}

TEST_CASE("shardkit-plan options: bad arguments name the flag, what was given and expected") {
  CHECK_THAT(parse_error({"--frobnicate", "1"}),
             Contains("unknown argument '--frobnicate'") && Contains("expected"));
  CHECK_THAT(parse_error({"--params", "7e9", "--ranks"}),
             Contains("--ranks: missing value; expected --ranks N"));
  CHECK_THAT(parse_error({"--intra-all-gather-bw"}),
             Contains("--intra-all-gather-bw: missing value"));
  CHECK_THAT(parse_error({"stray"}), Contains("unexpected argument 'stray'"));
  CHECK_THAT(parse_error({"--intra-all-reduce-bw", "5GBps"}),
             Contains("--intra-all-reduce-bw: '5GBps' has an unknown unit 'GBps'"));
  CHECK_THAT(parse_error({"--intra-reduce-scatter-alpha", "3"}),
             Contains("--intra-reduce-scatter-alpha: '3' has an unknown unit ''"));
  CHECK_THAT(parse_error({"--intra-all-gather-bw", "0GB/s"}),
             Contains("--intra-all-gather-bw: '0GB/s' must be a positive bandwidth"));
  CHECK_THAT(parse_error({"--ranks", "0"}), Contains("--ranks: '0' must be at least 1"));
  CHECK_THAT(parse_error({"--optimizer", "lion"}),
             Contains("--optimizer: 'lion' is not an optimizer"));
  // A value that looks like a flag is the value (as the hand-written parser did).
  CHECK_THAT(parse_error({"--ranks", "--json"}), Contains("--ranks: '--json' is not a number"));
}

TEST_CASE("shardkit-plan options: --help wins, and lists every flag") {
  for (const auto& args :
       {std::vector<std::string>{"--help"}, {"-h"}, {"--params", "-5", "--help"}}) {
    const command_line cl(args);
    shardkit_plan::options o;
    CHECK_FALSE(shardkit_plan::parse_plan_options(cl.argc(), cl.argv.data(), o));
  }
  const std::string help = shardkit_plan::help_text();
  CHECK(help.rfind("usage: shardkit-plan --params P", 0) == 0);
  CHECK_THAT(help, Contains("\nusage: shardkit-plan --calibrate [--comm thread|mpi]"));
  for (const char* flag : {"--params P",
                           "--units FILE|a,b,c",
                           "--largest-unit L",
                           "--dtype bf16|fp16|fp32",
                           "--grad-dtype",
                           "--optimizer",
                           "--ranks N",
                           "--hybrid G",
                           "--micro-batches K",
                           "--grad-buffers B",
                           "--alignment A",
                           "--prefetch D",
                           "--persist-below E",
                           "--no-reshard",
                           "--max-live E",
                           "--gpu-mem BYTES",
                           "--headroom X",
                           "--activations BYTES",
                           "--gpus-per-node G",
                           "--intra-bw BW",
                           "--inter-bw BW",
                           "--alpha T",
                           "--intra-alpha T",
                           "--inter-alpha T",
                           "--intra-all-reduce-bw BW",
                           "--intra-all-reduce-alpha T",
                           "--intra-reduce-scatter-bw BW",
                           "--intra-reduce-scatter-alpha T",
                           "--intra-all-gather-bw BW",
                           "--intra-all-gather-alpha T",
                           "--rank R",
                           "--exact",
                           "--offload",
                           "--host-mem BYTES",
                           "--json",
                           "-h,--help",
                           "--calibrate",
                           "--comm thread|mpi",
                           "--max-bytes B",
                           "--reps K",
                           "--cold-bytes B",
                           "--fresh-input",
                           "--in-place",
                           "--async",
                           "--growth G",
                           "--optimizer-bytes B",
                           "--gather-outputs K",
                           "--zero-reduce-outputs",
                           "--after-last-arrival",
                           "--save-samples FILE",
                           "--samples FILE",
                           "--intra-all-reduce-in-place-bw BW",
                           "--intra-all-gather-in-place-alpha T"}) {
    CHECK_THAT(help, Contains(std::string("    ") + flag));
  }
}

TEST_CASE("shardkit-plan options: --calibrate's flags") {
  const command_line cl({"--reps", "3", "--calibrate", "--max-bytes", "1MiB", "--cold-bytes", "0",
                         "--dtype", "fp32", "--comm", "thread", "--ranks", "3"});
  REQUIRE(shardkit_plan::wants_calibrate(cl.argc(), cl.argv.data()));
  shardkit_plan::calibrate_options c;
  REQUIRE(shardkit_plan::parse_calibrate_options(cl.argc(), cl.argv.data(), c));
  CHECK(c.sweep.reps == 3);
  CHECK(c.sweep.max_bytes == (std::size_t{1} << 20));
  CHECK(c.sweep.cold_bytes == 0);
  CHECK(c.sweep.element == shardkit::dtype::f32);
  CHECK(c.comm == "thread");
  CHECK(c.ranks == 3);
  CHECK(c.ranks_given);
  CHECK_FALSE(c.sweep.fresh_input);
  CHECK_FALSE(c.sweep.in_place);
  CHECK_FALSE(c.sweep.asynchronous);
  const command_line like_step({"--calibrate", "--fresh-input", "--in-place", "--async"});
  REQUIRE(shardkit_plan::parse_calibrate_options(like_step.argc(), like_step.argv.data(), c));
  CHECK(c.sweep.fresh_input);
  CHECK(c.sweep.in_place);
  CHECK(c.sweep.out_of_place);
  CHECK(c.sweep.asynchronous);
  CHECK(c.sweep.optimizer_bytes == 0);
  CHECK(c.sweep.gather_outputs == 0);
  CHECK(c.sweep.growth == 4);
  const command_line as_engine({"--calibrate", "--fresh-input", "--in-place", "--async", "--growth",
                                "2", "--optimizer-bytes", "117MB", "--gather-outputs", "2"});
  REQUIRE(shardkit_plan::parse_calibrate_options(as_engine.argc(), as_engine.argv.data(), c));
  CHECK(c.sweep.optimizer_bytes == 117'000'000);
  CHECK(c.sweep.gathered_bytes == 0);
  CHECK(c.sweep.gather_outputs == 2);
  CHECK(c.sweep.growth == 2);
  CHECK_FALSE(c.sweep.zero_reduce_outputs);
  CHECK(c.save_samples.empty());
  const command_line zeroed(
      {"--calibrate", "--fresh-input", "--zero-reduce-outputs", "--save-samples", "s.txt"});
  REQUIRE(shardkit_plan::parse_calibrate_options(zeroed.argc(), zeroed.argv.data(), c));
  CHECK(c.sweep.zero_reduce_outputs);
  CHECK(c.save_samples == "s.txt");
  // Streamed before in-place all-gathers timed alone: without --fresh-input and --in-place
  // there are none.
  shardkit_plan::calibrate_options e;
  const command_line alone({"--calibrate", "--optimizer-bytes", "1MiB", "--in-place"});
  CHECK_THROWS_WITH(shardkit_plan::parse_calibrate_options(alone.argc(), alone.argv.data(), e),
                    Contains("--optimizer-bytes needs --fresh-input and --in-place"));
  // The gathers grouped after one optimizer pass: with that pass only.
  const command_line grouped({"--calibrate", "--fresh-input", "--in-place", "--optimizer-bytes",
                              "117MB", "--gathered-bytes", "8MiB"});
  shardkit_plan::calibrate_options g;
  REQUIRE(shardkit_plan::parse_calibrate_options(grouped.argc(), grouped.argv.data(), g));
  CHECK(g.sweep.gathered_bytes == (std::size_t{8} << 20));
  const command_line ungrouped(
      {"--calibrate", "--fresh-input", "--in-place", "--gathered-bytes", "8MiB"});
  shardkit_plan::calibrate_options u;
  CHECK_THROWS_WITH(
      shardkit_plan::parse_calibrate_options(ungrouped.argc(), ungrouped.argv.data(), u),
      Contains("--gathered-bytes needs --optimizer-bytes"));
  const command_line unprepared({"--calibrate", "--zero-reduce-outputs"});
  shardkit_plan::calibrate_options f;
  CHECK_THROWS_WITH(
      shardkit_plan::parse_calibrate_options(unprepared.argc(), unprepared.argv.data(), f),
      Contains("--zero-reduce-outputs needs --fresh-input"));
  const command_line slow({"--calibrate", "--growth", "1"});
  CHECK_THROWS_WITH(shardkit_plan::parse_calibrate_options(slow.argc(), slow.argv.data(), e),
                    Contains("--growth: '1' must be 2..1024"));
  const command_line many({"--calibrate", "--gather-outputs", "17"});
  CHECK_THROWS_WITH(shardkit_plan::parse_calibrate_options(many.argc(), many.argv.data(), e),
                    Contains("--gather-outputs: '17' must be 0..16"));

  const shardkit_plan::calibrate_options d;
  CHECK(d.sweep.element == shardkit::dtype::bf16);
  CHECK(d.sweep.cold_bytes == (std::size_t{256} << 20));
  CHECK(d.ranks == 4);

  const command_line bad({"--calibrate", "--params", "7e9"});
  CHECK_THROWS_WITH(shardkit_plan::parse_calibrate_options(bad.argc(), bad.argv.data(), c),
                    Contains("--calibrate: unknown argument '--params'; expected --comm"));
  const command_line missing({"--calibrate", "--max-bytes"});
  CHECK_THROWS_WITH(shardkit_plan::parse_calibrate_options(missing.argc(), missing.argv.data(), c),
                    Contains("--max-bytes: missing value"));
}

TEST_CASE("shardkit-plan --calibrate: the printed flags, per collective too, parse back") {
  plan::collective_fits per;
  per.all_reduce.emplace();
  per.all_reduce->fitted = plan::link{2.5e-6, 3.3e9};
  per.all_gather.emplace();
  per.all_gather->fitted = plan::link{0, 750e6};  // no reduce-scatter fit: it keeps the link
  per.all_reduce_in_place.emplace();
  per.all_reduce_in_place->fitted = plan::link{1.5e-6, 9.1e9};
  const plan::link one{3.1e-6, 5.2e9};
  const std::string flags = shardkit_plan::calibration_flags(one, 4, per);
  INFO(flags);
  CHECK_THAT(flags, Contains("--intra-all-reduce-alpha 2.5us --intra-all-reduce-bw 3.3GB/s"));
  CHECK_THAT(flags, Contains("--intra-all-gather-alpha 0us --intra-all-gather-bw 750MB/s"));
  CHECK_THAT(flags, !Contains("reduce-scatter"));
  CHECK_THAT(flags, Contains("--intra-all-reduce-in-place-alpha 1.5us "
                             "--intra-all-reduce-in-place-bw 9.1GB/s"));
  CHECK_THAT(flags, !Contains("all-gather-in-place"));

  std::istringstream in(flags);
  std::vector<std::string> args;
  for (std::string w; in >> w;) args.push_back(w);
  const auto o = parse(args);
  CHECK(o.cluster.gpus_per_node == 4);
  CHECK(o.cluster.intra.latency_s == Approx(one.latency_s).epsilon(1e-3));
  CHECK(o.cluster.intra.bytes_per_s == Approx(one.bytes_per_s).epsilon(1e-3));
  REQUIRE(o.cluster.intra_all_reduce);
  CHECK(o.cluster.intra_all_reduce->latency_s == Approx(2.5e-6).epsilon(1e-3));
  CHECK(o.cluster.intra_all_reduce->bytes_per_s == Approx(3.3e9).epsilon(1e-3));
  CHECK_FALSE(o.cluster.intra_reduce_scatter);
  REQUIRE(o.cluster.intra_all_gather);
  CHECK(o.cluster.intra_all_gather->latency_s == 0);
  CHECK(o.cluster.intra_all_gather->bytes_per_s == Approx(750e6).epsilon(1e-3));
  REQUIRE(o.cluster.intra_all_reduce_in_place);
  CHECK(o.cluster.intra_all_reduce_in_place->latency_s == Approx(1.5e-6).epsilon(1e-3));
  CHECK(o.cluster.intra_all_reduce_in_place->bytes_per_s == Approx(9.1e9).epsilon(1e-3));
  CHECK_FALSE(o.cluster.intra_all_gather_in_place);
}

TEST_CASE("shardkit-plan --calibrate: a line more than 15% off its samples ends with a note") {
  plan::link_fit one;
  one.max_rel_error = 0.40;  // the one link: ignored once the collectives have their own
  plan::collective_fits per;
  per.all_reduce.emplace();
  per.all_reduce->max_rel_error = 0.12;
  per.all_gather_in_place.emplace();
  per.all_gather_in_place->max_rel_error = 0.221;
  per.reduce_scatter.emplace();
  per.reduce_scatter->max_rel_error = 0.18;

  const std::string note = shardkit_plan::fit_note(one, per, false);
  INFO(note);
  CHECK_THAT(note, Contains("the all_gather in-place line lies up to 22.1% off"));
  CHECK_THAT(note, Contains("calibrate with --save-samples FILE and pass the planner "
                            "--samples FILE"));
  const std::string saving = shardkit_plan::fit_note(one, per, true);
  INFO(saving);
  CHECK_THAT(saving, Contains("pass the samples written below to the planner as --samples FILE"));

  // Every collective's own line within 15%: no note, whatever the one link's error.
  per.all_gather_in_place->max_rel_error = 0.15;
  per.reduce_scatter->max_rel_error = 0.149;
  CHECK(shardkit_plan::fit_note(one, per, false).empty());

  // No collective could be fitted alone: the one link decides.
  CHECK_THAT(shardkit_plan::fit_note(one, plan::collective_fits{}, false),
             Contains("the one link lies up to 40.0% off"));
  one.max_rel_error = 0.1;
  CHECK(shardkit_plan::fit_note(one, plan::collective_fits{}, false).empty());
}
