// shardkit-plan: which ZeRO stage fits? Prints, for every stage, the bytes each rank holds by
// category (exact, with shardkit's padding), whether that fits in a GPU's memory, the bytes each
// rank sends per step and the predicted communication time, and recommends the lowest stage
// that fits. The numbers come from <shardkit/plan/planner.hpp>, which the tests prove equal to
// what the engine allocates and sends.
//
//   shardkit-plan --params 7e9 --ranks 8 --gpu-mem 80GB
//   shardkit-plan --units layers.txt --ranks 1024 --gpu-mem 80GB --hybrid 8 --json
//   shardkit-plan --calibrate          (calibrate.hpp: measures the link, prints the flags)
//   shardkit-plan --calibrate --save-samples s.txt, then --samples s.txt: the times read off the
//                                      measured curve (samples_file.hpp, plan/sampled.hpp)
//
// The flags are parsed in options.hpp (CLI11; the values by parse.hpp), printed by report.hpp;
// this file checks them against each other, builds the model and plans it.
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
//                                      intra_node {bytes_per_s, latency_s}, inter_node {...},
//                                      intra_all_reduce, intra_reduce_scatter, intra_all_gather
//                                      (each collective's own intra-node link, {bytes_per_s,
//                                      latency_s}, or null when not given: it uses intra_node),
//                                      measured_samples (the --samples file, or null), rank
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
#include <shardkit/plan/sampled.hpp>

#include "../common/format.hpp"
#include "calibrate.hpp"
#include "offload_report.hpp"
#include "options.hpp"
#include "parse.hpp"
#include "report.hpp"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace {

namespace plan = shardkit::plan;
using examples::with_commas;
using shardkit_plan::options;

[[noreturn]] void bad(const std::string& msg) {
  throw cli::bad_argument(msg);
}

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

}  // namespace

int main(int argc, char** argv) {
  try {
    if (shardkit_plan::wants_calibrate(argc, argv)) {
      shardkit_plan::calibrate_options c;
      if (!shardkit_plan::parse_calibrate_options(argc, argv, c)) {
        std::fputs(shardkit_plan::help_text().c_str(), stdout);
        return 0;
      }
      return shardkit_plan::calibrate_main(argc, argv, c);
    }
    options o;
    if (!shardkit_plan::parse_plan_options(argc, argv, o)) {
      std::fputs(shardkit_plan::help_text().c_str(), stdout);
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
    const plan::plan_report r =
        o.measured ? plan::plan_all(s, model, o.cluster, *o.measured, budget, o.rank)
                   : plan::plan_all(s, model, o.cluster, budget, o.rank);
    if (o.json) {
      shardkit_plan::print_json(o, r, model, budget);
    } else {
      shardkit_plan::print_table(o, r, model, budget);
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
