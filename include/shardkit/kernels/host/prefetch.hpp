//! \file kernels/host/prefetch.hpp
//! Whether the host loops that stream through memory ask for the lines they will need next with
//! software prefetches. Two kinds of loop are set apart, each with its own default: the fused
//! optimizer step (prefetch_loop::step) and the copies, the casts and the flatten
//! (prefetch_loop::copy).
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
//!    memory bus; the narrowing casts and the flatten 1.1-1.5x faster without it.
//!  - AMD EPYC, Zen 5 (family 0x1A): with it, the step with bf16 gradients and working copy
//!    ran 1.05-1.21x faster on one thread (16Mi-64Mi elements, three runs), and the fp32 step
//!    on a framework's tensors on 4 KiB pages gained 3-6% against torch's fused AdamW beside it;
//!    the narrowing casts and the fp32 -> bf16 flatten ran 0.88-0.98x as fast with it (the
//!    runs whose control pair, a memcpy it does not touch, was at 1.00x), the widening casts
//!    the same either way.
//! So both kinds prefetch by default, except on AMD processors with AVX-512: on Zen 4 (family
//! 0x19; Zen 3 is family 0x19 too, but has no AVX-512) neither does, and on Zen 5 and later
//! families only the step does. A processor that was not measured takes the default of the
//! nearest one that was.
//!
//! The environment variable `SHARDKIT_HOST_PREFETCH` sets both: `on` or `off`. Any other value
//! is an error (invalid_argument, raised by the first host loop that asks, and by
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
//! The kinds of host loop whose software prefetch is set apart (see the file comment).
enum class prefetch_loop {
  step,  //!< the fused optimizer step (kernels/host/optimizer.hpp)
  copy,  //!< the casts and the flatten (kernels/host/convert.hpp, batched_copy.hpp)
};

inline const char* name(prefetch_loop l) noexcept {
  return l == prefetch_loop::step ? "step" : "copy";
}

namespace detail {

//! The default for a processor with features f, for loops of kind l (see the file comment).
constexpr bool default_software_prefetch(const cpu_features& f, prefetch_loop l) noexcept {
  if (!(f.amd && f.avx512)) return true;
  if (f.family <= 0x19u) return false;  // Zen 4
  return l == prefetch_loop::step;      // Zen 5 and later
}

//! The default for this processor, for loops of kind l.
inline bool default_software_prefetch(prefetch_loop l) noexcept {
  return default_software_prefetch(cpu(), l);
}

//! Words for whether each kind of loop prefetches: "on", "off", or "step on, copy off" where
//! the two differ.
constexpr const char* prefetch_words(bool step, bool copy) noexcept {
  if (step == copy) return step ? "on" : "off";
  return step ? "step on, copy off" : "step off, copy on";
}

//! What the defaults are here, for messages.
inline const char* default_software_prefetch_name() noexcept {
  return prefetch_words(default_software_prefetch(prefetch_loop::step),
                        default_software_prefetch(prefetch_loop::copy));
}

//! SHARDKIT_HOST_PREFETCH's setting: 1 (on), 0 (off), or -1 where it is unset or empty (the
//! defaults). Raises invalid_argument for a value other than "on" and "off".
inline int software_prefetch_setting() {
  const char* e = std::getenv("SHARDKIT_HOST_PREFETCH");
  if (e == nullptr || *e == '\0') return -1;
  const std::string_view v(e);
  if (v == "on") return 1;
  if (v == "off") return 0;
  ::shardkit::detail::raise("SHARDKIT_HOST_PREFETCH=", v,
                            ": expected on or off (unset: the defaults for this processor, here ",
                            default_software_prefetch_name(), ")");
}

//! Whether loops of kind l prefetch under `setting` (software_prefetch_setting()'s value): the
//! setting where one is made, else the default.
inline bool software_prefetch_for(int setting, prefetch_loop l) noexcept {
  return setting == -1 ? default_software_prefetch(l) : setting != 0;
}

//! SHARDKIT_HOST_PREFETCH's setting, else the default for loops of kind l. Raises as
//! software_prefetch_setting().
inline bool software_prefetch_from_environment(prefetch_loop l) {
  return software_prefetch_for(software_prefetch_setting(), l);
}

//! -2: not resolved yet; else software_prefetch_setting()'s value.
inline std::atomic<int> software_prefetch_value{-2};
//! What a host::scoped_prefetch sets (-1: none).
inline std::atomic<int> forced_software_prefetch{-1};

}  // namespace detail

//! Whether host loops of kind l prefetch: host::scoped_prefetch's setting, else
//! SHARDKIT_HOST_PREFETCH's, else the default for this processor (on, except on AMD processors
//! with AVX-512: off on Zen 4, only the step on Zen 5 and later). Cheap after the first call.
//! Raises invalid_argument when SHARDKIT_HOST_PREFETCH is neither "on" nor "off".
inline bool software_prefetch(prefetch_loop l) {
  const int forced = detail::forced_software_prefetch.load(std::memory_order_relaxed);
  if (forced != -1) return forced != 0;
  int v = detail::software_prefetch_value.load(std::memory_order_relaxed);
  if (v == -2) {
    v = detail::software_prefetch_setting();  // raises; not cached then
    detail::software_prefetch_value.store(v, std::memory_order_relaxed);
  }
  return detail::software_prefetch_for(v, l);
}

//! What software_prefetch() is for each kind of loop, for reports: "on", "off", or "step on,
//! copy off" where the two differ. Raises as software_prefetch().
inline const char* software_prefetch_name() {
  return detail::prefetch_words(software_prefetch(prefetch_loop::step),
                                software_prefetch(prefetch_loop::copy));
}

//! Sets software_prefetch() for every kind of loop while it lives (tests, benchmarks). Not for
//! use while other threads run host loops. Scopes nest.
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
