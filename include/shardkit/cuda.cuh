//! \file cuda.cuh
//! The CUDA umbrella header: shardkit.hpp plus device memory, the CUDA kernels and the thread
//! communicator on device memory and the engine on it (zero/engine_cuda.cuh). Include from CUDA
//! translation units (nvcc); link shardkit::cuda. The NCCL communicator is comm/nccl.cuh (link
//! shardkit::nccl).
#pragma once

#include <shardkit/comm/thread_cuda.cuh>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/cuda_memory.cuh>
#include <shardkit/core/device.hpp>
#include <shardkit/kernels/cuda/common.cuh>
#include <shardkit/kernels/cuda/convert.cuh>
#include <shardkit/kernels/cuda/grad_stats.cuh>
#include <shardkit/kernels/cuda/launch.hpp>
#include <shardkit/kernels/cuda/optimizer.cuh>
#include <shardkit/kernels/cuda/reduce.cuh>
#include <shardkit/shardkit.hpp>
#include <shardkit/zero/engine_cuda.cuh>
