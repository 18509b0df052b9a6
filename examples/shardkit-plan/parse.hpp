// Parsing of shardkit-plan's arguments: counts, bytes, bandwidths and durations with SI or
// binary suffixes, and lists of unit sizes. Every error is a `bad_argument` whose message names
// the argument, what was given and what was expected.
//
//   counts:     7e9, 7000000000, 1.5k, 200M, 7G, 1T, 64Ki (k/M/G/T = 1e3..1e12, Ki/Mi/Gi = 2^10..)
//               must be whole numbers: 1.5k is 1500, 1.2345k is an error
//   bytes:      80GB (8e10), 80GiB (80·2^30), 512MB, 1.5TB, 100B (a unit is required)
//   bandwidth:  450GB/s, 50GiB/s, 400Gbit/s (= 50GB/s)
//   durations:  5us, 5µs, 2ms, 500ns, 1e-5s
//   headroom:   10% (of the GPU's memory) or bytes (4GB)
//   dtypes:     bf16, fp16, fp32 (working parameters, gradients)
#pragma once

#include <shardkit/core/dtype.hpp>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace cli {

//! A command-line argument that cannot be used; the message says which and why.
struct bad_argument : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(std::string_view flag, std::string_view text, std::string_view why) {
  throw bad_argument(std::string(flag) + ": '" + std::string(text) + "' " + std::string(why));
}

//! A decimal number split into digits and a power of ten, plus what follows it.
struct decimal {
  std::uint64_t mantissa = 0;  // the digits, without the point
  int exp10 = 0;               // value = mantissa · 10^exp10
  bool negative = false;
  std::string_view number;  // the numeric part of the text
  std::string_view suffix;  // the rest
};

//! Splits "[-+]digits[.digits][e[-+]digits]suffix". Fails when there is no number or its
//! significant digits do not fit in 64 bits.
inline decimal split_decimal(std::string_view flag, std::string_view text) {
  decimal d;
  std::size_t i = 0;
  if (i < text.size() && (text[i] == '-' || text[i] == '+')) d.negative = text[i++] == '-';
  bool any_digit = false, point = false;
  for (; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '.' && !point) {
      point = true;
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(ch))) break;
    any_digit = true;
    if (d.mantissa == 0 && ch == '0') {
      if (point) --d.exp10;
      continue;
    }
    if (__builtin_mul_overflow(d.mantissa, 10u, &d.mantissa) ||
        __builtin_add_overflow(d.mantissa, static_cast<std::uint64_t>(ch - '0'), &d.mantissa)) {
      fail(flag, text, "has too many significant digits (its digits must fit in 64 bits)");
    }
    if (point) --d.exp10;
  }
  if (!any_digit) fail(flag, text, "is not a number");
  // An exponent: 'e' or 'E' followed by an optional sign and at least one digit.
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    std::size_t j = i + 1;
    bool neg = false;
    if (j < text.size() && (text[j] == '-' || text[j] == '+')) neg = text[j++] == '-';
    if (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) {
      int e = 0;
      for (; j < text.size() && std::isdigit(static_cast<unsigned char>(text[j])); ++j) {
        e = e * 10 + (text[j] - '0');
        if (e > 400) fail(flag, text, "has an exponent out of range");
      }
      d.exp10 += neg ? -e : e;
      i = j;
    }
  }
  d.number = text.substr(0, i);
  d.suffix = text.substr(i);
  return d;
}

//! mantissa · 10^exp10 · 2^exp2 as an exact integer; fails when it is not whole or overflows.
inline std::uint64_t exact_integer(std::string_view flag, std::string_view text, const decimal& d,
                                   int exp10, int exp2, std::string_view what) {
  std::uint64_t v = d.mantissa;
  auto mul = [&](std::uint64_t f) {
    if (__builtin_mul_overflow(v, f, &v)) fail(flag, text, "is too large (more than 2^64 - 1)");
  };
  for (int k = 0; k < exp2; ++k) mul(2);
  int e = d.exp10 + exp10;
  if (v == 0) return 0;
  for (; e > 0; --e) mul(10);
  for (; e < 0; ++e) {
    if (v % 10 != 0) fail(flag, text, "is not a whole number of " + std::string(what));
    v /= 10;
  }
  return v;
}

//! A count of elements or ranks: a whole, non-negative number with an optional suffix
//! k/K, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti (powers of 1024).
inline std::uint64_t parse_count(std::string_view flag, std::string_view text) {
  const decimal d = split_decimal(flag, text);
  if (d.negative && d.mantissa != 0) fail(flag, text, "is negative; expected a count >= 0");
  struct suffix {
    std::string_view s;
    int e10, e2;
  };
  static constexpr suffix table[] = {{"", 0, 0},    {"k", 3, 0},  {"K", 3, 0},   {"M", 6, 0},
                                     {"G", 9, 0},   {"T", 12, 0}, {"Ki", 0, 10}, {"Mi", 0, 20},
                                     {"Gi", 0, 30}, {"Ti", 0, 40}};
  for (const auto& s : table) {
    if (d.suffix == s.s) return exact_integer(flag, text, d, s.e10, s.e2, "elements");
  }
  fail(flag, text,
       "has an unknown suffix '" + std::string(d.suffix) +
           "'; expected a count such as 7e9, 7G, 200M, 1.5k or 64Ki");
}

//! Bytes: a number with a unit B, kB (or KB), MB, GB, TB, PB (powers of 1000:
//! GB = 1e9 bytes) or KiB, MiB, GiB, TiB, PiB (powers of 1024).
inline std::uint64_t parse_bytes(std::string_view flag, std::string_view text) {
  const decimal d = split_decimal(flag, text);
  if (d.negative && d.mantissa != 0) fail(flag, text, "is negative; expected bytes >= 0");
  struct unit {
    std::string_view s;
    int e10, e2;
  };
  static constexpr unit table[] = {{"B", 0, 0},    {"kB", 3, 0},   {"KB", 3, 0},   {"MB", 6, 0},
                                   {"GB", 9, 0},   {"TB", 12, 0},  {"PB", 15, 0},  {"KiB", 0, 10},
                                   {"MiB", 0, 20}, {"GiB", 0, 30}, {"TiB", 0, 40}, {"PiB", 0, 50}};
  for (const auto& u : table) {
    if (d.suffix == u.s) return exact_integer(flag, text, d, u.e10, u.e2, "bytes");
  }
  if (d.suffix.empty()) {
    fail(flag, text, "has no unit; expected bytes such as 80GB (80e9 bytes) or 80GiB (80 x 2^30)");
  }
  fail(flag, text,
       "has an unknown unit '" + std::string(d.suffix) +
           "'; expected B, kB, MB, GB, TB, PB (powers of 1000) or KiB, MiB, GiB, TiB, PiB");
}

//! A finite, non-negative real number from the numeric part of `d`.
inline double to_double(std::string_view flag, std::string_view text, const decimal& d) {
  const std::string num(d.number);
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(num.c_str(), &end);
  if (errno != 0 || end != num.c_str() + num.size() || !std::isfinite(v)) {
    fail(flag, text, "is not a finite number");
  }
  if (v < 0) fail(flag, text, "is negative; expected a value >= 0");
  return v;
}

//! Bandwidth in bytes per second: a byte unit followed by /s (450GB/s, 50GiB/s), or bits per
//! second spelled out (400Gbit/s = 50GB/s).
inline double parse_bandwidth(std::string_view flag, std::string_view text) {
  const decimal d = split_decimal(flag, text);
  const double v = to_double(flag, text, d);
  struct unit {
    std::string_view s;
    double scale;
  };
  static constexpr unit table[] = {{"B/s", 1.0},
                                   {"kB/s", 1e3},
                                   {"KB/s", 1e3},
                                   {"MB/s", 1e6},
                                   {"GB/s", 1e9},
                                   {"TB/s", 1e12},
                                   {"KiB/s", 1024.0},
                                   {"MiB/s", 1048576.0},
                                   {"GiB/s", 1073741824.0},
                                   {"TiB/s", 1099511627776.0},
                                   {"bit/s", 0.125},
                                   {"kbit/s", 125.0},
                                   {"Mbit/s", 125e3},
                                   {"Gbit/s", 125e6},
                                   {"Tbit/s", 125e9}};
  for (const auto& u : table) {
    if (d.suffix == u.s) {
      if (!(v > 0)) fail(flag, text, "must be a positive bandwidth");
      return v * u.scale;
    }
  }
  fail(flag, text,
       "has an unknown unit '" + std::string(d.suffix) +
           "'; expected bytes per second such as 450GB/s or 50GiB/s, or bits per second "
           "spelled out such as 400Gbit/s");
}

//! A duration in seconds: a number with a unit s, ms, us (or µs) or ns.
inline double parse_duration(std::string_view flag, std::string_view text) {
  const decimal d = split_decimal(flag, text);
  const double v = to_double(flag, text, d);
  struct unit {
    std::string_view s;
    double scale;
  };
  static constexpr unit table[] = {
      {"s", 1.0}, {"ms", 1e-3}, {"us", 1e-6}, {"\xC2\xB5s", 1e-6}, {"ns", 1e-9}};
  for (const auto& u : table) {
    if (d.suffix == u.s) return v * u.scale;
  }
  fail(flag, text,
       "has an unknown unit '" + std::string(d.suffix) +
           "'; expected a duration such as 5us, "
           "2ms, 500ns or 1e-5s");
}

//! A training dtype (of the working parameters or of the gradients): bf16, fp16 or fp32, the
//! names shardkit::name(dtype) prints.
inline shardkit::dtype parse_dtype(std::string_view flag, std::string_view text) {
  if (text == "bf16") return shardkit::dtype::bf16;
  if (text == "fp16") return shardkit::dtype::f16;
  if (text == "fp32") return shardkit::dtype::f32;
  fail(flag, text, "is not a training dtype; expected bf16, fp16 or fp32");
}

//! A reserve of memory: a percentage of the GPU's memory ("10%") or bytes ("4GB").
struct headroom {
  bool is_percent = false;
  double percent = 0.0;     // when is_percent, in [0, 100)
  std::uint64_t bytes = 0;  // otherwise

  //! Bytes kept free of a GPU with `memory` bytes (a percentage rounds up to whole bytes).
  std::uint64_t of(std::uint64_t memory) const {
    if (!is_percent) return bytes;
    return static_cast<std::uint64_t>(
        std::ceil(static_cast<long double>(memory) * static_cast<long double>(percent) / 100.0L));
  }
};

inline headroom parse_headroom(std::string_view flag, std::string_view text) {
  if (!text.empty() && text.back() == '%') {
    const decimal d = split_decimal(flag, text.substr(0, text.size() - 1));
    if (!d.suffix.empty()) fail(flag, text, "is not a percentage such as 10%");
    const double v = to_double(flag, text, d);
    if (!(v < 100)) fail(flag, text, "must be below 100%");
    return {true, v, 0};
  }
  return {false, 0.0, parse_bytes(flag, text)};
}

//! Unit sizes separated by commas, white space or new lines; '#' starts a comment that runs to
//! the end of the line. At least one size.
inline std::vector<std::uint64_t> parse_unit_list(std::string_view flag, std::string_view text) {
  std::vector<std::uint64_t> sizes;
  std::string token;
  bool comment = false;
  auto flush = [&] {
    if (!token.empty()) {
      sizes.push_back(parse_count(flag, token));
      token.clear();
    }
  };
  for (const char ch : text) {
    if (comment) {
      if (ch == '\n') comment = false;
      continue;
    }
    if (ch == '#') {
      flush();
      comment = true;
    } else if (ch == ',' || std::isspace(static_cast<unsigned char>(ch))) {
      flush();
    } else {
      token += ch;
    }
  }
  flush();
  if (sizes.empty()) fail(flag, text, "lists no unit sizes; expected e.g. 2e8,2e8,5e7");
  return sizes;
}

//! `text` names a readable file: its unit sizes (same syntax, one or more per line); otherwise
//! `text` itself is the list. `source` says which it was.
inline std::vector<std::uint64_t> parse_units(std::string_view flag, std::string_view text,
                                              std::string& source) {
  std::ifstream in{std::string(text)};
  if (in) {
    std::stringstream ss;
    ss << in.rdbuf();
    source = "file " + std::string(text);
    try {
      return parse_unit_list(flag, ss.str());
    } catch (const bad_argument& e) {
      throw bad_argument(std::string(e.what()) + " (in file " + std::string(text) + ")");
    }
  }
  // Not a file: a list has a comma or starts with a digit; anything else was meant as a file.
  const bool looks_like_list = text.find(',') != std::string_view::npos ||
                               (!text.empty() && std::isdigit(static_cast<unsigned char>(text[0])));
  if (!looks_like_list) {
    fail(flag, text, "is neither a readable file nor a list of unit sizes such as 2e8,2e8,5e7");
  }
  source = "list";
  return parse_unit_list(flag, text);
}

}  // namespace cli
