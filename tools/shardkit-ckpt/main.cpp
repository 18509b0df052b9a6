// shardkit-ckpt: inspect, verify, export and reshard shardkit checkpoints offline, streaming
// (bounded memory whatever the model's size). docs/checkpoints.md describes the format.
//
//   shardkit-ckpt inspect DIR                     what the checkpoint holds
//   shardkit-ckpt verify DIR                      every file and block against its checksum
//   shardkit-ckpt export DIR OUT.safetensors [--dtype fp32|bf16|fp16]
//   shardkit-ckpt reshard DIR OUT --world-size M [--stage S] [--shard-group G] [--alignment A]
//
// Exit status: 0 when it did what was asked (verify: the checkpoint is intact), 1 when the
// checkpoint is damaged or an operation failed (the message says why), 2 for bad arguments.
#include <shardkit/core/layout.hpp>
#include <shardkit/io/block_file.hpp>
#include <shardkit/io/checkpoint.hpp>
#include <shardkit/io/export.hpp>
#include <shardkit/io/manifest.hpp>
#include <shardkit/io/plan.hpp>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace io = shardkit::io;

namespace {

//! Removes `path` (a partial output) unless disarmed: a failed export or reshard leaves nothing.
struct remove_unless_done {
  std::string path;
  bool done = false;
  ~remove_unless_done() {
    if (done) return;
    try {
      io::remove_all(path);
    } catch (...) {  // the failure that got here is the one to report
    }
  }
};

std::string shape_text(const std::vector<std::uint64_t>& s) {
  std::string t = "[";
  for (std::size_t k = 0; k < s.size(); ++k) t += (k ? ", " : "") + std::to_string(s[k]);
  return t + "]";
}

int inspect(const std::string& dir) {
  const io::manifest m = io::read_manifest(dir);
  std::uint64_t psi = 0, bytes = 0;
  for (const auto& p : m.params) psi += p.numel();
  for (const auto& f : m.files) bytes += f.bytes;
  std::printf("checkpoint %s (format version %llu)\n", dir.c_str(),
              static_cast<unsigned long long>(m.version));
  std::printf("  saved by %llu ranks at stage %llu, shard group %llu, alignment %llu\n",
              static_cast<unsigned long long>(m.world_size),
              static_cast<unsigned long long>(m.stage),
              static_cast<unsigned long long>(m.shard_group_size),
              static_cast<unsigned long long>(m.alignment));
  std::printf("  step %llu; optimizer %s; working %s, gradients %s; loss scaling %s",
              static_cast<unsigned long long>(m.step), m.optimizer.c_str(), m.working_dtype.c_str(),
              m.grad_dtype.c_str(), m.loss_scaling ? "on" : "off");
  if (m.loss_scaling) std::printf(" (scale %g)", m.loss_scale);
  std::printf("\n  model: %zu parameters, %llu elements, %zu units, fingerprint %s\n",
              m.params.size(), static_cast<unsigned long long>(psi), m.units.size(),
              io::to_hex(m.fingerprint).c_str());
  for (std::size_t g = 0; g < m.group_options.size(); ++g) {
    std::printf("  group %zu:", g);
    for (const auto& [k, v] : m.group_options[g]) std::printf(" %s=%g", k.c_str(), v);
    std::printf("\n");
  }
  std::printf("  %-40s %-20s %6s %6s\n", "parameter", "shape", "group", "unit");
  for (const auto& p : m.params) {
    std::printf("  %-40s %-20s %6llu %6llu\n", p.name.c_str(), shape_text(p.shape).c_str(),
                static_cast<unsigned long long>(p.group), static_cast<unsigned long long>(p.unit));
  }
  std::printf("  kinds:");
  for (const auto& k : m.kinds) std::printf(" %s", k.c_str());
  std::printf("\n  %zu files, %llu bytes:\n", m.files.size(),
              static_cast<unsigned long long>(bytes));
  for (const auto& f : m.files) {
    std::printf("    %s  rank %llu  %llu bytes  xxh64 %s\n", f.name.c_str(),
                static_cast<unsigned long long>(f.rank), static_cast<unsigned long long>(f.bytes),
                io::to_hex(f.xxh64).c_str());
  }
  return 0;
}

int verify(const std::string& dir) {
  const io::manifest m = io::read_manifest(dir);  // checks the manifest and its ranges
  int problems = 0;
  for (const auto& f : m.files) {
    const std::string path = dir + "/" + f.name;
    try {
      if (!io::exists(path)) throw shardkit::format_error("'" + path + "' is missing");
      io::block_file_reader r(path);
      if (r.data_bytes() != f.data_bytes) {
        throw shardkit::format_error("'" + path + "' holds " + std::to_string(r.data_bytes()) +
                                     " data bytes; the manifest says " +
                                     std::to_string(f.data_bytes));
      }
      const std::uint64_t sum = r.verify();
      if (sum != f.xxh64) {
        throw shardkit::format_error("'" + path + "' has checksum " + io::to_hex(sum) +
                                     "; the manifest says " + io::to_hex(f.xxh64));
      }
      std::printf("ok       %s\n", f.name.c_str());
    } catch (const std::exception& e) {
      std::printf("DAMAGED  %s: %s\n", f.name.c_str(), e.what());
      ++problems;
    }
  }
  std::printf(problems == 0 ? "checkpoint %s is intact\n" : "checkpoint %s is damaged\n",
              dir.c_str());
  return problems == 0 ? 0 : 1;
}

int export_file(const std::string& dir, const std::string& out, const std::string& type_name) {
  const io::manifest m = io::read_manifest(dir);
  const shardkit::dtype type = type_name == "bf16"   ? shardkit::dtype::bf16
                               : type_name == "fp16" ? shardkit::dtype::f16
                                                     : shardkit::dtype::f32;
  std::vector<std::string> names;
  std::vector<std::vector<std::size_t>> shapes;
  for (const auto& p : m.params) {
    names.push_back(p.name);
    shapes.emplace_back(p.shape.begin(), p.shape.end());
  }
  std::vector<std::uint64_t> offsets;
  std::uint64_t data_bytes = 0;
  const std::string header = io::safetensors_header_for(
      names, shapes, type, {{"format", "pt"}, {"shardkit_step", std::to_string(m.step)}}, offsets,
      data_bytes);
  const std::string tmp = out + ".partial";
  remove_unless_done cleanup{tmp};
  io::file f = io::file::create(tmp);
  f.resize(8 + header.size() + data_bytes);
  unsigned char size[8];
  std::uint64_t h = header.size();
  for (int b = 0; b < 8; ++b, h >>= 8) size[b] = static_cast<unsigned char>(h);
  f.write_at(size, 8, 0);
  f.write_at(header.data(), header.size(), 8);
  io::range_reader in(m, dir);
  constexpr std::size_t block = std::size_t{1} << 18;
  std::vector<float> values(block);
  std::vector<unsigned char> bytes(block * shardkit::size_of(type));
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const std::uint64_t n = m.params[i].numel();
    for (std::uint64_t at = 0; at < n; at += block) {
      const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(block, n - at));
      in.read(i, 0, at, len, values.data());
      shardkit::host::convert(values.data(), shardkit::dtype::f32, bytes.data(), type, len);
      f.write_at(bytes.data(), len * shardkit::size_of(type),
                 8 + header.size() + offsets[i] + at * shardkit::size_of(type));
    }
  }
  f.sync();
  f.close();
  io::rename_path(tmp, out);
  cleanup.done = true;
  io::sync_directory(io::parent_of(out));
  std::printf("wrote %s: %zu tensors, %llu bytes of %s\n", out.c_str(), names.size(),
              static_cast<unsigned long long>(data_bytes), type_name.c_str());
  return 0;
}

int reshard(const std::string& dir, const std::string& out, std::uint64_t world,
            std::uint64_t stage, std::uint64_t group, std::uint64_t alignment) {
  const io::manifest old = io::read_manifest(dir);
  if (world == 0) throw shardkit::invalid_argument("--world-size must be at least 1");
  if (stage > 3) throw shardkit::invalid_argument("--stage must be 0, 1, 2 or 3");
  const std::uint64_t G = stage == 0 ? 1 : (group == 0 ? world : group);
  if (stage != 0 && world % G != 0) {
    throw shardkit::invalid_argument("--shard-group " + std::to_string(G) +
                                     " does not divide --world-size " + std::to_string(world));
  }
  // The layout an engine of that world size and stage builds (units as groups for stages 2-3).
  std::vector<std::size_t> numels, starts;
  for (const auto& p : old.params) numels.push_back(p.numel());
  if (stage >= 2) {
    for (const auto& u : old.units) starts.push_back(u.first);
  }
  const shardkit::flat_layout layout = stage == 0
                                           ? shardkit::flat_layout(numels, {}, 1, 1)
                                           : shardkit::flat_layout(numels, starts, G, alignment);
  io::manifest m = old;
  m.world_size = world;
  m.stage = stage;
  m.shard_group_size = G;
  m.alignment = stage == 0 ? 1 : alignment;
  m.files.clear();
  m.ranges.clear();
  const std::string tmp = out + ".partial";
  io::remove_all(tmp);
  remove_unless_done cleanup{tmp};
  io::make_directory(tmp);
  io::range_reader in(old, dir);
  constexpr std::size_t block = std::size_t{1} << 18;
  std::vector<float> values(block);
  for (std::uint64_t q = 0; q < world; ++q) {
    const auto pieces = io::saved_pieces(layout, static_cast<int>(stage), world, G, q);
    if (pieces.empty()) continue;
    const std::string name = io::detail::rank_file_name(q);
    io::block_file_writer w(tmp + "/" + name);
    const std::uint64_t total = io::elements_of(pieces);
    const std::uint64_t file = m.files.size();
    for (std::size_t k = 0; k < m.kinds.size(); ++k) {
      std::uint64_t at = 0;
      for (const auto& pc : pieces) {
        m.ranges.push_back({pc.param, k, file, (k * total + at) * 4, pc.param_offset, pc.count});
        for (std::size_t b = 0; b < pc.count; b += block) {
          const std::size_t len = std::min(block, pc.count - b);
          in.read(pc.param, k, pc.param_offset + b, len, values.data());
          w.append(values.data(), len * 4);
        }
        at += pc.count;
      }
    }
    const auto info = w.finish();
    m.files.push_back({name, q, info.file_bytes, info.data_bytes, info.xxh64});
  }
  const std::string text = io::to_json(m);
  io::file f = io::file::create(tmp + "/manifest.json");
  f.write_at(text.data(), text.size(), 0);
  f.sync();
  f.close();
  io::sync_directory(tmp);
  io::replace_directory(tmp, out);
  cleanup.done = true;
  std::printf("wrote %s: %zu files for %llu ranks at stage %llu\n", out.c_str(), m.files.size(),
              static_cast<unsigned long long>(world), static_cast<unsigned long long>(stage));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardkit-ckpt: inspect, verify, export and reshard shardkit checkpoints"};
  app.require_subcommand(1);
  std::string dir, out, type = "fp32";
  std::uint64_t world = 0, stage = 3, group = 0, alignment = 1;
  auto* ins = app.add_subcommand("inspect", "print what a checkpoint holds");
  ins->add_option("dir", dir, "checkpoint directory")->required();
  auto* ver = app.add_subcommand("verify", "check every file and block against its checksum");
  ver->add_option("dir", dir, "checkpoint directory")->required();
  auto* exp = app.add_subcommand("export", "write the weights as one safetensors file");
  exp->add_option("dir", dir, "checkpoint directory")->required();
  exp->add_option("out", out, "safetensors file to write")->required();
  exp->add_option("--dtype", type, "element type of the file")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  auto* res = app.add_subcommand("reshard", "rewrite a checkpoint for another world size/stage");
  res->add_option("dir", dir, "checkpoint directory")->required();
  res->add_option("out", out, "directory to write")->required();
  res->add_option("--world-size", world, "ranks of the new layout")->required();
  res->add_option("--stage", stage, "ZeRO stage of the new layout (default 3)");
  res->add_option("--shard-group", group, "hybrid shard group size (default: all ranks)");
  res->add_option("--alignment", alignment, "per-rank slice alignment in elements (default 1)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help prints and exits 0; bad arguments exit 2
  }
  try {
    if (*ins) return inspect(dir);
    if (*ver) return verify(dir);
    if (*exp) return export_file(dir, out, type);
    if (*res) return reshard(dir, out, world, stage, group, alignment);
  } catch (const shardkit::invalid_argument& e) {
    std::fprintf(stderr, "shardkit-ckpt: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardkit-ckpt: %s\n", e.what());
    return 1;
  }
  return 2;
}
