// shardkit-plan: which ZeRO stage fits? Prints, for every stage, the bytes each rank holds by
// category (exact, with shardkit's padding), whether that fits in a GPU's memory, the bytes each
// rank sends per step and the predicted communication time, and recommends the lowest stage
// that fits. The numbers come from <shardkit/plan/planner.hpp>, which the tests prove equal to
// what the engine allocates and sends.
//
//   shardkit-plan --params 7e9 --ranks 8 --gpu-mem 80GB
//   shardkit-plan --units layers.txt --ranks 1024 --gpu-mem 80GB --hybrid 8 --json
//
// Exit status: 0 when a plan was printed (also when no stage fits: see "recommended"),
// 2 for bad arguments (the message names the argument and what was expected), 1 otherwise.
//
// --json prints one object:
//   shardkit_version                   string
//   inputs                             the parsed arguments: params, units, largest_unit,
//                                      ranks, hybrid_shard_ranks (0 = none), dtype, grad_dtype,
//                                      optimizer, optimizer_states, bytes_per_element {working,
//                                      grad, master, optimizer}, alignment, grad_buffers,
//                                      micro_batches,
//                                      prefetch, persist_below, reshard_after_forward,
//                                      max_live_elems, gpu_mem_bytes, headroom_bytes,
//                                      usable_bytes, activation_bytes, gpus_per_node,
//                                      intra_node {bytes_per_s, latency_s}, inter_node {...}, rank
//   stages                             array of 4 objects, stage 0..3, each with:
//     stage, hybrid, shard_group, replicas, groups, shard_elems, padded_elems
//     bytes_per_rank                   {working_params, grads, master_params, optimizer_moments,
//                                       model_state, gathered_params, grad_buckets, comm_scratch,
//                                       activations, total}
//     fits                             total <= usable_bytes and live_limit_ok
//     live_elems, live_limit_ok        ZeRO-3 bound on gathered elements (0 / true otherwise)
//     bytes_sent_per_step              {all_reduce, reduce_scatter, all_gather, total}
//     collectives_per_step             {all_reduce, reduce_scatter, all_gather, total}
//     comm_time_per_step_s             {ring, hierarchical}
//   recommended_stage                  the lowest stage that fits, or null
#include <shardkit/plan/planner.hpp>

#include "../common/format.hpp"
#include "calibrate.hpp"
#include "offload_report.hpp"
#include "parse.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace plan = shardkit::plan;

constexpr const char* usage_text =
    "usage: shardkit-plan --params P | --units FILE|a,b,c   --ranks N   --gpu-mem BYTES\n"
    "  model\n"
    "    --params P            parameters (7e9, 7G, 13000M)\n"
    "    --units FILE|a,b,c    unit (layer/block) sizes, from a file or inline; ZeRO-2 uses them\n"
    "                          as gradient buckets, ZeRO-3 gathers one unit at a time\n"
    "    --largest-unit L      with --params: units of L parameters (and one of the rest)\n"
    "    --dtype bf16|fp16|fp32           working parameters and gradients (default bf16;\n"
    "                                     16-bit adds an fp32 master copy)\n"
    "    --grad-dtype bf16|fp16|fp32      gradients in a type of their own (default: --dtype;\n"
    "                                     fp32 under bf16 is engine<..., bf16, Opt, float>)\n"
    "    --optimizer adamw|adam|sgd       sgd = SGD with momentum (default adamw)\n"
    "  set-up\n"
    "    --ranks N             data-parallel ranks (GPUs)\n"
    "    --hybrid G            stages 1-3 shard within groups of G ranks, replicate N/G times\n"
    "    --micro-batches K     forward/backward passes per optimizer step (default 1)\n"
    "    --grad-buffers B      ZeRO-2/3 gradient staging buffers (default 1)\n"
    "    --alignment A         round each rank's slice up to A elements (default 1)\n"
    "    --prefetch D          ZeRO-3 units gathered ahead (default 1)\n"
    "    --persist-below E     ZeRO-3 units under E parameters stay gathered (default 0)\n"
    "    --no-reshard          ZeRO-3 keeps units gathered from forward to backward\n"
    "    --max-live E          ZeRO-3 limit on gathered parameters (default none)\n"
    "  memory\n"
    "    --gpu-mem BYTES       memory per GPU (80GB = 80e9 bytes, 80GiB = 80 x 2^30)\n"
    "    --headroom X          keep X free: a percentage (10%) or bytes (4GB); default 0\n"
    "    --activations BYTES   activation memory per rank (default 0)\n"
    "  cluster (for the communication time)\n"
    "    --gpus-per-node G     default 8\n"
    "    --intra-bw BW         inside a node, per GPU and direction (default 450GB/s)\n"
    "    --inter-bw BW         between nodes, per GPU and direction (default 50GB/s)\n"
    "    --alpha T             latency per message, both networks (default 5us)\n"
    "    --intra-alpha T, --inter-alpha T   latency per network\n"
    "  output\n"
    "    --rank R              report the bytes rank R sends (default 0)\n"
    "    --exact               bytes as exact integers instead of GB/MB/kB\n"
    "    --offload             also print GPU and host bytes with the optimizer in host memory\n"
    "    --host-mem BYTES      host memory per rank for --offload (default: no limit)\n"
    "    --json                one JSON object (keys documented in README.md)\n"
    "    --help\n";

struct options {
  std::optional<std::uint64_t> params;
  std::optional<std::vector<std::uint64_t>> units;
  std::string units_source;
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
  plan::cluster cluster;
  std::uint64_t rank = 0;
  bool exact = false;
  bool json = false;
  bool help = false;
  bool offload = false;
  std::optional<std::uint64_t> host_mem;
};

[[noreturn]] void bad(const std::string& msg) {
  throw cli::bad_argument(msg);
}

std::uint64_t at_least(std::string_view flag, std::string_view text, std::uint64_t v,
                       std::uint64_t lo) {
  if (v < lo) {
    cli::fail(flag, text, "must be at least " + std::to_string(lo));
  }
  return v;
}

//! Whether `flag` is one of the options that take a value (so a flag that is not is reported as
//! unknown, not as missing its value).
bool takes_value(std::string_view flag) {
  constexpr std::string_view valued[] = {
      "--params",       "--units",       "--largest-unit",  "--ranks",         "--gpu-mem",
      "--dtype",        "--grad-dtype",  "--optimizer",     "--hybrid",        "--micro-batches",
      "--grad-buffers", "--alignment",   "--prefetch",      "--persist-below", "--max-live",
      "--headroom",     "--activations", "--gpus-per-node", "--intra-bw",      "--inter-bw",
      "--alpha",        "--intra-alpha", "--inter-alpha",   "--rank",          "--host-mem"};
  for (const auto v : valued)
    if (flag == v) return true;
  return false;
}

options parse(int argc, char** argv) {
  options o;
  double alpha = -1, intra_alpha = -1, inter_alpha = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      o.help = true;
      return o;
    }
    if (a == "--json") {
      o.json = true;
      continue;
    }
    if (a == "--exact") {
      o.exact = true;
      continue;
    }
    if (a == "--offload") {
      o.offload = true;
      continue;
    }
    if (a == "--no-reshard") {
      o.reshard = false;
      continue;
    }
    if (a.substr(0, 2) != "--") bad("unexpected argument '" + std::string(a) + "' (see --help)");
    if (!takes_value(a)) bad("unknown argument '" + std::string(a) + "' (see --help)");
    if (i + 1 >= argc) bad(std::string(a) + ": missing value (see --help)");
    const std::string_view v = argv[++i];
    if (a == "--params") {
      o.params = at_least(a, v, cli::parse_count(a, v), 1);
    } else if (a == "--units") {
      o.units = cli::parse_units(a, v, o.units_source);
    } else if (a == "--largest-unit") {
      o.largest_unit = at_least(a, v, cli::parse_count(a, v), 1);
    } else if (a == "--ranks") {
      o.ranks = at_least(a, v, cli::parse_count(a, v), 1);
      if (*o.ranks > (1u << 24)) cli::fail(a, v, "is more ranks than the planner models (2^24)");
    } else if (a == "--host-mem") {
      o.host_mem = cli::parse_bytes(a, v);
    } else if (a == "--gpu-mem") {
      o.gpu_mem = at_least(a, v, cli::parse_bytes(a, v), 1);
    } else if (a == "--dtype") {
      o.dtype = cli::parse_dtype(a, v);
    } else if (a == "--grad-dtype") {
      o.grad_dtype = cli::parse_dtype(a, v);
    } else if (a == "--optimizer") {
      if (v == "adamw") {
        o.optimizer = plan::optimizer_kind::adamw;
      } else if (v == "adam") {
        o.optimizer = plan::optimizer_kind::adam;
      } else if (v == "sgd" || v == "sgd_momentum") {
        o.optimizer = plan::optimizer_kind::sgd_momentum;
      } else {
        cli::fail(a, v, "is not an optimizer shardkit ships; expected adamw, adam or sgd");
      }
    } else if (a == "--hybrid") {
      o.hybrid = at_least(a, v, cli::parse_count(a, v), 1);
    } else if (a == "--micro-batches") {
      o.micro_batches = at_least(a, v, cli::parse_count(a, v), 1);
    } else if (a == "--grad-buffers") {
      o.grad_buffers = at_least(a, v, cli::parse_count(a, v), 1);
    } else if (a == "--alignment") {
      o.alignment = at_least(a, v, cli::parse_count(a, v), 1);
    } else if (a == "--prefetch") {
      o.prefetch = cli::parse_count(a, v);
    } else if (a == "--persist-below") {
      o.persist_below = cli::parse_count(a, v);
    } else if (a == "--max-live") {
      o.max_live = at_least(a, v, cli::parse_count(a, v), 1);
    } else if (a == "--headroom") {
      o.headroom = cli::parse_headroom(a, v);
    } else if (a == "--activations") {
      o.activations = cli::parse_bytes(a, v);
    } else if (a == "--gpus-per-node") {
      o.cluster.gpus_per_node = at_least(a, v, cli::parse_count(a, v), 1);
    } else if (a == "--intra-bw") {
      o.cluster.intra.bytes_per_s = cli::parse_bandwidth(a, v);
    } else if (a == "--inter-bw") {
      o.cluster.inter.bytes_per_s = cli::parse_bandwidth(a, v);
    } else if (a == "--alpha") {
      alpha = cli::parse_duration(a, v);
    } else if (a == "--intra-alpha") {
      intra_alpha = cli::parse_duration(a, v);
    } else if (a == "--inter-alpha") {
      inter_alpha = cli::parse_duration(a, v);
    } else if (a == "--rank") {
      o.rank = cli::parse_count(a, v);
    } else {
      bad("unknown argument '" + std::string(a) + "' (see --help)");
    }
  }
  if (alpha >= 0) o.cluster.intra.latency_s = o.cluster.inter.latency_s = alpha;
  if (intra_alpha >= 0) o.cluster.intra.latency_s = intra_alpha;
  if (inter_alpha >= 0) o.cluster.inter.latency_s = inter_alpha;
  return o;
}

using examples::with_commas;

// Cross-argument checks, and the model they describe.
std::vector<plan::unit> build_model(options& o) {
  if (!o.ranks) bad("missing --ranks: the number of data-parallel ranks (GPUs), e.g. --ranks 8");
  if (o.offload && o.json) bad("--offload prints a table; it has no --json form yet");
  if (!o.gpu_mem) bad("missing --gpu-mem: the memory of one GPU, e.g. --gpu-mem 80GB");
  if (!o.params && !o.units) {
    bad("missing --params (the number of parameters, e.g. --params 7e9) or --units (unit sizes)");
  }
  const std::uint64_t N = *o.ranks;
  if (o.hybrid != 0 && N % o.hybrid != 0) {
    bad("--hybrid: shard groups of " + std::to_string(o.hybrid) + " ranks cannot tile --ranks " +
        std::to_string(N) + "; expected a divisor of " + std::to_string(N));
  }
  if (o.rank >= N) {
    bad("--rank: " + std::to_string(o.rank) + " is not a rank of " + std::to_string(N) +
        "; expected 0.." + std::to_string(N - 1));
  }
  const std::uint64_t gpn = o.cluster.gpus_per_node;
  if (N > gpn && N % gpn != 0) {
    bad("--ranks " + std::to_string(N) + " with --gpus-per-node " + std::to_string(gpn) +
        ": the time model needs the ranks to fill whole nodes; expected at most " +
        std::to_string(gpn) + " ranks or a multiple of " + std::to_string(gpn));
  }
  if (o.hybrid > 1 && o.hybrid < N && o.hybrid % gpn != 0 && gpn % o.hybrid != 0) {
    bad("--hybrid " + std::to_string(o.hybrid) + " with --gpus-per-node " + std::to_string(gpn) +
        ": expected a shard group that divides a node or is made of whole nodes");
  }
  const std::uint64_t headroom = o.headroom.of(*o.gpu_mem);
  if (headroom >= *o.gpu_mem) {
    bad("--headroom: " + with_commas(headroom) + " bytes leaves nothing of --gpu-mem " +
        with_commas(*o.gpu_mem) + " bytes; expected less than the GPU's memory");
  }
  std::vector<plan::unit> model;
  if (o.units) {
    if (o.largest_unit) bad("--largest-unit: give either --units or --largest-unit, not both");
    std::uint64_t psi = 0;
    for (const auto n : *o.units) {
      if (__builtin_add_overflow(psi, n, &psi)) bad("--units: the sizes add up to more than 2^64");
      model.push_back(plan::unit{n, o.reshard});
    }
    if (psi == 0) bad("--units: every unit is empty; expected at least one parameter");
    if (o.params && *o.params != psi) {
      bad("--params " + with_commas(*o.params) + " differs from the sum of --units, " +
          with_commas(psi) + "; give one of them or make them agree");
    }
    o.params = psi;
  } else {
    const std::uint64_t psi = *o.params;
    std::uint64_t largest = o.largest_unit.value_or(0);
    if (largest > psi) {
      bad("--largest-unit: " + with_commas(largest) + " is larger than --params " +
          with_commas(psi) + "; expected at most the whole model");
    }
    if (largest != 0 && psi / largest > 10'000'000) {
      bad("--largest-unit: " + with_commas(largest) + " cuts " + with_commas(psi) +
          " parameters into more than 10,000,000 units; expected a larger unit");
    }
    model = plan::uniform_units(psi, largest);
    for (auto& u : model) u.reshard_after_forward = o.reshard;
  }
  // Limits that keep every byte count of the plan below 2^64.
  if (*o.params > (std::uint64_t{1} << 44)) {
    bad("--params: " + with_commas(*o.params) +
        " is more than the planner models; expected at "
        "most 2^44 = 17,592,186,044,416 parameters");
  }
  if (o.micro_batches > 65536) bad("--micro-batches: expected at most 65536");
  if (o.grad_buffers > 1024) bad("--grad-buffers: expected at most 1024");
  if (o.alignment > (1u << 20)) bad("--alignment: expected at most 2^20 elements");
  if (o.prefetch > 1'000'000) bad("--prefetch: expected at most 1,000,000 units");
  return model;
}

// ---- output ---------------------------------------------------------------------------------

struct byte_unit {
  double scale;
  const char* name;
};

byte_unit pick_unit(std::uint64_t largest) {
  if (largest >= 1'000'000'000) return {1e9, "GB"};
  if (largest >= 1'000'000) return {1e6, "MB"};
  if (largest >= 1'000) return {1e3, "kB"};
  return {1.0, "B"};
}

std::string fmt_bytes(std::uint64_t v, const byte_unit& u, bool exact) {
  if (exact || u.scale == 1.0) return with_commas(v);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", static_cast<double>(v) / u.scale);
  return buf;
}

std::string fmt_time(double s) {
  char buf[64];
  if (s == 0) return "0";
  if (s >= 1.0) {
    std::snprintf(buf, sizeof buf, "%.3f s", s);
  } else if (s >= 1e-3) {
    std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.3f us", s * 1e6);
  }
  return buf;
}

std::string stage_label(const plan::stage_plan& p) {
  std::string s = "stage " + std::to_string(p.config.stage);
  if (p.config.hybrid()) s += " hyb";
  return s;
}

void print_table(const options& o, const plan::plan_report& r, std::span<const plan::unit> model,
                 const plan::gpu_budget& budget) {
  const auto& st = r.stages;
  const auto& s0 = st[0].config;
  std::uint64_t largest_unit = 0;
  for (const auto& u : model) largest_unit = std::max(largest_unit, u.numel);
  const std::uint64_t N = s0.ranks;
  const std::uint64_t gpn = o.cluster.gpus_per_node;
  const std::uint64_t nodes = N <= gpn ? 1 : N / gpn;

  std::printf("shardkit-plan %s: %s parameters in %s unit%s (largest %s), %s ranks on %s node%s\n",
              SHARDKIT_VERSION_STRING, with_commas(*o.params).c_str(),
              with_commas(model.size()).c_str(), model.size() == 1 ? "" : "s",
              with_commas(largest_unit).c_str(), with_commas(N).c_str(), with_commas(nodes).c_str(),
              nodes == 1 ? "" : "s");
  const auto& p = s0.bytes;
  const shardkit::dtype grads = o.grad_dtype.value_or(o.dtype);
  const std::string kinds = grads == o.dtype
                                ? std::string(shardkit::name(o.dtype)) + " working params and grads"
                                : std::string(shardkit::name(o.dtype)) + " working params, " +
                                      shardkit::name(grads) + " grads";
  std::printf("%s%s, %s (%" PRIu64 " fp32 state%s per parameter)\n", kinds.c_str(),
              p.master_bytes != 0 ? ", fp32 master" : "", plan::name(o.optimizer),
              plan::state_count(o.optimizer), plan::state_count(o.optimizer) == 1 ? "" : "s");
  if (o.hybrid > 1 && o.hybrid < N) {
    std::printf("hybrid sharding: stages 1-3 shard within groups of %s ranks, %s replicas\n",
                with_commas(o.hybrid).c_str(), with_commas(N / o.hybrid).c_str());
  }

  std::uint64_t largest = 0;
  for (const auto& x : st) largest = std::max(largest, x.memory.total());
  const byte_unit u = o.exact ? byte_unit{1.0, "B"} : pick_unit(largest);
  const std::string usable = fmt_bytes(budget.usable(), u, o.exact) + " " + u.name;
  std::printf("GPU memory %s %s, headroom %s %s, usable %s; activations %s %s per rank\n\n",
              fmt_bytes(budget.memory_bytes, u, o.exact).c_str(), u.name,
              fmt_bytes(budget.headroom_bytes, u, o.exact).c_str(), u.name, usable.c_str(),
              fmt_bytes(o.activations, u, o.exact).c_str(), u.name);

  const int w = o.exact ? 18 : 13;
  auto header = [&](const char* title) {
    std::printf("%-34s", title);
    for (const auto& x : st) std::printf("%*s", w, stage_label(x).c_str());
    std::printf("\n");
  };
  auto row = [&](const char* name, auto&& cell) {
    std::printf("  %-32s", name);
    for (const auto& x : st) std::printf("%*s", w, cell(x).c_str());
    std::printf("\n");
  };
  auto bytes_row = [&](const char* name, auto field) {
    row(name, [&](const plan::stage_plan& x) { return fmt_bytes(field(x), u, o.exact); });
  };

  const std::string held = std::string("bytes held per rank (") + u.name + ")";
  header(held.c_str());
  bytes_row("working params", [](const auto& x) { return x.memory.working_params; });
  bytes_row("grads", [](const auto& x) { return x.memory.grads; });
  bytes_row("master params (fp32)", [](const auto& x) { return x.memory.master_params; });
  bytes_row("optimizer state", [](const auto& x) { return x.memory.optimizer_moments; });
  bytes_row("= model state", [](const auto& x) { return x.memory.model_state().total(); });
  bytes_row("gathered units (peak)", [](const auto& x) { return x.memory.gathered_params; });
  bytes_row("grad buckets (peak)", [](const auto& x) { return x.memory.grad_buckets; });
  bytes_row("comm scratch (peak)", [](const auto& x) { return x.memory.comm_scratch; });
  bytes_row("activations", [](const auto& x) { return x.memory.activations; });
  bytes_row("= total (peak)", [](const auto& x) { return x.memory.total(); });
  row("fits?", [](const plan::stage_plan& x) {
    return std::string(x.fits ? "yes" : x.live_ok ? "no" : "no (live)");
  });

  std::uint64_t most_sent = 0;
  for (const auto& x : st) most_sent = std::max(most_sent, x.sent.total());
  const byte_unit su = o.exact ? byte_unit{1.0, "B"} : pick_unit(most_sent);
  const std::string sent =
      "bytes sent by rank " + std::to_string(o.rank) + " per step (" + su.name + ")";
  std::printf("\n");
  header(sent.c_str());
  auto sent_row = [&](const char* name, auto field) {
    row(name, [&](const plan::stage_plan& x) { return fmt_bytes(field(x), su, o.exact); });
  };
  sent_row("all-reduce", [](const auto& x) { return x.sent.all_reduce; });
  sent_row("reduce-scatter", [](const auto& x) { return x.sent.reduce_scatter; });
  sent_row("all-gather", [](const auto& x) { return x.sent.all_gather; });
  sent_row("= total", [](const auto& x) { return x.sent.total(); });
  row("collectives", [](const plan::stage_plan& x) { return with_commas(x.sent.calls()); });

  std::printf("\n");
  header("communication time per step");
  row("flat rings", [](const plan::stage_plan& x) { return fmt_time(x.ring_time_s); });
  row("hierarchical", [](const plan::stage_plan& x) { return fmt_time(x.hierarchical_time_s); });
  std::printf(
      "  alpha-beta model: intra-node %.4g GB/s, %.3g us; inter-node %.4g GB/s, %.3g us;\n"
      "  %" PRIu64 " GPUs per node; collectives one after another, no overlap with compute\n\n",
      o.cluster.intra.bytes_per_s / 1e9, o.cluster.intra.latency_s * 1e6,
      o.cluster.inter.bytes_per_s / 1e9, o.cluster.inter.latency_s * 1e6, gpn);

  if (r.recommended >= 0) {
    const auto& best = st[static_cast<std::size_t>(r.recommended)];
    std::printf("recommended: %s, the lowest stage that fits (%s of %s usable per GPU)\n",
                stage_label(best).c_str(),
                (fmt_bytes(best.memory.total(), u, o.exact) + " " + u.name).c_str(),
                usable.c_str());
  } else {
    std::printf(
        "recommended: none - no stage fits in %s per GPU; add ranks, use a smaller "
        "unit (ZeRO-3), or fewer activations\n",
        usable.c_str());
  }
  if (model.size() == 1) {
    std::printf(
        "note: the model is one unit: ZeRO-2 stages all its gradients in one bucket and\n"
        "      ZeRO-3 gathers all of it at once; pass --largest-unit or --units\n");
  }
}

void print_json(const options& o, const plan::plan_report& r, std::span<const plan::unit> model,
                const plan::gpu_budget& budget) {
  const auto& s0 = r.stages[0].config;
  std::uint64_t largest_unit = 0;
  for (const auto& u : model) largest_unit = std::max(largest_unit, u.numel);
  const auto& p = s0.bytes;
  std::printf("{\"shardkit_version\": \"%s\",\n", SHARDKIT_VERSION_STRING);
  std::printf(" \"inputs\": {\"params\": %" PRIu64 ", \"units\": %zu, \"largest_unit\": %" PRIu64
              ", \"ranks\": %" PRIu64 ", \"hybrid_shard_ranks\": %" PRIu64
              ", \"dtype\": \"%s\", \"grad_dtype\": \"%s\", \"optimizer\": \"%s\""
              ", \"optimizer_states\": %" PRIu64 ",\n",
              *o.params, model.size(), largest_unit, s0.ranks, o.hybrid, shardkit::name(o.dtype),
              shardkit::name(o.grad_dtype.value_or(o.dtype)), plan::name(o.optimizer),
              plan::state_count(o.optimizer));
  std::printf("  \"bytes_per_element\": {\"working\": %" PRIu64 ", \"grad\": %" PRIu64
              ", \"master\": %" PRIu64 ", \"optimizer\": %" PRIu64 "},\n",
              p.working_bytes, p.grad_bytes, p.master_bytes, p.state_bytes);
  std::printf("  \"alignment\": %" PRIu64 ", \"grad_buffers\": %" PRIu64
              ", \"micro_batches\": %" PRIu64 ", \"prefetch\": %" PRIu64
              ", \"persist_below\": %" PRIu64
              ", \"reshard_after_forward\": %s"
              ", \"max_live_elems\": %" PRIu64 ",\n",
              s0.alignment, s0.grad_buffers, s0.micro_batches, s0.prefetch, s0.persist_below,
              o.reshard ? "true" : "false", s0.max_live_elems);
  std::printf("  \"gpu_mem_bytes\": %" PRIu64 ", \"headroom_bytes\": %" PRIu64
              ", \"usable_bytes\": %" PRIu64 ", \"activation_bytes\": %" PRIu64 ",\n",
              budget.memory_bytes, budget.headroom_bytes, budget.usable(), s0.activation_bytes);
  std::printf("  \"gpus_per_node\": %" PRIu64
              ", \"intra_node\": {\"bytes_per_s\": %.17g, \"latency_s\": %.17g}"
              ", \"inter_node\": {\"bytes_per_s\": %.17g, \"latency_s\": %.17g}"
              ", \"rank\": %" PRIu64 "},\n",
              o.cluster.gpus_per_node, o.cluster.intra.bytes_per_s, o.cluster.intra.latency_s,
              o.cluster.inter.bytes_per_s, o.cluster.inter.latency_s, o.rank);
  std::printf(" \"stages\": [\n");
  for (std::size_t i = 0; i < r.stages.size(); ++i) {
    const auto& x = r.stages[i];
    const auto& m = x.memory;
    const auto& b = x.sent;
    std::printf("  {\"stage\": %d, \"hybrid\": %s, \"shard_group\": %" PRIu64
                ", \"replicas\": %" PRIu64 ", \"groups\": %" PRIu64 ", \"shard_elems\": %" PRIu64
                ", \"padded_elems\": %" PRIu64 ",\n",
                x.config.stage, x.config.hybrid() ? "true" : "false", x.layout.ranks,
                x.config.replicas(), x.layout.groups, x.layout.shard, x.layout.padded());
    std::printf("   \"bytes_per_rank\": {\"working_params\": %" PRIu64 ", \"grads\": %" PRIu64
                ", \"master_params\": %" PRIu64 ", \"optimizer_moments\": %" PRIu64
                ", \"model_state\": %" PRIu64 ", \"gathered_params\": %" PRIu64
                ", \"grad_buckets\": %" PRIu64 ", \"comm_scratch\": %" PRIu64
                ", \"activations\": %" PRIu64 ", \"total\": %" PRIu64 "},\n",
                m.working_params, m.grads, m.master_params, m.optimizer_moments,
                m.model_state().total(), m.gathered_params, m.grad_buckets, m.comm_scratch,
                m.activations, m.total());
    std::printf("   \"fits\": %s, \"live_elems\": %" PRIu64 ", \"live_limit_ok\": %s,\n",
                x.fits ? "true" : "false", x.live_elems, x.live_ok ? "true" : "false");
    std::printf("   \"bytes_sent_per_step\": {\"all_reduce\": %" PRIu64
                ", \"reduce_scatter\": %" PRIu64 ", \"all_gather\": %" PRIu64
                ", \"total\": %" PRIu64 "},\n",
                b.all_reduce, b.reduce_scatter, b.all_gather, b.total());
    std::printf("   \"collectives_per_step\": {\"all_reduce\": %" PRIu64
                ", \"reduce_scatter\": %" PRIu64 ", \"all_gather\": %" PRIu64
                ", \"total\": %" PRIu64 "},\n",
                b.all_reduce_calls, b.reduce_scatter_calls, b.all_gather_calls, b.calls());
    std::printf("   \"comm_time_per_step_s\": {\"ring\": %.17g, \"hierarchical\": %.17g}}%s\n",
                x.ring_time_s, x.hierarchical_time_s, i + 1 < r.stages.size() ? "," : "");
  }
  std::printf(" ],\n");
  if (r.recommended >= 0) {
    std::printf(" \"recommended_stage\": %d}\n", r.recommended);
  } else {
    std::printf(" \"recommended_stage\": null}\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage = std::string(usage_text) + shardkit_plan::calibrate_usage_text;
  if (shardkit_plan::wants_calibrate(argc, argv)) {
    return shardkit_plan::calibrate_main(argc, argv, usage.c_str());
  }
  try {
    options o = parse(argc, argv);
    if (o.help) {
      std::fputs(usage.c_str(), stdout);
      return 0;
    }
    const std::vector<plan::unit> model = build_model(o);

    plan::setup s;
    s.ranks = *o.ranks;
    s.shard_ranks = o.hybrid;
    s.alignment = o.alignment;
    s.bytes = plan::precision_of(o.dtype, o.grad_dtype.value_or(o.dtype), o.optimizer);
    s.grad_buffers = o.grad_buffers;
    s.micro_batches = o.micro_batches;
    s.prefetch = o.prefetch;
    s.persist_below = o.persist_below;
    s.max_live_elems = o.max_live;
    s.activation_bytes = o.activations;
    for (int st = 0; st <= 3; ++st) {  // what build_model() missed, in the library's words
      s.stage = st;
      if (const char* why = plan::invalid_reason(s)) bad(why);
      if (const char* why = plan::placement_problem(s, o.cluster)) bad(why);
    }
    const plan::gpu_budget budget{*o.gpu_mem, o.headroom.of(*o.gpu_mem)};
    const plan::plan_report r = plan::plan_all(s, model, o.cluster, budget, o.rank);
    if (o.json) {
      print_json(o, r, model, budget);
    } else {
      print_table(o, r, model, budget);
      if (o.offload) shardkit_plan::print_offload(r, budget.usable(), o.host_mem);
    }
    return 0;
  } catch (const cli::bad_argument& e) {
    std::fprintf(stderr, "shardkit-plan: error: %s\n(see shardkit-plan --help)\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardkit-plan: error: %s\n", e.what());
    return 1;
  }
}
