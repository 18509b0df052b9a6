// The shared frame of the libFuzzer targets (SHARDKIT_BUILD_FUZZERS): a violation of
// fuzz_cases.hpp's rules prints what broke and aborts, which libFuzzer reports as a crash and
// keeps the input of (crash-<sha1>). Files the checks write go to a per-process scratch path.
#pragma once

#include "io/fuzz_cases.hpp"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <unistd.h>

namespace fuzz {

inline const std::string& scratch_file() {
  static const std::string p = (std::filesystem::temp_directory_path() /
                                ("shardkit-fuzz-" + std::to_string(::getpid()) + ".bin"))
                                   .string();
  return p;
}

template <class F>
int guarded(F&& f) {
  try {
    f();
  } catch (const violation& v) {
    std::fprintf(stderr, "shardkit fuzz: VIOLATION: %s\n", v.what());
    std::abort();
  }
  return 0;
}

}  // namespace fuzz
