// Small formatting helpers shared by shardkit's examples and tools.
#pragma once

#include <cstdint>
#include <string>

namespace examples {

//! 1234567 -> "1,234,567"
inline std::string with_commas(std::uint64_t v) {
  const std::string digits = std::to_string(v);
  std::string s;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i != 0 && (digits.size() - i) % 3 == 0) s += ',';
    s += digits[i];
  }
  return s;
}

}  // namespace examples
