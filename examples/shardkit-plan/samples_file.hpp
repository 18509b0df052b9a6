// The file of calibration samples that shardkit-plan --calibrate --save-samples FILE writes and
// the planner's --samples FILE reads: one timed collective per line, as plan::calibration_sample
// holds it, so that the planner can read its times off the measured curve (plan/sampled.hpp)
// where a step's calls lie among the sampled sizes.
//
//   # shardkit-plan calibration samples: collective placement ranks count elem_bytes seconds
//   all_gather out 2 2048 2 1.21e-05
//   all_reduce in_place 2 8388608 2 0.00165
//
// count as calibration_sample counts it: per rank for all-gather and reduce-scatter, the whole
// array for all-reduce. '#' starts a comment; blank lines are skipped.
#pragma once

#include <shardkit/plan/calibrate.hpp>
#include <shardkit/plan/sampled.hpp>

#include "parse.hpp"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace shardkit_plan {

namespace plan = shardkit::plan;

//! Writes `samples` to `path` in the format above; throws std::runtime_error naming the file
//! when it cannot be written.
inline void write_samples(const std::string& path,
                          const std::vector<plan::calibration_sample>& samples,
                          const std::string& what) {
  std::ofstream out(path);
  out << "# shardkit-plan calibration samples (" << what << ")\n"
      << "# collective placement ranks count elem_bytes seconds\n";
  out.precision(std::numeric_limits<double>::max_digits10);
  for (const auto& s : samples) {
    out << shardkit::name(s.op) << (s.in_place ? " in_place " : " out ") << s.ranks << ' '
        << s.count << ' ' << s.elem_bytes << ' ' << s.seconds << '\n';
  }
  out.flush();
  if (!out) {
    throw std::runtime_error("--save-samples: cannot write '" + path + "'");
  }
}

//! The samples of the file `path` (format above), checked as plan::sampled_times checks them.
//! Throws cli::bad_argument naming the flag, the file, the line and what was expected.
inline plan::sampled_times read_samples(std::string_view flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) cli::fail(flag, path, "is not a readable file of calibration samples");
  std::vector<plan::calibration_sample> samples;
  std::string line;
  for (std::size_t number = 1; std::getline(in, line); ++number) {
    if (const auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    std::istringstream words(line);
    std::string op, where, extra;
    plan::calibration_sample s;
    if (!(words >> op)) continue;  // blank or comment
    const auto at = [&](const std::string& why) {
      throw cli::bad_argument(std::string(flag) + ": '" + path + "' line " +
                              std::to_string(number) + ": " + why);
    };
    if (op == "all_gather") {
      s.op = shardkit::collective::all_gather;
    } else if (op == "reduce_scatter") {
      s.op = shardkit::collective::reduce_scatter;
    } else if (op == "all_reduce") {
      s.op = shardkit::collective::all_reduce;
    } else {
      at("collective '" + op + "'; expected all_gather, reduce_scatter or all_reduce");
    }
    if (!(words >> where) || (where != "out" && where != "in_place")) {
      at("expected the placement 'out' or 'in_place' after the collective");
    }
    s.in_place = where == "in_place";
    if (!(words >> s.ranks >> s.count >> s.elem_bytes >> s.seconds)) {
      at("expected ranks, count, elem_bytes and seconds after the placement");
    }
    if (words >> extra) at("unexpected '" + extra + "' after the seconds");
    samples.push_back(s);
  }
  if (samples.empty()) cli::fail(flag, path, "holds no samples; expected a --save-samples file");
  try {
    return plan::sampled_times(std::move(samples));
  } catch (const plan::calibration_error& e) {
    throw cli::bad_argument(std::string(flag) + ": '" + path + "': " + e.what());
  }
}

}  // namespace shardkit_plan
