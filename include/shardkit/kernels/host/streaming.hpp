//! \file kernels/host/streaming.hpp
//! When the host casts write with streaming (non-temporal) stores.
//!
//! An ordinary store to a line that is not in the cache first reads the line from memory
//! (read-for-ownership): a cast that writes B bytes moves 2B bytes of memory traffic for its
//! output. A streaming store writes the whole line without reading it and without displacing
//! the cache. That pays when the output would leave the cache before the next pass (a
//! collective, the optimizer step) reads it, and costs that pass a trip to memory when it
//! would not have. So a cast streams when the bytes one thread reads and writes reach
//! host::streaming_threshold(): by default 1/4 of one CPU's share of the last-level cache, but
//! never less than that whole cache up to 32 MiB.
//!
//! Both terms are measured, not derived (benchmarks/convert.cpp's cast_read pairs: a cast
//! fp32 -> bf16, then a pass that reads its output, with either kind of store):
//!  - On an Intel Xeon whose VM reports a 480 MiB L3 for 2 CPUs (a 240 MiB share), ordinary
//!    stores were faster up to about 50 MB read and written per thread (8Mi elements), about as
//!    fast at 75 MB (12Mi), and streaming stores faster from 100 MB (16Mi), on 1 and on 2
//!    threads: a quarter of the share (60 MiB). The share reported is not what one CPU of a
//!    shared machine gets.
//!  - On an AMD EPYC whose VM reports a 32 MiB L3 for 2 CPUs (a 16 MiB share), ordinary stores
//!    were faster at 12 and 24 MiB (2Mi and 4Mi elements), streaming stores from 48 MiB (8Mi):
//!    about the whole cache. A quarter of the share (4 MiB) sent casts of 6 MiB, which fit in
//!    the cache five times over, to memory, at half the speed of ordinary stores.
//! A small last-level cache is then used whole; the cap keeps a large one shared by many CPUs
//! from holding back streaming for output that cannot stay. glibc's memcpy switches to
//! streaming at 3/4 of the share, but below that it copies with `rep movsb`, which on the Xeon
//! did not pay for reading the lines it overwrites; a cast's vector stores do.
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

//! The last-level cache CPU 0 sees: its bytes, and how many CPUs share it (bytes 0: unknown).
struct llc_info {
  std::size_t bytes = 0;
  std::size_t sharing = 1;
  std::size_t share() const { return bytes / sharing; }
};

//! The L3 (else the L2) that CPU 0 sees, and the CPUs that share it (Linux sysfs; else sysconf;
//! else unknown).
inline llc_info last_level_cache() {
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
  return {bytes, sharing};
}

//! The bytes of last-level cache one CPU can count on: the cache divided among the CPUs that
//! share it (0 when unknown).
inline std::size_t llc_share_bytes() {
  return last_level_cache().share();
}

//! The largest last-level cache a cast uses whole (see the file comment).
inline constexpr std::size_t whole_cache_cap = std::size_t{32} << 20;

//! The threshold for a last-level cache: 1/4 of one CPU's share, and at least the whole cache
//! up to whole_cache_cap; 8 MiB when the cache size is unknown.
inline std::size_t streaming_threshold_for(const llc_info& llc) {
  if (llc.bytes == 0) return std::size_t{8} << 20;
  return std::max(llc.share() / 4, std::min(llc.bytes, whole_cache_cap));
}

//! The threshold when neither the environment nor a scope sets one: streaming_threshold_for
//! this machine's last-level cache.
inline std::size_t default_streaming_threshold() {
  return streaming_threshold_for(last_level_cache());
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
//! detail::streaming_threshold_for this machine's last-level cache (1/4 of one CPU's share, at
//! least the whole cache up to 32 MiB). Raises invalid_argument when SHARDKIT_STREAMING_BYTES
//! is not a non-negative integer.
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
