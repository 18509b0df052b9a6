//! \file shardkit.hpp
//! The host umbrella header: everything that needs neither CUDA, MPI nor NCCL.
//! (comm/mpi.hpp and the CUDA headers under kernels/cuda/ are included separately.)
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/tensor.hpp>
