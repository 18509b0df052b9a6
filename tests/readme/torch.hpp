// What the README's LibTorch snippets take as given (context `torch`): the model of
// examples/03_libtorch (blocks with named parameters, an `around` hook for each unit's forward),
// its initial values, the engine type, and data. Compiled with LibTorch's include directories.
#pragma once
#include <shardkit/adapters/torch.hpp>
#include <shardkit/shardkit.hpp>

#include <functional>
#include <memory>
#include <string>
#include <torch/torch.h>
#include <vector>

struct NetImpl : torch::nn::Module {
  std::size_t num_units() const;
  std::string unit_name(std::size_t u) const;
  std::shared_ptr<torch::nn::Module> unit(std::size_t u);
  torch::Tensor forward(torch::Tensor x);
  std::function<torch::Tensor(std::size_t, const std::function<torch::Tensor()>&)> around;
};
inline std::shared_ptr<NetImpl> net;
// examples/06_gpt's GPT: embeddings, blocks, hooks around the whole forward and each block.
struct GPTImpl : torch::nn::Module {
  torch::Tensor wte, wpe;
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);
  std::function<torch::Tensor(const std::function<torch::Tensor()>&)> around_model;
  std::function<torch::Tensor(std::size_t, const std::function<torch::Tensor()>&)> around_block;
};
inline std::shared_ptr<GPTImpl> gpt;
inline torch::Tensor idx, targets;
inline std::vector<torch::Tensor> init;  // the initial values, one tensor per parameter
inline std::size_t i = 0;
inline int steps = 0;
inline torch::Tensor x, y;
inline std::vector<std::vector<torch::Tensor>> unit_params;
using engine_t = shardkit::engine<shardkit::thread_comm, shardkit::zero3, float>;
extern shardkit::thread_comm& comm;
extern engine_t& eng;
