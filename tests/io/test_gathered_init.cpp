// gathered_parameters (zero/gathered_parameters.hpp) and sharded initialisation
// (model_spec initialisers): whole parameters at every stage equal the engine's own values;
// written-back values reach every rank; ranks that disagree on the scope get a named error; an
// initialiser gives the same model at every N, and under ZeRO-3 a rank holds no more than its
// shard and one staging block while the engine is built.
#include <shardkit/shardkit.hpp>
#include <shardkit/zero/gathered_parameters.hpp>

#include "support/reference.hpp"
#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <bit>
#include <string>
#include <vector>

using namespace shardkit;

namespace {

const std::vector<std::size_t> sizes{5, 0, 13, 1, 64, 3, 0, 7};

// Element k of parameter i, from an initialiser (deterministic by global index).
float init_value(std::size_t i, std::size_t k) {
  return ref::init_value(i + 100, k);
}

model_spec by_initialiser(std::atomic<std::uint64_t>* filled = nullptr) {
  model_spec m;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i % 2 == 0) m.begin_unit("u" + std::to_string(i / 2));
    m.add("p" + std::to_string(i), {sizes[i]}, [i, filled](std::size_t off, std::span<float> out) {
      for (std::size_t k = 0; k < out.size(); ++k) out[k] = init_value(i, off + k);
      if (filled != nullptr) *filled += out.size();
    });
  }
  return m;
}

// Every parameter's fp32 values through a gathered_parameters scope, as bits.
template <class E>
std::vector<std::uint32_t> gathered_bits(E& e) {
  gathered_parameters full(e);
  std::vector<std::uint32_t> out;
  for (std::size_t i = 0; i < e.num_params(); ++i) {
    for (float x : full.values(i)) out.push_back(std::bit_cast<std::uint32_t>(x));
  }
  return out;
}

template <class World, class P, class W>
std::vector<std::vector<std::uint32_t>> init_and_gather(int n) {
  using Comm = typename World::comm_type;
  return World::run(n, [](Comm& c) {
    engine<Comm, P, W, adamw> e(c, by_initialiser());
    return gathered_bits(e);
  });
}

}  // namespace

TEMPLATE_TEST_CASE(
    "an initialiser gives the same model at every N and stage, and gathered values "
    "are the initialiser's",
    "[io][init][gathered]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  std::vector<std::uint32_t> want;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (std::size_t k = 0; k < sizes[i]; ++k) {
      want.push_back(std::bit_cast<std::uint32_t>(init_value(i, k)));
    }
  }
  for (int n : {1, 2, 3, 4}) {
    if (!test::fits<World>(n)) continue;
    CAPTURE(World::name, n);
    for (const auto& got : init_and_gather<World, zero0, bf16>(n)) CHECK(got == want);
    for (const auto& got : init_and_gather<World, zero1, float>(n)) CHECK(got == want);
    for (const auto& got : init_and_gather<World, zero2, bf16>(n)) CHECK(got == want);
    for (const auto& got : init_and_gather<World, zero3, bf16>(n)) CHECK(got == want);
  }
}

TEST_CASE("ZeRO-3 built from an initialiser holds its shard and one staging block, no more",
          "[io][init]") {
  // 8 units of 1Mi elements: 8Mi elements, 32 MiB of fp32, on 4 ranks.
  constexpr std::size_t unit = std::size_t{1} << 20, units = 8;
  auto r = run_ranks(4, [](thread_comm& c) {
    std::atomic<std::uint64_t> filled{0};
    model_spec m;
    for (std::size_t u = 0; u < units; ++u) {
      m.begin_unit("block" + std::to_string(u));
      m.add("w" + std::to_string(u), {1024, 1024},
            [&filled](std::size_t off, std::span<float> out) {
              for (std::size_t k = 0; k < out.size(); ++k)
                out[k] = 1e-3f * static_cast<float>((off + k) % 97);
              filled += out.size();
            });
    }
    engine<thread_comm, zero3, bf16, adamw> e(c, m);
    const auto& mem = e.memory();
    return std::tuple{filled.load(), mem.total_peak(), mem.total(),
                      mem.peak(memory_category::io_staging),
                      mem.current(memory_category::io_staging)};
  });
  const std::uint64_t S = units * unit / 4;  // each rank's shard (4 divides every unit)
  for (const auto& [filled, peak, now, staging_peak, staging_now] : r) {
    CHECK(filled == S);  // the initialiser ran only for this rank's elements
    // Held after construction: bf16 params + bf16 grads + fp32 master + 2 fp32 moments of the
    // shard, and one staging bucket of the largest unit (bf16, padded).
    CHECK(now == 16 * S + 2 * unit);
    CHECK(staging_peak == (std::size_t{1} << 20) * sizeof(float));  // one block of 4 MiB
    CHECK(staging_now == 0);
    CHECK(peak == now + staging_peak);  // nothing else was ever held at once: no whole parameter,
                                        // let alone the whole model (each rank's fp32 values are
                                        // a quarter of the model's)
  }
}

TEMPLATE_TEST_CASE("gathered_parameters writes back to every rank's shard at every stage",
                   "[io][gathered]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  if (!test::fits<World>(3)) return;
  auto written = [](auto policies_tag, auto working_tag) {
    using P = decltype(policies_tag);
    using W = decltype(working_tag);
    return World::run(3, [](Comm& c) {
      engine<Comm, P, W, adamw> e(c, by_initialiser());
      {
        gathered_parameters full(e, {4}, gather_mode::write_back);
        for (std::size_t k = 0; k < 64; ++k) full.values(4)[k] = static_cast<float>(k) * 0.5f;
        full.commit();
      }
      // Read through the engine's own views (gathered under ZeRO-3).
      std::vector<float> seen;
      e.pre_forward(e.unit_of(4));
      for (auto x : e.param(4)) seen.push_back(static_cast<float>(x));
      e.post_forward(e.unit_of(4));
      const auto after = gathered_bits(e);
      return std::pair{seen, after};
    });
  };
  std::vector<float> want;
  for (std::size_t k = 0; k < 64; ++k) want.push_back(static_cast<float>(k) * 0.5f);
  auto check = [&](const auto& per_rank) {
    for (const auto& [seen, after] : per_rank) {
      CHECK(seen == want);                 // the working copy on every rank
      CHECK(after == per_rank[0].second);  // every rank gathers the same
    }
  };
  check(written(zero0{}, bf16{}));
  check(written(zero1{}, float{}));
  check(written(zero2{}, bf16{}));
  check(written(zero3{}, bf16{}));
  check(written(zero3{}, float{}));
}

TEST_CASE("ranks that open different scopes, or only some ranks, get a named error",
          "[io][gathered][errors]") {
  const auto msgs = test::errors_per_rank(2, [](thread_comm& c) {
    engine<thread_comm, zero3, bf16, adamw> e(c, by_initialiser());
    gathered_parameters full(e, {static_cast<std::size_t>(c.rank())});  // rank 0: {0}, rank 1: {1}
  });
  for (const auto& m : msgs) {
    CHECK_THAT(m, Catch::Contains("gathered_parameters: rank") &&
                      Catch::Contains("a different set") &&
                      Catch::Contains("every rank must open the same scope"));
  }
  const auto only_one = test::errors_per_rank(2, [](thread_comm& c) {
    engine<thread_comm, zero2, bf16, adamw> e(c, by_initialiser());
    if (c.rank() == 0) {
      gathered_parameters full(e);
    } else {
      c.barrier();  // rank 1 does something else collective instead
    }
  });
  CHECK_THAT(only_one[0], Catch::Contains("not every rank entered the scope"));
  CHECK(only_one[1] != "");
}
