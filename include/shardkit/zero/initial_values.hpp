//! \file zero/initial_values.hpp
//! How an engine fills its buffers from a model_spec at construction: each parameter's initial
//! values go into the parameter component (working values) and the optimizer component (fp32
//! master, or the fp32 working copy), from the registered tensor or from the initialiser.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/zero/collective_log.hpp>
#include <shardkit/zero/model.hpp>
#include <shardkit/zero/registry.hpp>
#include <shardkit/zero/space_ops.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! Elements of the staging block initialisers fill (4 MiB of fp32).
inline constexpr std::size_t initial_values_block_elems = std::size_t{1} << 20;

//! Initial values of every parameter into the parameters' and the optimizer's buffers: from
//! the registered tensor (broadcast from rank 0 first when asked), or from the initialiser,
//! block by block through one host staging block (ledger: io_staging). Under ZeRO-3 a rank
//! initialises only the pieces it owns, so it never holds more than its shard and the block.
template <bool Sharded, class Comm, class Params, class Optimizer, class Space>
void load_initial_values(const model_spec& model, const param_registry& registry,
                         const flat_layout& layout, std::size_t shard_index, Comm& world,
                         bool broadcast_init, Params& params, Optimizer& optimizer,
                         const space_ops<Space>& ops, collective_log& log, memory_ledger& memory) {
  std::vector<float> tmp;
  buffer<float, host_space> block;
  for (std::size_t i = 0; i < model.size(); ++i) {
    const auto& mp = model[i];
    const std::size_t n = registry.numel(i);
    if (n == 0) continue;
    if (mp.initial) {
      const void* src = mp.initial->data;
      dtype type = mp.initial->type;
      if (broadcast_init && world.size() > 1) {
        tmp.resize(n);
        host::convert(src, type, tmp.data(), dtype::f32, n);
        ops.broadcast_host(world, tmp.data(), n, 0);
        log.record(world, collective::broadcast, n, sizeof(float), i);
        src = tmp.data();
        type = dtype::f32;
      }
      params.load(i, src, type);
      optimizer.load(i, src, type);
    } else if (mp.init) {
      if (block.empty()) {
        block = buffer<float, host_space>(initial_values_block_elems, &memory,
                                          memory_category::io_staging);
      }
      auto fill = [&](std::size_t offset, std::size_t count) {
        for (std::size_t b = offset; b < offset + count; b += block.size()) {
          const std::size_t len = std::min(block.size(), offset + count - b);
          mp.init(b, std::span<float>(block.data(), len));
          params.load(i, b, len, block.data(), dtype::f32);
          optimizer.load(i, b, len, block.data(), dtype::f32);
        }
      };
      if constexpr (Sharded) {
        for (const auto& pc : layout.pieces_of(i)) {
          if (static_cast<std::size_t>(pc.rank) == shard_index) fill(pc.param_offset, pc.count);
        }
      } else {
        fill(0, n);  // every rank holds the whole working parameters anyway
      }
    }
  }
}

SHARDKIT_NAMESPACE_END
