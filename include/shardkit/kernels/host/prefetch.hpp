//! \file kernels/host/prefetch.hpp
//! Whether the host loops that stream through memory (the fused optimizer step, the casts and
//! the flatten) ask for the lines they will need next with software prefetches.
//!
//! A prefetch is a hint: the values, and so every bit of every result, are the same with or
//! without it. What it does to speed depends on the processor's own prefetchers, and was
//! measured, not derived (benchmarks/README.md):
//!  - Intel Xeon (AVX-512): its hardware prefetchers stop at every 4 KiB page, and the fused
//!    step's division and square root slow the rate at which it issues loads. Prefetching 2 KiB
//!    ahead made the step 1.10-1.13x faster on one thread (16Mi-64Mi fp32 elements, 4 KiB and
//!    2 MiB pages), the fp32 -> bf16 cast 1.06-1.22x and the flatten 1.17-1.34x.
//!  - AMD EPYC without AVX-512 (Zen 3): the fp32 -> bf16 cast of 4Mi elements ran 1.35x slower
//!    without it.
//!  - AMD EPYC with AVX-512, Zen 4 (family 0x19): the fused step ran 1.10-1.24x faster
//!    *without* it on one thread (16Mi-64Mi fp32 elements, on malloc's layout and on shardkit's
//!    own buffers), and as fast at two threads, where both cores together are bound by the
//!    memory bus.
//!  - AMD EPYC, Zen 5 (family 0x1A): with it, the step with bf16 gradients and working copy
//!    ran 1.09-1.21x faster on one thread (16Mi-64Mi elements, shardkit's buffers, three
//!    runs), the fp32 step on a framework's tensors on 4 KiB pages 1.03-1.06x faster relative
//!    to torch's fused AdamW beside it; the fp32 step on shardkit's buffers, the casts and the
//!    flatten moved within +-15% either way, as much as a bf16 flatten that it does not touch
//!    (a memcpy), so no more than the pairs' own bias.
//! So software prefetch is on by default, except on Zen 4: AMD processors of family 0x19 with
//! AVX-512 (Zen 3 is family 0x19 too, but has no AVX-512, and gains from it). A processor that
//! was not measured keeps the default of the others, on.
//!
//! The environment variable `SHARDKIT_HOST_PREFETCH` sets it: `on` or `off`. Any other value is
//! an error (invalid_argument, raised by the first host loop that asks, and by
//! host::software_prefetch()) that names the accepted values. Tests and benchmarks set it
//! in-process with host::scoped_prefetch.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/kernels/host/isa.hpp>

#include <atomic>
#include <cstdlib>
#include <string_view>

SHARDKIT_NAMESPACE_BEGIN
namespace host {
namespace detail {

//! The default for this processor (see the file comment).
inline bool default_software_prefetch() noexcept {
  const auto& f = cpu();
  return !(f.amd && f.avx512 && f.family == 0x19u);
}

//! SHARDKIT_HOST_PREFETCH's setting, else the default. Raises invalid_argument for a value other
//! than "on" and "off".
inline bool software_prefetch_from_environment() {
  const char* e = std::getenv("SHARDKIT_HOST_PREFETCH");
  if (e == nullptr || *e == '\0') return default_software_prefetch();
  const std::string_view v(e);
  if (v == "on") return true;
  if (v == "off") return false;
  ::shardkit::detail::raise("SHARDKIT_HOST_PREFETCH=", v,
                            ": expected on or off (unset: the default for this processor, here ",
                            default_software_prefetch() ? "on" : "off", ")");
}

//! -1: not resolved yet; else 0 (off) or 1 (on).
inline std::atomic<int> software_prefetch_value{-1};
//! What a host::scoped_prefetch sets (-1: none).
inline std::atomic<int> forced_software_prefetch{-1};

}  // namespace detail

//! Whether the host loops prefetch: host::scoped_prefetch's setting, else SHARDKIT_HOST_PREFETCH's,
//! else the default for this processor (off on AMD's Zen 4, on elsewhere).
//! Cheap after the first call. Raises invalid_argument when SHARDKIT_HOST_PREFETCH is neither
//! "on" nor "off".
inline bool software_prefetch() {
  const int forced = detail::forced_software_prefetch.load(std::memory_order_relaxed);
  if (forced != -1) return forced != 0;
  int v = detail::software_prefetch_value.load(std::memory_order_relaxed);
  if (v == -1) {
    v = detail::software_prefetch_from_environment() ? 1 : 0;  // raises; not cached then
    detail::software_prefetch_value.store(v, std::memory_order_relaxed);
  }
  return v != 0;
}

//! Sets software_prefetch() while it lives (tests, benchmarks). Not for use while other threads
//! run host loops. Scopes nest.
class scoped_prefetch {
 public:
  explicit scoped_prefetch(bool on) : previous_(detail::forced_software_prefetch.load()) {
    detail::forced_software_prefetch.store(on ? 1 : 0);
  }
  scoped_prefetch(const scoped_prefetch&) = delete;
  scoped_prefetch& operator=(const scoped_prefetch&) = delete;
  ~scoped_prefetch() { detail::forced_software_prefetch.store(previous_); }

 private:
  int previous_;
};

}  // namespace host
SHARDKIT_NAMESPACE_END
