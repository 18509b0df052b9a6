//! \file shardkit.hpp
//! The host umbrella header: everything that needs neither CUDA, MPI nor NCCL.
//! (comm/mpi.hpp and the CUDA headers under kernels/cuda/ are included separately.)
#pragma once

#include <shardkit/comm/communicator.hpp>
#include <shardkit/comm/thread.hpp>
#include <shardkit/comm/timed.hpp>
#include <shardkit/comm/volume.hpp>
#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/flat_span.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/reduce_op.hpp>
#include <shardkit/core/tensor.hpp>
#include <shardkit/kernels/host/batched_copy.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/dispatch.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/prefetch.hpp>
#include <shardkit/kernels/host/reduce.hpp>
#include <shardkit/kernels/host/simd.hpp>
#include <shardkit/kernels/host/simd_storage.hpp>
#include <shardkit/kernels/host/streaming.hpp>
#include <shardkit/kernels/math.hpp>
#include <shardkit/plan/calibrate.hpp>
#include <shardkit/plan/formulas.hpp>
#include <shardkit/plan/offload.hpp>
#include <shardkit/plan/planner.hpp>
#include <shardkit/zero/accounting.hpp>
#include <shardkit/zero/engine.hpp>
#include <shardkit/zero/full_grads.hpp>
#include <shardkit/zero/model.hpp>
#include <shardkit/zero/offload_optimizer.hpp>
#include <shardkit/zero/policies.hpp>
#include <shardkit/zero/registry.hpp>
#include <shardkit/zero/replicated_params.hpp>
#include <shardkit/zero/shard_grads.hpp>
#include <shardkit/zero/shard_optimizer.hpp>
#include <shardkit/zero/shard_params.hpp>
#include <shardkit/zero/step_control.hpp>
#include <shardkit/zero/topology.hpp>
