// Plain LibTorch, no shardkit: the same GPT trained unsharded with torch::optim::AdamW on the
// full global batch (the reference the sharded runs are compared with, and the throughput
// baseline), and the evaluation of exported weights (a safetensors file) in a fresh model.
#pragma once

#include <shardkit/io/safetensors.hpp>

#include "config.hpp"
#include "corpus.hpp"
#include "gpt.hpp"

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace gpt {

//! The reference: the same initial values, data, schedule, clipping and weight-decay groups;
//! torch's AdamW (which multiplies p by 1 - lr·wd before the update, where shardkit subtracts
//! lr·wd·p inside it: the two differ by rounding).
inline run_result train_torch(const config& c, const corpus& data, GPT& net) {
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& [name, t] : net->ordered_parameters()) (t.dim() >= 2 ? decay : no_decay).push_back(t);
  auto opts = [&](float wd) {
    return torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd);
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(opts(c.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(opts(0.0f)));
  torch::optim::AdamW opt(std::move(groups), opts(0.0f));
  run_result r;
  for (auto& [name, t] : net->ordered_parameters()) r.params += static_cast<std::size_t>(t.numel());
  const batch val = val_batch(data, static_cast<std::size_t>(c.val_seqs), c.model.context);
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < c.last_step(); ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& g : opt.param_groups()) {
      g.options().set_lr(static_cast<double>(c.lr) *
                         c.lr_factor(static_cast<std::uint64_t>(step) + 1));
    }
    opt.zero_grad();
    const batch b = train_batch(data, c.seed, static_cast<std::uint64_t>(step), 0,
                                static_cast<std::size_t>(c.batch), c.model.context);
    torch::Tensor loss = net->loss(b.idx, b.targets);
    loss.backward();
    double norm = NAN;
    if (c.clip > 0) norm = torch::nn::utils::clip_grad_norm_(net->parameters(), c.clip);
    opt.step();
    step_record rec;
    rec.step = step + 1;
    rec.loss = loss.item<double>();
    rec.grad_norm = norm;
    rec.lr = static_cast<double>(c.lr) * c.lr_factor(static_cast<std::uint64_t>(step) + 1);
    rec.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rec.tokens_per_s = static_cast<double>(c.batch) * c.model.context / rec.seconds;
    if (step + 1 == c.last_step()) {
      torch::NoGradGuard no_grad;
      rec.val_loss = r.final_val_loss = net->loss(val.idx, val.targets).item<double>();
    }
    r.records.push_back(rec);
  }
  r.train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.tokens = static_cast<std::uint64_t>(c.last_step()) * static_cast<std::uint64_t>(c.batch) *
             static_cast<std::uint64_t>(c.model.context);
  for (auto& [name, t] : net->ordered_parameters()) {
    const auto flat = t.detach().reshape({-1}).contiguous();
    r.final_params.insert(r.final_params.end(), flat.data_ptr<float>(),
                          flat.data_ptr<float>() + flat.numel());
  }
  return r;
}

//! Loads every parameter of a fresh model from `path` (as the names of the model's state dict;
//! the tied matrix is stored once, as "wte") and returns its validation loss.
inline double evaluate_safetensors(const config& c, const corpus& data, const std::string& path) {
  GPT net(c.model);
  shardkit::io::safetensors_file f(path);
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : net->ordered_parameters()) {
      const auto& e = f.entry(name);
      if (e.numel() != static_cast<std::uint64_t>(t.numel())) {
        throw std::runtime_error("'" + path + "' has " + std::to_string(e.numel()) +
                                 " elements in '" + name + "', the model (--layers/--width/" +
                                 "--context as in training) has " + std::to_string(t.numel()));
      }
      auto fp32 = torch::empty({t.numel()}, torch::kFloat32);
      f.read(name, 0,
             std::span<float>(fp32.data_ptr<float>(), static_cast<std::size_t>(t.numel())));
      t.copy_(fp32.view(t.sizes()));
    }
  }
  const batch val = val_batch(data, static_cast<std::size_t>(c.val_seqs), c.model.context);
  torch::NoGradGuard no_grad;
  return net->loss(val.idx, val.targets).item<double>();
}

}  // namespace gpt
