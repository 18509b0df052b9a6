// A GPT-2-style decoder-only transformer in plain torch::nn code, byte-level: token and position
// embeddings, pre-LayerNorm blocks (causal multi-head self-attention, then a GELU MLP, each with
// a residual connection), a final LayerNorm, and the output projection tied to the token
// embedding (logits = h · wteᵀ). Nothing here knows about shardkit: the training loop
// (main.cpp) wraps the model's forward and each block's forward in shardkit's hooks through the
// two function objects `around_model` and `around_block`.
//
// Activation recomputation: with `recompute` set, each block's forward runs without building an
// autograd graph, and its backward runs the block's forward again, with grad on, before
// back-propagating through it (recompute_block, a torch::autograd::Function). The re-run happens
// inside the block's backward, after the hook on the block's output gradient has gathered the
// block: ZeRO-3 gathers each block once per backward, with or without recomputation.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <torch/torch.h>
#include <vector>

namespace gpt {

struct options {
  int vocab = 256;    // bytes
  int context = 128;  // T: tokens per sequence
  int width = 256;    // d_model
  int layers = 4;     // blocks
  int heads = 4;      // attention heads (width must be a multiple)
  bool recompute = false;
};

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const options& o)
      : heads(o.heads),
        qkv(register_module("qkv", torch::nn::Linear(o.width, 3 * o.width))),
        proj(register_module("proj", torch::nn::Linear(o.width, o.width))) {
    // The causal mask, kept out of the module's parameters and buffers (it is not model state).
    mask = torch::ones({o.context, o.context}, torch::kBool).tril();
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2);
    const auto hd = C / heads;
    auto parts = qkv(x).split(C, -1);
    auto shape = [&](const torch::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
    const auto q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    auto att = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    att = att.masked_fill(mask.narrow(0, 0, T).narrow(1, 0, T).logical_not(),
                          -std::numeric_limits<float>::infinity());
    att = torch::softmax(att, -1);
    const auto y = att.matmul(v).transpose(1, 2).contiguous().view({B, T, C});
    return proj(y);
  }
  std::int64_t heads;
  torch::nn::Linear qkv, proj;
  torch::Tensor mask;
};
TORCH_MODULE(Attention);

struct BlockImpl : torch::nn::Module {
  BlockImpl(const options& o)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.width})))),
        attn(register_module("attn", Attention(o))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.width})))),
        fc(register_module("fc", torch::nn::Linear(o.width, 4 * o.width))),
        proj(register_module("proj", torch::nn::Linear(4 * o.width, o.width))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto h = x + attn(ln1(x));
    return h + proj(torch::gelu(fc(ln2(h))));
  }
  torch::nn::LayerNorm ln1;
  Attention attn;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, proj;
};
TORCH_MODULE(Block);

// Forward without a graph; backward re-runs the block's forward with grad on and back-propagates
// through it. The parameters' gradients reach them through autograd as usual (and so any hook on
// them); the input's gradient is returned.
struct recompute_block : torch::autograd::Function<recompute_block> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               std::int64_t block) {
    ctx->save_for_backward({x});
    ctx->saved_data["block"] = block;
    return reinterpret_cast<BlockImpl*>(block)->forward(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto* b = reinterpret_cast<BlockImpl*>(ctx->saved_data["block"].toInt());
    const torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode on(true);
      y = b->forward(x);
    }
    torch::autograd::backward({y}, {grad_out[0]});
    return {x.grad(), torch::Tensor()};
  }
};

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const options& o) : opt(o) {
    if (o.width % o.heads != 0) {
      throw std::invalid_argument("--width " + std::to_string(o.width) +
                                  " must be a multiple of --heads " + std::to_string(o.heads));
    }
    wte = register_parameter("wte", torch::randn({o.vocab, o.width}) * 0.02);
    wpe = register_parameter("wpe", torch::randn({o.context, o.width}) * 0.01);
    for (int l = 0; l < o.layers; ++l) {
      blocks.push_back(register_module("h" + std::to_string(l), Block(o)));
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.width})));
    // GPT-2's initialisation: N(0, 0.02) matrices, zero biases, residual projections scaled by
    // 1/sqrt(2·layers).
    torch::NoGradGuard no_grad;
    for (auto& b : blocks) {
      for (torch::nn::Linear* l : {&b->attn->qkv, &b->attn->proj, &b->fc, &b->proj}) {
        const bool residual = l == &b->attn->proj || l == &b->proj;
        (*l)->weight.normal_(0.0, residual ? 0.02 / std::sqrt(2.0 * o.layers) : 0.02);
        (*l)->bias.zero_();
      }
    }
  }

  // The model's forward: logits (B, T, vocab) of token ids `idx` (B, T). `around_model` wraps
  // the whole of it (where the embeddings and the final norm are used), `around_block` each
  // block; both may be empty (plain LibTorch training).
  torch::Tensor forward(const torch::Tensor& idx) {
    auto body = [&] {
      const auto T = idx.size(1);
      auto x = torch::embedding(wte, idx) + wpe.narrow(0, 0, T);
      for (std::size_t b = 0; b < blocks.size(); ++b) {
        auto run = [&, b] {
          if (opt.recompute && torch::GradMode::is_enabled()) {
            return recompute_block::apply(x, reinterpret_cast<std::int64_t>(blocks[b].get()));
          }
          return blocks[b]->forward(x);
        };
        x = around_block ? around_block(b, run) : run();
      }
      return ln_f(x).matmul(wte.t());  // tied output projection
    };
    return around_model ? around_model(body) : body();
  }

  //! Mean cross-entropy of predicting idx[:, t+1] from idx[:, :t+1].
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets) {
    const auto logits = forward(idx);
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), targets.reshape({-1}));
  }

  // The parameters of the root unit (used outside any one block: embeddings, final norm), then
  // of each block, in registration order; names as in the model's state dict.
  std::vector<std::pair<std::string, torch::Tensor>> root_parameters() {
    return {{"wte", wte}, {"wpe", wpe}, {"ln_f.weight", ln_f->weight}, {"ln_f.bias", ln_f->bias}};
  }
  std::vector<std::pair<std::string, torch::Tensor>> block_parameters(std::size_t b) {
    std::vector<std::pair<std::string, torch::Tensor>> v;
    for (const auto& kv : blocks[b]->named_parameters()) {
      v.emplace_back("h" + std::to_string(b) + "." + kv.key(), kv.value());
    }
    return v;
  }
  // Every parameter, root unit first, then the blocks.
  std::vector<std::pair<std::string, torch::Tensor>> ordered_parameters() {
    auto v = root_parameters();
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      auto p = block_parameters(b);
      v.insert(v.end(), p.begin(), p.end());
    }
    return v;
  }

  options opt;
  torch::Tensor wte, wpe;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  std::function<torch::Tensor(const std::function<torch::Tensor()>&)> around_model;
  std::function<torch::Tensor(std::size_t, const std::function<torch::Tensor()>&)> around_block;
};
TORCH_MODULE(GPT);

}  // namespace gpt
