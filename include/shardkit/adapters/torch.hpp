//! \file adapters/torch.hpp
//! LibTorch adapter: torch::Tensor as a shardkit tensor, torch tensors over shardkit's buffers,
//! and `torch_hooks`, which drives an engine's unit hooks from a torch model's forward and from
//! autograd. Include it only where LibTorch is available; it is not part of
//! <shardkit/shardkit.hpp>. It needs only ATen's core headers (no <torch/torch.h>), and links with
//! `torch` (CMake: `find_package(Torch)`, `target_link_libraries(t PRIVATE shardkit::shardkit
//! torch)`).
//!
//! - `tensor_traits<at::Tensor>` (torch::Tensor is at::Tensor): element type and device are read
//!   at run time; CPU tensors are host tensors, CUDA tensors report cuda memory (so the host
//!   engine rejects them by parameter name); data() requires a dense, contiguous tensor.
//! - `torch_view(view, shape)`: a torch tensor over shardkit memory (no copy).
//! - `torch_bind(param, view)` / `torch_unbind(param)`: make an existing tensor, typically an
//!   nn::Module parameter, alias shardkit memory. A second bind of a bound tensor swaps the data
//!   pointer of its storage in place, so every view of it, including the tensors autograd saved
//!   in forward, sees the new address: what ZeRO-3 needs, since a unit is gathered into a new
//!   buffer for its backward.
//! - `torch_hooks<Engine>`: pre/post_forward around each unit's forward, pre_backward from a
//!   hook on the unit's output gradient, grad_ready from a hook on each parameter, post_backward
//!   when the unit's last gradient arrives. See the class comment for why this order is correct.
#pragma once

#include <shardkit/adapters/torch_hooks.hpp>
#include <shardkit/adapters/torch_tensor.hpp>
