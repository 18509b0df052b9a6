//! \file kernels/cuda/convert.cuh
//! Element-wise kernels over device arrays, the device twins of kernels/host/convert.hpp: casts
//! between fp32/bf16/fp16 (round to nearest even, NaN payloads kept, as core/dtype.hpp),
//! accumulation (acc += x in fp32, rounded once), and `batched_copy`: flatten, unflatten and
//! pad many tensors in one launch: same-type copies on cub::DeviceMemcpy::Batched (copies and
//! paddings in one call); converting ones, or same-type ones when asked for, from a device table
//! of (source, destination, count, zero fill) entries cut into chunks, with the cast on the way.
//! That kernel moves 16-byte words for same-type copies, also when source and destination are
//! misaligned against each other (shifted loads, launch.hpp); converting copies between arrays
//! that cannot be aligned together run scalar. Casts and accumulation run on
//! cub::DeviceTransform by default (kernels/cuda/transform.cuh).
//!
//!     // flatten three tensors into a padded flat buffer, then back:
//!     using copy = shardkit::gpu::batched_copy<bf16, bf16>;
//!     std::vector<copy::item> in = {{w0, flat + 0, n0}, {b0, flat + n0, n1},
//!                                   {w1, flat + n0 + n1, n2, padding}};
//!     copy flatten(in, stream);          // plans and uploads the table once
//!     flatten.run(stream);               // every step: one launch
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/cuda.cuh>
#include <shardkit/core/cuda_memory.cuh>
#include <shardkit/core/device.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/kernels/cuda/common.cuh>
#include <shardkit/kernels/cuda/launch.hpp>
#include <shardkit/kernels/cuda/transform.cuh>

#include <cub/device/device_memcpy.cuh>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace gpu {

namespace detail {

template <class S, class D>
inline constexpr int copy_pack = pack_of<std::min(sizeof(S), sizeof(D))>;

//! One pack's registers of a copy from S to D: raw bits when the types agree, floats otherwise.
template <class S, class D, int E>
struct copy_regs {
  float v[E];
};
template <class T, int E>
struct copy_regs<T, T, E> {
  uint4 w[E * sizeof(T) / 16];
};

//! Copies (converting) elements [begin, end) of src to dst, U packs per thread per iteration.
template <class S, class D>
__device__ SHARDKIT_FORCEINLINE void copy_range(const S* src, D* dst, const vector_split& split,
                                                std::size_t begin, std::size_t end, std::size_t tid,
                                                std::size_t threads) {
  constexpr int E = copy_pack<S, D>;
  using regs = copy_regs<S, D, E>;
  for_each_element_ilp<E, copy_policy.unroll, regs>(
      split, begin, end, tid, threads,
      [&](std::size_t i) { dst[i] = from_float<D>(to_float(src[i])); },
      [&](std::size_t i, regs& r) {
        if constexpr (std::is_same_v<S, D>) {
#pragma unroll
          for (std::size_t j = 0; j < sizeof(r.w) / 16; ++j) {
            r.w[j] = load16(src + i + j * (16 / sizeof(S)));
          }
        } else {
          load_pack<S, E>(src + i, r.v);
        }
      },
      [&](std::size_t i, const regs& r) {
        if constexpr (std::is_same_v<S, D>) {
#pragma unroll
          for (std::size_t j = 0; j < sizeof(r.w) / 16; ++j) {
            store16(dst + i + j * (16 / sizeof(D)), r.w[j]);
          }
        } else {
          store_pack<D, E>(dst + i, r.v);
        }
      });
}

template <class S, class D>
__global__ void __launch_bounds__(copy_policy.threads, copy_policy.blocks_per_sm)
    convert_kernel(const S* in, D* out, std::size_t n, vector_split split) {
  copy_range(in, out, split, 0, n, global_thread(), global_threads());
}

template <class S, class D, int E>
struct accumulate_regs {
  float acc[E];
  float x[E];
};

template <class S, class D>
__global__ void __launch_bounds__(copy_policy.threads, copy_policy.blocks_per_sm)
    accumulate_kernel(const S* in, D* acc, std::size_t n, vector_split split) {
  constexpr int E = copy_pack<S, D>;
  using regs = accumulate_regs<S, D, E>;
  for_each_element_ilp<E, copy_policy.unroll, regs>(
      split, 0, n, global_thread(), global_threads(),
      [&](std::size_t i) { acc[i] = from_float<D>(to_float(acc[i]) + to_float(in[i])); },
      [&](std::size_t i, regs& r) {
        load_pack<D, E>(acc + i, r.acc);
        load_pack<S, E>(in + i, r.x);
      },
      [&](std::size_t i, regs& r) {
#pragma unroll
        for (int e = 0; e < E; ++e) r.acc[e] = r.acc[e] + r.x[e];
        store_pack<D, E>(acc + i, r.acc);
      });
}

//! Copies elements [begin, end) of a same-type shifted copy (launch.hpp, plan_shifted_copy):
//! aligned 16-byte stores to dst, each from two aligned 16-byte loads of src combined with a
//! funnel shift; Q = shift / 4 (compile time, so the words stay in registers). Raw bits: every
//! pattern, NaN payloads included, arrives unchanged, as in copy_range.
template <int Q, class T>
__device__ SHARDKIT_FORCEINLINE void copy_range_shifted_q(const T* src, T* dst,
                                                          const vector_split& split, unsigned shift,
                                                          std::size_t begin, std::size_t end,
                                                          std::size_t tid, std::size_t threads) {
  constexpr int E = static_cast<int>(16 / sizeof(T));
  const unsigned bits = (shift % 4u) * 8u;
  for_each_element_ilp<E, copy_policy.unroll, words4>(
      split, begin, end, tid, threads, [&](std::size_t i) { dst[i] = src[i]; },
      [&](std::size_t i, words4& r) {
        const char* at = reinterpret_cast<const char*>(src + i) - shift;  // 16-byte aligned
        const uint4 lo = load16(at);
        const uint4 hi = load16(at + 16);
        r = shifted_pack<Q>(words4{{lo.x, lo.y, lo.z, lo.w}}, words4{{hi.x, hi.y, hi.z, hi.w}},
                            bits);
      },
      [&](std::size_t i, const words4& r) {
        store16(dst + i, make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]));
      });
}

template <class T>
__device__ SHARDKIT_FORCEINLINE void copy_range_shifted(const T* src, T* dst,
                                                        const vector_split& split, unsigned shift,
                                                        std::size_t begin, std::size_t end,
                                                        std::size_t tid, std::size_t threads) {
  switch (shift / 4u) {
    case 0:
      return copy_range_shifted_q<0>(src, dst, split, shift, begin, end, tid, threads);
    case 1:
      return copy_range_shifted_q<1>(src, dst, split, shift, begin, end, tid, threads);
    case 2:
      return copy_range_shifted_q<2>(src, dst, split, shift, begin, end, tid, threads);
    default:
      return copy_range_shifted_q<3>(src, dst, split, shift, begin, end, tid, threads);
  }
}

//! One entry of a batched copy as the kernel sees it.
template <class S, class D>
struct copy_entry {
  const S* src;
  D* dst;
  std::size_t count;  // converted elements; zeros follow up to the chunk's end
  vector_split split;
  unsigned shift;  // same-type copies only: != 0 for a shifted copy (plan_shifted_copy)
};

template <class S, class D>
__global__ void __launch_bounds__(copy_policy.threads, copy_policy.blocks_per_sm)
    batched_copy_kernel(const copy_entry<S, D>* entries, const work_chunk* chunks,
                        std::uint32_t chunk_count) {
  for (std::uint32_t c = blockIdx.x; c < chunk_count; c += gridDim.x) {
    const work_chunk ch = chunks[c];
    const copy_entry<S, D> t = entries[ch.run];
    const std::size_t copy_end = ch.end < t.count ? ch.end : t.count;
    if (ch.begin < copy_end) {
      if constexpr (std::is_same_v<S, D>) {
        if (t.shift != 0) {
          copy_range_shifted(t.src, t.dst, t.split, t.shift, ch.begin, copy_end, threadIdx.x,
                             blockDim.x);
        } else {
          copy_range(t.src, t.dst, t.split, ch.begin, copy_end, threadIdx.x, blockDim.x);
        }
      } else {
        copy_range(t.src, t.dst, t.split, ch.begin, copy_end, threadIdx.x, blockDim.x);
      }
    }
    const std::size_t zero_begin = ch.begin > t.count ? ch.begin : t.count;
    for (std::size_t i = zero_begin + threadIdx.x; i < ch.end; i += blockDim.x) {
      t.dst[i] = from_float<D>(0.0f);
    }
  }
}

}  // namespace detail

//! out[i] = in[i] converted (exact widening, or round to nearest even), i < n, on `stream`. The
//! same contract as host::convert; a same-type copy is a cudaMemcpyAsync.
template <float_storage S, float_storage D>
void convert(const S* in, D* out, std::size_t n, device_stream stream,
             elementwise_path path = default_elementwise_path) {
  if (n == 0) return;
  if constexpr (std::is_same_v<S, D>) {
    copy_bytes_async(out, in, n * sizeof(S), stream);
  } else if (path == elementwise_path::cub_transform) {
    convert_transform(in, out, n, stream);
  } else {
    const vector_split split = plan_vector_split({ref(in), ref(out)}, n);
    const std::size_t items = split.vectorised ? split.packs + split.pack : n;
    detail::launch(&detail::convert_kernel<S, D>, "gpu::convert",
                   detail::grid_for(items, copy_policy), copy_policy.threads, stream, n, in, out, n,
                   split);
  }
}

//! acc[i] = acc[i] + in[i], computed in fp32 and rounded once to D, on `stream` (as
//! host::accumulate).
template <float_storage S, float_storage D>
void accumulate(const S* in, D* acc, std::size_t n, device_stream stream,
                elementwise_path path = default_elementwise_path) {
  if (n == 0) return;
  if (path == elementwise_path::cub_transform) {
    accumulate_transform(in, acc, n, stream);
    return;
  }
  const vector_split split = plan_vector_split({ref(in), ref(acc)}, n);
  const std::size_t items = split.vectorised ? split.packs + split.pack : n;
  detail::launch(&detail::accumulate_kernel<S, D>, "gpu::accumulate",
                 detail::grid_for(items, copy_policy), copy_policy.threads, stream, n, in, acc, n,
                 split);
}

//! Many converting copies in one launch: flatten tensors into a flat buffer (with zero padding),
//! unflatten it into tensors, or any other list of copies between device arrays. Build it once
//! (it plans chunks and uploads the table, ordered on the given stream), run it as often as
//! needed; the arrays must stay valid. Destinations must not overlap each other or any source.
template <float_storage S, float_storage D>
class batched_copy {
 public:
  //! Copy `count` elements from `src` to `dst` (converting), then write `zero_fill` zeros
  //! after them (padding).
  struct item {
    const S* src = nullptr;
    D* dst = nullptr;
    std::size_t count = 0;
    std::size_t zero_fill = 0;
  };

  batched_copy() = default;

  //! Every copy runs on shardkit's chunked kernel by default: `chunk` elements per block, one
  //! block per chunk, 16-byte words, shifted loads for pairs that cannot be aligned together.
  //! Measured on an H200 (benchmarks/bench_cuda.cu, flatten of 1,024 uneven bf16 tensors at
  //! odd offsets, 256Mi elements): 0.96x a device-to-device copy of the same bytes, against
  //! 0.59x for cub::DeviceMemcpy::Batched, which a same-type table still runs with
  //! elementwise_path::cub_transform (the padding copied from a zeroed block of the table, so
  //! copies and padding are one call).
  batched_copy(std::span<const item> items, device_stream stream,
               elementwise_path path = elementwise_path::handwritten,
               std::size_t chunk = copy_chunk_elems)
      : stream_(stream) {
    if (chunk == 0) ::shardkit::detail::raise("batched_copy: a chunk of 0 elements");
    check_items(items);
    if constexpr (std::is_same_v<S, D>) {
      if (path == elementwise_path::cub_transform) {
        build_memcpy(items, stream);
        return;
      }
    }
    std::vector<detail::copy_entry<S, D>> entries(items.size());
    std::vector<run_extent> extents(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      const item& it = items[i];
      entries[i] = {it.src, it.dst, it.count,
                    plan_vector_split({ref(it.src), ref(it.dst)}, it.count), 0u};
      if constexpr (std::is_same_v<S, D>) {
        // source and destination that cannot be aligned together (tensors at arbitrary element
        // offsets of a flat buffer): 16-byte stores fed by shifted 16-byte loads
        if (!entries[i].split.vectorised) {
          const shifted_copy_split sh =
              plan_shifted_copy(reinterpret_cast<std::uintptr_t>(it.src),
                                reinterpret_cast<std::uintptr_t>(it.dst), it.count, sizeof(S));
          if (sh.split.vectorised) {
            entries[i].split = sh.split;
            entries[i].shift = sh.shift;
          }
        }
      }
      extents[i] = {it.count + it.zero_fill, entries[i].split, 0};
      elements_ += it.count + it.zero_fill;
      bytes_moved_ += it.count * (sizeof(S) + sizeof(D)) + it.zero_fill * sizeof(D);
    }
    const chunk_plan plan = plan_chunks(extents, 1, chunk);
    chunk_count_ = plan.chunks.size();
    if (chunk_count_ == 0) return;
    const std::size_t entry_bytes = (entries.size() * sizeof(entries[0]) + 255) / 256 * 256;
    device_stream_scope scope(stream);
    table_ = buffer<std::byte, cuda_space>(entry_bytes + chunk_count_ * sizeof(work_chunk), nullptr,
                                           memory_category::comm_scratch);
    copy_bytes_async(table_.data(), entries.data(), entries.size() * sizeof(entries[0]), stream);
    copy_bytes_async(table_.data() + entry_bytes, plan.chunks.data(),
                     chunk_count_ * sizeof(work_chunk), stream);
    chunks_ = reinterpret_cast<const work_chunk*>(table_.data() + entry_bytes);
  }

  batched_copy(batched_copy&&) noexcept = default;
  //! Frees this table's memory ordered on the stream it was built on (not the caller's
  //! current stream), then takes over `o`'s.
  batched_copy& operator=(batched_copy&& o) noexcept {
    if (this != &o) {
      {
        device_stream_scope scope(stream_);
        table_.release();
      }
      stream_ = std::exchange(o.stream_, {});
      elements_ = std::exchange(o.elements_, {});
      bytes_moved_ = std::exchange(o.bytes_moved_, {});
      chunk_count_ = std::exchange(o.chunk_count_, {});
      table_ = std::move(o.table_);
      chunks_ = std::exchange(o.chunks_, {});
      memcpy_buffers_ = std::exchange(o.memcpy_buffers_, {});
      memcpy_dst_at_ = std::exchange(o.memcpy_dst_at_, {});
      memcpy_size_at_ = std::exchange(o.memcpy_size_at_, {});
      memcpy_temp_at_ = std::exchange(o.memcpy_temp_at_, {});
      memcpy_temp_bytes_ = std::exchange(o.memcpy_temp_bytes_, {});
    }
    return *this;
  }
  //! Frees the device table ordered on the stream it was built on.
  ~batched_copy() {
    device_stream_scope scope(stream_);
    table_.release();
  }

  //! Enqueues every copy on `stream` (one launch). Runs of one table must not overlap in time
  //! (they write the same destinations; the CUB path also shares its temporary storage).
  //! `max_blocks` caps the kernel's grid (table_grid; 0: one block per chunk).
  void run(device_stream stream, std::size_t max_blocks = 0) const {
    if (memcpy_buffers_ != 0) {
      detail::cub_call("gpu::batched_copy (cub::DeviceMemcpy::Batched)", elements_, [&] {
        std::size_t temp = memcpy_temp_bytes_;
        return cub::DeviceMemcpy::Batched(
            // CUB's temporary storage: scratch of the table, written by every run
            const_cast<std::byte*>(table_.data() + memcpy_temp_at_), temp,
            reinterpret_cast<const void* const*>(table_.data()),
            reinterpret_cast<void* const*>(table_.data() + memcpy_dst_at_),
            reinterpret_cast<const std::size_t*>(table_.data() + memcpy_size_at_),
            static_cast<std::int64_t>(memcpy_buffers_), stream);
      });
      return;
    }
    if (chunk_count_ == 0) return;
    const std::size_t grid = table_grid(chunk_count_, max_blocks);
    detail::launch(&detail::batched_copy_kernel<S, D>, "gpu::batched_copy", grid,
                   copy_policy.threads, stream, elements_,
                   reinterpret_cast<const detail::copy_entry<S, D>*>(table_.data()), chunks_,
                   static_cast<std::uint32_t>(chunk_count_));
  }

  //! Destination elements written per run (copies and zeros).
  std::size_t elements() const noexcept { return elements_; }
  //! Bytes read plus bytes written per run.
  std::size_t bytes_moved() const noexcept { return bytes_moved_; }
  std::size_t chunks() const noexcept { return chunk_count_; }
  //! Buffers of the cub::DeviceMemcpy::Batched call (copies and paddings), 0 on the kernel path.
  std::size_t memcpy_buffers() const noexcept { return memcpy_buffers_; }

 private:
  static constexpr std::size_t align256(std::size_t b) { return (b + 255) / 256 * 256; }

  static void check_items(std::span<const item> items) {
    for (std::size_t i = 0; i < items.size(); ++i) {
      const item& it = items[i];
      if ((it.count != 0 && (it.src == nullptr || it.dst == nullptr)) ||
          (it.zero_fill != 0 && it.dst == nullptr)) {
        ::shardkit::detail::raise("batched_copy: item ", i, " has a null pointer for ", it.count,
                                  " elements and ", it.zero_fill, " zeros");
      }
    }
  }

  // The table of the CUB path: source pointers, destination pointers, byte counts, CUB's
  // temporary storage, and a zeroed block the paddings are copied from (buffer memory is
  // zeroed when allocated, and nothing writes that block).
  void build_memcpy(std::span<const item> items, device_stream stream) {
    std::vector<const void*> src;
    std::vector<void*> dst;
    std::vector<std::size_t> bytes;
    std::size_t most_zeros = 0;
    for (const item& it : items) {
      if (it.count != 0) {
        src.push_back(it.src);
        dst.push_back(it.dst);
        bytes.push_back(it.count * sizeof(S));
      }
      if (it.zero_fill != 0) {
        src.push_back(nullptr);  // the zero block, once its address is known
        dst.push_back(it.dst + it.count);
        bytes.push_back(it.zero_fill * sizeof(D));
        most_zeros = std::max(most_zeros, it.zero_fill * sizeof(D));
      }
      elements_ += it.count + it.zero_fill;
      bytes_moved_ += it.count * (sizeof(S) + sizeof(D)) + it.zero_fill * sizeof(D);
    }
    memcpy_buffers_ = src.size();
    if (memcpy_buffers_ == 0) return;
    std::size_t temp = 0;
    detail::cub_call("gpu::batched_copy (cub::DeviceMemcpy::Batched, sizing)", elements_, [&] {
      return cub::DeviceMemcpy::Batched(nullptr, temp, static_cast<const void* const*>(nullptr),
                                        static_cast<void* const*>(nullptr),
                                        static_cast<const std::size_t*>(nullptr),
                                        static_cast<std::int64_t>(memcpy_buffers_), stream);
    });
    const std::size_t n = memcpy_buffers_;
    memcpy_dst_at_ = align256(n * sizeof(void*));
    memcpy_size_at_ = memcpy_dst_at_ + align256(n * sizeof(void*));
    memcpy_temp_at_ = memcpy_size_at_ + align256(n * sizeof(std::size_t));
    memcpy_temp_bytes_ = temp;
    const std::size_t zeros_at = memcpy_temp_at_ + align256(temp);
    device_stream_scope scope(stream);
    table_ = buffer<std::byte, cuda_space>(zeros_at + most_zeros, nullptr,
                                           memory_category::comm_scratch);
    for (auto& p : src) {
      if (p == nullptr) p = table_.data() + zeros_at;
    }
    copy_bytes_async(table_.data(), src.data(), n * sizeof(void*), stream);
    copy_bytes_async(table_.data() + memcpy_dst_at_, dst.data(), n * sizeof(void*), stream);
    copy_bytes_async(table_.data() + memcpy_size_at_, bytes.data(), n * sizeof(std::size_t),
                     stream);
  }

  device_stream stream_ = nullptr;
  std::size_t elements_ = 0;
  std::size_t bytes_moved_ = 0;
  std::size_t chunk_count_ = 0;
  buffer<std::byte, cuda_space> table_;
  const work_chunk* chunks_ = nullptr;
  std::size_t memcpy_buffers_ = 0;
  std::size_t memcpy_dst_at_ = 0, memcpy_size_at_ = 0, memcpy_temp_at_ = 0, memcpy_temp_bytes_ = 0;
};

}  // namespace gpu
SHARDKIT_NAMESPACE_END
