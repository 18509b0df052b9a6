// A minimal CUDA user of shardkit: one fused AdamW step over device memory when a GPU exists.
#include <shardkit/comm/nccl.cuh>
#include <shardkit/cuda.cuh>

#include <cstdio>
#include <vector>

int main() {
  if (shardkit::cuda_device_count() == 0) {
    std::printf("cuda consumer ok (built; no CUDA device to run on)\n");
    return 0;
  }
  shardkit::buffer<float, shardkit::cuda_space> p(10, nullptr,
                                                  shardkit::memory_category::master_params),
      m(10, nullptr, shardkit::memory_category::optimizer_moments),
      v(10, nullptr, shardkit::memory_category::optimizer_moments);
  shardkit::buffer<shardkit::bf16, shardkit::cuda_space> g(10, nullptr,
                                                           shardkit::memory_category::grads),
      w(10, nullptr, shardkit::memory_category::working_params);
  float* state[2] = {m.data(), v.data()};
  const auto k = shardkit::adamw::prepare({.lr = 0.5f}, 1, 0.5f, 1.0f);
  shardkit::gpu::fused_step<shardkit::adamw>(k, p.data(), state, g.data(), w.data(), 10, nullptr);
  std::vector<float> h(10);
  shardkit::copy_elements(h.data(), p.data(), h.size());
  std::printf("cuda consumer ok: %g\n", h[0]);
  return 0;
}
