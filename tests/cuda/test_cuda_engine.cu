// GPU tests of the ZeRO engine on device memory: the training run of cuda/engine_case.hpp on the
// device engine over thread_cuda_comm and (where NCCL was found) nccl_communicator, against the
// host engine of test_cuda_engine_host.cpp, bit for bit. Runs only where a CUDA device exists
// (test_cuda_main.cpp skips otherwise).
#include <shardkit/zero/engine_cuda.cuh>

#include "cuda/engine_case.hpp"
#include "cuda/gpu_support.cuh"
#include "support/world.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using namespace shardkit;
using namespace shardkit_test_gpu;

// ---- the ZeRO engine on device memory --------------------------------------------------------
// The training run of cuda/engine_case.hpp on the device engine over thread_cuda_comm (each rank
// with its own non-blocking compute stream) and on the host engine over thread_comm: every
// rank's working parameters, master shard, optimizer states and step reports must be equal bit
// for bit, and the ledger (device bytes) must hold what the host's holds and what
// plan/formulas.hpp predicts.

namespace {

struct device_io {
  cudaStream_t s = nullptr;
  std::vector<buffer<float, cuda_space>> d32;
  std::vector<buffer<bf16, cuda_space>> d16;

  device_io() {
    ::shardkit::detail::cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                   "cudaStreamCreateWithFlags");
  }
  device_io(const device_io&) = delete;
  device_io& operator=(const device_io&) = delete;
  ~device_io() {
    (void)cudaStreamSynchronize(s);
    {
      device_stream_scope scope(s);
      d32.clear();
      d16.clear();
    }
    (void)cudaStreamSynchronize(s);
    (void)cudaStreamDestroy(s);
  }

  device_stream stream() const { return s; }
  void sync() const { ::shardkit::detail::cuda_check(cudaStreamSynchronize(s), "sync"); }

  template <class T>
  buffer<T, cuda_space>& slot(std::vector<buffer<T, cuda_space>>& v, std::size_t i, std::size_t n) {
    if (v.size() <= i) v.resize(i + 1);
    if (v[i].size() != n) {
      device_stream_scope scope(s);
      v[i] = buffer<T, cuda_space>(n, nullptr, memory_category::comm_scratch);
    }
    return v[i];
  }

  // Uploads on the compute stream and hands over the device tensor; waits before returning,
  // since the host vector is rewritten for the next gradient.
  template <class Engine, class T>
  void grad_ready(Engine& eng, std::size_t i, const std::vector<T>& g) {
    buffer<T, cuda_space>* b = nullptr;
    if constexpr (std::is_same_v<T, float>)
      b = &slot(d32, i, g.size());
    else
      b = &slot(d16, i, g.size());
    copy_bytes_async(b->data(), g.data(), g.size() * sizeof(T), s);
    eng.grad_ready(i, tensor_view<T, cuda_space>(b->data(), g.size()));
    sync();
  }

  template <class T>
  std::vector<std::uint32_t> bits(tensor_view<T, cuda_space> v) const {
    using E = std::remove_const_t<T>;
    std::vector<E> h(v.size());
    if (!h.empty()) {
      ::shardkit::detail::cuda_check(
          cudaMemcpy(h.data(), v.data(), v.size() * sizeof(E), cudaMemcpyDeviceToHost),
          "cudaMemcpy (engine test)");
    }
    std::vector<std::uint32_t> b;
    for (const E& x : h) b.push_back(test::engine_bits(x));
    return b;
  }
  // What an offloaded optimizer keeps in host memory (its master and state).
  template <class T>
  std::vector<std::uint32_t> bits(tensor_view<T, host_space> v) const {
    std::vector<std::uint32_t> b;
    for (std::size_t k = 0; k < v.size(); ++k) b.push_back(test::engine_bits(v.data()[k]));
    return b;
  }
};

template <class Policies, class W>
void check_engine_on_device(const test::engine_case& ec) {
  for (int n : {1, 2, 4}) {
    CAPTURE(n, Policies::stage, sizeof(W));
    const auto host =
        test::host_engine_reference(Policies::stage, !std::is_same_v<W, float>, n, ec);
    const auto dev = run_ranks<cuda_space>(
        n,
        [&](thread_cuda_comm& c) {
          device_io io;
          return test::train_engine<Policies, W>(c, ec, io);
        },
        short_timeout());
    REQUIRE(host.size() == static_cast<std::size_t>(n));
    REQUIRE(dev.size() == static_cast<std::size_t>(n));
    for (std::size_t r = 0; r < host.size(); ++r) {
      CAPTURE(r);
      REQUIRE(host[r].failure == "");
      REQUIRE(dev[r].failure == "");
      REQUIRE(host[r].reports.size() == static_cast<std::size_t>(3 * ec.steps));
      CHECK(dev[r].reports == host[r].reports);
      CHECK(dev[r].params == host[r].params);
      CHECK(dev[r].master == host[r].master);
      CHECK(dev[r].states == host[r].states);
      CHECK(dev[r].ledger == host[r].ledger);
    }
  }
}

template <class Policies>
void check_engine_stage() {
  SECTION("bf16, norm reported, clipping, two parameter groups") {
    test::engine_case ec;
    ec.options.report_grad_norm = true;
    ec.options.clip_grad_norm = 0.05f;
    check_engine_on_device<Policies, bf16>(ec);
  }
  SECTION("fp32, no statistics (the schedule check only)") {
    test::engine_case ec;
    check_engine_on_device<Policies, float>(ec);
  }
  SECTION("bf16, two micro-batches, small buckets double-buffered, an overflow skipped") {
    test::engine_case ec;
    ec.micro_batches = 2;
    ec.inject_inf_step = 2;
    ec.options.report_grad_norm = true;
    ec.options.bucket_elems = 64;
    ec.options.grad_buffers = 2;
    ec.options.alignment = 8;
    check_engine_on_device<Policies, bf16>(ec);
  }
}

}  // namespace

TEST_CASE("engine on device memory, ZeRO-0: equal to the host engine bit for bit", "[engine]") {
  check_engine_stage<zero0>();
}
TEST_CASE("engine on device memory, ZeRO-1: equal to the host engine bit for bit", "[engine]") {
  check_engine_stage<zero1>();
}
TEST_CASE("engine on device memory, ZeRO-2: equal to the host engine bit for bit", "[engine]") {
  check_engine_stage<zero2>();
}
TEST_CASE("engine on device memory, ZeRO-3: equal to the host engine bit for bit", "[engine]") {
  check_engine_stage<zero3>();
}
// ---- the optimizer offloaded to the host (ZeRO-Offload) ---------------------------------------
// A device engine whose optimizer keeps master and state in pinned host memory: gradient slices
// stream to the host on the copy stream, the host steps them, the working slices stream back.
// Every rank's parameters, master, state and step reports equal the device engine's bit for bit.

namespace {
template <class Device, class Offloaded>
void check_offload_on_device() {
  test::engine_case ec;
  ec.options.report_grad_norm = true;
  ec.options.clip_grad_norm = 0.05f;
  for (int n : {1, 2}) {
    CAPTURE(n, Device::stage);
    auto run = [&]<class P>() {
      return run_ranks<cuda_space>(
          n,
          [&](thread_cuda_comm& c) {
            device_io io;
            return test::train_engine<P, bf16>(c, ec, io);
          },
          short_timeout());
    };
    const auto dev = run.template operator()<Device>();
    const auto off = run.template operator()<Offloaded>();
    REQUIRE(dev.size() == off.size());
    for (std::size_t r = 0; r < dev.size(); ++r) {
      CAPTURE(r);
      REQUIRE(dev[r].failure == "");
      REQUIRE(off[r].failure == "");
      CHECK(off[r].reports == dev[r].reports);
      CHECK(off[r].params == dev[r].params);
      CHECK(off[r].master == dev[r].master);
      CHECK(off[r].states == dev[r].states);
    }
  }
}
}  // namespace

TEST_CASE("engine on device memory, optimizer offloaded to the host: equal to the device engine",
          "[engine]") {
  check_offload_on_device<zero1, zero1_offload>();
  check_offload_on_device<zero2, zero2_offload>();
  check_offload_on_device<zero3, zero3_offload>();
}

// ---- the engine on NCCL (built where NCCL was found) -----------------------------------------
#if defined(SHARDKIT_TEST_NCCL)

namespace {
// The engine over NCCL (one rank per GPU; one rank on a one-GPU machine), deterministic
// reductions: equal to the host engine bit for bit, ZeRO-0 to ZeRO-3.
template <class Policies, class W>
void check_engine_on_nccl(const test::engine_case& ec) {
  const int n = nccl_ranks();
  CAPTURE(n, Policies::stage, sizeof(W));
  const auto host = test::host_engine_reference(Policies::stage, !std::is_same_v<W, float>, n, ec);
  std::vector<test::engine_run> dev(static_cast<std::size_t>(n));
  test::require_all_ok(on_nccl_ranks([&](nccl_communicator& c, thread_comm& h) -> std::string {
    device_io io;
    dev[static_cast<std::size_t>(h.rank())] = test::train_engine<Policies, W>(c, ec, io);
    return {};
  }));
  REQUIRE(host.size() == dev.size());
  for (std::size_t r = 0; r < host.size(); ++r) {
    CAPTURE(r);
    REQUIRE(host[r].failure == "");
    REQUIRE(dev[r].failure == "");
    CHECK(dev[r].reports == host[r].reports);
    CHECK(dev[r].params == host[r].params);
    CHECK(dev[r].master == host[r].master);
    CHECK(dev[r].states == host[r].states);
    CHECK(dev[r].ledger == host[r].ledger);
  }
}
}  // namespace

TEST_CASE("engine on NCCL, stages 0-3: equal to the host engine bit for bit", "[nccl]") {
  test::engine_case ec;
  ec.micro_batches = 2;
  ec.inject_inf_step = 2;
  ec.options.report_grad_norm = true;
  ec.options.clip_grad_norm = 0.05f;
  ec.options.bucket_elems = 64;
  ec.options.grad_buffers = 2;
  check_engine_on_nccl<zero0, bf16>(ec);
  check_engine_on_nccl<zero1, bf16>(ec);
  check_engine_on_nccl<zero2, bf16>(ec);
  check_engine_on_nccl<zero3, bf16>(ec);
  check_engine_on_nccl<zero2, float>(ec);
}

#endif  // SHARDKIT_TEST_NCCL
