//! \file kernels/host/dispatch.hpp
//! Runs a host loop in the build of it this CPU runs best (kernels/host/isa.hpp picks it,
//! SHARDKIT_HOST_ISA or host::scoped_isa force one). A loop is a `Kernel` type with a
//! force-inlined `template <class Isa> static void run(Args...)` over simd::vf<Isa::width>
//! (kernels/host/simd.hpp); dispatch<Kernel>(args...) instantiates it once per build, each
//! compiled for its own target.
//!
//! Each build's entry point is flattened: every call in it, down to a user's optimizer policy's
//! `update` (which need not be marked inline), is inlined into the code compiled for that
//! target. A vector operation left out of line would be compiled for the translation unit's
//! own flags, where 8- and 16-lane vectors cannot be held (GCC: "impossible constraint in
//! asm"); whether the inliner keeps such a function in line otherwise depends on how often the
//! kernel calls it.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/kernels/host/isa.hpp>
#include <shardkit/kernels/host/simd.hpp>

SHARDKIT_NAMESPACE_BEGIN

namespace detail {
#if defined(SHARDKIT_DETAIL_HOST_X86)
// One trampoline per build: `Kernel::run<Isa>` (force-inlined) is compiled for the build's
// target. The AVX2 target omits FMA (nothing may be contracted; see simd.hpp).
template <class Kernel, class... Args>
[[gnu::flatten, gnu::target("avx2,f16c,popcnt")]] void run_avx2(Args... args) {
  Kernel::template run<simd::isa_avx2>(args...);
}
template <class Kernel, class... Args>
[[gnu::flatten, gnu::target("avx512f,avx512bw,avx512vl,avx512dq,f16c,popcnt")]] void run_avx512(
    Args... args) {
  Kernel::template run<simd::isa_avx512>(args...);
}
template <class Kernel, class... Args>
[[gnu::flatten, gnu::target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,popcnt")]] void
run_avx512bf16(Args... args) {
  Kernel::template run<simd::isa_avx512bf16>(args...);
}
#endif
}  // namespace detail

//! Runs `Kernel::run<Isa>(args...)`, a force-inlined loop over simd::vf<Isa::width>, in the
//! build host::active_isa() names (the best this CPU runs unless SHARDKIT_HOST_ISA or
//! host::scoped_isa says otherwise). Every build computes the same bits.
template <class Kernel, class... Args>
void dispatch(Args... args) {
#if defined(SHARDKIT_HOST_SCALAR_SIMD)
  Kernel::template run<simd::isa_scalar>(args...);
#elif defined(SHARDKIT_DETAIL_HOST_X86)
  switch (host::active_isa()) {
    case host::isa::avx512bf16:
      return detail::run_avx512bf16<Kernel>(args...);
    case host::isa::avx512:
      return detail::run_avx512<Kernel>(args...);
    case host::isa::avx2:
      return detail::run_avx2<Kernel>(args...);
    default:
      return Kernel::template run<simd::isa_baseline>(args...);
  }
#else
  Kernel::template run<simd::isa_baseline>(args...);
#endif
}

SHARDKIT_NAMESPACE_END
