//! \file io/manifest.hpp
//! The manifest of a sharded checkpoint (docs/checkpoints.md lists every field): the model
//! (parameter names, shapes, groups, units, fingerprint), the training state (optimizer and its
//! options per group, step count, loss scaler), the layout that saved it (world size, stage,
//! shard group, alignment), the data files with their sizes and checksums, and the *ranges*:
//! which file holds which elements of which parameter, for each kind of value (the fp32
//! parameter values, then each optimizer state). A loader of any world size and stage finds the
//! bytes of its own shard from the ranges alone.
//!
//! Written as JSON (nlohmann-json) with a "checksum" field: the XXH64 of the canonical dump of
//! everything else. parse_manifest() checks every field's presence and type, the format version,
//! the checksum, and that the ranges of every (parameter, kind) cover its elements exactly once;
//! any failure is a format_error naming the file and the field.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/io/checksum.hpp>
#include <shardkit/io/file.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace io {

struct manifest {
  //! The format this library writes; it reads this and every earlier version.
  static constexpr std::uint64_t current_version = 1;
  static constexpr const char* format_name = "shardkit-checkpoint";

  struct param {
    std::string name;
    std::vector<std::uint64_t> shape;
    std::uint64_t group = 0;  //!< optimizer parameter group
    std::uint64_t unit = 0;
    std::uint64_t numel() const {
      std::uint64_t n = 1;
      for (auto d : shape) n *= d;
      return n;
    }
  };
  struct unit {
    std::string name;
    std::uint64_t first = 0;  //!< index of its first parameter
    bool reshard_after_forward = true;
  };
  struct file_entry {
    std::string name;        //!< relative to the checkpoint directory
    std::uint64_t rank = 0;  //!< the rank that wrote it
    std::uint64_t bytes = 0;
    std::uint64_t data_bytes = 0;
    std::uint64_t xxh64 = 0;  //!< of the whole file
  };
  //! Elements [param_offset, param_offset + count) of parameter `param`, kind `kind`, as fp32 at
  //! byte `offset` of the data of file `file`.
  struct range {
    std::uint64_t param = 0;
    std::uint64_t kind = 0;
    std::uint64_t file = 0;
    std::uint64_t offset = 0;
    std::uint64_t param_offset = 0;
    std::uint64_t count = 0;
  };

  std::uint64_t version = current_version;
  // the model
  std::uint64_t fingerprint = 0;
  std::vector<param> params;
  std::vector<unit> units;
  // the training
  std::string working_dtype;
  std::string grad_dtype;
  std::string optimizer;
  //! Each group's hyper-parameters by name (lr, beta1, ...).
  std::vector<std::vector<std::pair<std::string, double>>> group_options;
  std::uint64_t step = 0;
  bool loss_scaling = false;
  double loss_scale = 1.0;
  std::uint64_t good_steps = 0;
  // the layout that saved it
  std::uint64_t world_size = 1;
  std::uint64_t stage = 0;
  std::uint64_t shard_group_size = 1;
  std::uint64_t alignment = 1;
  // the data
  std::vector<std::string> kinds;  //!< "values", then the optimizer's states
  std::vector<file_entry> files;
  std::vector<range> ranges;
};

namespace detail {
using json = nlohmann::json;

struct manifest_reader {
  const std::string& path;
  [[noreturn]] void bad(const std::string& where, const std::string& what) const {
    throw format_error(
        shardkit::detail::concat("checkpoint manifest '", path, "': ", where, " ", what));
  }
  const json& field(const json& j, const char* key, const std::string& where) const {
    if (!j.is_object()) bad(where, "is not an object");
    const auto it = j.find(key);
    if (it == j.end()) bad(where, shardkit::detail::concat("has no field '", key, "'"));
    return *it;
  }
  std::uint64_t u64(const json& j, const char* key, const std::string& where) const {
    const json& v = field(j, key, where);
    if (!v.is_number_unsigned()) {
      bad(where + "." + key, "is not a non-negative integer");
    }
    return v.get<std::uint64_t>();
  }
  double number(const json& j, const char* key, const std::string& where) const {
    const json& v = field(j, key, where);
    if (!v.is_number()) bad(where + "." + key, "is not a number");
    return v.get<double>();
  }
  bool boolean(const json& j, const char* key, const std::string& where) const {
    const json& v = field(j, key, where);
    if (!v.is_boolean()) bad(where + "." + key, "is not true or false");
    return v.get<bool>();
  }
  std::string str(const json& j, const char* key, const std::string& where) const {
    const json& v = field(j, key, where);
    if (!v.is_string()) bad(where + "." + key, "is not a string");
    return v.get<std::string>();
  }
  const json& array(const json& j, const char* key, const std::string& where) const {
    const json& v = field(j, key, where);
    if (!v.is_array()) bad(where + "." + key, "is not an array");
    return v;
  }
};

inline json manifest_body(const manifest& m) {
  json j;
  j["format"] = manifest::format_name;
  j["version"] = m.version;
  json model;
  model["fingerprint"] = to_hex(m.fingerprint);
  json params = json::array();
  for (const auto& p : m.params) {
    params.push_back({{"name", p.name}, {"shape", p.shape}, {"group", p.group}, {"unit", p.unit}});
  }
  model["parameters"] = std::move(params);
  json units = json::array();
  for (const auto& u : m.units) {
    units.push_back(
        {{"name", u.name}, {"first", u.first}, {"reshard_after_forward", u.reshard_after_forward}});
  }
  model["units"] = std::move(units);
  j["model"] = std::move(model);
  json training;
  training["working_dtype"] = m.working_dtype;
  training["grad_dtype"] = m.grad_dtype;
  training["optimizer"] = m.optimizer;
  json groups = json::array();
  for (const auto& g : m.group_options) {
    json o = json::object();
    for (const auto& [k, v] : g) o[k] = v;
    groups.push_back(std::move(o));
  }
  training["groups"] = std::move(groups);
  training["step"] = m.step;
  training["schedule_position"] = m.step;
  training["loss_scaling"] = m.loss_scaling;
  training["loss_scale"] = m.loss_scale;
  training["good_steps"] = m.good_steps;
  j["training"] = std::move(training);
  j["layout"] = {{"world_size", m.world_size},
                 {"stage", m.stage},
                 {"shard_group_size", m.shard_group_size},
                 {"alignment", m.alignment}};
  j["kinds"] = m.kinds;
  json files = json::array();
  for (const auto& f : m.files) {
    files.push_back({{"name", f.name},
                     {"rank", f.rank},
                     {"bytes", f.bytes},
                     {"data_bytes", f.data_bytes},
                     {"xxh64", to_hex(f.xxh64)}});
  }
  j["files"] = std::move(files);
  json ranges = json::array();
  for (const auto& r : m.ranges) {
    ranges.push_back(json::array({r.param, r.kind, r.file, r.offset, r.param_offset, r.count}));
  }
  j["ranges"] = std::move(ranges);
  return j;
}
}  // namespace detail

//! The manifest as JSON text, with its checksum.
inline std::string to_json(const manifest& m) {
  detail::json j = detail::manifest_body(m);
  const std::string canonical = j.dump();
  j["checksum"] = to_hex(xxh64(canonical.data(), canonical.size()));
  return j.dump(1) + "\n";
}

//! Parses and validates manifest text (see the file comment); `path` names it in messages.
inline manifest parse_manifest(std::string_view text, const std::string& path) {
  using detail::json;
  const detail::manifest_reader r{path};
  // Nesting deeper than a manifest's is refused while parsing (the parser itself is iterative):
  // the checksum's dump() recurses once per level, and brackets nested 100000 deep would
  // overflow the stack there.
  constexpr int max_depth = 32;
  bool too_deep = false;
  json j = json::parse(
      text.begin(), text.end(),
      [&too_deep](int depth, json::parse_event_t, json&) {
        if (depth > max_depth) too_deep = true;
        return depth <= max_depth;
      },
      /*allow_exceptions=*/false);
  if (j.is_discarded()) r.bad("", "is not valid JSON (truncated or damaged?)");
  if (too_deep) {
    r.bad("", shardkit::detail::concat("nests values deeper than ", max_depth, " levels"));
  }
  // from_hex's errors name the field; these name the file too
  auto hex = [&](std::string_view s, const std::string& where) {
    return from_hex(s, shardkit::detail::concat("checkpoint manifest '", path, "': ", where));
  };
  if (!j.is_object()) r.bad("", "is not a JSON object");
  if (r.str(j, "format", "the manifest") != manifest::format_name) {
    r.bad("", "is not a shardkit checkpoint manifest (field 'format')");
  }
  manifest m;
  m.version = r.u64(j, "version", "the manifest");
  if (m.version > manifest::current_version || m.version == 0) {
    r.bad("", shardkit::detail::concat("has format version ", m.version, "; this shardkit reads ",
                                       "versions 1 to ", manifest::current_version,
                                       " (written by a newer shardkit?)"));
  }
  const std::string sum = r.str(j, "checksum", "the manifest");
  j.erase("checksum");
  const std::string canonical = j.dump();
  if (hex(sum, "checksum") != xxh64(canonical.data(), canonical.size())) {
    r.bad("", "does not match its checksum (the file was modified or damaged)");
  }
  const json& model = r.field(j, "model", "the manifest");
  m.fingerprint = hex(r.str(model, "fingerprint", "model"), "model.fingerprint");
  const json& params = r.array(model, "parameters", "model");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string w = shardkit::detail::concat("model.parameters[", i, "]");
    manifest::param p;
    p.name = r.str(params[i], "name", w);
    const json& sh = r.array(params[i], "shape", w);
    std::uint64_t n = 1;
    for (const auto& d : sh) {
      if (!d.is_number_unsigned()) r.bad(w + ".shape", "holds a value that is not a size");
      p.shape.push_back(d.get<std::uint64_t>());
      if (__builtin_mul_overflow(n, p.shape.back(), &n)) r.bad(w + ".shape", "overflows");
    }
    p.group = r.u64(params[i], "group", w);
    p.unit = r.u64(params[i], "unit", w);
    m.params.push_back(std::move(p));
  }
  const json& units = r.array(model, "units", "model");
  for (std::size_t u = 0; u < units.size(); ++u) {
    const std::string w = shardkit::detail::concat("model.units[", u, "]");
    m.units.push_back({r.str(units[u], "name", w), r.u64(units[u], "first", w),
                       r.boolean(units[u], "reshard_after_forward", w)});
  }
  const json& tr = r.field(j, "training", "the manifest");
  m.working_dtype = r.str(tr, "working_dtype", "training");
  m.grad_dtype = r.str(tr, "grad_dtype", "training");
  m.optimizer = r.str(tr, "optimizer", "training");
  const json& groups = r.array(tr, "groups", "training");
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::string w = shardkit::detail::concat("training.groups[", g, "]");
    if (!groups[g].is_object()) r.bad(w, "is not an object");
    std::vector<std::pair<std::string, double>> o;
    for (auto it = groups[g].begin(); it != groups[g].end(); ++it) {
      if (!it.value().is_number()) r.bad(w + "." + it.key(), "is not a number");
      o.emplace_back(it.key(), it.value().get<double>());
    }
    m.group_options.push_back(std::move(o));
  }
  m.step = r.u64(tr, "step", "training");
  m.loss_scaling = r.boolean(tr, "loss_scaling", "training");
  m.loss_scale = r.number(tr, "loss_scale", "training");
  m.good_steps = r.u64(tr, "good_steps", "training");
  const json& lay = r.field(j, "layout", "the manifest");
  m.world_size = r.u64(lay, "world_size", "layout");
  m.stage = r.u64(lay, "stage", "layout");
  m.shard_group_size = r.u64(lay, "shard_group_size", "layout");
  m.alignment = r.u64(lay, "alignment", "layout");
  if (m.world_size == 0 || m.stage > 3 || m.shard_group_size == 0 || m.alignment == 0) {
    r.bad("layout", "holds an impossible world size, stage, shard group or alignment");
  }
  const json& kinds = r.array(j, "kinds", "the manifest");
  for (const auto& k : kinds) {
    if (!k.is_string()) r.bad("kinds", "holds a value that is not a string");
    m.kinds.push_back(k.get<std::string>());
  }
  if (m.kinds.empty() || m.kinds[0] != "values") r.bad("kinds", "does not start with \"values\"");
  const json& files = r.array(j, "files", "the manifest");
  for (std::size_t f = 0; f < files.size(); ++f) {
    const std::string w = shardkit::detail::concat("files[", f, "]");
    manifest::file_entry e;
    e.name = r.str(files[f], "name", w);
    if (e.name.empty() || e.name.find('/') != std::string::npos || e.name[0] == '.') {
      r.bad(w + ".name", "is not a plain file name");
    }
    e.rank = r.u64(files[f], "rank", w);
    e.bytes = r.u64(files[f], "bytes", w);
    e.data_bytes = r.u64(files[f], "data_bytes", w);
    e.xxh64 = hex(r.str(files[f], "xxh64", w), w + ".xxh64");
    m.files.push_back(std::move(e));
  }
  const json& ranges = r.array(j, "ranges", "the manifest");
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    const std::string w = shardkit::detail::concat("ranges[", k, "]");
    const json& x = ranges[k];
    if (!x.is_array() || x.size() != 6)
      r.bad(w, "is not [param, kind, file, offset, first, count]");
    std::uint64_t v[6];
    for (std::size_t c = 0; c < 6; ++c) {
      if (!x[c].is_number_unsigned()) r.bad(w, "holds a value that is not a size");
      v[c] = x[c].get<std::uint64_t>();
    }
    manifest::range rg{v[0], v[1], v[2], v[3], v[4], v[5]};
    if (rg.param >= m.params.size() || rg.kind >= m.kinds.size() || rg.file >= m.files.size()) {
      r.bad(w, "names a parameter, kind or file that does not exist");
    }
    std::uint64_t end = 0, bytes = 0;
    if (__builtin_add_overflow(rg.param_offset, rg.count, &end) ||
        end > m.params[rg.param].numel() ||
        __builtin_mul_overflow(rg.count, std::uint64_t{4}, &bytes) ||
        __builtin_add_overflow(rg.offset, bytes, &end) || end > m.files[rg.file].data_bytes) {
      r.bad(w, "lies outside its parameter or its file");
    }
    m.ranges.push_back(rg);
  }
  // Every (parameter, kind) is covered exactly once.
  std::vector<manifest::range> sorted = m.ranges;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return std::tie(a.param, a.kind, a.param_offset) < std::tie(b.param, b.kind, b.param_offset);
  });
  std::size_t at = 0;
  for (std::uint64_t p = 0; p < m.params.size(); ++p) {
    for (std::uint64_t kd = 0; kd < m.kinds.size(); ++kd) {
      std::uint64_t covered = 0;
      for (; at < sorted.size() && sorted[at].param == p && sorted[at].kind == kd; ++at) {
        if (sorted[at].param_offset != covered) {
          r.bad("ranges", shardkit::detail::concat("leave a gap or overlap in '", m.kinds[kd],
                                                   "' of parameter '", m.params[p].name,
                                                   "' at element ", covered));
        }
        covered += sorted[at].count;
      }
      if (covered != m.params[p].numel()) {
        r.bad("ranges", shardkit::detail::concat("cover ", covered, " of the ", m.params[p].numel(),
                                                 " elements of '", m.kinds[kd], "' of parameter '",
                                                 m.params[p].name, "'"));
      }
    }
  }
  return m;
}

//! Reads and validates `<dir>/manifest.json`. A directory without one is not a checkpoint.
inline manifest read_manifest(const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  if (!exists(dir))
    throw io_error(shardkit::detail::concat("checkpoint '", dir, "' does not exist"));
  if (!exists(path)) {
    throw format_error(shardkit::detail::concat("'", dir, "' is not a shardkit checkpoint: it has ",
                                                "no manifest.json (an interrupted save leaves "
                                                "'<dir>.partial', never a directory without one)"));
  }
  file f = file::open_read(path);
  const std::uint64_t n = f.size();
  if (n > (std::uint64_t{1} << 32)) {
    throw format_error(shardkit::detail::concat("'", path, "' is ", n, " bytes: not a manifest"));
  }
  std::string text(static_cast<std::size_t>(n), '\0');
  f.read_at(text.data(), text.size(), 0);
  return parse_manifest(text, path);
}

}  // namespace io
SHARDKIT_NAMESPACE_END
