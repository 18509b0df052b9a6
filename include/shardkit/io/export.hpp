//! \file io/export.hpp
//! Export of an engine's weights as one standard safetensors file, written by every rank at
//! once without gathering the model on any of them, and import into a model_spec.
//!
//!     shardkit::io::export_safetensors(eng, "model.safetensors", {.type = shardkit::dtype::bf16});
//!
//!     shardkit::io::safetensors_file f("model.safetensors");        // import: each rank reads
//!     shardkit::model_spec model;                                     // only what it holds
//!     shardkit::io::add_from_safetensors(model, f, "wte.weight");
//!
//! Export (collective): every rank computes the same header (the parameters in registration
//! order, with the shapes they were registered with, contiguous, the header padded to 8 bytes);
//! rank 0 creates `<path>.partial` at its full size and writes the header; every rank writes the
//! elements it saves (io/plan.hpp) at their offsets, converted from the fp32 master (or fp32
//! working) values to the chosen type (round to nearest even: a bf16 export is the working
//! copy); after every rank has synced, rank 0 renames the file into place. A failure on any rank
//! raises on every rank and leaves `<path>` as it was.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/io/file.hpp>
#include <shardkit/io/plan.hpp>
#include <shardkit/io/safetensors.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/zero/model.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace io {

//! Settings of an export.
struct export_options {
  //! Element type of every tensor in the file: fp32, bf16 or fp16.
  dtype type = dtype::f32;
  //! Extra "__metadata__" entries (shardkit adds "format": "pt" and "shardkit_step").
  std::map<std::string, std::string> metadata;
};

//! The header (without its 8-byte size) a model of `names` and `shapes` gets as `type`, and the
//! data offset of each tensor.
inline std::string safetensors_header_for(const std::vector<std::string>& names,
                                          const std::vector<std::vector<std::size_t>>& shapes,
                                          dtype type,
                                          const std::map<std::string, std::string>& metadata,
                                          std::vector<std::uint64_t>& offsets,
                                          std::uint64_t& data_bytes) {
  nlohmann::json j = nlohmann::json::object();
  std::uint64_t at = 0;
  offsets.clear();
  const std::uint64_t esize = size_of(type);
  for (std::size_t i = 0; i < names.size(); ++i) {
    std::uint64_t n = 1;
    for (auto d : shapes[i]) n *= d;
    offsets.push_back(at);
    j[names[i]] = {{"dtype", safetensors_dtype(type)},
                   {"shape", shapes[i]},
                   {"data_offsets", {at, at + n * esize}}};
    at += n * esize;
  }
  data_bytes = at;
  if (!metadata.empty()) j["__metadata__"] = metadata;
  std::string text = j.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

//! Writes the weights of `e` to `path` (see the file comment). Collective: every rank calls it.
template <class Engine>
void export_safetensors(Engine& e, const std::string& path, export_options opts = {}) {
  auto& world = e.topo().world();
  const auto& reg = e.registry();
  const std::size_t N = static_cast<std::size_t>(world.size());
  const std::size_t me = static_cast<std::size_t>(world.rank());
  const std::size_t G = Engine::stage == 0 ? 1 : static_cast<std::size_t>(e.shard_size());
  const std::string tmp = path + ".partial";
  std::vector<std::string> names;
  std::vector<std::vector<std::size_t>> shapes;
  for (std::size_t i = 0; i < reg.size(); ++i) {
    names.push_back(reg.name(i));
    shapes.push_back(reg.shape(i));
  }
  auto meta = opts.metadata;
  meta.emplace("format", "pt");
  meta.emplace("shardkit_step", std::to_string(e.steps_taken()));
  std::vector<std::uint64_t> offsets;
  std::uint64_t data_bytes = 0;
  detail::agreement step;
  std::string header;
  try {
    (void)safetensors_dtype(opts.type);  // fp32, bf16 or fp16
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (names[i] == "__metadata__" || names[i].empty()) {
        shardkit::detail::raise("export_safetensors: parameter #", i, " is named '", names[i],
                                "', which safetensors cannot hold");
      }
    }
    header = safetensors_header_for(names, shapes, opts.type, meta, offsets, data_bytes);
    if (me == 0) {
      make_directories(parent_of(path));
      file f = file::create(tmp);
      f.resize(8 + header.size() + data_bytes);
      unsigned char size[8];
      std::uint64_t h = header.size();
      for (int b = 0; b < 8; ++b, h >>= 8) size[b] = static_cast<unsigned char>(h);
      f.write_at(size, 8, 0);
      f.write_at(header.data(), header.size(), 8);
      f.sync();
      f.close();
    }
  } catch (const std::exception& x) {
    step.failed = 1;
    step.message = x.what();
  }
  auto check = [&](const char* what) {
    const auto all = detail::agree(world, e.space(), step);
    const std::string failed = detail::failures(all);
    if (failed.empty()) return;
    if (me == 0) {
      try {
        remove_all(tmp);
      } catch (...) {  // the reason is in the message
      }
    }
    throw io_error(shardkit::detail::concat("safetensors export to '", path, "' failed ", what,
                                            "; '", path, "' is unchanged: ", failed));
  };
  check("preparing the file");
  try {
    const auto pieces = saved_pieces(e.layout(), Engine::stage, N, G, me);
    if (!pieces.empty()) {
      file f = file::open_write(tmp);
      const std::uint64_t data_start = 8 + header.size();
      const std::size_t esize = size_of(opts.type);
      constexpr std::size_t block = std::size_t{1} << 18;
      buffer<float, host_space> values(block, &e.memory(), memory_category::io_staging);
      std::vector<unsigned char> out(block * esize);
      for (const auto& pc : pieces) {
        for (std::size_t at = 0; at < pc.count; at += block) {
          const std::size_t n = std::min(block, pc.count - at);
          flat_layout::piece part = pc;
          part.shard_offset += at;
          part.full_offset += at;
          part.count = n;
          if constexpr (Engine::has_master) {
            e.space().download(e.optimizer().master().data() + part.shard_offset, values.data(),
                               dtype::f32, n);
          } else {
            const auto w = e.parameters().working();
            e.space().download(w.data + w.offset_of(part), values.data(), dtype::f32, n);
          }
          host::convert(values.data(), dtype::f32, out.data(), opts.type, n);
          f.write_at(out.data(), n * esize,
                     data_start + offsets[pc.param] + (pc.param_offset + at) * esize);
        }
      }
      f.sync();
      f.close();
    }
  } catch (const std::exception& x) {
    step.failed = 1;
    step.message = x.what();
  }
  check("writing the tensors");
  try {
    if (me == 0) {
      rename_path(tmp, path);
      sync_directory(parent_of(path));
    }
  } catch (const std::exception& x) {
    step.failed = 1;
    step.message = x.what();
  }
  check("putting the file in place");
}

//! Registers tensor `name` of `f` as a parameter of `model`, initialised from the file range by
//! range (each rank reads only what it holds). `f` must stay open until the engine is built.
inline std::size_t add_from_safetensors(model_spec& model, safetensors_file& f,
                                        const std::string& name, std::size_t param_group = 0) {
  const auto& e = f.entry(name);
  std::vector<std::size_t> shape(e.shape.begin(), e.shape.end());
  if (shape.empty()) shape = {};
  return model.add(name, std::move(shape), f.initializer(name), param_group);
}

}  // namespace io
SHARDKIT_NAMESPACE_END
