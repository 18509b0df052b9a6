// A ZeRO-3 test model shared by the engine's ZeRO-3 tests: `units` units, each one weight of
// `elems` elements (values 0.01·(u+1)) plus a 3-element zero bias.
#pragma once

#include <shardkit/shardkit.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace test {

struct unit_stack {
  std::vector<std::vector<float>> values;
  shardkit::model_spec model;
  unit_stack(std::size_t units, std::size_t elems) {
    values.reserve(2 * units);
    for (std::size_t u = 0; u < units; ++u) {
      values.emplace_back(elems, 0.01f * static_cast<float>(u + 1));
      values.emplace_back(3, 0.0f);
      model.begin_unit("block" + std::to_string(u));
      model.add("block" + std::to_string(u) + ".w", values[values.size() - 2]);
      model.add("block" + std::to_string(u) + ".b", values.back());
    }
  }
};

}  // namespace test
