//! \file io/checksum.hpp
//! XXH64 checksums of checkpoint data (Debian's libxxhash-dev, used header-only), streaming or
//! in one call, and their fixed 16-digit hex form for manifests.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

SHARDKIT_NAMESPACE_BEGIN
namespace io {

//! The XXH64 (seed 0) of `n` bytes.
inline std::uint64_t xxh64(const void* data, std::size_t n) noexcept {
  return XXH64(data, n, 0);
}

//! XXH64 over bytes given piece by piece (the same value as xxh64 of their concatenation).
class xxh64_stream {
 public:
  xxh64_stream() noexcept { XXH64_reset(&state_, 0); }
  void update(const void* data, std::size_t n) noexcept { XXH64_update(&state_, data, n); }
  std::uint64_t digest() const noexcept { return XXH64_digest(&state_); }

 private:
  XXH64_state_t state_{};
};

//! 16 lower-case hex digits.
inline std::string to_hex(std::uint64_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = digits[v & 0xf];
  return s;
}

//! The value of 16 hex digits; format_error naming `what` otherwise.
inline std::uint64_t from_hex(std::string_view s, std::string_view what) {
  if (s.size() != 16) {
    throw format_error(shardkit::detail::concat(what, ": '", s, "' is not 16 hex digits"));
  }
  std::uint64_t v = 0;
  for (const char c : s) {
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    if (d < 0) throw format_error(shardkit::detail::concat(what, ": '", s, "' is not hex"));
    v = v << 4 | static_cast<std::uint64_t>(d);
  }
  return v;
}

}  // namespace io
SHARDKIT_NAMESPACE_END
