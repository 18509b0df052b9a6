//! \file kernels/host/isa.hpp
//! Which build of the host loops runs: the instruction sets this CPU has, the one the host
//! kernels dispatch to, and how to force one.
//!
//! The host loops are compiled several times into every program that includes them, whatever
//! flags it is built with: for the x86-64 baseline (SSE2, 4 lanes), for AVX2 (8 lanes) and for
//! AVX-512 F/BW/VL/DQ (16 lanes), the last once more with the AVX512-BF16 conversion
//! instructions. At run time the best one the CPU (and the operating system) supports runs.
//! Every build computes the same bits (kernels/host/simd.hpp says why), so the choice changes
//! speed only.
//!
//! The environment variable `SHARDKIT_HOST_ISA` forces one build: `baseline`, `avx2`, `avx512`
//! (AVX-512 without the BF16 instructions) or `avx512bf16`. Any other value, or a build this
//! CPU cannot run, is an error (invalid_argument, raised by the first host loop that runs and
//! by host_isa()) that names the accepted values; it never falls back silently. Tests and
//! benchmarks select a build in-process with host::scoped_isa.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(SHARDKIT_HOST_SCALAR_SIMD)
//! The host loops dispatch at run time between x86-64 builds (otherwise: one build).
#define SHARDKIT_DETAIL_HOST_X86 1
#include <cpuid.h>
#endif

SHARDKIT_NAMESPACE_BEGIN
namespace host {

//! A build of the host loops, from the slowest to the fastest.
enum class isa : int {
  scalar = -1,     //!< one lane (SHARDKIT_HOST_SCALAR_SIMD translation units, CUDA's)
  baseline = 0,    //!< the translation unit's own flags (x86-64: SSE2, 4 lanes)
  avx2 = 1,        //!< AVX2 and F16C, 8 lanes
  avx512 = 2,      //!< AVX-512 F/BW/VL/DQ, 16 lanes
  avx512bf16 = 3,  //!< the same with the AVX512-BF16 fp32 -> bf16 conversion instruction
};

//! The name of a build, as SHARDKIT_HOST_ISA spells it.
constexpr const char* name(isa i) noexcept {
  switch (i) {
    case isa::scalar:
      return "scalar";
    case isa::baseline:
      return "baseline";
    case isa::avx2:
      return "avx2";
    case isa::avx512:
      return "avx512";
    case isa::avx512bf16:
      return "avx512bf16";
  }
  return "?";
}

namespace detail {

//! What the CPU and the operating system support (checked once).
struct cpu_features {
  bool avx2 = false;    // AVX2 and F16C, with the OS saving ymm state
  bool avx512 = false;  // AVX-512 F, BW, VL, DQ, with the OS saving zmm and mask state
  bool avx512bf16 = false;
  bool amd = false;     // the vendor string is "AuthenticAMD" (kernels/host/prefetch.hpp)
  unsigned family = 0;  // the display family of CPUID leaf 1 (display_family)
};

//! The display family of CPUID leaf 1's EAX: the base family, plus the extended family where
//! the base family is 0xF (the rule of both vendors' manuals). AMD's Zen 3 and Zen 4 are family
//! 0x19, Zen 5 0x1A; Intel's Xeons are family 6.
constexpr unsigned display_family(unsigned eax) noexcept {
  const unsigned base = (eax >> 8) & 0xFu;
  return base == 0xFu ? base + ((eax >> 20) & 0xFFu) : base;
}

inline cpu_features detect_cpu() noexcept {
  cpu_features f;
#if defined(SHARDKIT_DETAIL_HOST_X86)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return f;
  f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "Auth" "enti" "cAMD"
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return f;
  f.family = display_family(a);
  const bool osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u, f16c = (c >> 29) & 1u;
  if (!osxsave || !avx) return f;
  unsigned xlo = 0, xhi = 0;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool ymm_state = (xlo & 0x6u) == 0x6u;
  const bool zmm_state = (xlo & 0xe6u) == 0xe6u;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return f;
  const bool avx2 = (b >> 5) & 1u;
  const bool avx512f = (b >> 16) & 1u, avx512dq = (b >> 17) & 1u;
  const bool avx512bw = (b >> 30) & 1u, avx512vl = (b >> 31) & 1u;
  f.avx2 = avx2 && f16c && ymm_state;
  f.avx512 = f.avx2 && zmm_state && avx512f && avx512dq && avx512bw && avx512vl;
  if (f.avx512 && __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0) f.avx512bf16 = (a >> 5) & 1u;
#endif
  return f;
}

inline const cpu_features& cpu() noexcept {
  static const cpu_features f = detect_cpu();
  return f;
}

inline bool cpu_runs(isa i) noexcept {
  switch (i) {
    case isa::scalar:
    case isa::baseline:
      return true;
    case isa::avx2:
      return cpu().avx2;
    case isa::avx512:
      return cpu().avx512;
    case isa::avx512bf16:
      return cpu().avx512bf16;
  }
  return false;
}

//! The builds this program contains (scalar translation units contain one).
inline std::vector<isa> compiled_isas() {
#if defined(SHARDKIT_DETAIL_HOST_X86)
  return {isa::baseline, isa::avx2, isa::avx512, isa::avx512bf16};
#elif defined(SHARDKIT_HOST_SCALAR_SIMD)
  return {isa::scalar};
#else
  return {isa::baseline};
#endif
}

inline isa best_isa() noexcept {
  isa best = compiled_isas().front();
  for (isa i : compiled_isas())
    if (cpu_runs(i)) best = i;
  return best;
}

inline std::string isa_list(bool runnable_only) {
  std::string s;
  for (isa i : compiled_isas()) {
    if (runnable_only && !cpu_runs(i)) continue;
    if (!s.empty()) s += ", ";
    s += name(i);
  }
  return s;
}

//! The build SHARDKIT_HOST_ISA asks for, or the best one when it is unset or empty. Raises
//! invalid_argument for an unknown value or a build this CPU cannot run. (Translation units of
//! the one-lane build ignore the variable: they contain no other build.)
inline isa isa_from_environment() {
  const char* e = std::getenv("SHARDKIT_HOST_ISA");
  if (e == nullptr || *e == '\0') return best_isa();
  const std::string_view v(e);
  for (isa i : compiled_isas()) {
    if (v != name(i)) continue;
    if (!cpu_runs(i)) {
      ::shardkit::detail::raise("SHARDKIT_HOST_ISA=", v, ": this CPU cannot run that build of the ",
                                "host loops; it runs: ", isa_list(true));
    }
    return i;
  }
  ::shardkit::detail::raise("SHARDKIT_HOST_ISA=", v,
                            ": unknown build of the host loops; accepted values: ", isa_list(false),
                            " (unset: the best this CPU runs, here ", name(best_isa()), ")");
}

//! -2: not resolved yet; otherwise the int value of the isa every host loop runs.
inline std::atomic<int> active_isa_value{-2};
//! The forced build (host::scoped_isa), or -2 for none.
inline std::atomic<int> forced_isa_value{-2};

//! The build the host loops run now (cheap after the first call).
inline isa active_isa() {
#if defined(SHARDKIT_HOST_SCALAR_SIMD)
  return isa::scalar;  // one build only; SHARDKIT_HOST_ISA does not apply
#else
  const int forced = forced_isa_value.load(std::memory_order_relaxed);
  if (forced != -2) return static_cast<isa>(forced);
  int v = active_isa_value.load(std::memory_order_relaxed);
  if (v == -2) {
    v = static_cast<int>(isa_from_environment());  // raises for a bad value; not cached then
    active_isa_value.store(v, std::memory_order_relaxed);
  }
  return static_cast<isa>(v);
#endif
}

}  // namespace detail

//! The builds of the host loops this CPU runs, slowest first (each can be forced).
inline std::vector<isa> available_isas() {
  std::vector<isa> v;
  for (isa i : detail::compiled_isas())
    if (detail::cpu_runs(i)) v.push_back(i);
  return v;
}

//! The build the host loops run: SHARDKIT_HOST_ISA's, else the best this CPU runs.
inline isa active_isa() {
  return detail::active_isa();
}

//! Forces the host loops of this program onto one build while it lives (tests, benchmarks);
//! raises invalid_argument when this CPU cannot run it. Not for use while other threads run
//! host loops. Scopes nest.
class scoped_isa {
 public:
  explicit scoped_isa(isa i) : previous_(detail::forced_isa_value.load()) {
    bool compiled = false;
    for (isa c : detail::compiled_isas()) compiled = compiled || c == i;
    if (!compiled || !detail::cpu_runs(i)) {
      ::shardkit::detail::raise(
          "host::scoped_isa: the ", name(i),
          " build of the host loops cannot run here; available: ", detail::isa_list(true));
    }
    detail::forced_isa_value.store(static_cast<int>(i));
  }
  scoped_isa(const scoped_isa&) = delete;
  scoped_isa& operator=(const scoped_isa&) = delete;
  ~scoped_isa() { detail::forced_isa_value.store(previous_); }

 private:
  int previous_;
};

}  // namespace host

//! Name of the build of the host loops that runs: "baseline", "avx2", "avx512", "avx512bf16"
//! (or "scalar" in translation units built with SHARDKIT_HOST_SCALAR_SIMD). Raises
//! invalid_argument when SHARDKIT_HOST_ISA holds an unknown value.
inline const char* host_isa() {
  return host::name(host::active_isa());
}

SHARDKIT_NAMESPACE_END
