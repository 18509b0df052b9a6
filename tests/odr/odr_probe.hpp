// One probe, compiled twice into one program: by nvcc (odr_cuda.cu, one-lane host loops) and by
// g++ (odr_host.cpp, vector host loops). Each returns what its own build computed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace odr {

struct probe {
  std::string comm_type;                   // typeid name of shardkit::thread_comm in that TU
  std::size_t lanes = 0;                   // shardkit::simd::width in that TU
  std::vector<std::uint32_t> fused_bits;   // host::fused_step<adamw> over fixed inputs
  std::vector<std::uint32_t> engine_bits;  // a ZeRO-2 engine on 3 thread ranks, 3 steps
};

probe run_cuda_tu();  // odr_cuda.cu
probe run_host_tu();  // odr_host.cpp

//! Throws shardkit::usage_error from the CUDA translation unit.
void throw_from_cuda_tu();

}  // namespace odr
