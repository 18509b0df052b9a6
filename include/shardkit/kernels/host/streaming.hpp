//! \file kernels/host/streaming.hpp
//! When the host casts write with streaming (non-temporal) stores.
//!
//! An ordinary store to a line that is not in the cache first reads the line from memory
//! (read-for-ownership): a cast that writes B bytes moves 2B bytes of memory traffic for its
//! output. A streaming store writes the whole line without reading it and without displacing
//! the cache. That pays when the output would leave the cache before the next pass (a
//! collective, the optimizer step) reads it, and costs that pass a trip to memory when it
//! would not have. So a cast streams when the bytes one thread reads and writes reach
//! host::streaming_threshold(): by default 1/4 of one CPU's share of the last-level cache.
//!
//! The quarter is measured, not derived. On an Intel Xeon whose VM reports a 480 MiB L3 for
//! 2 CPUs (a 240 MiB share), a cast followed by a pass that reads its output ran faster with
//! ordinary stores up to about 50 MB read and written per thread (fp32 -> bf16 at 8Mi
//! elements), about as fast either way at 75 MB (12Mi), and faster with streaming stores from
//! 100 MB (16Mi), on 1 and on 2 threads (benchmarks/convert.cpp's cast_read pairs measure it);
//! the share reported is not what one CPU of a shared machine gets. glibc's memcpy switches to
//! streaming at 3/4 of the share, but below that it copies with `rep movsb`, which on that
//! machine did not pay for reading the lines it overwrites; a cast's vector stores do.
//!
//! The streaming path writes the same bits (the value of a store never depends on its kind);
//! it exists in the AVX2 and AVX-512 builds compiled by GCC (simd::has_stream_stores).
//!
//! The environment variable `SHARDKIT_STREAMING_BYTES` sets the threshold, in bytes (a
//! non-negative integer: 0 streams every cast that can), overriding the cache size; tests and
//! benchmarks set it in-process with host::scoped_streaming_threshold.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>
#include <thread>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

SHARDKIT_NAMESPACE_BEGIN
namespace host {

//! How a cast writes its output.
enum class stores {
  automatic,  //!< streaming when the call's bytes reach streaming_threshold(), else cached
  cached,     //!< ordinary stores: the output stays in the cache
  streaming,  //!< streaming stores where the build has them (the output goes to memory)
};

namespace detail {

//! How many CPUs a sysfs cpu list ("0-3,8,10-11") names; 0 if it cannot be read.
inline std::size_t count_cpu_list(const std::string& list) {
  std::size_t count = 0;
  std::size_t pos = 0;
  while (pos < list.size()) {
    const std::size_t end = std::min(list.find(',', pos), list.size());
    const std::string item = list.substr(pos, end - pos);
    const std::size_t dash = item.find('-');
    char* tail = nullptr;
    const unsigned long first = std::strtoul(item.c_str(), &tail, 10);
    if (tail == item.c_str()) return 0;
    if (dash == std::string::npos) {
      ++count;
    } else {
      const unsigned long last = std::strtoul(item.c_str() + dash + 1, &tail, 10);
      if (last < first) return 0;
      count += last - first + 1;
    }
    pos = end + 1;
  }
  return count;
}

//! The bytes of last-level cache one CPU can count on: the L3 (else the L2) that CPU 0 sees,
//! divided among the CPUs that share it (Linux sysfs; else sysconf; else 0 when unknown).
inline std::size_t llc_share_bytes() {
  std::size_t best_level = 0, bytes = 0, sharing = 1;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level_file(dir + "/level"), type_file(dir + "/type"), size_file(dir + "/size"),
        shared_file(dir + "/shared_cpu_list");
    std::size_t level = 0;
    std::string type, size, shared;
    if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) continue;
    if (type == "Instruction" || level < best_level) continue;
    char* tail = nullptr;
    std::size_t b = std::strtoull(size.c_str(), &tail, 10);
    if (*tail == 'K') b <<= 10;
    if (*tail == 'M') b <<= 20;
    std::getline(shared_file, shared);
    best_level = level;
    bytes = b;
    sharing = std::max<std::size_t>(1, count_cpu_list(shared));
  }
#if defined(_SC_LEVEL3_CACHE_SIZE)
  if (bytes == 0) {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) {
      bytes = static_cast<std::size_t>(l3);
      sharing = std::max(1u, std::thread::hardware_concurrency());
    }
  }
#endif
  return bytes / sharing;
}

//! The threshold when neither the environment nor a scope sets one: 1/4 of a CPU's share of
//! the last-level cache, or 8 MiB when the cache size is unknown.
inline std::size_t default_streaming_threshold() {
  const std::size_t share = llc_share_bytes();
  return share == 0 ? std::size_t{8} << 20 : share / 4;
}

//! SHARDKIT_STREAMING_BYTES's threshold, else the default. Raises invalid_argument for a value
//! that is not a non-negative integer.
inline std::size_t streaming_threshold_from_environment() {
  const char* e = std::getenv("SHARDKIT_STREAMING_BYTES");
  if (e == nullptr || *e == '\0') return default_streaming_threshold();
  const std::string s = e;
  std::size_t used = 0;
  unsigned long long v = 0;
  bool ok = s.find_first_not_of("0123456789") == std::string::npos;
  if (ok) {
    try {
      v = std::stoull(s, &used);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  if (!ok || used != s.size()) {
    ::shardkit::detail::raise("SHARDKIT_STREAMING_BYTES=\"", s,
                              "\": expected a non-negative integer number of bytes (the size of "
                              "a cast from which its output is written with streaming stores)");
  }
  return static_cast<std::size_t>(v);
}

inline constexpr std::size_t unresolved_threshold = ~std::size_t{0};
//! The resolved threshold (unresolved_threshold: not read yet).
inline std::atomic<std::size_t> streaming_threshold_value{unresolved_threshold};
//! The threshold a host::scoped_streaming_threshold sets (unresolved_threshold: none).
inline std::atomic<std::size_t> forced_streaming_threshold{unresolved_threshold};

}  // namespace detail

//! The bytes (read plus written) from which a cast with stores::automatic writes with
//! streaming stores: host::scoped_streaming_threshold's, else SHARDKIT_STREAMING_BYTES's, else
//! 1/4 of one CPU's share of the last-level cache. Raises invalid_argument when
//! SHARDKIT_STREAMING_BYTES is not a non-negative integer.
inline std::size_t streaming_threshold() {
  const std::size_t forced = detail::forced_streaming_threshold.load(std::memory_order_relaxed);
  if (forced != detail::unresolved_threshold) return forced;
  std::size_t v = detail::streaming_threshold_value.load(std::memory_order_relaxed);
  if (v == detail::unresolved_threshold) {
    v = detail::streaming_threshold_from_environment();  // raises; not cached then
    detail::streaming_threshold_value.store(v, std::memory_order_relaxed);
  }
  return v;
}

//! Whether a cast that reads and writes `bytes` in all streams its output under `s`.
inline bool streams(stores s, std::size_t bytes) {
  return s == stores::streaming || (s == stores::automatic && bytes >= streaming_threshold());
}

//! Sets streaming_threshold() while it lives (tests, benchmarks). Not for use while other
//! threads run host casts. Scopes nest.
class scoped_streaming_threshold {
 public:
  explicit scoped_streaming_threshold(std::size_t bytes)
      : previous_(detail::forced_streaming_threshold.load()) {
    if (bytes == detail::unresolved_threshold) {
      ::shardkit::detail::raise("host::scoped_streaming_threshold: ", bytes,
                                " bytes is reserved; pass at most ", bytes - 1);
    }
    detail::forced_streaming_threshold.store(bytes);
  }
  scoped_streaming_threshold(const scoped_streaming_threshold&) = delete;
  scoped_streaming_threshold& operator=(const scoped_streaming_threshold&) = delete;
  ~scoped_streaming_threshold() { detail::forced_streaming_threshold.store(previous_); }

 private:
  std::size_t previous_;
};

}  // namespace host
SHARDKIT_NAMESPACE_END
