// A .cu and a .cpp of one program that use the same host kernels and the same host engine
// (config.hpp). Each translation unit must keep its own host-loop build (distinct ABI
// namespaces: simd_scalar under nvcc, simd_native here), both must compute the same bits, and
// core/'s exception types must be the same type on both sides. Runs without a GPU.
#include "odr/odr_body.hpp"

#include <cstdio>
#include <string>

namespace odr {
probe run_host_tu() {
  return run_probe();
}
}  // namespace odr

int main() {
  int failures = 0;
  auto fail = [&](const std::string& what) {
    std::printf("FAIL: %s\n", what.c_str());
    ++failures;
  };
  const odr::probe cu = odr::run_cuda_tu();
  const odr::probe cpp = odr::run_host_tu();
  std::printf("CUDA translation unit: thread_comm = %s, %zu lane(s)\n", cu.comm_type.c_str(),
              cu.lanes);
  std::printf("host translation unit: thread_comm = %s, %zu lane(s)\n", cpp.comm_type.c_str(),
              cpp.lanes);
  if (cu.lanes != 1) fail("the CUDA translation unit should run the one-lane host loops");
  if (cu.comm_type.find("simd_scalar") == std::string::npos) {
    fail("the CUDA translation unit's thread_comm is not in shardkit::simd_scalar");
  }
  if (cpp.comm_type.find("simd_native") == std::string::npos) {
    fail("the host translation unit's thread_comm is not in shardkit::simd_native");
  }
  if (cu.comm_type == cpp.comm_type) fail("both translation units name the same thread_comm type");
  if (cu.fused_bits != cpp.fused_bits) fail("host::fused_step differs between the two builds");
  if (cu.engine_bits != cpp.engine_bits) fail("the host engine differs between the two builds");
  if (cu.engine_bits.empty() || cu.fused_bits.empty()) fail("a probe computed nothing");
  try {
    odr::throw_from_cuda_tu();
    fail("nothing was thrown");
  } catch (const shardkit::usage_error& e) {
    std::printf("caught shardkit::usage_error from the CUDA translation unit: %s\n", e.what());
  } catch (...) {
    fail(
        "an exception of core/ thrown in the CUDA translation unit is not shardkit::usage_error "
        "here");
  }
  std::printf(failures == 0 ? "odr: ok\n" : "odr: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
