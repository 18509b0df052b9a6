//! \file core/hash.hpp
//! A stable 64-bit hash (FNV-1a over a fixed little-endian encoding): the same value on every
//! platform, compiler and run, for fingerprints that ranks compare with each other and that
//! checkpoints store. Not a checksum of data files (io/checksum.hpp is) and not cryptographic.
#pragma once

#include <shardkit/config.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

SHARDKIT_CORE_NAMESPACE_BEGIN

class stable_hash {
 public:
  //! Adds `n` bytes.
  constexpr stable_hash& bytes(const unsigned char* p, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
      h_ ^= p[i];
      h_ *= 0x100000001b3ull;
    }
    return *this;
  }
  //! Adds an unsigned integer as 8 little-endian bytes.
  constexpr stable_hash& u64(std::uint64_t v) noexcept {
    unsigned char b[8] = {};
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    return bytes(b, 8);
  }
  //! Adds a string: its length, then its bytes (so "ab","c" and "a","bc" differ).
  constexpr stable_hash& str(std::string_view s) noexcept {
    u64(s.size());
    for (const char c : s) {
      h_ ^= static_cast<unsigned char>(c);
      h_ *= 0x100000001b3ull;
    }
    return *this;
  }
  //! Adds a float by its bits (so -0 and 0, and every NaN payload, differ).
  stable_hash& f32(float f) noexcept {
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u64(u);
  }
  constexpr std::uint64_t value() const noexcept { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ull;
};

SHARDKIT_CORE_NAMESPACE_END
