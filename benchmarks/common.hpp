// Shared pieces of shardkit's benchmark suites: a persistent team of threads (for host loops
// split over threads and for in-process ranks), size lists chosen at run time (--size=tiny,
// quick or full), and the naming and counter conventions scripts/bench reads.
//
// Conventions (scripts/bench relies on them):
//  - a benchmark's name is "<suite>/<what>/<key>:<value>/..."; runs that are compared share
//    every key and value after <what>;
//  - `bytes_per_second` (SetBytesProcessed) counts the bytes the operation must move, as stated
//    per suite, so bandwidths of an operation and of its baseline compare as inverse times;
//  - counters repeat the parameters (elements, bytes, threads, ranks) for the plots.
#pragma once

#include <shardkit/core/memory.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace bench {

//! How many sizes a suite runs: `tiny` for the smoke test (ctest), `quick` for a run of a minute
//! or two, `full` for the results page.
enum class size_set { tiny, quick, full };

//! Reads (and removes) the suite's own flag --size=tiny|quick|full; the rest goes to Google
//! Benchmark.
inline size_set take_size_flag(int& argc, char** argv) {
  size_set s = size_set::full;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a.rfind("--size=", 0) == 0) {
      const auto v = a.substr(7);
      if (v == "tiny")
        s = size_set::tiny;
      else if (v == "quick")
        s = size_set::quick;
      else if (v == "full")
        s = size_set::full;
      else
        throw std::invalid_argument("--size must be tiny, quick or full");
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  return s;
}

//! Powers of `step` from `lo` to `hi` inclusive.
inline std::vector<std::size_t> geometric(std::size_t lo, std::size_t hi, std::size_t step) {
  std::vector<std::size_t> v;
  for (std::size_t x = lo; x <= hi; x *= step) v.push_back(x);
  return v;
}

//! A barrier for a few threads that may share few cores: arrivals spin briefly (yielding the
//! core), then sleep on the generation word (futex), so an idle wait costs no CPU.
class spin_barrier {
 public:
  explicit spin_barrier(int n) : n_(n) {}
  void arrive_and_wait() {
    const std::uint32_t gen = gen_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      arrived_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      gen_.notify_all();
      return;
    }
    for (int i = 0; i < 200; ++i) {
      if (gen_.load(std::memory_order_acquire) != gen) return;
      std::this_thread::yield();
    }
    while (gen_.load(std::memory_order_acquire) == gen) gen_.wait(gen, std::memory_order_acquire);
  }

 private:
  const int n_;
  std::atomic<int> arrived_{0};
  std::atomic<std::uint32_t> gen_{0};
};

//! T threads that run one function together, again and again, without being created anew:
//! run(f) calls f(t) on thread t for t = 0..T-1 (t = 0 is the caller) and returns when every
//! thread has finished. This is how a training framework drives a per-step parallel loop or its
//! in-process ranks, so a measured iteration includes the start and the join.
class team {
 public:
  explicit team(int threads) : n_(threads), start_(threads), done_(threads) {
    for (int t = 1; t < n_; ++t) {
      workers_.emplace_back([this, t] {
        for (;;) {
          start_.arrive_and_wait();
          if (stop_) return;
          (*job_)(t);
          done_.arrive_and_wait();
        }
      });
    }
  }
  team(const team&) = delete;
  team& operator=(const team&) = delete;
  ~team() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& w : workers_) w.join();
  }

  int size() const noexcept { return n_; }

  void run(const std::function<void(int)>& f) {
    job_ = &f;
    start_.arrive_and_wait();
    f(0);
    done_.arrive_and_wait();
  }

 private:
  int n_;
  spin_barrier start_;
  spin_barrier done_;
  const std::function<void(int)>* job_ = nullptr;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

//! [begin, end) of part t of n elements cut into T parts (aligned to 64 elements).
inline std::pair<std::size_t, std::size_t> part(std::size_t n, int t, int T) {
  const std::size_t per =
      ((n + static_cast<std::size_t>(T) - 1) / static_cast<std::size_t>(T) + 63) / 64 * 64;
  const std::size_t b = std::min(n, per * static_cast<std::size_t>(t));
  const std::size_t e = std::min(n, b + per);
  return {b, e};
}

//! A 64-byte aligned, zero-initialised (hence first-touched) host array.
template <class T>
using array = shardkit::buffer<T>;

template <class T>
array<T> make_array(std::size_t n) {
  return array<T>(n, nullptr, shardkit::memory_category::working_params);
}

//! Sets the standard counters: bytes moved per iteration, and the parameters as counters.
inline void set_bytes(benchmark::State& state, double bytes_per_iteration) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes_per_iteration) *
                          static_cast<std::int64_t>(state.iterations()));
  state.counters["bytes"] = bytes_per_iteration;
}

}  // namespace bench

//! main() of a suite: reads --size, registers the suite's benchmarks for that size set, runs.
#define SHARDKIT_BENCH_MAIN(register_fn)                              \
  int main(int argc, char** argv) {                                   \
    const bench::size_set sizes = bench::take_size_flag(argc, argv);  \
    register_fn(sizes);                                               \
    benchmark::Initialize(&argc, argv);                               \
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1; \
    benchmark::RunSpecifiedBenchmarks();                              \
    benchmark::Shutdown();                                            \
    return 0;                                                         \
  }
