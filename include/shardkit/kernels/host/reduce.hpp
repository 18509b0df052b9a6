//! \file kernels/host/reduce.hpp
//! The rank-ordered reduction behind every shardkit communicator on the host:
//!     out[i] = in[0][i] ∘ in[1][i] ∘ ... ∘ in[k-1][i]
//! always in this order, so the result is the same bit pattern whatever the thread timing or the
//! transport. fp32, bf16 and fp16 accumulate in fp32 and round once; double in double; integers
//! in their own type (sums of signed integers wrap in two's complement, as unsigned ones do).
//! `out` may be one of the inputs (in-place reductions).
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/reduce_op.hpp>
#include <shardkit/kernels/host/dispatch.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/host/simd_storage.hpp>
#include <shardkit/kernels/host/streaming.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace host {

namespace detail {
//! a + b; for signed integers in two's complement, wrapping on overflow like unsigned and like
//! NCCL's integer sums (a plain signed + would be undefined behaviour).
template <class T>
constexpr T add_wrapping(T a, T b) noexcept {
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return static_cast<T>(a + b);
  }
}

//! Calls run(static_cast<T*>(nullptr)) with T the element type `t` names.
template <class F>
void with_element_type(dtype t, F&& run) {
  switch (t) {
    case dtype::f32:
      return run(static_cast<float*>(nullptr));
    case dtype::f64:
      return run(static_cast<double*>(nullptr));
    case dtype::bf16:
      return run(static_cast<bf16*>(nullptr));
    case dtype::f16:
      return run(static_cast<fp16*>(nullptr));
    case dtype::i32:
      return run(static_cast<std::int32_t*>(nullptr));
    case dtype::i64:
      return run(static_cast<std::int64_t*>(nullptr));
    case dtype::u8:
      return run(static_cast<std::uint8_t*>(nullptr));
    case dtype::u32:
      return run(static_cast<std::uint32_t*>(nullptr));
    case dtype::u64:
      return run(static_cast<std::uint64_t*>(nullptr));
  }
}

template <class T, reduce_op Op>
struct reduce_kernel {
  template <int W>
  SHARDKIT_FORCEINLINE static simd::vf<W> combine(simd::vf<W> acc, simd::vf<W> x) {
    if constexpr (Op == reduce_op::sum || Op == reduce_op::avg) {
      return acc + x;
    } else {
      const auto take = Op == reduce_op::max ? x > acc : x < acc;
      return simd::select(take | isnan(x), x, acc);  // NaN wins, as in IEEE max/min of NCCL
    }
  }

  template <class Isa>
  SHARDKIT_FORCEINLINE static simd::vf<Isa::width> one(const T* const* in, std::size_t k,
                                                       std::size_t i, std::size_t len) {
    const bool full = len == Isa::width;
    auto acc = full ? simd::load<Isa>(in[0] + i) : simd::load_partial<Isa>(in[0] + i, len);
    for (std::size_t q = 1; q < k; ++q) {
      acc =
          combine(acc, full ? simd::load<Isa>(in[q] + i) : simd::load_partial<Isa>(in[q] + i, len));
    }
    if constexpr (Op == reduce_op::avg) acc = acc / static_cast<float>(k);
    return acc;
  }

  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(const T* const* in, std::size_t k, T* out, std::size_t n) {
    constexpr std::size_t L = Isa::width;
    std::size_t i = 0;
    for (; i + L <= n; i += L) simd::store<Isa>(out + i, one<Isa>(in, k, i, L));
    if (i < n) simd::store_partial<Isa>(out + i, one<Isa>(in, k, i, n - i), n - i);
  }
};

//! reduce_kernel's result written to m outputs in the same pass (reduce_ordered_to).
template <class T, reduce_op Op>
struct reduce_to_kernel {
  using one_kernel = reduce_kernel<T, Op>;

  //! One vector's result to every output, converted to T once.
  template <class Isa, bool Stream>
  SHARDKIT_FORCEINLINE static void put(T* const* out, std::size_t m, std::size_t i,
                                       simd::vf<Isa::width> x) {
    const auto s = simd::stored<Isa, T>(x);
    for (std::size_t p = 0; p < m; ++p) {
      if constexpr (Stream) {
        simd::store_stored_stream<Isa>(out[p] + i, s);
      } else {
        simd::store_stored(out[p] + i, s);
      }
    }
  }

  //! Elements i to n (fewer than a vector), through the partial-vector code.
  template <class Isa>
  SHARDKIT_FORCEINLINE static void tail(const T* const* in, std::size_t k, T* const* out,
                                        std::size_t m, std::size_t i, std::size_t n) {
    if (i >= n) return;
    const auto x = one_kernel::template one<Isa>(in, k, i, n - i);
    for (std::size_t p = 0; p < m; ++p) simd::store_partial<Isa>(out[p] + i, x, n - i);
  }

  //! Two vectors at a time (more loads in flight than one): every input's two vectors are
  //! loaded before any output is stored, so an output that is also an input reads its old
  //! values.
  template <class Isa, bool Stream>
  SHARDKIT_FORCEINLINE static void body(const T* const* in, std::size_t k, T* const* out,
                                        std::size_t m, std::size_t i, std::size_t n) {
    constexpr std::size_t L = Isa::width;
    for (; i + 2 * L <= n; i += 2 * L) {
      const auto a = one_kernel::template one<Isa>(in, k, i, L);
      const auto b = one_kernel::template one<Isa>(in, k, i + L, L);
      put<Isa, Stream>(out, m, i, a);
      put<Isa, Stream>(out, m, i + L, b);
    }
    for (; i + L <= n; i += L)
      put<Isa, Stream>(out, m, i, one_kernel::template one<Isa>(in, k, i, L));
    tail<Isa>(in, k, out, m, i, n);
  }

  template <class Isa>
  SHARDKIT_FORCEINLINE static void run(const T* const* in, std::size_t k, T* const* out,
                                       std::size_t m, std::size_t n, bool stream) {
    if constexpr (simd::has_stream_stores<Isa>) {
      // Streaming stores need every output aligned to a vector at the same element: the
      // first elements, up to there, go through the partial-vector code.
      constexpr std::size_t vector_bytes = Isa::width * sizeof(T);
      const std::size_t misalign = reinterpret_cast<std::uintptr_t>(out[0]) % vector_bytes;
      bool aligned = stream && misalign % sizeof(T) == 0;
      for (std::size_t p = 1; p < m && aligned; ++p) {
        aligned = reinterpret_cast<std::uintptr_t>(out[p]) % vector_bytes == misalign;
      }
      if (aligned) {
        const std::size_t head = std::min(n, (vector_bytes - misalign) % vector_bytes / sizeof(T));
        tail<Isa>(in, k, out, m, 0, head);
        body<Isa, true>(in, k, out, m, head, n);
        simd::stream_fence();
        return;
      }
    }
    body<Isa, false>(in, k, out, m, 0, n);
  }
};
}  // namespace detail

//! Reduces k arrays of n elements element-wise in the fixed order in[0], in[1], ..., in[k-1].
//! `out` may be one of the inputs (each element is read from every input before it is
//! written); it must not overlap them otherwise.
template <element_type T>
void reduce_ordered(const T* const* in, std::size_t k, T* out, std::size_t n, reduce_op op) {
  if (n == 0 || k == 0) return;
  if constexpr (float_storage<T>) {
    switch (op) {
      case reduce_op::sum:
        return dispatch<detail::reduce_kernel<T, reduce_op::sum>>(in, k, out, n);
      case reduce_op::avg:
        return dispatch<detail::reduce_kernel<T, reduce_op::avg>>(in, k, out, n);
      case reduce_op::max:
        return dispatch<detail::reduce_kernel<T, reduce_op::max>>(in, k, out, n);
      case reduce_op::min:
        return dispatch<detail::reduce_kernel<T, reduce_op::min>>(in, k, out, n);
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      T acc = in[0][i];
      for (std::size_t q = 1; q < k; ++q) {
        const T x = in[q][i];
        switch (op) {
          case reduce_op::sum:
          case reduce_op::avg:
            acc = detail::add_wrapping(acc, x);
            break;
          case reduce_op::max:
            acc = (x > acc || x != x) ? x : acc;
            break;
          case reduce_op::min:
            acc = (x < acc || x != x) ? x : acc;
            break;
        }
      }
      if (op == reduce_op::avg) acc = static_cast<T>(acc / static_cast<T>(k));
      out[i] = acc;
    }
  }
}

//! Reduces k arrays of n elements as reduce_ordered does (the same bits) and writes the result
//! to each of the m arrays `out[0]`, ..., `out[m-1]` in the same pass: the thread
//! communicator's all-reduce, whose rank writes its reduced chunk into every rank's output,
//! reads each input once and each output never. An output may be one of the inputs (in-place
//! all-reduces); outputs and inputs must not overlap otherwise. `how` says whether the outputs
//! are written with streaming stores (kernels/host/streaming.hpp; stores::automatic: when no
//! output is an input and the (k + m) * n elements read and written reach
//! host::streaming_threshold()); the bits are the same.
template <element_type T>
void reduce_ordered_to(const T* const* in, std::size_t k, T* const* out, std::size_t m,
                       std::size_t n, reduce_op op, stores how = stores::cached) {
  if (n == 0 || k == 0 || m == 0) return;
  if constexpr (float_storage<T>) {
    // An output that is also an input was just read into the cache, line by line: a streaming
    // store would save no read there and would evict what the next pass reads.
    bool in_place = false;
    for (std::size_t p = 0; p < m && !in_place; ++p) {
      for (std::size_t q = 0; q < k && !in_place; ++q) in_place = out[p] == in[q];
    }
    const bool stream =
        how == stores::streaming || (!in_place && streams(how, (k + m) * n * sizeof(T)));
    switch (op) {
      case reduce_op::sum:
        return dispatch<detail::reduce_to_kernel<T, reduce_op::sum>>(in, k, out, m, n, stream);
      case reduce_op::avg:
        return dispatch<detail::reduce_to_kernel<T, reduce_op::avg>>(in, k, out, m, n, stream);
      case reduce_op::max:
        return dispatch<detail::reduce_to_kernel<T, reduce_op::max>>(in, k, out, m, n, stream);
      case reduce_op::min:
        return dispatch<detail::reduce_to_kernel<T, reduce_op::min>>(in, k, out, m, n, stream);
    }
  } else {
    // double and integers (scalar): block by block into a buffer on the stack, then copied to
    // every output while the block is in cache. Every input's block is read before any output's
    // is written, so in-place is safe.
    constexpr std::size_t block = 4096 / sizeof(T);
    std::vector<const T*> piece(k);
    for (std::size_t b = 0; b < n; b += block) {
      const std::size_t len = std::min(block, n - b);
      T tmp[block];
      for (std::size_t q = 0; q < k; ++q) piece[q] = in[q] + b;
      reduce_ordered(piece.data(), k, tmp, len, op);
      for (std::size_t p = 0; p < m; ++p) std::memcpy(out[p] + b, tmp, len * sizeof(T));
    }
  }
}

//! Elements per thread below which the parallel reduction uses fewer threads.
inline constexpr std::size_t reduce_grain = 65536;

//! reduce_ordered on the threads of `exec` (nullptr: the caller's only): the same bits, each
//! thread reducing a contiguous piece of every input in the same rank order. As there, `out`
//! may be one of the inputs.
template <element_type T>
void parallel_reduce_ordered(executor* exec, const T* const* in, std::size_t k, T* out,
                             std::size_t n, reduce_op op) {
  if (n == 0 || k == 0) return;
  parallel_for(exec, n, reduce_grain, [&](std::size_t b, std::size_t e) {
    if (b == 0 && e == n) return reduce_ordered(in, k, out, n, op);
    std::vector<const T*> piece(k);
    for (std::size_t q = 0; q < k; ++q) piece[q] = in[q] + b;
    reduce_ordered(piece.data(), k, out + b, e - b, op);
  });
}

//! reduce_ordered for an element type known at run time: `in` holds k pointers to arrays of n
//! elements of type `t`. Every communicator reduces through this one function, so they agree
//! bit for bit.
inline void parallel_reduce_ordered(executor* exec, dtype t, const void* const* in, std::size_t k,
                                    void* out, std::size_t n, reduce_op op) {
  auto run = [&]<class T>(T*) {
    parallel_reduce_ordered(exec, reinterpret_cast<const T* const*>(in), k, static_cast<T*>(out), n,
                            op);
  };
  detail::with_element_type(t, run);
}

//! reduce_ordered_to for an element type known at run time: `in` holds k pointers to arrays of
//! n elements of type `t`, `out` m pointers to arrays of n elements of type `t`.
inline void reduce_ordered_to(dtype t, const void* const* in, std::size_t k, void* const* out,
                              std::size_t m, std::size_t n, reduce_op op,
                              stores how = stores::cached) {
  auto run = [&]<class T>(T*) {
    reduce_ordered_to(reinterpret_cast<const T* const*>(in), k, reinterpret_cast<T* const*>(out), m,
                      n, op, how);
  };
  detail::with_element_type(t, run);
}

//! reduce_ordered for an element type known at run time (see parallel_reduce_ordered): `in`
//! holds k pointers to arrays of n elements of type `t`. Every communicator reduces through this
//! one function, so they agree bit for bit.
inline void reduce_ordered(dtype t, const void* const* in, std::size_t k, void* out, std::size_t n,
                           reduce_op op) {
  parallel_reduce_ordered(nullptr, t, in, k, out, n, op);
}

}  // namespace host
SHARDKIT_NAMESPACE_END
