//! \file zero/fingerprint.hpp
//! Fingerprints of what must agree: between the ranks of one engine, and between a checkpoint
//! and the engine that loads it. A fingerprint is a list of named 64-bit hashes, one per field
//! (parameter names, shapes, units, ...), so a mismatch is reported by the field that differs,
//! not as "something is different".
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/hash.hpp>
#include <shardkit/zero/registry.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN

//! One field of a fingerprint.
struct fingerprint_field {
  std::string name;
  std::uint64_t hash = 0;
  friend bool operator==(const fingerprint_field&, const fingerprint_field&) = default;
};

using fingerprint = std::vector<fingerprint_field>;

//! The model's fields: parameter names (in order), their shapes, their optimizer parameter
//! groups, and the units (where each starts, its name, its reshard_after_forward).
inline fingerprint model_fingerprint(const param_registry& reg) {
  stable_hash names, shapes, groups, units;
  names.u64(reg.size());
  for (std::size_t i = 0; i < reg.size(); ++i) {
    names.str(reg.name(i));
    const auto& sh = reg.shape(i);
    shapes.u64(sh.size());
    for (const std::size_t d : sh) shapes.u64(d);
    groups.u64(reg.param_group(i));
  }
  units.u64(reg.num_units());
  for (std::size_t u = 0; u < reg.num_units(); ++u) {
    units.u64(reg.unit_begin(u)).str(reg.unit_name(u));
    units.u64(reg.options_of_unit(u).reshard_after_forward ? 1 : 0);
  }
  return {{"parameter names", names.value()},
          {"parameter shapes", shapes.value()},
          {"parameter groups", groups.value()},
          {"units", units.value()}};
}

//! One hash of all fields.
inline std::uint64_t combined(const fingerprint& f) {
  stable_hash h;
  for (const auto& x : f) h.str(x.name).u64(x.hash);
  return h.value();
}

//! "parameter shapes, units" for the fields of `a` whose hash differs from `b`'s (by name).
inline std::string differing_fields(const fingerprint& a, const fingerprint& b) {
  std::string out;
  for (const auto& x : a) {
    bool same = false;
    for (const auto& y : b) same = same || (y.name == x.name && y.hash == x.hash);
    if (!same) out += (out.empty() ? "" : ", ") + x.name;
  }
  return out;
}

SHARDKIT_NAMESPACE_END
