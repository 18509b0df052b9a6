// The framework's part of the main example on the GPU: examples/common/mlp.hpp's layers as CUDA
// kernels, one thread per output element, each sum taken in the host loops' order with
// explicitly rounded multiplies and adds (__fmul_rn, __fadd_rn: never fused), so the device
// gives the host's bits. Deliberately plain: the example shows shardkit, not fast matrix
// products.
#pragma once

#include <shardkit/core/cuda.cuh>
#include <shardkit/core/cuda_memory.cuh>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/tensor.hpp>

#include "../../common/mlp.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mlp_gpu {

// y[i, o] = bias[o] + sum_k W[o, k] x[i, k] (k ascending), then ReLU below the last layer.
__global__ void forward_kernel(const float* x, const shardkit::bf16* W, const shardkit::bf16* bias,
                               float* y, std::size_t batch, std::size_t in, std::size_t out,
                               bool relu) {
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= batch * out) return;
  const std::size_t i = t / out, o = t % out;
  float z = shardkit::to_float(bias[o]);
  for (std::size_t k = 0; k < in; ++k)
    z = __fadd_rn(z, __fmul_rn(shardkit::to_float(W[o * in + k]), x[i * in + k]));
  y[t] = relu && z < 0.0f ? 0.0f : z;  // std::max(z, 0.0f)
}

// gW[o, k] = sum_i dy[i, o] x[i, k] and gb[o] = sum_i dy[i, o] (i ascending).
__global__ void grad_kernel(const float* x, const float* dy, float* gW, float* gb,
                            std::size_t batch, std::size_t in, std::size_t out) {
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t < out * in) {
    const std::size_t o = t / in, k = t % in;
    float g = 0.0f;
    for (std::size_t i = 0; i < batch; ++i)
      g = __fadd_rn(g, __fmul_rn(dy[i * out + o], x[i * in + k]));
    gW[t] = g;
  }
  if (t < out) {
    float g = 0.0f;
    for (std::size_t i = 0; i < batch; ++i) g = __fadd_rn(g, dy[i * out + t]);
    gb[t] = g;
  }
}

// dx[i, k] = sum_o W[o, k] dy[i, o] (o ascending), zero where the layer below's ReLU was.
__global__ void input_grad_kernel(const float* x, const shardkit::bf16* W, const float* dy,
                                  float* dx, std::size_t batch, std::size_t in, std::size_t out) {
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= batch * in) return;
  const std::size_t i = t / in, k = t % in;
  float d = 0.0f;
  for (std::size_t o = 0; o < out; ++o)
    d = __fadd_rn(d, __fmul_rn(shardkit::to_float(W[o * in + k]), dy[i * out + o]));
  dx[t] = x[t] <= 0.0f ? 0.0f : d;
}

inline unsigned blocks_for(std::size_t n) {
  return static_cast<unsigned>((n + 255) / 256);
}

inline void check_launch(const char* what) {
  shardkit::detail::cuda_check(cudaGetLastError(), what);
}

//! One rank's layers on the device, on its stream: activations, the loss gradient, and one
//! fp32 gradient buffer per parameter (handed to the engine, which reads them in stream order).
class device_backend {
 public:
  device_backend(const mlp::shape& s, std::size_t batch, cudaStream_t stream)
      : shape_(s), stream_(stream) {
    shardkit::device_stream_scope scope(stream_);
    std::size_t widest = 0;
    for (std::size_t w : s.widths) {
      acts_.emplace_back(batch * w, nullptr, shardkit::memory_category::comm_scratch);
      widest = w > widest ? w : widest;
    }
    dy_ = buffer(batch * widest, nullptr, shardkit::memory_category::comm_scratch);
    dx_ = buffer(batch * widest, nullptr, shardkit::memory_category::comm_scratch);
    for (std::size_t l = 0; l < s.layers(); ++l) {
      gW_.emplace_back(s.widths[l + 1] * s.widths[l], nullptr, shardkit::memory_category::grads);
      gb_.emplace_back(s.widths[l + 1], nullptr, shardkit::memory_category::grads);
    }
  }
  device_backend(const device_backend&) = delete;
  device_backend& operator=(const device_backend&) = delete;
  ~device_backend() {
    (void)cudaStreamSynchronize(stream_);
    shardkit::device_stream_scope scope(stream_);
    acts_.clear();
    gW_.clear();
    gb_.clear();
    dy_.release();
    dx_.release();
  }

  void load(const mlp::shape& s, const mlp::dataset& d, std::uint64_t first, std::size_t size,
            mlp::batch& b) {
    mlp::load(s, d, first, size, b);  // the data pipeline stays on the host
    upload(acts_[0].data(), b.acts[0]);
  }
  void forward(std::size_t l, shardkit::tensor_view<shardkit::bf16, shardkit::cuda_space> W,
               shardkit::tensor_view<shardkit::bf16, shardkit::cuda_space> bias, mlp::batch& b) {
    const std::size_t in = shape_.widths[l], out = shape_.widths[l + 1];
    forward_kernel<<<blocks_for(b.size * out), 256, 0, stream_>>>(
        acts_[l].data(), W.data(), bias.data(), acts_[l + 1].data(), b.size, in, out,
        l + 1 < shape_.layers());
    check_launch("forward_kernel");
  }
  void logits(mlp::batch& b) {
    b.acts.back().resize(b.size * shape_.classes());
    download(b.acts.back(), acts_.back().data());
  }
  void delta(mlp::batch& b) { upload(dy_.data(), b.delta); }
  void backward(std::size_t l, shardkit::tensor_view<shardkit::bf16, shardkit::cuda_space> W,
                mlp::batch& b) {
    const std::size_t in = shape_.widths[l], out = shape_.widths[l + 1];
    grad_kernel<<<blocks_for(out * in), 256, 0, stream_>>>(
        acts_[l].data(), dy_.data(), gW_[l].data(), gb_[l].data(), b.size, in, out);
    check_launch("grad_kernel");
    if (l == 0) return;
    input_grad_kernel<<<blocks_for(b.size * in), 256, 0, stream_>>>(
        acts_[l].data(), W.data(), dy_.data(), dx_.data(), b.size, in, out);
    check_launch("input_grad_kernel");
    std::swap(dy_, dx_);
  }
  shardkit::tensor_view<float, shardkit::cuda_space> grad_w(std::size_t l) {
    return {gW_[l].data(), gW_[l].size()};
  }
  shardkit::tensor_view<float, shardkit::cuda_space> grad_b(std::size_t l) {
    return {gb_[l].data(), gb_[l].size()};
  }
  void bits(shardkit::tensor_view<shardkit::bf16, shardkit::cuda_space> v,
            std::vector<std::uint16_t>& out) {
    std::vector<shardkit::bf16> h(v.size());
    download(h, v.data());
    for (auto x : h) out.push_back(x.bits);
  }

 private:
  using buffer = shardkit::buffer<float, shardkit::cuda_space>;

  template <class T>
  void upload(T* dst, const std::vector<T>& src) {
    shardkit::copy_bytes_async(dst, src.data(), src.size() * sizeof(T), stream_);
    sync();  // the host vector is rewritten next step
  }
  template <class T>
  void download(std::vector<T>& dst, const T* src) {
    shardkit::copy_bytes_async(dst.data(), src, dst.size() * sizeof(T), stream_);
    sync();
  }
  void sync() {
    shardkit::detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  mlp::shape shape_;
  cudaStream_t stream_;
  std::vector<buffer> acts_, gW_, gb_;
  buffer dy_, dx_;
};

}  // namespace mlp_gpu
