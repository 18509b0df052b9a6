// Collectives of the thread communicator (comm/thread.hpp): N ranks as threads of one process,
// against a lower bound made of memcpy in the same binary.
//
//  collectives/<op>/ranks:N/bytes:B   op = all_reduce, reduce_scatter, all_gather; fp32 sum,
//                                     out of place; B is the full array (nccl-tests: the
//                                     all-reduce buffer, the reduce-scatter input, the
//                                     all-gather output)
//  collectives/all_reduce_in_place/ranks:N/bytes:B
//                                     the all-reduce of bf16 on each rank's one buffer, as the
//                                     engine issues stage 0's (its bound:
//                                     bound_all_reduce_in_place, the same memcpy as
//                                     bound_all_reduce)
//  collectives/placement_all_reduce_in_place/ranks:N/bytes:B/slots:same|own
//                                     the same all-reduce with each rank's buffer allocated as
//                                     a rank thread allocates it: all on one slot of the
//                                     allocator's stagger across threads (congruent modulo
//                                     2 MiB) or each on its own (what run_ranks gives); counter
//                                     apart_kib: the least distance of two ranks' buffers
//                                     modulo 2 MiB
//  collectives/bound_<op>/ranks:N/bytes:B
//                                     baseline: every rank memcpys, at the same time, the least
//                                     traffic the op needs of it in shared memory:
//                                       all-reduce:      read B (its slice of every input),
//                                                        write B (its reduced slice into every
//                                                        output) = a memcpy of B
//                                       all-gather:      read B, write B = a memcpy of B
//                                       reduce-scatter:  read B, write B/N = a memcpy of
//                                                        (B + B/N) / 2
//
//  collectives/latency_<op>/ranks:N/bytes:4096
//                                     small-message latency: each iteration, every rank issues
//                                     `ops` 4 KiB collectives back to back (items_per_second:
//                                     collectives per second)
//  collectives/latency_spin_barrier/ranks:N
//                                     baseline: the same number of passes of N threads through
//                                     a spin barrier (bench::spin_barrier: pause/yield, then
//                                     futex) in the same binary; the ratio of the two is what a
//                                     small collective costs beyond synchronising N threads
//
// Counters: algbw = B / time and busbw = algbw x factor (2(N-1)/N for all-reduce, (N-1)/N for
// reduce-scatter and all-gather), both in bytes/s, as nccl-tests defines them (docs/accounting.md).
// Each iteration starts the N rank threads together and waits for all of them (the time is rank 0's
// wall clock); ranks are persistent threads, as in training.
#include <shardkit/comm/thread.hpp>

#include "common.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

enum class op { all_reduce, reduce_scatter, all_gather };

const char* name_of(op o) {
  switch (o) {
    case op::all_reduce:
      return "all_reduce";
    case op::reduce_scatter:
      return "reduce_scatter";
    case op::all_gather:
      return "all_gather";
  }
  return "?";
}

double bus_factor(op o, int n) {
  const double N = n;
  return o == op::all_reduce ? 2.0 * (N - 1) / N : (N - 1) / N;
}

//! Per-rank input and output buffers of `bytes` each, kept between benchmarks (grown as sizes
//! grow, rebuilt when the number of ranks changes).
struct buffers {
  int ranks = 0;
  std::size_t bytes = 0;
  std::vector<bench::array<float>> in, out;

  void ensure(int n, std::size_t b) {
    if (n == ranks && b <= bytes) return;
    in.clear();
    out.clear();
    // Each rank's buffers on the rank's slot of the stagger across threads, where run_ranks
    // puts a rank thread's own (core/memory.hpp), although this thread allocates them all.
    using alloc = shardkit::space_allocator<shardkit::host_space>;
    const std::size_t own_slot = alloc::thread_slot();
    for (int r = 0; r < n; ++r) {
      alloc::set_thread_slot(static_cast<std::size_t>(r));
      in.push_back(bench::make_array<float>(b / sizeof(float)));
      out.push_back(bench::make_array<float>(b / sizeof(float)));
      std::fill_n(in.back().data(), b / sizeof(float), 1.0f + static_cast<float>(r));
    }
    alloc::set_thread_slot(own_slot);
    ranks = n;
    bytes = b;
  }
};

buffers& the_buffers() {
  static buffers b;
  return b;
}

void counters(benchmark::State& state, op o, int n, std::size_t bytes) {
  // algbw/busbw as rates: Google Benchmark divides them by the time of one iteration.
  state.counters["algbw"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["busbw"] = benchmark::Counter(static_cast<double>(bytes) * bus_factor(o, n),
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ranks"] = n;
  state.counters["size"] = static_cast<double>(bytes);
}

void bm_collective(benchmark::State& state, op o, int n, std::size_t bytes, bool in_place) {
  buffers& buf = the_buffers();
  buf.ensure(n, bytes);
  auto group =
      std::make_shared<shardkit::detail::thread_group_state>(n, shardkit::thread_comm_options{});
  std::vector<shardkit::thread_comm> comms;
  for (int r = 0; r < n; ++r) comms.emplace_back(group, r);
  const std::size_t elems = bytes / sizeof(float);
  const std::size_t per_rank = elems / static_cast<std::size_t>(n);
  bench::team team(n);
  const std::function<void(int)> job = [&](int r) {
    auto& c = comms[static_cast<std::size_t>(r)];
    float* in = buf.in[static_cast<std::size_t>(r)].data();
    float* out = buf.out[static_cast<std::size_t>(r)].data();
    switch (o) {
      case op::all_reduce:
        if (in_place) {
          auto* grads = reinterpret_cast<shardkit::bf16*>(in);
          c.all_reduce(grads, grads, bytes / sizeof(shardkit::bf16), shardkit::reduce_op::sum);
        } else {
          c.all_reduce(in, out, elems, shardkit::reduce_op::sum);
        }
        break;
      case op::reduce_scatter:
        c.reduce_scatter(in, out, per_rank, shardkit::reduce_op::sum);
        break;
      case op::all_gather:
        c.all_gather(in, out, per_rank);
        break;
    }
  };
  for (auto _ : state) team.run(job);
  counters(state, o, n, bytes);
  state.counters["bytes"] = static_cast<double>(bytes);
}

std::size_t bound_copy_bytes(op o, int n, std::size_t bytes) {
  return o == op::reduce_scatter ? (bytes + bytes / static_cast<std::size_t>(n)) / 2 : bytes;
}

void bm_bound(benchmark::State& state, op o, int n, std::size_t bytes) {
  buffers& buf = the_buffers();
  buf.ensure(n, bytes);
  const std::size_t copy = bound_copy_bytes(o, n, bytes);
  bench::team team(n);
  const std::function<void(int)> job = [&](int r) {
    std::memcpy(buf.out[static_cast<std::size_t>(r)].data(),
                buf.in[static_cast<std::size_t>(r)].data(), copy);
  };
  for (auto _ : state) team.run(job);
  counters(state, o, n, bytes);
  state.counters["bytes"] = static_cast<double>(bytes);
}

// The in-place bf16 all-reduce (stage 0's, on the gradients) on buffers laid out as rank threads
// lay out their own: each rank's allocated on a thread of its own, so that each starts the
// stagger within a page afresh as a rank thread does, on the rank's slot of the stagger across
// threads ("own", what run_ranks gives) or all on slot 0 ("same": the ranks' buffers congruent
// modulo 2 MiB, as every rank's gradients were before that stagger; core/memory.hpp). Counter
// apart_kib: the least distance between two ranks' buffers modulo 2 MiB.
void bm_placement(benchmark::State& state, int n, std::size_t bytes, bool own_slots) {
  using alloc = shardkit::space_allocator<shardkit::host_space>;
  const std::size_t elems = bytes / sizeof(shardkit::bf16);
  std::vector<bench::array<shardkit::bf16>> grads(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    std::thread([&, r] {
      alloc::set_thread_slot(own_slots ? static_cast<std::size_t>(r) : 0);
      auto& g = grads[static_cast<std::size_t>(r)];
      g = bench::array<shardkit::bf16>(elems, nullptr, shardkit::memory_category::grads);
      std::fill_n(g.data(), elems, shardkit::bf16(1.0f));
    }).join();
  }
  std::uintptr_t apart = alloc::huge_page;
  for (const auto& a : grads) {
    for (const auto& b : grads) {
      if (&a == &b) continue;
      const auto d = (reinterpret_cast<std::uintptr_t>(a.data()) -
                      reinterpret_cast<std::uintptr_t>(b.data())) %
                     alloc::huge_page;
      apart = std::min(apart, std::min<std::uintptr_t>(d, alloc::huge_page - d));
    }
  }
  auto group =
      std::make_shared<shardkit::detail::thread_group_state>(n, shardkit::thread_comm_options{});
  std::vector<shardkit::thread_comm> comms;
  for (int r = 0; r < n; ++r) comms.emplace_back(group, r);
  bench::team team(n);
  const std::function<void(int)> job = [&](int r) {
    auto* g = grads[static_cast<std::size_t>(r)].data();
    comms[static_cast<std::size_t>(r)].all_reduce(g, g, elems, shardkit::reduce_op::sum);
  };
  for (auto _ : state) team.run(job);
  counters(state, op::all_reduce, n, bytes);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["apart_kib"] = static_cast<double>(apart) / 1024.0;
}

constexpr int latency_ops = 256;

void bm_latency(benchmark::State& state, op o, int n) {
  constexpr std::size_t bytes = 4096;
  buffers& buf = the_buffers();
  buf.ensure(n, bytes);
  auto group =
      std::make_shared<shardkit::detail::thread_group_state>(n, shardkit::thread_comm_options{});
  std::vector<shardkit::thread_comm> comms;
  for (int r = 0; r < n; ++r) comms.emplace_back(group, r);
  const std::size_t elems = bytes / sizeof(float);
  bench::team team(n);
  const std::function<void(int)> job = [&](int r) {
    auto& c = comms[static_cast<std::size_t>(r)];
    float* in = buf.in[static_cast<std::size_t>(r)].data();
    float* out = buf.out[static_cast<std::size_t>(r)].data();
    for (int k = 0; k < latency_ops; ++k) {
      switch (o) {
        case op::all_reduce:
          c.all_reduce(in, out, elems, shardkit::reduce_op::sum);
          break;
        case op::reduce_scatter:
          c.reduce_scatter(in, out, elems / static_cast<std::size_t>(n), shardkit::reduce_op::sum);
          break;
        case op::all_gather:
          c.all_gather(in, out, elems / static_cast<std::size_t>(n));
          break;
      }
    }
  };
  for (auto _ : state) team.run(job);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * latency_ops);
  state.counters["ranks"] = n;
  state.counters["size"] = static_cast<double>(bytes);
}

void bm_spin_barrier(benchmark::State& state, int n) {
  bench::spin_barrier barrier(n);
  bench::team team(n);
  const std::function<void(int)> job = [&](int) {
    for (int k = 0; k < latency_ops; ++k) barrier.arrive_and_wait();
  };
  for (auto _ : state) team.run(job);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * latency_ops);
  state.counters["ranks"] = n;
}

void register_all(bench::size_set s) {
  const auto sizes = s == bench::size_set::tiny    ? std::vector<std::size_t>{4 << 10}
                     : s == bench::size_set::quick ? bench::geometric(4 << 10, 16 << 20, 16)
                                                   : bench::geometric(4 << 10, 256 << 20, 4);
  for (int n : {2, 4}) {
    const std::string r = "/ranks:" + std::to_string(n);
    for (op o : {op::all_reduce, op::reduce_scatter, op::all_gather}) {
      benchmark::RegisterBenchmark(
          ("collectives/latency_" + std::string(name_of(o)) + r + "/bytes:4096").c_str(),
          bm_latency, o, n)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
    benchmark::RegisterBenchmark(("collectives/latency_spin_barrier" + r).c_str(), bm_spin_barrier,
                                 n)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
    for (std::size_t b : sizes) {
      for (op o : {op::all_reduce, op::reduce_scatter, op::all_gather}) {
        const std::string tail = "/ranks:" + std::to_string(n) + "/bytes:" + std::to_string(b);
        benchmark::RegisterBenchmark(("collectives/" + std::string(name_of(o)) + tail).c_str(),
                                     bm_collective, o, n, b, false)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(
            ("collectives/bound_" + std::string(name_of(o)) + tail).c_str(), bm_bound, o, n, b)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
      const std::string tail = "/ranks:" + std::to_string(n) + "/bytes:" + std::to_string(b);
      benchmark::RegisterBenchmark(("collectives/all_reduce_in_place" + tail).c_str(),
                                   bm_collective, op::all_reduce, n, b, true)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("collectives/bound_all_reduce_in_place" + tail).c_str(),
                                   bm_bound, op::all_reduce, n, b)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
    const auto placement_sizes = s == bench::size_set::tiny ? std::vector<std::size_t>{4 << 20}
                                 : s == bench::size_set::quick
                                     ? std::vector<std::size_t>{16 << 20}
                                     : std::vector<std::size_t>{4 << 20, 16 << 20, 64 << 20};
    for (std::size_t b : placement_sizes) {
      for (const bool own : {false, true}) {
        const std::string name =
            "collectives/placement_all_reduce_in_place/ranks:" + std::to_string(n) +
            "/bytes:" + std::to_string(b) + (own ? "/slots:own" : "/slots:same");
        benchmark::RegisterBenchmark(name.c_str(), bm_placement, n, b, own)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
}

}  // namespace

SHARDKIT_BENCH_MAIN(register_all)
