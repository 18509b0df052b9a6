//! \file zero/fingerprint.hpp
//! Fingerprints of what must agree: between the ranks of one engine, and between a checkpoint
//! and the engine that loads it. A fingerprint is a list of named 64-bit hashes, one per field
//! (parameter names, shapes, units, ...), so a mismatch is reported by the field that differs,
//! not as "something is different".
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/hash.hpp>
#include <shardkit/zero/registry.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
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

//! Most fields agree_across_ranks() compares.
inline constexpr std::size_t max_fingerprint_fields = 48;

namespace detail {
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string out = "{";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  return out + "}";
}
}  // namespace detail

//! Collective, once, before anything else a constructor exchanges: runs `local()` (this rank's
//! own checks, returning its fingerprint) and exchanges with every rank of `comm` whether the
//! checks passed and the fingerprint (one all-gather of 8·(1 + max_fingerprint_fields) bytes).
//! Then, on every rank: a rank whose checks failed rethrows its own error; the others raise
//! invalid_argument naming the ranks that failed; if the checks passed everywhere but the
//! fingerprints differ, every rank raises invalid_argument naming each field that differs and
//! which ranks hold which value. So a fault on one rank never leaves the others waiting for it,
//! and ranks with different models or settings never train on. Ranks are those of `comm`;
//! `world_rank_of` maps them to world ranks for the messages (identity by default).
//! `gather(in, out, n)` all-gathers n host words over `comm` (out holds comm.size()·n): a
//! communicator of host memory does it directly (the forms below); one of device memory needs
//! its space's staging (space_ops::all_gather_host).
template <class Comm, class Local, class WorldRank, class Gather>
void agree_across_ranks(Comm& comm, const char* who, Local&& local, WorldRank&& world_rank_of,
                        Gather&& gather) {
  const std::size_t W = 1 + max_fingerprint_fields;
  std::vector<std::uint64_t> mine(W, 0), all;
  std::exception_ptr error;
  fingerprint fp;
  try {
    fp = local();
    if (fp.size() > max_fingerprint_fields) {
      detail::raise<usage_error>(who, ": a fingerprint of ", fp.size(), " fields (at most ",
                                 max_fingerprint_fields, ")");
    }
    mine[0] = 1 + fp.size();
    for (std::size_t f = 0; f < fp.size(); ++f) mine[1 + f] = fp[f].hash;
  } catch (...) {
    error = std::current_exception();
    mine[0] = 0;
  }
  const auto n = static_cast<std::size_t>(comm.size());
  all.resize(W * n);
  gather(mine.data(), all.data(), W);
  if (error) std::rethrow_exception(error);
  std::vector<int> failed;
  for (std::size_t q = 0; q < n; ++q) {
    if (all[q * W] == 0) failed.push_back(world_rank_of(static_cast<int>(q)));
  }
  if (!failed.empty()) {
    detail::raise(who, ": rank(s) ", detail::rank_list(failed), " of ", n,
                  " refused their arguments (each raised the reason); this rank (",
                  world_rank_of(comm.rank()), ") stops with them");
  }
  std::string diff;
  for (std::size_t f = 0; f < fp.size(); ++f) {
    std::vector<std::uint64_t> values;
    std::vector<std::vector<int>> holders;
    for (std::size_t q = 0; q < n; ++q) {
      const std::uint64_t v = all[q * W] == mine[0] ? all[q * W + 1 + f] : ~all[q * W];
      std::size_t k = 0;
      while (k < values.size() && values[k] != v) ++k;
      if (k == values.size()) {
        values.push_back(v);
        holders.emplace_back();
      }
      holders[k].push_back(world_rank_of(static_cast<int>(q)));
    }
    if (values.size() > 1) {
      diff += (diff.empty() ? "" : "; ") + fp[f].name + " differs: ranks ";
      for (std::size_t k = 0; k < holders.size(); ++k) {
        diff += (k == 0 ? "" : " vs ") + detail::rank_list(holders[k]);
      }
    }
  }
  if (!diff.empty()) {
    detail::raise(who, ": the ranks were given different models or settings (", diff,
                  "); every rank must build the same model with the same options");
  }
}

template <class Comm, class Local, class WorldRank>
void agree_across_ranks(Comm& comm, const char* who, Local&& local, WorldRank&& world_rank_of) {
  agree_across_ranks(comm, who, local, world_rank_of,
                     [&](const std::uint64_t* in, std::uint64_t* out, std::size_t n) {
                       comm.all_gather(in, out, n);
                     });
}

template <class Comm, class Local>
void agree_across_ranks(Comm& comm, const char* who, Local&& local) {
  agree_across_ranks(comm, who, local, [](int r) { return r; });
}

SHARDKIT_NAMESPACE_END
