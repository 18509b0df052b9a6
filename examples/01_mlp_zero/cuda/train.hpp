// The main example's training loop on the GPU and on the host, written once: the MLP of
// examples/common/mlp.hpp with bf16 working parameters, fp32 gradients and AdamW, one ZeRO unit
// per layer, ranks as threads. A backend does the framework's part (the layers' forward and
// backward); shardkit's engine does the rest. The GPU program (main.cu) runs it on the device
// engine over thread_cuda_comm with the layers as CUDA kernels (mlp_kernels.cuh), and on the
// host engine over thread_comm with examples/common/mlp.hpp's loops (host_reference.cpp), and
// compares the two bit for bit.
//
// The loss head (softmax cross-entropy of batch x classes logits, in double) stays on the host
// in both: the logits come down and the gradient of the loss goes back up, a few kilobytes a
// step. The layers do every multiply and add in the same order on both sides with no fused
// multiply-add (-fmad=false, -ffp-contract=off), so the two runs give the same bits.
#pragma once

#include <shardkit/core/dtype.hpp>
#include <shardkit/zero/engine_options.hpp>
#include <shardkit/zero/model.hpp>
#include <shardkit/zero/policies.hpp>

#include "../../common/mlp.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mlp_gpu {

struct options {
  int stage = 2;
  int ranks = 2;
  int steps = 20;
  std::vector<std::size_t> layers{64, 256, 10};
  std::size_t batch = 128;  // global: a multiple of the ranks
  float lr = 1e-2f;
  float weight_decay = 0.01f;
  std::uint64_t seed = 1;
  std::size_t bucket = 4096;  // ZeRO-2 bucket elements
  std::size_t prefetch = 1;   // ZeRO-3 units gathered ahead
};

//! What one rank's training gives: its own summed loss per step (the global mean is the sum
//! over ranks, added in rank order by the caller) and the final working parameters' bits.
struct rank_result {
  std::vector<double> loss_sums;
  std::vector<std::uint16_t> param_bits;
  std::string error;
};

//! The loop. Backend: load(shape, data, first, size, b); forward(l, W, bias, b); logits(b)
//! (the last layer's outputs into b.acts.back()); delta(b) (b.delta to where backward reads it);
//! backward(l, W, b); grad_w(l), grad_b(l) (tensors for grad_ready); bits(view, out).
template <class Engine, class Backend>
rank_result train(Engine& eng, Backend& be, const options& o, int rank, int ranks) {
  const mlp::shape shape{o.layers};
  const mlp::dataset data{shape, o.seed};
  const std::size_t per_rank = o.batch / static_cast<std::size_t>(ranks);
  rank_result r;
  mlp::batch b;
  for (int step = 0; step < o.steps; ++step) {
    const std::uint64_t first =
        static_cast<std::uint64_t>(step) * o.batch + static_cast<std::uint64_t>(rank) * per_rank;
    be.load(shape, data, first, per_rank, b);
    for (std::size_t l = 0; l < shape.layers(); ++l) {
      eng.pre_forward(l);
      be.forward(l, eng.param(2 * l), eng.param(2 * l + 1), b);
      eng.post_forward(l);
    }
    be.logits(b);
    r.loss_sums.push_back(mlp::loss_and_delta(shape, data, b));
    be.delta(b);
    for (std::size_t l = shape.layers(); l-- > 0;) {
      eng.pre_backward(l);
      be.backward(l, eng.param(2 * l), b);
      eng.grad_ready(2 * l + 1, be.grad_b(l));
      eng.grad_ready(2 * l, be.grad_w(l));
      eng.post_backward(l);
    }
    eng.step();
  }
  for (std::size_t l = 0; l < shape.layers(); ++l) {
    eng.pre_forward(l);
    be.bits(eng.param(2 * l), r.param_bits);
    be.bits(eng.param(2 * l + 1), r.param_bits);
    eng.post_forward(l);
  }
  return r;
}

//! The model of the example: one unit per layer, its weight then its bias, with the initial
//! values in `init` (mlp::init_params), which must outlive the engine's construction: the spec
//! keeps views of them.
inline shardkit::model_spec model(const options& o, const std::vector<std::vector<float>>& init) {
  const mlp::shape shape{o.layers};
  shardkit::model_spec m;
  for (std::size_t l = 0; l < shape.layers(); ++l) {
    m.begin_unit("layer" + std::to_string(l));
    m.add("layer" + std::to_string(l) + ".weight", init[2 * l]);
    m.add("layer" + std::to_string(l) + ".bias", init[2 * l + 1]);
  }
  return m;
}

inline shardkit::engine_options engine_options(const options& o) {
  shardkit::engine_options eo;
  eo.bucket_elems = o.bucket;
  eo.prefetch = o.prefetch;
  return eo;
}

//! The host engine's run (host_reference.cpp): every rank's result.
std::vector<rank_result> train_on_host(const options& o);

}  // namespace mlp_gpu
