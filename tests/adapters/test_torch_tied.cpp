// torch_hooks' root units: a weight used twice (an embedding that is also the output projection)
// gets the sum of both uses' gradients at every stage, equal to the unsharded autograd gradient;
// a root unit stays gathered from the forward to the end of the backward under ZeRO-3; misuse is
// named.
#include <shardkit/adapters/torch.hpp>
#include <shardkit/shardkit.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <torch/torch.h>
#include <vector>

using namespace shardkit;

namespace {

constexpr int vocab = 11, width = 6, tokens = 5, ranks = 2;
constexpr float lr = 0.5f;

// The model: h = tanh(block(embedding(wte, x))); logits = h · wteᵀ (tied); CE loss. The root unit
// is {wte}; the block is one unit.
struct tied_net {
  torch::Tensor wte;
  torch::nn::Linear block{torch::nn::LinearOptions(width, width)};
  tied_net() {
    torch::manual_seed(7);
    wte = torch::randn({vocab, width}).requires_grad_(true);
    block = torch::nn::Linear(width, width);
  }
  template <class Around>
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y, Around&& around_block) {
    auto h = torch::embedding(wte, x);
    h = around_block([&] { return torch::tanh(block->forward(h)); });
    const auto logits = h.matmul(wte.t());
    return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}), y.reshape({-1}));
  }
};

torch::Tensor tokens_of(int seed) {
  torch::manual_seed(static_cast<std::uint64_t>(seed));
  return torch::randint(0, vocab, {ranks * tokens}, torch::kInt64);
}

// The unsharded gradient of the global batch, by plain autograd.
std::vector<torch::Tensor> reference_grads() {
  tied_net net;
  const auto x = tokens_of(1), y = tokens_of(2);
  net.loss(x, y, [](auto&& f) { return f(); }).backward();
  return {net.wte.grad().clone(), net.block->weight.grad().clone(), net.block->bias.grad().clone()};
}

// One SGD step (no momentum, no decay) at `stage` on 2 ranks: (p0 - p1) / lr is the averaged
// gradient the engine reduced; returned per parameter (rank 0's view after the step).
template <class P>
std::vector<torch::Tensor> engine_grads() {
  using eng_t = engine<thread_comm, P, float, sgd_momentum>;
  // Built here, not in the rank threads: torch's random generator is global.
  std::vector<tied_net> nets(ranks);
  const auto xs = tokens_of(1), ys = tokens_of(2);
  auto per_rank = run_ranks(ranks, [&](thread_comm& comm) {
    tied_net& net = nets[static_cast<std::size_t>(comm.rank())];
    std::vector<torch::Tensor> initial = {net.wte.detach().clone(),
                                          net.block->weight.detach().clone(),
                                          net.block->bias.detach().clone()};
    model_spec model;
    model.begin_unit("root", {.reshard_after_forward = false});
    model.add("wte", net.wte);
    model.begin_unit("block");
    model.add("block.weight", net.block->weight);
    model.add("block.bias", net.block->bias);
    eng_t eng(comm, model, sgd_options{.lr = lr, .momentum = 0.0f, .weight_decay = 0.0f});
    torch_hooks<eng_t> hooks(eng, {{net.wte}, {net.block->weight, net.block->bias}},
                             {.root_units = {0}});
    const auto x = xs.narrow(0, comm.rank() * tokens, tokens);
    const auto y = ys.narrow(0, comm.rank() * tokens, tokens);
    torch::Tensor loss = hooks.forward_root(
        0, [&] { return net.loss(x, y, [&](auto&& f) { return hooks.forward(1, f); }); });
    loss.backward();
    hooks.finish_backward();
    eng.step();
    std::vector<torch::Tensor> g;
    std::vector<torch::Tensor> now = {net.wte, net.block->weight, net.block->bias};
    for (std::size_t u = 0; u < eng.num_units(); ++u) eng.pre_forward(u);
    for (std::size_t i = 0; i < 3; ++i) {
      auto view = eng.param(i);
      const auto p1 = torch::from_blob(view.data(), initial[i].sizes(), torch::kFloat32).clone();
      g.push_back((initial[i] - p1) / lr);
    }
    for (std::size_t u = 0; u < eng.num_units(); ++u) eng.post_forward(u);
    return g;
  });
  return per_rank.front();
}

template <class P>
void check_tied_gradient() {
  const auto ref = reference_grads();
  const std::vector<torch::Tensor> got = engine_grads<P>();
  const char* names[] = {"wte (tied)", "block.weight", "block.bias"};
  for (std::size_t i = 0; i < ref.size(); ++i) {
    INFO("stage " << P::stage << ", " << names[i]);
    const double err = (got[i] - ref[i]).abs().max().item<double>();
    const double scale = ref[i].abs().max().item<double>();
    // (p0 - p1)/lr loses the low bits of p0 (|p| ~ 1, so about 1e-7/lr); the sum over ranks is
    // in another order than autograd's.
    CHECK(err <= 1e-6 + 1e-5 * scale);
    CHECK(scale > 1e-3);  // a real gradient, not zeros
  }
  // Both uses matter: the gradient of the embedding use alone differs by far more than the bound.
  tied_net net;
  const auto x = tokens_of(1), y = tokens_of(2);
  auto h = torch::tanh(net.block->forward(torch::embedding(net.wte, x)));
  const auto logits = h.matmul(net.wte.detach().t());
  torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}), y.reshape({-1})).backward();
  CHECK((net.wte.grad() - ref[0]).abs().max().item<double>() > 1e-3);
}

}  // namespace

TEST_CASE("torch_hooks root unit: a tied weight gets the sum of both uses' gradients",
          "[torch][tied]") {
  SECTION("stage 0") {
    check_tied_gradient<zero0>();
  }
  SECTION("stage 1") {
    check_tied_gradient<zero1>();
  }
  SECTION("stage 2") {
    check_tied_gradient<zero2>();
  }
  SECTION("stage 3") {
    check_tied_gradient<zero3>();
  }
}

TEST_CASE("torch_hooks root unit: misuse is named", "[torch][tied]") {
  using eng_t = engine<thread_comm, zero3, float, adamw>;
  tied_net net;
  const auto x = tokens_of(1).narrow(0, 0, tokens), y = tokens_of(2).narrow(0, 0, tokens);
  run_ranks(1, [&](thread_comm& comm) {
    auto spec = [&](bool keep) {
      model_spec model;
      model.begin_unit("root", {.reshard_after_forward = !keep});
      model.add("wte", net.wte);
      model.begin_unit("block");
      model.add("block.weight", net.block->weight);
      model.add("block.bias", net.block->bias);
      return model;
    };
    const std::vector<std::vector<torch::Tensor>> lists = {{net.wte},
                                                           {net.block->weight, net.block->bias}};
    {
      eng_t eng(comm, spec(false), {});
      CHECK_THROWS_WITH(
          (torch_hooks<eng_t>(eng, lists, {.root_units = {0}})),
          Catch::Contains("root unit 'root'") && Catch::Contains("reshard_after_forward = false"));
      CHECK_THROWS_WITH((torch_hooks<eng_t>(eng, lists, {.root_units = {5}})),
                        Catch::Contains("unit 5 out of range"));
    }
    eng_t eng(comm, spec(true), {});
    torch_hooks<eng_t> hooks(eng, lists, {.root_units = {0}});
    CHECK_THROWS_WITH(hooks.forward(0, [] { return torch::Tensor(); }),
                      Catch::Contains("is a root unit") && Catch::Contains("forward_root(0"));
    CHECK_THROWS_WITH(hooks.forward_root(1, [] { return torch::Tensor(); }),
                      Catch::Contains("'block' is not a root unit"));
    auto run = [&] {
      return hooks.forward_root(
          0, [&] { return net.loss(x, y, [&](auto&& f) { return hooks.forward(1, f); }); });
    };
    torch::Tensor loss = run();
    CHECK_THROWS_WITH(run(), Catch::Contains("has not been ended by finish_backward"));
    loss.backward();
    hooks.finish_backward();
    eng.step();
    // Evaluation: under no_grad the root's forward ends at once; training goes on after it.
    {
      torch::NoGradGuard no_grad;
      CHECK(std::isfinite(run().item<double>()));
    }
    loss = run();
    loss.backward();
    hooks.finish_backward();
    CHECK_NOTHROW(eng.step());
  });
}
