// The planner against the engine: for small models, every stage the engine implements, several
// rank counts, dtypes, optimizers, alignments, staging buffers, buckets and micro-batches, the
// bytes the planner predicts equal, byte for byte, what the engine's memory ledger holds and
// what its traffic ledger (and step_report::bytes_sent) says it sent; and the collectives it
// issues in place are the ones the planner says it does. Engines run on in-process
// ranks (run_ranks + thread_comm); each rank returns its first mismatch and the test asserts
// after all ranks are done.
#include <shardkit/plan/planner.hpp>
#include <shardkit/shardkit.hpp>

#include "zero/engine_harness.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace plan = shardkit::plan;
using shardkit::collective;
using shardkit::memory_category;

namespace {

//! A model for the comparison: parameter sizes and where units start.
std::vector<test::model_case> models() {
  auto m = test::model_cases();
  m.push_back({"a unit of empty parameters", {3, 0, 0, 9}, {0, 1, 3}});
  m.push_back({"one parameter", {1000}, {}});
  return m;
}

//! Engine settings the comparison runs with.
struct variant {
  const char* name;
  shardkit::engine_options options;
  int micro_batches;
};

std::vector<variant> variants() {
  std::vector<variant> v;
  v.push_back({"defaults", {}, 1});
  shardkit::engine_options aligned;
  aligned.alignment = 4;
  aligned.grad_buffers = 2;
  v.push_back({"alignment 4, 2 staging buffers, 3 micro-batches", aligned, 3});
  shardkit::engine_options bucketed;
  bucketed.bucket_elems = 16;
  bucketed.grad_buffers = 2;
  v.push_back({"buckets of 16 elements, 2 staging buffers, 2 micro-batches", bucketed, 2});
  shardkit::engine_options wide;
  wide.alignment = 8;
  wide.bucket_elems = 300;
  v.push_back({"alignment 8, buckets of 300, 2 micro-batches", wide, 2});
  shardkit::engine_options z3;
  z3.prefetch = 2;
  z3.persist_below = 10;
  v.push_back({"prefetch 2, units below 10 elements persist", z3, 1});
  shardkit::engine_options z3b;
  z3b.prefetch = 0;
  z3b.max_live_elems = 40000;
  v.push_back({"no prefetch, at most 40000 live elements, 2 micro-batches", z3b, 2});
  shardkit::engine_options hybrid;
  hybrid.shard_group_size = 2;
  v.push_back({"hybrid sharding in groups of 2", hybrid, 1});
  shardkit::engine_options hybrid_mb = hybrid;
  hybrid_mb.grad_buffers = 2;
  v.push_back({"hybrid sharding in groups of 2, 2 staging buffers, 3 micro-batches", hybrid_mb, 3});
  return v;
}

//! The model as the planner sees it: the groups a stage-2 engine builds from these options (a
//! stage-3 engine always uses the units).
std::vector<plan::unit> planner_units(const test::model_case& mc, const shardkit::engine_options& o,
                                      int stage) {
  const std::vector<std::uint64_t> sizes(mc.sizes.begin(), mc.sizes.end());
  if (o.bucket_elems != 0 && stage != 3) return plan::buckets(sizes, o.bucket_elems);
  std::vector<plan::unit> units;
  const std::vector<std::size_t> starts = mc.units.empty() ? std::vector<std::size_t>{0} : mc.units;
  for (std::size_t u = 0; u < starts.size(); ++u) {
    const std::size_t end = u + 1 < starts.size() ? starts[u + 1] : sizes.size();
    std::uint64_t n = 0;
    for (std::size_t i = starts[u]; i < end; ++i) n += sizes[i];
    units.push_back(plan::unit{n});
  }
  return units;
}

//! Builds an engine on every rank, runs two steps and compares each rank's ledgers with the
//! planner. Returns one string per rank: empty, or the first mismatch. Grad: the engine's
//! gradient type (default the working type).
template <class Policies, class W, class Opt, class Grad = W>
std::vector<std::string> compare(int N, const test::model_case& mc, const variant& v) {
  using engine_t = shardkit::engine<shardkit::thread_comm, Policies, W, Opt, Grad>;
  constexpr int stage = Policies::stage;
  plan::setup s;
  s.stage = stage;
  s.ranks = static_cast<std::uint64_t>(N);
  s.alignment = v.options.alignment;
  s.grad_buffers = v.options.grad_buffers;
  s.micro_batches = static_cast<std::uint64_t>(v.micro_batches);
  s.bytes = plan::precision_of(shardkit::dtype_of<W>, shardkit::dtype_of<Grad>, Opt::state_count);
  s.prefetch = v.options.prefetch;
  s.persist_below = v.options.persist_below;
  s.max_live_elems = v.options.max_live_elems;
  s.shard_ranks = v.options.shard_group_size;
  const auto units = planner_units(mc, v.options, stage);
  const plan::memory_bytes want_mem = plan::memory_per_rank(s, units);

  return shardkit::run_ranks(N, [&](shardkit::thread_comm& c) -> std::string {
    std::ostringstream fail;
    auto check = [&](bool ok, auto&&... what) {
      if (!ok && fail.tellp() == 0) (fail << ... << what);
    };
    shardkit::model_spec model;
    std::size_t next_unit = 0;
    for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
      if (next_unit < mc.units.size() && mc.units[next_unit] == i) {
        model.begin_unit();
        ++next_unit;
      }
      model.add("p" + std::to_string(i), mc.sizes[i]);
    }
    engine_t eng(c, model, typename engine_t::optimizer_options{}, v.options);
    check(engine_t::precision() == s.bytes, "precision_of disagrees with engine::precision()");
    const auto rank = static_cast<std::uint64_t>(c.rank());
    const plan::comm_bytes want = plan::bytes_sent_per_step(s, units, rank);

    std::vector<float> g;
    for (int step = 1; step <= 2; ++step) {
      const shardkit::traffic_ledger before = eng.traffic();
      for (int mb = 0; mb < v.micro_batches; ++mb) {
        // The unit hooks gather under ZeRO-3 and are no-ops in stages 0-2.
        for (std::size_t u = 0; u < eng.num_units(); ++u) {
          eng.pre_forward(u);
          eng.post_forward(u);
        }
        for (std::size_t i = mc.sizes.size(); i-- > 0;) {  // backward order
          const std::size_t u = eng.unit_of(i);
          if (i + 1 == mc.sizes.size() || eng.unit_of(i + 1) != u) eng.pre_backward(u);
          g.assign(mc.sizes[i], 0.001f * static_cast<float>(1 + mb + c.rank()) * eng.loss_scale());
          eng.grad_ready(i, g);
          if (i == 0 || eng.unit_of(i - 1) != u) eng.post_backward(u);
        }
      }
      const auto rep = eng.step();
      const auto sent = eng.traffic().since(before);
      check(rep.bytes_sent == want.total(), "step ", step, ": step_report::bytes_sent ",
            rep.bytes_sent, ", planner ", want.total());
      for (const collective op :
           {collective::all_reduce, collective::reduce_scatter, collective::all_gather}) {
        check(sent.bytes_sent(op) == want.bytes(op), "step ", step, ": ", op, " sent ",
              sent.bytes_sent(op), " bytes, planner ", want.bytes(op));
        // With one rank the engine still calls its (empty) collectives; the planner counts
        // the ones that move data.
        if (N > 1) {
          check(sent.calls(op) == want.calls(op), "step ", step, ": ", op, " called ",
                sent.calls(op), " times, planner ", want.calls(op));
        }
      }
      check(sent.bytes_sent(collective::broadcast) == 0 &&
                sent.bytes_sent(collective::all_to_all) == 0,
            "the engine used a collective the planner does not model");
    }

    const auto& mem = eng.memory();
    const auto got = eng.measured_state_bytes();
    check(got == want_mem.model_state(), "model state (", got.working_params, ", ", got.grads, ", ",
          got.master_params, ", ", got.optimizer_moments, "), planner (", want_mem.working_params,
          ", ", want_mem.grads, ", ", want_mem.master_params, ", ", want_mem.optimizer_moments,
          ")");
    check(got == eng.expected_state_bytes(), "formulas.hpp disagrees with the ledger");
    check(mem.peak(memory_category::grad_buckets) == want_mem.grad_buckets, "grad_buckets peak ",
          mem.peak(memory_category::grad_buckets), ", planner ", want_mem.grad_buckets);
    check(mem.peak(memory_category::comm_scratch) == want_mem.comm_scratch, "comm_scratch peak ",
          mem.peak(memory_category::comm_scratch), ", planner ", want_mem.comm_scratch);
    // ZeRO-3's gathered bytes and the total are bounds (the window of live units); for stages
    // 0-2 nothing is freed during a step and they are exact.
    const std::uint64_t gathered = mem.peak(memory_category::gathered_params);
    check(stage == 3 ? gathered <= want_mem.gathered_params : gathered == want_mem.gathered_params,
          "gathered_params peak ", gathered, ", planner ", want_mem.gathered_params);
    check(stage == 3 ? mem.total_peak() <= want_mem.total() : mem.total_peak() == want_mem.total(),
          "total peak ", mem.total_peak(), ", planner ", want_mem.total());
    return fail.str();
  });
}

template <class Policies, class W, class Opt, class Grad = W>
void compare_all() {
  for (const auto& mc : models()) {
    for (const auto& v : variants()) {
      for (int N : {1, 2, 3, 4, 8}) {
        const auto G = static_cast<int>(v.options.shard_group_size);
        if (G != 0 && (N % G != 0 || Policies::stage == 0)) continue;  // hybrid needs G | N
        const auto per_rank = compare<Policies, W, Opt, Grad>(N, mc, v);
        for (std::size_t r = 0; r < per_rank.size(); ++r) {
          INFO("stage " << Policies::stage << ", " << shardkit::dtype_of<W> << " (gradients "
                        << shardkit::dtype_of<Grad> << ") + " << Opt::name << ", model '" << mc.name
                        << "', " << v.name << ", " << N << " ranks, rank " << r);
          CHECK(per_rank[r] == "");
        }
      }
    }
  }
}

//! The whole matrix for one stage: dtypes and optimizers.
template <class Policies>
void check_stage() {
  compare_all<Policies, shardkit::bf16, shardkit::adamw>();
  compare_all<Policies, shardkit::fp16, shardkit::adam>();
  compare_all<Policies, float, shardkit::sgd_momentum>();
  compare_all<Policies, float, shardkit::adamw>();
}

}  // namespace

// One line per stage the engine implements.
TEST_CASE("planner equals the engine's ledgers: stage 0") {
  check_stage<shardkit::zero0>();
}
TEST_CASE("planner equals the engine's ledgers: stage 1") {
  check_stage<shardkit::zero1>();
}
TEST_CASE("planner equals the engine's ledgers: stage 2") {
  check_stage<shardkit::zero2>();
}
TEST_CASE("planner equals the engine's ledgers: stage 3") {
  check_stage<shardkit::zero3>();
}

// Gradients in their own type: bf16 working parameters with fp32 gradients (engine<..., bf16,
// Opt, float>), and fp32 working parameters with bf16 gradients. The planner is told with
// precision_of(working, grad, states); grads, staging and scratch take the gradient's bytes,
// all-gathers the working parameters'.
TEST_CASE("planner equals the engine's ledgers: gradients in a type of their own") {
  compare_all<shardkit::zero0, shardkit::bf16, shardkit::adamw, float>();
  compare_all<shardkit::zero1, shardkit::bf16, shardkit::adamw, float>();
  compare_all<shardkit::zero2, shardkit::bf16, shardkit::adamw, float>();
  compare_all<shardkit::zero3, shardkit::bf16, shardkit::adamw, float>();
  compare_all<shardkit::zero2, float, shardkit::sgd_momentum, shardkit::bf16>();
  compare_all<shardkit::zero3, float, shardkit::adam, shardkit::bf16>();
}

namespace {

//! One step of stage `Policies` on N thread ranks behind timed_comm, its collectives logged:
//! each rank returns its first disagreement with the planner's list of collectives (op, count,
//! element bytes, times per step and whether the engine issues it in place), and the bits of
//! its working parameters after the step.
template <class Policies>
std::vector<std::pair<std::string, std::vector<std::uint32_t>>> placement_run(
    int N, std::size_t shard_group, bool serialize) {
  using timed = shardkit::timed_comm<shardkit::thread_comm>;
  using engine_t = shardkit::engine<timed, Policies, shardkit::bf16, shardkit::adamw>;
  const std::vector<std::size_t> sizes = {1000, 24, 2048, 32, 512};
  const test::model_case mc{"three units", sizes, {0, 2, 4}};
  shardkit::engine_options o;
  o.shard_group_size = shard_group;
  plan::setup s;
  s.stage = Policies::stage;
  s.ranks = static_cast<std::uint64_t>(N);
  s.shard_ranks = shard_group;
  s.bytes = plan::precision_of(shardkit::dtype::bf16, shardkit::dtype::bf16, 2);
  const auto units = planner_units(mc, o, Policies::stage);
  return shardkit::run_ranks(N, [&](shardkit::thread_comm& c) {
    timed t(std::move(c));
    shardkit::model_spec model;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (i == 0 || i == 2 || i == 4) model.begin_unit();
      model.add("p" + std::to_string(i), sizes[i]);
    }
    engine_t eng(t, model, shardkit::adam_options{}, o);
    t.timing().record = true;
    t.timing().serialize = serialize;
    for (std::size_t u = 0; u < eng.num_units(); ++u) {
      eng.pre_forward(u);
      eng.post_forward(u);
    }
    std::vector<float> g;
    for (std::size_t i = sizes.size(); i-- > 0;) {
      const std::size_t u = eng.unit_of(i);
      if (i + 1 == sizes.size() || eng.unit_of(i + 1) != u) eng.pre_backward(u);
      g.assign(sizes[i], 0.01f * static_cast<float>(1 + (i + 3 * t.rank()) % 7));
      eng.grad_ready(i, g);
      if (i == 0 || eng.unit_of(i - 1) != u) eng.post_backward(u);
    }
    (void)eng.step();
    std::ostringstream fail;
    std::size_t matched = 0;
    plan::for_each_collective(s, units, [&](const shardkit::accounting::collective_call& call) {
      std::uint64_t seen = 0;
      for (const auto& r : t.timing().log) {
        if (r.kind != call.op || r.count != call.count || r.elem_bytes != call.elem_bytes) continue;
        ++seen;
        if (r.in_place != call.in_place && fail.tellp() == 0) {
          fail << call.op << " of " << call.count << " elements: the engine issued it "
               << (r.in_place ? "in place" : "out of place") << ", the planner says "
               << (call.in_place ? "in place" : "out of place");
        }
      }
      matched += call.repeat;
      if (seen < call.repeat && fail.tellp() == 0) {
        fail << call.op << " of " << call.count << " elements: " << seen
             << " logged, the planner counts " << call.repeat;
      }
    });
    if (matched == 0 && N > 1 && fail.tellp() == 0) fail << "no collective matched the planner's";
    std::vector<std::uint32_t> bits;  // the rank's fp32 master shard after the step
    for (const float x : eng.master_shard()) bits.push_back(std::bit_cast<std::uint32_t>(x));
    return std::pair{fail.str(), bits};
  });
}

template <class Policies>
void check_placement(int N, std::size_t shard_group = 0) {
  const auto overlapped = placement_run<Policies>(N, shard_group, false);
  const auto serial = placement_run<Policies>(N, shard_group, true);
  for (std::size_t r = 0; r < overlapped.size(); ++r) {
    INFO("stage " << Policies::stage << ", " << N << " ranks, shard group " << shard_group
                  << ", rank " << r);
    CHECK(overlapped[r].first == "");
    CHECK(serial[r].first == "");
    // timed_comm::serialize changes when collectives complete, not what they compute.
    CHECK(serial[r].second == overlapped[r].second);
  }
}

}  // namespace

// The time model gives in-place collectives their own link (plan/time.hpp); the planner's list
// says which calls the engine issues in place, and timed_comm's log shows what the engine did.
TEST_CASE("planner: which collectives the engine issues in place") {
  for (const int N : {2, 4}) {
    check_placement<shardkit::zero0>(N);
    check_placement<shardkit::zero1>(N);
    check_placement<shardkit::zero2>(N);
    check_placement<shardkit::zero3>(N);
  }
  check_placement<shardkit::zero1>(4, 2);  // hybrid: the replica all-reduce of the shard
  check_placement<shardkit::zero2>(4, 2);
  check_placement<shardkit::zero3>(4, 2);
}
