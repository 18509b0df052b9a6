// The offloaded optimizer step (zero/offload_optimizer.hpp) on the host path: the pipelined
// schedule (group g steps while later groups' gradients are copied in and earlier groups'
// working values are copied out) against its serial form (every copy in, the whole step, every
// copy out), in the same binary. "device" buffers are host memory and the copy queue a copy
// thread, so this measures the schedule, not a PCIe link.
//
// bytes_per_second counts, per element, the copies (2 bytes of bf16 gradient in, 2 of working
// out) and the step's read-modify-write (2 + 4·3 read, 4·3 + 2 written): 32 bytes, the same for
// both schedules, so their bandwidths compare as inverse times. offload/ratio times both
// schedules alternately in one loop and reports serial_over_pipelined = serial time / pipelined
// time (> 1: the pipeline is faster).
#include <shardkit/shardkit.hpp>

#include "common.hpp"

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace {

using opt_t = shardkit::offload_optimizer<shardkit::host_space, shardkit::adamw, shardkit::bf16>;
constexpr double bytes_per_element = 32;

//! One rank's shard of n elements in `groups` equal groups, with its "device" buffers.
struct setup {
  setup(std::size_t n, std::size_t groups, int threads)
      : numels(groups, n / groups),
        group_of(groups, 0),
        layout(numels, starts(groups), 1),
        grads(layout.padded_numel(), shardkit::bf16(0.01f)),
        working(layout.padded_numel()),
        opt(layout, 0, group_of,
            shardkit::param_groups<shardkit::adam_options>({shardkit::adam_options{.lr = 1e-4f}}),
            shardkit::space_ops<shardkit::host_space>{},
            shardkit::space_ops<shardkit::host_space>::with_threads(
                static_cast<std::size_t>(threads))) {}
  static std::vector<std::size_t> starts(std::size_t groups) {
    std::vector<std::size_t> s(groups);
    for (std::size_t g = 0; g < groups; ++g) s[g] = g;
    return s;
  }
  void step(shardkit::offload_schedule s) {
    opt.set_schedule(s);
    opt.step(shardkit::flat_span<const shardkit::bf16>::full(grads.data(), grads.size()),
             shardkit::flat_span<shardkit::bf16>::full(working.data(), working.size()), 1.0f);
  }
  std::vector<std::size_t> numels, group_of;
  shardkit::flat_layout layout;
  std::vector<shardkit::bf16> grads, working;
  opt_t opt;
};

void bm_schedule(benchmark::State& state, shardkit::offload_schedule s, std::size_t n,
                 std::size_t groups, int threads) {
  setup st(n, groups, threads);
  for (auto _ : state) {
    st.step(s);
    benchmark::ClobberMemory();
  }
  bench::set_bytes(state, bytes_per_element * static_cast<double>(n));
  state.counters["elements"] = static_cast<double>(n);
  state.counters["groups"] = static_cast<double>(groups);
  state.counters["threads"] = threads;
}

void bm_ratio(benchmark::State& state, std::size_t n, std::size_t groups, int threads) {
  setup st(n, groups, threads);
  double serial = 0, pipelined = 0;
  using clock = std::chrono::steady_clock;
  for (auto _ : state) {
    const auto t0 = clock::now();
    st.step(shardkit::offload_schedule::serial);
    const auto t1 = clock::now();
    st.step(shardkit::offload_schedule::pipelined);
    const auto t2 = clock::now();
    serial += std::chrono::duration<double>(t1 - t0).count();
    pipelined += std::chrono::duration<double>(t2 - t1).count();
  }
  state.counters["serial_over_pipelined"] = pipelined > 0 ? serial / pipelined : 0;
  state.counters["elements"] = static_cast<double>(n);
  state.counters["groups"] = static_cast<double>(groups);
  state.counters["threads"] = threads;
}

void register_all(bench::size_set s) {
  const auto sizes = s == bench::size_set::tiny    ? std::vector<std::size_t>{1 << 12}
                     : s == bench::size_set::quick ? std::vector<std::size_t>{1 << 22}
                                                   : bench::geometric(1 << 20, 64 << 20, 4);
  auto reg = [](const std::string& name, auto fn, auto... args) {
    benchmark::RegisterBenchmark(name.c_str(), fn, args...)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  for (std::size_t n : sizes) {
    for (std::size_t groups : {std::size_t{1}, std::size_t{16}}) {
      for (int threads : {1, 2}) {
        const std::string tail = "/n:" + std::to_string(n) + "/groups:" + std::to_string(groups) +
                                 "/threads:" + std::to_string(threads);
        reg("offload/pipelined" + tail, bm_schedule, shardkit::offload_schedule::pipelined, n,
            groups, threads);
        reg("offload/serial" + tail, bm_schedule, shardkit::offload_schedule::serial, n, groups,
            threads);
        reg("offload/ratio" + tail, bm_ratio, n, groups, threads);
      }
    }
  }
}

}  // namespace

SHARDKIT_BENCH_MAIN(register_all)
