// Where the engine's flat buffers start, modulo 4 KiB. The fused optimizer step streams through
// five arrays at the same index: the gradient (read), the fp32 master, m and v (read and
// written) and the working copy (written). Large allocations all start at the same offset of a
// page (malloc's mmap'ed chunks; heap chunks of page-multiple sizes nearly so), and arrays whose
// addresses agree modulo 4096 at the same index alias: a load that matches the low 12 bits of
// an earlier store waits for it (4K aliasing), and the lines of all the streams fall in the same
// L1/L2 sets. Measured earlier on this kind of machine: a streaming multi-array kernel 10x
// slower when its arrays were congruent modulo 4 KiB.
//
// The rule checked: for every pair of the streams, the addresses of the first element they
// touch together differ modulo 4096 by at least 256 bytes (four cache lines) in cyclic distance,
// so neither a store and a later load nor the adjacent-line prefetch pairs of two streams fall
// on the same 4 KiB offset. Differing modulo 4096 implies differing modulo every larger power of
// two. The allocator staggers large host allocations to give this (core/memory.hpp).
#include <shardkit/comm/thread.hpp>
#include <shardkit/zero/engine.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

using namespace shardkit;

namespace {

constexpr std::uintptr_t page = 4096;
constexpr std::uintptr_t min_distance = 256;

// The distance of a and b modulo `modulus`, the shorter way round.
std::uintptr_t cyclic_distance(std::uintptr_t a, std::uintptr_t b, std::uintptr_t modulus = page) {
  const std::uintptr_t d = (a - b) % modulus;
  return d < modulus - d ? d : modulus - d;
}

struct stream {
  const char* name;
  std::uintptr_t address;  // of the first element the fused step touches
};

// The first failed pair, empty when every pair is at least min_distance apart modulo 4096.
std::string check_streams(const std::vector<stream>& s) {
  for (std::size_t i = 0; i < s.size(); ++i) {
    for (std::size_t j = i + 1; j < s.size(); ++j) {
      const std::uintptr_t d = cyclic_distance(s[i].address, s[j].address);
      if (d < min_distance) {
        return std::string(s[i].name) + " (at " + std::to_string(s[i].address % page) +
               " mod 4096) and " + s[j].name + " (at " + std::to_string(s[j].address % page) +
               " mod 4096) are " + std::to_string(d) + " bytes apart modulo 4096, fewer than " +
               std::to_string(min_distance);
      }
    }
  }
  return {};
}

template <class T>
std::uintptr_t at(const T* base, flat_coords coords, const flat_layout::piece& pc) {
  const std::size_t i = coords == flat_coords::full ? pc.full_offset : pc.shard_offset;
  return reinterpret_cast<std::uintptr_t>(base + i);
}

// A model of `units` units, each a d x d weight and a d bias, whose initial values `init` holds.
model_spec units_model(std::vector<std::vector<float>>& init, std::size_t d, std::size_t units) {
  for (std::size_t u = 0; u < units; ++u) {
    init.emplace_back(d * d, 0.01f);
    init.emplace_back(d, 0.0f);
  }
  model_spec model;
  for (std::size_t u = 0; u < units; ++u) {
    model.begin_unit("layer" + std::to_string(u));
    model.add("layer" + std::to_string(u) + ".weight", init[2 * u]);
    model.add("layer" + std::to_string(u) + ".bias", init[2 * u + 1]);
  }
  return model;
}

// Builds the engine of `Stage` on N thread ranks (units of a d x d weight and a d bias; large
// enough that every buffer is a large, page-backed allocation) and checks every rank's streams.
template <int Stage>
std::vector<std::string> engine_streams(int N, std::size_t d, std::size_t units) {
  using engine_t = engine<thread_comm, stage<Stage>, bf16, adamw>;
  std::vector<std::vector<float>> init;
  const model_spec model = units_model(init, d, units);
  return run_ranks(N, [&](thread_comm& c) -> std::string {
    engine_t e(c, model, adam_options{.lr = 1e-3f});
    const flat_layout& layout = e.layout();  // 1-way at stage 0: every rank steps shard 0
    const auto pieces =
        layout.pieces(layout.ranks() == 1 ? 0 : static_cast<std::size_t>(e.shard_rank()));
    if (pieces.empty()) return "rank " + std::to_string(c.rank()) + " owns no elements";
    const auto& pc = pieces.front();
    const auto grads = e.gradients().gradients();
    const auto working = e.parameters().working();
    auto& opt = e.optimizer();
    const flat_coords shard = flat_coords::shard;
    const std::vector<stream> s = {
        {"gradient", at(grads.data, grads.coords, pc)},
        {"master", at(opt.master().data(), shard, pc)},
        {"m", at(opt.state(0).data(), shard, pc)},
        {"v", at(opt.state(1).data(), shard, pc)},
        {"working", at(working.data, working.coords, pc)},
    };
    const std::string f = check_streams(s);
    return f.empty() ? f : "rank " + std::to_string(c.rank()) + ": " + f;
  });
}

template <int Stage>
void check_engine(int N) {
  // 4 units of 512 x 512 + 512: 1.05M parameters, shards of 0.5-1 MiB of fp32.
  const auto failures = engine_streams<Stage>(N, 512, 4);
  for (const auto& f : failures) {
    INFO("stage " << Stage << ", N = " << N);
    CHECK(f.empty());
    if (!f.empty()) WARN(f);
  }
}

// Across ranks: the thread communicator's collectives stream every rank's gradients (the
// all-reduce and the reduce-scatter) and working parameters (the all-gather) at the same
// offsets at once. Those buffers are 2 MiB-aligned (long-lived, 2 MiB or more), so unless the
// ranks' copies are staggered apart they agree in their low 21 address bits. Checked: every
// pair of ranks' copies at least 28 KiB apart modulo 2 MiB (one slot of the stagger across
// threads, less the stagger within a page, which may differ where the rank's slice does).
template <int Stage>
void check_across_ranks(int N) {
  using engine_t = engine<thread_comm, stage<Stage>, bf16, adamw>;
  using alloc = space_allocator<host_space>;
  constexpr std::size_t d = 1024, units = 2;  // 2.1M parameters: 4.2 MB of bf16
  std::vector<std::vector<float>> init;
  const model_spec model = units_model(init, d, units);
  struct placed {
    std::uintptr_t grads = 0, working = 0;  // 0: under 2 MiB, not on a 2 MiB boundary
  };
  const auto at = run_ranks(N, [&](thread_comm& c) {
    engine_t e(c, model, adam_options{.lr = 1e-3f});
    const auto grads = e.gradients().gradients();
    const auto working = e.parameters().working();
    placed p;
    if (grads.size * sizeof(bf16) >= alloc::huge_threshold) {
      p.grads = reinterpret_cast<std::uintptr_t>(grads.data);
    }
    if (working.size * sizeof(bf16) >= alloc::huge_threshold) {
      p.working = reinterpret_cast<std::uintptr_t>(working.data);
    }
    return p;
  });
  const std::uintptr_t least = alloc::thread_step - page;
  int checked = 0;
  for (int r = 0; r < N; ++r) {
    for (int q = r + 1; q < N; ++q) {
      const auto& a = at[static_cast<std::size_t>(r)];
      const auto& b = at[static_cast<std::size_t>(q)];
      INFO("stage " << Stage << ", N = " << N << ", ranks " << r << " and " << q);
      if (a.grads != 0 && b.grads != 0) {
        CHECK(cyclic_distance(a.grads, b.grads, alloc::huge_page) >= least);
        ++checked;
      }
      if (a.working != 0 && b.working != 0) {
        CHECK(cyclic_distance(a.working, b.working, alloc::huge_page) >= least);
        ++checked;
      }
    }
  }
  CHECK(checked > 0);  // the model is large enough that some buffer is on 2 MiB boundaries
}

}  // namespace

TEST_CASE("large host buffers allocated in a row start at distinct offsets modulo 4 KiB",
          "[memory][placement]") {
  // Sizes that are whole pages: back-to-back chunks would otherwise keep one page offset.
  for (const std::size_t n : {std::size_t{1} << 16, std::size_t{1} << 18, std::size_t{3} << 20}) {
    std::vector<buffer<float>> bufs;
    std::vector<stream> s;
    static const char* names[] = {"#0", "#1", "#2", "#3", "#4", "#5", "#6", "#7"};
    for (const char* name : names) {
      bufs.emplace_back(n, nullptr, memory_category::optimizer_moments);
      s.push_back({name, reinterpret_cast<std::uintptr_t>(bufs.back().data())});
      CHECK(reinterpret_cast<std::uintptr_t>(bufs.back().data()) % 64 == 0);
    }
    INFO(n << " floats each");
    CHECK(check_streams(s).empty());
    if (!check_streams(s).empty()) WARN(check_streams(s));
  }
}

TEST_CASE("the fused step's streams do not alias modulo 4 KiB: stage 0", "[placement]") {
  check_engine<0>(1);
  check_engine<0>(2);
}
TEST_CASE("the fused step's streams do not alias modulo 4 KiB: stage 1", "[placement]") {
  check_engine<1>(2);
  check_engine<1>(4);
}
TEST_CASE("the fused step's streams do not alias modulo 4 KiB: stage 2", "[placement]") {
  check_engine<2>(2);
  check_engine<2>(4);
}
TEST_CASE("the fused step's streams do not alias modulo 4 KiB: stage 3", "[placement]") {
  check_engine<3>(2);
  check_engine<3>(4);
}

TEST_CASE("the ranks' gradients and working parameters do not agree modulo 2 MiB", "[placement]") {
  check_across_ranks<0>(2);
  check_across_ranks<0>(4);
  check_across_ranks<1>(4);
  check_across_ranks<2>(4);
  check_across_ranks<3>(2);
}
