// The host reference of the device-engine tests: the host engine on thread_comm, built by g++
// with the one-lane host kernels (the build nvcc translation units get, which computes what
// the baseline host build computes, bit for bit). nvcc cannot compile the host engine's
// vectorised step, so it lives in this .cpp of the test_cuda target.
#ifndef SHARDKIT_HOST_SCALAR_SIMD
#define SHARDKIT_HOST_SCALAR_SIMD 1
#endif

#include <shardkit/comm/thread.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/zero/engine.hpp>

#include "cuda/engine_case.hpp"

#include <chrono>
#include <vector>

namespace test {
namespace {

struct host_io {
  shardkit::device_stream stream() const { return nullptr; }
  template <class Engine, class T>
  void grad_ready(Engine& eng, std::size_t i, const std::vector<T>& g) {
    eng.grad_ready(i, g);
  }
  template <class T>
  std::vector<std::uint32_t> bits(shardkit::tensor_view<T> v) const {
    std::vector<std::uint32_t> b;
    for (std::size_t k = 0; k < v.size(); ++k) b.push_back(engine_bits(v.data()[k]));
    return b;
  }
  void sync() const {}
};

template <class Policies, class W>
std::vector<engine_run> run(int ranks, const engine_case& ec) {
  shardkit::thread_comm_options o;
  o.timeout = std::chrono::seconds(60);
  // A device engine frees every released ZeRO-3 unit (its stream-ordered allocator reuses the
  // memory); a host engine keeps spare buffers counted as gathered_params unless told not to.
  // The host reference does what the device does, so the ledgers compare category by category
  // (the values never depend on it).
  engine_case host_case = ec;
  host_case.options.reuse_gathered_buffers = false;
  return shardkit::run_ranks(
      ranks,
      [&](shardkit::thread_comm& c) {
        host_io io;
        return train_engine<Policies, W>(c, host_case, io);
      },
      o);
}

template <class W>
std::vector<engine_run> by_stage(int stage, int ranks, const engine_case& ec) {
  switch (stage) {
    case 0:
      return run<shardkit::zero0, W>(ranks, ec);
    case 1:
      return run<shardkit::zero1, W>(ranks, ec);
    case 2:
      return run<shardkit::zero2, W>(ranks, ec);
    default:
      return run<shardkit::zero3, W>(ranks, ec);
  }
}

}  // namespace

std::vector<engine_run> host_engine_reference(int stage, bool bf16_working, int ranks,
                                              const engine_case& ec) {
  return bf16_working ? by_stage<shardkit::bf16>(stage, ranks, ec)
                      : by_stage<float>(stage, ranks, ec);
}

}  // namespace test
