// Entry point of the GPU test binary: runs the Catch2 session when a CUDA device is usable and
// otherwise exits with 77, which ctest reports as Skipped (SKIP_RETURN_CODE). Any error of
// cudaGetDeviceCount (no driver: cudaErrorInsufficientDriver; no device: cudaErrorNoDevice)
// counts as no device. Listing the tests (--list-tests, --list-test-names-only, --list-tags,
// -l) needs no device, so scripts/gpu-check counts each suite's tests where it builds.
// `--probe-device` prints the device line and exits 0, or 77 without one.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string_view>

int main(int argc, char** argv) {
  bool probe = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--probe-device") probe = true;
    if (a == "-l" || a.starts_with("--list")) return Catch::Session().run(argc, argv);
  }
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("no CUDA device (%s): skipping the GPU tests\n",
                e != cudaSuccess ? cudaGetErrorName(e) : "0 devices");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("GPU tests on %d device(s); device 0: %s, compute capability %d.%d, %d SMs\n",
                devices, prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  }
  if (probe) return 0;
  return Catch::Session().run(argc, argv);
}
