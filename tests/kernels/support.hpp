// What the host-kernel tests share: a seeded random source, the bit pattern of a stored value,
// running a check in every build of the host loops (with software prefetch on and off), and
// setting an environment variable for a scope.
#pragma once

#include <shardkit/kernels/host/isa.hpp>
#include <shardkit/kernels/host/prefetch.hpp>

#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>

namespace kernel_test {

inline std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

//! Uniform in [-scale, scale).
inline float random_float(std::uint64_t& s, float scale = 1.0f) {
  return scale * static_cast<float>(static_cast<double>(splitmix(s) >> 11) * 0x1.0p-53 * 2 - 1);
}

//! The bit pattern of a stored value (fp32, bf16 or fp16).
template <class T>
std::uint32_t pattern(T x) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(x);
  else
    return x.bits;
}

//! The build of the host loops that runs and whether it prefetches, for section names:
//! "avx2 build, software prefetch on".
inline std::string build_name() {
  return std::string(shardkit::host::name(shardkit::host::active_isa())) +
         " build, software prefetch " + shardkit::host::software_prefetch_name();
}

//! Runs f() in every build of the host loops this CPU runs, each with software prefetch on and
//! off (kernels/host/prefetch.hpp: the loops take other paths without it). Sections inside f
//! name the build (DYNAMIC_SECTION): a plain SECTION met again in a loop would run in the first
//! build only.
template <class F>
void in_every_build(F&& f) {
  for (shardkit::host::isa i : shardkit::host::available_isas()) {
    shardkit::host::scoped_isa forced(i);
    for (bool prefetch : {true, false}) {
      shardkit::host::scoped_prefetch p(prefetch);
      INFO("host loops: " << build_name());
      f();
    }
  }
}

//! Sets an environment variable for the scope (nullptr: unsets it), restoring the previous
//! value.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
  ~scoped_env() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace kernel_test
