// The probe as nvcc builds it: the host loops on the one-lane stand-in (shardkit::simd_scalar).
#include <shardkit/core/error.hpp>

#include "odr/odr_body.hpp"

namespace odr {
probe run_cuda_tu() {
  return run_probe();
}
void throw_from_cuda_tu() {
  shardkit::core_detail::raise<shardkit::usage_error>("thrown in the CUDA translation unit");
}
}  // namespace odr
