// Command-line values of shardkit's examples: an integer or a non-negative number, checked, with
// the message a user sees when it is wrong. `fail(message)` is the example's usage reporter and
// does not return (it exits or throws).
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

namespace examples {

//! The integer `v` given for `flag`, which must lie in [lo, hi].
template <class Fail>
long parse_int(const std::string& flag, const char* v, long lo, long hi, Fail&& fail) {
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || x < lo || x > hi) {
    fail(flag + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
         "], got '" + v + "'");
  }
  return x;
}

//! The finite, non-negative number `v` given for `flag`.
template <class Fail>
float parse_nonnegative(const std::string& flag, const char* v, Fail&& fail) {
  char* end = nullptr;
  const float x = std::strtof(v, &end);
  if (end == v || *end != '\0' || !(x >= 0.0f) || !std::isfinite(x)) {
    fail(flag + " expects a non-negative number, got '" + std::string(v) + "'");
  }
  return x;
}

}  // namespace examples
