// CUDA benchmarks of shardkit's kernels, each against its own baseline measured in this binary:
// a device-to-device cudaMemcpyAsync that moves the same number of bytes (read + write counted).
//
//   fused_adamw/N      gpu::fused_step<adamw>: bf16 grads, fp32 master/m/v, bf16 working copy
//                      out: 28 bytes per element (the minimum, docs/accounting.md)
//   fused_adamw_fp32/N the same with fp32 grads and no working copy (28 bytes per element), the
//                      side-by-side with torch.optim.AdamW(fused=True) (scripts/gpu-check-torch.py)
//   fused_adamw_handwritten/N  the same on the hand-written kernel (elementwise_path)
//   fused_step_table/N gpu::fused_step_table over two runs (two parameter groups, 3:1), one
//                      block per chunk; _persistent: 4 blocks per SM looping over the chunks;
//                      fused_step_per_run/N: one gpu::fused_step per run, what the engine does
//   flatten/N          gpu::batched_copy<bf16, bf16> as constructed by default: N elements in
//                      1,024 tensors of uneven sizes into one padded flat buffer, one launch:
//                      4 bytes per element; flatten_cub (cub::DeviceMemcpy::Batched),
//                      flatten_persistent (4 blocks per SM looping over the chunks) and
//                      flatten_chunk4k/64k (elements per block) the alternatives
//   grad_norm/N        gpu::accumulate_stats<bf16>: the exact integer-bin norm, 2 bytes per element
//   reduce_ordered/N   gpu::reduce_ordered<bf16>, 4 sources: 10 bytes per element
//   offload_to_host/B, offload_to_device/B  copy_queue<cuda_space> (ZeRO-Offload) moving B bytes
//                      to or from pinned host memory, against a plain pinned cudaMemcpyAsync
//   d2d_copy/B         cudaMemcpyAsync of B/2 bytes (B bytes moved)
//
// Every benchmark reports bytes_per_second (read + write) and `vs_copy`, its bandwidth over the
// copy's at the same byte count. Times come from CUDA events around each launch (manual time).
// Without a CUDA device the binary says so and exits with 77.
#include <shardkit/cuda.cuh>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>
#include <vector>

using namespace shardkit;

namespace {

constexpr std::int64_t mi = std::int64_t{1} << 20;

template <class T>
__global__ void fill_kernel(T* p, std::size_t n, std::uint64_t seed, float lo, float hi) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z ^= z >> 27;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
    p[i] = from_float<T>(lo + (hi - lo) * u);
  }
}

// Random values in [lo, hi), generated on the device.
template <class T>
void fill(T* p, std::size_t n, std::uint64_t seed, float lo, float hi) {
  gpu::detail::launch(&fill_kernel<T>, "fill", 1024, 256, nullptr, n, p, n, seed, lo, hi);
}

void check(cudaError_t e, const char* what) {
  detail::cuda_check(e, what);
}

// Times `fn` (which enqueues work on stream 0) with events, one sample per benchmark iteration;
// returns the bytes moved per second over all samples.
template <class F>
double run_timed(benchmark::State& state, std::int64_t bytes, F&& fn) {
  cuda_event start(true), stop(true);
  fn();  // warm-up
  check(cudaDeviceSynchronize(), "warm-up");
  double total = 0;
  for (auto _ : state) {
    start.record(nullptr);
    fn();
    stop.record(nullptr);
    stop.synchronize();
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
    total += static_cast<double>(ms) * 1e-3;
  }
  state.SetBytesProcessed(bytes * state.iterations());
  return total > 0 ? static_cast<double>(bytes) * static_cast<double>(state.iterations()) / total
                   : 0;
}

// The copy's bandwidth (bytes moved per second, median of 15) for a given byte count, measured
// once per count.
double copy_bandwidth(std::int64_t bytes_moved) {
  static std::map<std::int64_t, double> cache;
  if (auto it = cache.find(bytes_moved); it != cache.end()) return it->second;
  const std::size_t half = static_cast<std::size_t>(bytes_moved / 2);
  buffer<std::byte, cuda_space> a(half, nullptr, memory_category::comm_scratch);
  buffer<std::byte, cuda_space> b(half, nullptr, memory_category::comm_scratch);
  cuda_event start(true), stop(true);
  std::vector<double> samples;
  for (int i = 0; i < 16; ++i) {
    start.record(nullptr);
    copy_bytes_async(b.data(), a.data(), half, nullptr);
    stop.record(nullptr);
    stop.synchronize();
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime");
    if (i > 0)
      samples.push_back(static_cast<double>(bytes_moved) / (static_cast<double>(ms) * 1e-3));
  }
  std::sort(samples.begin(), samples.end());
  return cache[bytes_moved] = samples[samples.size() / 2];
}

// Adds the bytes moved per iteration, the copy's bandwidth at that size and the ratio.
void report_ratio(benchmark::State& state, std::int64_t bytes, double bytes_per_second) {
  const double copy = copy_bandwidth(bytes);
  state.counters["bytes_moved"] = static_cast<double>(bytes);
  state.counters["copy_bytes_per_second"] = copy;
  state.counters["vs_copy"] = copy > 0 ? bytes_per_second / copy : 0;
}

void BM_d2d_copy(benchmark::State& state) {
  const std::int64_t bytes = state.range(0);
  const std::size_t half = static_cast<std::size_t>(bytes / 2);
  buffer<std::byte, cuda_space> a(half, nullptr, memory_category::comm_scratch);
  buffer<std::byte, cuda_space> b(half, nullptr, memory_category::comm_scratch);
  const double bw =
      run_timed(state, bytes, [&] { copy_bytes_async(b.data(), a.data(), half, nullptr); });
  report_ratio(state, bytes, bw);
}

// The arrays of an AdamW step over n elements: fp32 master, m and v, bf16 gradients and
// working copy, filled with values of a training step's magnitudes.
struct adamw_arrays {
  explicit adamw_arrays(std::size_t n)
      : p(n, nullptr, memory_category::master_params),
        m(n, nullptr, memory_category::optimizer_moments),
        v(n, nullptr, memory_category::optimizer_moments),
        g(n, nullptr, memory_category::grads),
        w(n, nullptr, memory_category::working_params) {
    fill(p.data(), n, 1, -1.0f, 1.0f);
    fill(m.data(), n, 2, -0.01f, 0.01f);
    fill(v.data(), n, 3, 1e-6f, 1e-4f);
    fill(g.data(), n, 4, -0.1f, 0.1f);
  }
  buffer<float, cuda_space> p, m, v;
  buffer<bf16, cuda_space> g, w;
};

void fused_adamw(benchmark::State& state, gpu::elementwise_path path) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  adamw_arrays a(n);
  float* state_ptrs[2] = {a.m.data(), a.v.data()};
  const auto k = adamw::prepare({.lr = 1e-4f, .weight_decay = 0.01f}, 10, 1e-4f, 0.5f);
  const std::int64_t bytes = static_cast<std::int64_t>(n) * 28;
  const double bw = run_timed(state, bytes, [&] {
    gpu::fused_step<adamw>(k, a.p.data(), state_ptrs, a.g.data(), a.w.data(), n, nullptr, nullptr,
                           path);
  });
  report_ratio(state, bytes, bw);
}
void BM_fused_adamw(benchmark::State& state) {
  fused_adamw(state, gpu::elementwise_path::cub_transform);
}
void BM_fused_adamw_handwritten(benchmark::State& state) {
  fused_adamw(state, gpu::elementwise_path::handwritten);
}

// The engine's step over its runs (here two parameter groups of one shard, 3:1), bf16
// gradients and working copy, 28 bytes per element.
enum class step_form {
  table,             // gpu::fused_step_table, one block per chunk
  table_persistent,  // the table on a grid of 4 blocks per SM looping over the chunks
  table_chunk16k,    // the table with a quarter of the elements per chunk
  per_run,           // one gpu::fused_step (cub::DeviceTransform) per run: the engine's form
};
void fused_step_runs(benchmark::State& state, step_form form) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  adamw_arrays a(n);
  using table = gpu::fused_step_table<adamw, bf16, bf16>;
  const std::size_t first = n / 4 * 3;
  std::vector<table::run> runs;
  for (auto [at, len, group] :
       {std::array<std::size_t, 3>{0, first, 0}, std::array<std::size_t, 3>{first, n - first, 1}}) {
    runs.push_back({a.p.data() + at,
                    {a.m.data() + at, a.v.data() + at},
                    a.g.data() + at,
                    a.w.data() + at,
                    len,
                    group});
  }
  const table t(runs, 2, nullptr,
                form == step_form::table_chunk16k ? gpu::chunk_elems / 4 : gpu::chunk_elems);
  const std::array<adamw::constants, 2> k{
      adamw::prepare({.lr = 1e-4f, .weight_decay = 0.01f}, 10, 1e-4f, 0.5f),
      adamw::prepare({.lr = 1e-4f, .weight_decay = 0.0f}, 10, 1e-4f, 0.5f)};
  const std::int64_t bytes = static_cast<std::int64_t>(n) * 28;
  const std::size_t persistent = static_cast<std::size_t>(cuda_sm_count()) * 4;
  const double bw = run_timed(state, bytes, [&] {
    if (form == step_form::per_run) {
      for (const auto& r : runs) {
        gpu::fused_step<adamw>(k[r.group], r.params, r.state.data(), r.grads, r.working_out,
                               r.count, nullptr);
      }
    } else {
      t.launch(k, nullptr, nullptr, form == step_form::table_persistent ? persistent : 0);
    }
  });
  report_ratio(state, bytes, bw);
}
void BM_fused_step_table(benchmark::State& state) {
  fused_step_runs(state, step_form::table);
}
void BM_fused_step_table_persistent(benchmark::State& state) {
  fused_step_runs(state, step_form::table_persistent);
}
void BM_fused_step_per_run(benchmark::State& state) {
  fused_step_runs(state, step_form::per_run);
}
void BM_fused_step_table_chunk16k(benchmark::State& state) {
  fused_step_runs(state, step_form::table_chunk16k);
}

// fp32 gradients, fp32 master/m/v, no working copy: what torch.optim.AdamW(fused=True) does for
// fp32 parameters (scripts/gpu-check-torch.py measures it on the same sizes): 28 bytes per
// element (p, m, v read and written, g read).
void BM_fused_adamw_fp32(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  buffer<float, cuda_space> p(n, nullptr, memory_category::master_params),
      m(n, nullptr, memory_category::optimizer_moments),
      v(n, nullptr, memory_category::optimizer_moments), g(n, nullptr, memory_category::grads);
  fill(p.data(), n, 1, -1.0f, 1.0f);
  fill(m.data(), n, 2, -0.01f, 0.01f);
  fill(v.data(), n, 3, 1e-6f, 1e-4f);
  fill(g.data(), n, 4, -0.1f, 0.1f);
  float* state_ptrs[2] = {m.data(), v.data()};
  const auto k = adamw::prepare({.lr = 1e-4f, .weight_decay = 0.01f}, 10, 1e-4f, 1.0f);
  const std::int64_t bytes = static_cast<std::int64_t>(n) * 28;
  const double bw = run_timed(state, bytes, [&] {
    gpu::fused_step<adamw>(k, p.data(), state_ptrs, g.data(), static_cast<float*>(nullptr), n,
                           nullptr);
  });
  report_ratio(state, bytes, bw);
}

// How a flatten benchmark builds its table: the constructor's defaults, or the given path,
// grid cap (0: one block per chunk) and elements per chunk.
struct flatten_setup {
  bool defaults = true;
  gpu::elementwise_path path = gpu::elementwise_path::handwritten;
  std::size_t max_blocks = 0;
  std::size_t chunk = gpu::copy_chunk_elems;
};

void flatten(benchmark::State& state, const flatten_setup& how) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  constexpr std::size_t tensors = 1024;
  buffer<bf16, cuda_space> src(n, nullptr, memory_category::working_params);
  buffer<bf16, cuda_space> flat(n + tensors * 8, nullptr, memory_category::gathered_params);
  fill(src.data(), n, 5, -1.0f, 1.0f);
  std::vector<gpu::batched_copy<bf16, bf16>::item> items;
  std::size_t at = 0, out = 0;
  for (std::size_t t = 0; t < tensors; ++t) {
    // uneven sizes (±25%) that start at odd offsets, like a model's parameters
    const std::size_t share = n / tensors;
    std::size_t len = t + 1 == tensors ? n - at : share * 3 / 4 + (t * 7919) % (share / 2 + 1);
    len = std::min(len, n - at);
    items.push_back({src.data() + at, flat.data() + out, len, t + 1 == tensors ? 0u : 1u});
    at += len;
    out += len + (t + 1 == tensors ? 0 : 1);
  }
  using table = gpu::batched_copy<bf16, bf16>;
  const table copy =
      how.defaults ? table(items, nullptr) : table(items, nullptr, how.path, how.chunk);
  const auto bytes = static_cast<std::int64_t>(copy.bytes_moved());
  const double bw = run_timed(state, bytes, [&] { copy.run(nullptr, how.max_blocks); });
  report_ratio(state, bytes, bw);
}
void BM_flatten(benchmark::State& state) {
  flatten(state, {});
}
// The other path, a persistent grid, and a quarter and four times the elements per block.
void BM_flatten_cub(benchmark::State& state) {
  flatten(state, {.defaults = false, .path = gpu::elementwise_path::cub_transform});
}
void BM_flatten_persistent(benchmark::State& state) {
  flatten(state, {.defaults = false, .max_blocks = static_cast<std::size_t>(cuda_sm_count()) * 4});
}
void BM_flatten_chunk4k(benchmark::State& state) {
  flatten(state, {.defaults = false, .chunk = gpu::copy_chunk_elems / 4});
}
void BM_flatten_chunk64k(benchmark::State& state) {
  flatten(state, {.defaults = false, .chunk = gpu::copy_chunk_elems * 4});
}

void BM_grad_norm(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  buffer<bf16, cuda_space> g(n, nullptr, memory_category::grads);
  buffer<gpu::device_grad_stats, cuda_space> st(1, nullptr, memory_category::comm_scratch);
  fill(g.data(), n, 6, -0.1f, 0.1f);
  const std::int64_t bytes = static_cast<std::int64_t>(n) * 2;
  const double bw =
      run_timed(state, bytes, [&] { gpu::accumulate_stats(g.data(), n, st.data(), nullptr); });
  report_ratio(state, bytes, bw);
}

void BM_reduce_ordered(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  constexpr std::size_t k = 4;
  buffer<bf16, cuda_space> in(n * k, nullptr, memory_category::grad_buckets);
  buffer<bf16, cuda_space> out(n, nullptr, memory_category::grads);
  fill(in.data(), n * k, 7, -1.0f, 1.0f);
  const bf16* src[k];
  for (std::size_t q = 0; q < k; ++q) src[q] = in.data() + q * n;
  const std::int64_t bytes = static_cast<std::int64_t>(n) * 2 * (k + 1);
  const double bw = run_timed(
      state, bytes, [&] { gpu::reduce_ordered(src, k, out.data(), n, reduce_op::sum, nullptr); });
  report_ratio(state, bytes, bw);
}

// ZeRO-Offload's copies (copy_queue<cuda_space>): device to host and host to device on the
// queue's copy stream, the host side pinned by the queue (pin()), against a plain
// cudaMemcpyAsync between device memory and cudaMallocHost memory of the same size measured in
// this run: here `vs_copy` is the ratio to that transfer, and bytes_moved counts each byte once.
double pinned_transfer(std::size_t bytes, bool to_host) {
  buffer<std::byte, cuda_space> dev(bytes, nullptr, memory_category::comm_scratch);
  void* host = nullptr;
  check(cudaMallocHost(&host, bytes), "cudaMallocHost");
  cuda_event start(true), stop(true);
  std::vector<double> samples;
  for (int i = 0; i < 9; ++i) {
    start.record(nullptr);
    check(to_host ? cudaMemcpyAsync(host, dev.data(), bytes, cudaMemcpyDeviceToHost, nullptr)
                  : cudaMemcpyAsync(dev.data(), host, bytes, cudaMemcpyHostToDevice, nullptr),
          "cudaMemcpyAsync");
    stop.record(nullptr);
    stop.synchronize();
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime");
    if (i > 0) samples.push_back(static_cast<double>(bytes) / (static_cast<double>(ms) * 1e-3));
  }
  check(cudaFreeHost(host), "cudaFreeHost");
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

void offload_copy(benchmark::State& state, bool to_host) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  buffer<std::byte, cuda_space> dev(bytes, nullptr, memory_category::comm_scratch);
  std::vector<std::byte> host(bytes);
  copy_queue<cuda_space> q;
  q.pin(host.data(), bytes);
  cuda_event start(true), stop(true);
  double total = 0;
  for (auto _ : state) {
    start.record(q.stream());
    const auto e = to_host ? q.to_host(dev.data(), host.data(), bytes)
                           : q.to_device(host.data(), dev.data(), bytes);
    stop.record(q.stream());
    q.wait(e);
    stop.synchronize();
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
    total += static_cast<double>(ms) * 1e-3;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  const double bw = static_cast<double>(bytes) * static_cast<double>(state.iterations()) / total;
  const double plain = pinned_transfer(bytes, to_host);
  state.counters["bytes_moved"] = static_cast<double>(bytes);
  state.counters["copy_bytes_per_second"] = plain;
  state.counters["vs_copy"] = plain > 0 ? bw / plain : 0;
}
void BM_offload_to_host(benchmark::State& state) {
  offload_copy(state, true);
}
void BM_offload_to_device(benchmark::State& state) {
  offload_copy(state, false);
}

void sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t n : {1 * mi, 4 * mi, 16 * mi, 64 * mi, 256 * mi}) b->Arg(n);
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

// 16Mi and 256Mi elements: the alternatives measured beside the defaults.
void two_sizes(benchmark::internal::Benchmark* b) {
  b->Arg(16 * mi)->Arg(256 * mi)->UseManualTime()->Unit(benchmark::kMicrosecond);
}
// Bytes moved by the offload queue's copies.
void transfer_sizes(benchmark::internal::Benchmark* b) {
  b->Arg(64 * mi)->Arg(512 * mi)->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_fused_adamw)->Apply(sizes);
BENCHMARK(BM_fused_adamw_fp32)->Apply(two_sizes);
BENCHMARK(BM_fused_adamw_handwritten)->Apply(two_sizes);
BENCHMARK(BM_fused_step_table)->Apply(two_sizes);
BENCHMARK(BM_fused_step_table_persistent)->Apply(two_sizes);
BENCHMARK(BM_fused_step_per_run)->Apply(two_sizes);
BENCHMARK(BM_fused_step_table_chunk16k)->Apply(two_sizes);
BENCHMARK(BM_flatten)->Apply(sizes);
BENCHMARK(BM_flatten_cub)->Apply(sizes);
BENCHMARK(BM_flatten_chunk4k)->Apply(sizes);
BENCHMARK(BM_flatten_chunk64k)->Apply(sizes);
BENCHMARK(BM_flatten_persistent)->Apply(sizes);
BENCHMARK(BM_grad_norm)->Apply(sizes);
BENCHMARK(BM_reduce_ordered)->Apply(sizes);
BENCHMARK(BM_offload_to_host)->Apply(transfer_sizes);
BENCHMARK(BM_offload_to_device)->Apply(transfer_sizes);
BENCHMARK(BM_d2d_copy)
    ->Arg(28 * 256 * mi)  // the fused step's bytes at 256M elements
    ->Arg(4 * 256 * mi)   // flatten's
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  // --benchmark_list_tests needs no device (scripts/gpu-check lists the benchmarks where it
  // builds); everything else does.
  bool listing = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]).starts_with("--benchmark_list_tests")) listing = true;
  }
  if (!listing) {
    if (cuda_device_count() == 0) {
      std::printf("no CUDA device: skipping the CUDA benchmarks\n");
      return 77;
    }
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    benchmark::AddCustomContext("gpu", prop.name);
    benchmark::AddCustomContext("gpu_sms", std::to_string(prop.multiProcessorCount));
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
