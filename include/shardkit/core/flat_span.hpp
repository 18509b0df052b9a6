//! \file core/flat_span.hpp
//! A flat buffer of a flat_layout together with the coordinates it is laid out in: the *full*
//! buffer (every group at its padded size N·S_g, N·S elements in all) or one rank's *shard*
//! buffer (its slice of every group, S elements). The ZeRO components hand buffers to each other
//! this way, so that the sharded optimizer can step a gradient that is a full buffer (stages 0
//! and 1, or the caller's own all-reduce) or a shard (stages 2 and 3) without being told which
//! stage it serves.
//!
//!     opt.step(shardkit::flat_span<const bf16>::full(grads.data(), grads.size()), ...);
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/layout.hpp>
#include <shardkit/core/memory.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

SHARDKIT_CORE_NAMESPACE_BEGIN

//! The coordinates of a flat buffer (see the file comment).
enum class flat_coords : std::uint8_t {
  full,   //!< N·S elements: group g at [offset_g, offset_g + N·S_g)
  shard,  //!< S elements: one rank's slice of every group, in group order
};

constexpr const char* name(flat_coords c) noexcept {
  return c == flat_coords::full ? "full" : "shard";
}

//! A non-owning view of a flat buffer in `Space` and its coordinates.
template <class T, memory_space Space = host_space>
struct flat_span {
  using value_type = T;
  using memory_space = Space;

  T* data = nullptr;
  std::size_t size = 0;
  flat_coords coords = flat_coords::full;

  //! The full buffer: N·S elements (layout.padded_numel()).
  static constexpr flat_span full(T* d, std::size_t n) noexcept {
    return {d, n, flat_coords::full};
  }
  //! One rank's shard: S elements (layout.shard_numel()).
  static constexpr flat_span shard(T* d, std::size_t n) noexcept {
    return {d, n, flat_coords::shard};
  }

  //! A span of const elements from a span of mutable ones.
  template <class U>
  requires std::is_same_v<const U, T>
  constexpr flat_span(flat_span<U, Space> o) noexcept
      : data(o.data), size(o.size), coords(o.coords) {}
  constexpr flat_span() = default;
  constexpr flat_span(T* d, std::size_t n, flat_coords c) noexcept : data(d), size(n), coords(c) {}

  //! Where piece `p` (of layout.pieces(r)) starts in this buffer.
  constexpr std::size_t offset_of(const flat_layout::piece& p) const noexcept {
    return coords == flat_coords::full ? p.full_offset : p.shard_offset;
  }

  //! Raises invalid_argument unless the size matches these coordinates of `layout`; `who` and
  //! `what` name the call and the buffer in the message.
  void check(const flat_layout& layout, const char* who, const char* what) const {
    const std::size_t want =
        coords == flat_coords::full ? layout.padded_numel() : layout.shard_numel();
    if (size != want) {
      core_detail::raise(who, ": the ", what, " buffer in ", name(coords), " coordinates has ",
                         size, " elements, expected ", want,
                         coords == flat_coords::full ? " (N·S, layout.padded_numel())"
                                                     : " (S, layout.shard_numel())");
    }
    if (size != 0 && data == nullptr) {
      core_detail::raise(who, ": the ", what, " buffer is null but should hold ", size,
                         " elements");
    }
  }
};

SHARDKIT_CORE_NAMESPACE_END
