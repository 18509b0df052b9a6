// The planner's offload numbers (plan/offload.hpp): the closed forms of docs/accounting.md
// ("Offloading the optimizer"), written out here, and the offloaded engine's two ledgers.
#include <shardkit/shardkit.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace plan = shardkit::plan;
using shardkit::memory_category;

namespace {

// Ψ = 7e9, N = 8, bf16 + Adam, one unit: S = Ψ/N = 875e6.
constexpr plan::setup seven_b(int stage) {
  plan::setup s;
  s.stage = stage;
  s.ranks = 8;
  return s;
}
constexpr std::uint64_t psi7 = 7'000'000'000ull;
constexpr std::uint64_t S7 = psi7 / 8;
constexpr plan::unit one7[1] = {plan::unit{psi7}};

// Stage 2: the device keeps w·N·S + g·S (+ one bucket g·N·S), the host 4S + 8S + 4S.
static_assert(plan::offloaded_memory_per_rank(seven_b(2), one7).device.model_state().total() ==
              2 * psi7 + 2 * S7);
static_assert(plan::offloaded_memory_per_rank(seven_b(2), one7).device.grad_buckets == 2 * psi7);
static_assert(plan::offloaded_memory_per_rank(seven_b(2), one7).host.total() == 16 * S7);
static_assert(plan::offloaded_memory_per_rank(seven_b(2), one7).host.staging == 4 * S7);
// Stage 3: 2S + 2S on the device besides the gathered units; stage 1: 4Ψ.
static_assert(plan::offloaded_memory_per_rank(seven_b(3), one7).device.model_state().total() ==
              4 * S7);
static_assert(plan::offloaded_memory_per_rank(seven_b(1), one7).device.model_state().total() ==
              4 * psi7);
// fp32: no master; the host copy of the working shard is the one the step updates.
constexpr plan::setup fp32_two() {
  plan::setup s = seven_b(2);
  s.bytes = shardkit::accounting::precision::fp32();
  return s;
}
static_assert(plan::offloaded_memory_per_rank(fp32_two(), one7).host.master_params == 0);
static_assert(plan::offloaded_memory_per_rank(fp32_two(), one7).host.total() == 16 * S7);

}  // namespace

TEST_CASE("offload plan: offload is what makes 7B fit at stage 2 on 8 x 40 GB", "[plan][offload]") {
  const auto l = plan::summarize(seven_b(2), one7);
  // Without offload stage 2 needs 2Ψ + 14Ψ/N + 2Ψ (bucket) = 40.25 GB; with it 2Ψ + 2Ψ/N + 2Ψ
  // = 29.75 GB on the device and 14 GB on the host.
  const auto v = plan::offload_fit(seven_b(2), l, 40'000'000'000ull, 64'000'000'000ull);
  CHECK_FALSE(v.fits_device);
  CHECK(v.fits_offload);
  CHECK(v.offload_makes_it_fit());
  // Not when the host cannot hold 16·S.
  CHECK_FALSE(plan::offload_fit(seven_b(2), l, 40'000'000'000ull, 13'000'000'000ull).fits_offload);
}

TEST_CASE("offload plan: the offloaded engine's ledgers equal the plan", "[plan][offload]") {
  const std::vector<std::uint64_t> sizes{5, 0, 13, 1, 64, 3, 0, 7};
  const std::vector<plan::unit> units{{5}, {14}, {67}, {7}};  // units at 0, 2, 4, 6
  for (int N : {1, 2, 3}) {
    plan::setup s;
    s.stage = 2;
    s.ranks = static_cast<std::uint64_t>(N);
    const plan::offload_memory want = plan::offloaded_memory_per_rank(s, units);
    const auto errs = shardkit::run_ranks(N, [&](shardkit::thread_comm& c) -> std::string {
      shardkit::model_spec model;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        if (i % 2 == 0) model.begin_unit();
        model.add("p" + std::to_string(i), sizes[i]);
      }
      shardkit::engine<shardkit::thread_comm, shardkit::zero2_offload> eng(c, model);
      const auto& d = eng.memory();
      const auto& h = eng.optimizer().memory();
      if (d.peak(memory_category::working_params) != want.device.working_params ||
          d.peak(memory_category::grads) != want.device.grads ||
          d.peak(memory_category::master_params) != 0 ||
          d.peak(memory_category::optimizer_moments) != 0 ||
          d.peak(memory_category::grad_buckets) != want.device.grad_buckets) {
        return "device ledger differs from the plan";
      }
      if (h.peak(memory_category::master_params) != want.host.master_params ||
          h.peak(memory_category::optimizer_moments) != want.host.optimizer_moments ||
          h.peak(memory_category::offload_staging) != want.host.staging) {
        return "host ledger differs from the plan";
      }
      return "";
    });
    for (const auto& e : errs) CHECK(e == "");
  }
}
