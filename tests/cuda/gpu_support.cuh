// Support of the GPU test translation units (test_cuda_*.cu): random data, a device array with
// synchronous upload and download, bit-for-bit comparison, the thread communicator options of
// the tests and, where NCCL was found, NCCL ranks bootstrapped over the thread communicator.
// Each translation unit gets its own copy (internal linkage).
#pragma once

#include <shardkit/comm/thread.hpp>
#include <shardkit/comm/thread_cuda.cuh>
#include <shardkit/cuda.cuh>
#if defined(SHARDKIT_TEST_NCCL)
#include <shardkit/comm/nccl.cuh>
#endif

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace shardkit_test_gpu {
using namespace shardkit;
namespace {

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
float random_float(std::uint64_t& s, float scale = 1.0f) {
  return scale * static_cast<float>(static_cast<double>(splitmix(s) >> 11) * 0x1.0p-53 * 2 - 1);
}

template <class T>
std::uint64_t bits_of(T x) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>)
    return x.bits;
  else if constexpr (sizeof(T) == 1)
    return std::bit_cast<std::uint8_t>(x);
  else if constexpr (sizeof(T) == 4)
    return std::bit_cast<std::uint32_t>(x);
  else
    return std::bit_cast<std::uint64_t>(x);
}

// Finite values over many binades (and some zeros), in T.
template <class T>
T random_value(std::uint64_t& s) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(splitmix(s) % 200);
  } else {
    const int e = static_cast<int>(splitmix(s) % 24) - 12;
    const float f = (splitmix(s) % 50 == 0) ? 0.0f : std::ldexp(random_float(s), e);
    return T(f);
  }
}

// A device array with host upload and download (synchronous), ordered on the calling thread's
// current device stream like its allocation and zeroing.
template <class T>
class dev_array {
 public:
  explicit dev_array(std::size_t n) : buf_(n, nullptr, memory_category::comm_scratch) {}
  explicit dev_array(const std::vector<T>& h) : dev_array(h.size()) { upload(h); }
  // Called on rank threads too: no Catch2 assertion here (Catch2 is not thread-safe).
  void upload(const std::vector<T>& h) {
    if (h.size() != buf_.size()) {
      throw std::invalid_argument("dev_array::upload: " + std::to_string(h.size()) +
                                  " values for " + std::to_string(buf_.size()) + " elements");
    }
    copy_elements(buf_.data(), h.data(), h.size(), current_device_stream());
  }
  std::vector<T> download() const {
    std::vector<T> h(buf_.size());
    copy_elements(h.data(), buf_.data(), h.size(), current_device_stream());
    return h;
  }
  T* data() { return buf_.data(); }
  std::size_t size() const { return buf_.size(); }

 private:
  buffer<T, cuda_space> buf_;
};

template <class T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want,
                             const char* what) {
  if (got.size() != want.size()) return std::string(what) + ": sizes differ";
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (bits_of(got[i]) != bits_of(want[i])) {
      std::ostringstream os;
      os << what << ": element " << i << " has bits " << std::hex << bits_of(got[i])
         << ", the host gives " << bits_of(want[i]);
      return os.str();
    }
  }
  return {};
}

void device_sync() {
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
}

thread_comm_options short_timeout() {
  thread_comm_options o;
  o.timeout = std::chrono::seconds(60);
  return o;
}

#if defined(SHARDKIT_TEST_NCCL)
int nccl_ranks() {
  return std::min(cuda_device_count(), 8);
}

template <class F>
std::vector<std::string> on_nccl_ranks(F&& fn, nccl_options opts = {}) {
  opts.timeout = std::chrono::seconds(120);
  return run_ranks(
      nccl_ranks(),
      [&](thread_comm& host) -> std::string {
        if (cudaSetDevice(host.rank()) != cudaSuccess) return "cudaSetDevice failed";
        auto comm = nccl_bootstrap(host, opts);
        return fn(comm, host);
      },
      short_timeout());
}
#endif  // SHARDKIT_TEST_NCCL

}  // namespace
}  // namespace shardkit_test_gpu
