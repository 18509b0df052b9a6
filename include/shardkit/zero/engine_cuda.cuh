//! \file zero/engine_cuda.cuh
//! The ZeRO engine on CUDA device memory: zero/engine.hpp together with the operations of its
//! components on device memory (zero/space_ops_cuda.cuh), used when the communicator's memory
//! space is `cuda_space` (thread_cuda_comm, nccl_communicator). Include it in a CUDA
//! translation unit (nvcc) that instantiates such an engine:
//!
//!     #include <shardkit/comm/thread_cuda.cuh>
//!     #include <shardkit/zero/engine_cuda.cuh>
//!     shardkit::engine<shardkit::thread_cuda_comm, shardkit::zero2, shardkit::bf16> eng(
//!         comm, model, shardkit::adam_options{.lr = 1e-3f},
//!         shardkit::engine_options{.compute_stream = stream});
//!
//! Every buffer lives in device memory (counted by the engine's ledger as on the host) and is
//! allocated, zeroed and freed in stream order on the compute stream
//! (engine_options::compute_stream). Gradients handed to grad_ready() and tensors given to
//! copy_param_to() are device tensors; the work on them is enqueued on the compute stream, so a
//! framework produces gradients and consumes parameters on that stream (or orders its own
//! streams against it). Initial values stay host tensors (model_spec).
//!
//! Ordering against the collectives:
//!  - a communicator with set_compute_stream (nccl_communicator) gets the compute stream at
//!    construction; its collectives wait for the compute stream by themselves, and the engine
//!    makes later compute-stream work wait for an asynchronous collective with wait_on() — the
//!    host does not block, except at step() for the small control messages (statistics,
//!    overflow count, schedule check: one copy to the host and back).
//!  - the thread communicator on device memory (thread_cuda_comm) needs its inputs complete
//!    when a collective is called and is complete when wait() returns: the engine synchronises
//!    the compute stream before each collective and waits on the host for it.
//! Results equal the host engine's bit for bit when the translation unit is built with
//! -fmad=false (docs/cuda.md, "What is bit-identical").
#pragma once

#include <shardkit/zero/copy_queue_cuda.cuh>
#include <shardkit/zero/engine.hpp>
#include <shardkit/zero/space_ops_cuda.cuh>
