// shardkit-plan's output: the table (print_table) and the --json object (print_json) of a plan,
// with the inputs they were computed from. The keys of the JSON object are listed in main.cpp's
// comment and README.md.
#pragma once

#include <shardkit/plan/planner.hpp>

#include "../common/format.hpp"
#include "options.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <utility>

namespace shardkit_plan {

using examples::with_commas;

struct byte_unit {
  double scale;
  const char* name;
};

inline byte_unit pick_unit(std::uint64_t largest) {
  if (largest >= 1'000'000'000) return {1e9, "GB"};
  if (largest >= 1'000'000) return {1e6, "MB"};
  if (largest >= 1'000) return {1e3, "kB"};
  return {1.0, "B"};
}

inline std::string fmt_bytes(std::uint64_t v, const byte_unit& u, bool exact) {
  if (exact || u.scale == 1.0) return with_commas(v);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", static_cast<double>(v) / u.scale);
  return buf;
}

inline std::string fmt_time(double s) {
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

//! "all-reduce 12 GB/s, 3.1 us; all-gather ...": the links set per collective, or "".
inline std::string own_links(const plan::cluster& c) {
  std::string out;
  for (const auto& [name, l] :
       {std::pair{"all-reduce", &c.intra_all_reduce},
        std::pair{"reduce-scatter", &c.intra_reduce_scatter},
        std::pair{"all-gather", &c.intra_all_gather},
        std::pair{"all-reduce in place", &c.intra_all_reduce_in_place},
        std::pair{"reduce-scatter in place", &c.intra_reduce_scatter_in_place},
        std::pair{"all-gather in place", &c.intra_all_gather_in_place}}) {
    if (!*l) continue;
    char buf[128];
    std::snprintf(buf, sizeof buf, "%s%s %.4g GB/s, %.3g us", out.empty() ? "" : "; ", name,
                  (*l)->bytes_per_s / 1e9, (*l)->latency_s * 1e6);
    out += buf;
  }
  return out;
}

//! `"name": {"bytes_per_s": B, "latency_s": T}`, or `"name": null` for a link not set.
inline std::string json_link(const char* name, const std::optional<plan::link>& l) {
  if (!l) return std::string("\"") + name + "\": null";
  char buf[160];
  std::snprintf(buf, sizeof buf, "\"%s\": {\"bytes_per_s\": %.17g, \"latency_s\": %.17g}", name,
                l->bytes_per_s, l->latency_s);
  return buf;
}

inline std::string stage_label(const plan::stage_plan& p) {
  std::string s = "stage " + std::to_string(p.config.stage);
  if (p.config.hybrid()) s += " hyb";
  return s;
}

inline void print_table(const options& o, const plan::plan_report& r,
                        std::span<const plan::unit> model, const plan::gpu_budget& budget) {
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
      "  %" PRIu64 " GPUs per node; collectives one after another, no overlap with compute\n",
      o.cluster.intra.bytes_per_s / 1e9, o.cluster.intra.latency_s * 1e6,
      o.cluster.inter.bytes_per_s / 1e9, o.cluster.inter.latency_s * 1e6, gpn);
  if (const std::string own = own_links(o.cluster); !own.empty()) {
    std::printf("  per collective inside a node: %s\n", own.c_str());
  }
  if (o.measured) {
    std::printf(
        "  measured (--samples %s, %zu samples): a call inside a node whose size lies among\n"
        "  them takes the measured curve (log-log interpolation), the others the links above\n",
        o.measured_source.c_str(), o.measured->samples().size());
  }
  std::printf("\n");

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

inline void print_json(const options& o, const plan::plan_report& r,
                       std::span<const plan::unit> model, const plan::gpu_budget& budget) {
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
  std::printf(
      "  \"gpus_per_node\": %" PRIu64
      ", \"intra_node\": {\"bytes_per_s\": %.17g, \"latency_s\": %.17g}"
      ", \"inter_node\": {\"bytes_per_s\": %.17g, \"latency_s\": %.17g},\n"
      "  %s, %s, %s,\n  %s, %s, %s, \"measured_samples\": %s, \"rank\": %" PRIu64 "},\n",
      o.cluster.gpus_per_node, o.cluster.intra.bytes_per_s, o.cluster.intra.latency_s,
      o.cluster.inter.bytes_per_s, o.cluster.inter.latency_s,
      json_link("intra_all_reduce", o.cluster.intra_all_reduce).c_str(),
      json_link("intra_reduce_scatter", o.cluster.intra_reduce_scatter).c_str(),
      json_link("intra_all_gather", o.cluster.intra_all_gather).c_str(),
      json_link("intra_all_reduce_in_place", o.cluster.intra_all_reduce_in_place).c_str(),
      json_link("intra_reduce_scatter_in_place", o.cluster.intra_reduce_scatter_in_place).c_str(),
      json_link("intra_all_gather_in_place", o.cluster.intra_all_gather_in_place).c_str(),
      o.measured ? std::to_string(o.measured->samples().size()).c_str() : "null", o.rank);
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

}  // namespace shardkit_plan
