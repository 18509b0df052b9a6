// The host side of the main example's GPU program: the same training (cuda/train.hpp) on the
// host engine over thread_comm, the layers as examples/common/mlp.hpp's loops. A g++
// translation unit: the host engine's vectorised step is host code only.
#include <shardkit/comm/thread.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/zero/engine.hpp>

#include "train.hpp"

#include <cstring>
#include <stdexcept>
#include <vector>

namespace mlp_gpu {
namespace {

// The framework's part on the host: examples/common/mlp.hpp.
struct host_backend {
  mlp::shape shape;
  std::vector<std::vector<float>> gW, gb;

  explicit host_backend(const mlp::shape& s) : shape(s), gW(s.layers()), gb(s.layers()) {}

  void load(const mlp::shape& s, const mlp::dataset& d, std::uint64_t first, std::size_t size,
            mlp::batch& b) {
    mlp::load(s, d, first, size, b);
  }
  template <class View>
  void forward(std::size_t l, View W, View bias, mlp::batch& b) {
    mlp::forward_layer<shardkit::bf16>(shape, l, W, bias, b);
  }
  void logits(mlp::batch&) {}
  void delta(mlp::batch&) {}
  template <class View>
  void backward(std::size_t l, View W, mlp::batch& b) {
    mlp::backward_layer<shardkit::bf16>(shape, l, W, b, gW[l], gb[l]);
  }
  std::vector<float>& grad_w(std::size_t l) { return gW[l]; }
  std::vector<float>& grad_b(std::size_t l) { return gb[l]; }
  template <class View>
  void bits(View v, std::vector<std::uint16_t>& out) {
    for (std::size_t i = 0; i < v.size(); ++i) out.push_back(v[i].bits);
  }
};

template <class Policies>
std::vector<rank_result> run(const options& o) {
  return shardkit::run_ranks(o.ranks, [&](shardkit::thread_comm& comm) {
    rank_result r;
    try {
      const auto init = mlp::init_params(mlp::shape{o.layers}, o.seed);
      shardkit::engine<shardkit::thread_comm, Policies, shardkit::bf16, shardkit::adamw> eng(
          comm, model(o, init), {.lr = o.lr, .weight_decay = o.weight_decay}, engine_options(o));
      host_backend be{mlp::shape{o.layers}};
      r = train(eng, be, o, comm.rank(), comm.size());
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    return r;
  });
}

}  // namespace

std::vector<rank_result> train_on_host(const options& o) {
  switch (o.stage) {
    case 0:
      return run<shardkit::zero0>(o);
    case 1:
      return run<shardkit::zero1>(o);
    case 2:
      return run<shardkit::zero2>(o);
    case 3:
      return run<shardkit::zero3>(o);
    default:
      throw std::invalid_argument("stage must be 0, 1, 2 or 3");
  }
}

}  // namespace mlp_gpu
