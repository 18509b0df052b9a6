// shardkit_io_helper: makes and reads the checkpoints and safetensors files that the tests of
// shardkit-ckpt (ckpt_tool_check.cmake) and of interoperability with the Python safetensors
// library (interop_check.py) work on. It trains io_model.hpp's model on thread ranks and
// prints hashes of what the engines hold, so that a script can compare a checkpoint, what the
// tool made of it, and an engine that loaded that.
//
//   train-save DIR --ranks N --stage S [--steps K] [--shard-group G]
//   load DIR --ranks M --stage T [--shard-group G]
//       print "state <hex>" (step, fp32 values and both Adam moments of every element),
//       "values <hex>" (names, shapes, fp32 values) and "working <hex>" (the bf16 values)
//   st-hash FILE                 "F32 <hex>" or "BF16 <hex>": the file's tensors hashed as
//                                values/working are (it must hold the model's names and shapes)
//   export FILE --ranks N --stage S --dtype fp32|bf16 [--expect JSON]
//                                trains two steps, exports; JSON gets names, shapes and the
//                                exported values' bits (fp32 master or bf16 working bits)
//   import FILE --ranks M --stage T --json OUT
//                                an engine built from every tensor of FILE (add_from_safetensors);
//                                OUT gets each parameter's shape and fp32 values as bits
//   flip FILE OFFSET             XORs one byte (OFFSET < 0: from the end) with 0x20
//
// Exit status 0, or 1 with a message on stderr.
#include <shardkit/io/checkpoint.hpp>
#include <shardkit/io/export.hpp>
#include <shardkit/io/safetensors.hpp>

#include "io/io_model.hpp"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace io = shardkit::io;
using shardkit::thread_comm;

namespace {

struct args {
  std::vector<std::string> pos;
  std::map<std::string, std::string> opt;
  int num(const std::string& k, int def = -1) const {
    const auto it = opt.find(k);
    if (it == opt.end()) {
      if (def < 0) throw std::runtime_error("missing " + k);
      return def;
    }
    return std::stoi(it->second);
  }
  std::string str(const std::string& k, const std::string& def = "") const {
    const auto it = opt.find(k);
    return it == opt.end() ? def : it->second;
  }
};

std::string hex(std::uint64_t v) {
  return io::to_hex(v);
}

void print_hashes(const iot::whole_state& w) {
  if (!w.failure.empty()) throw std::runtime_error("the ranks' states do not fit: " + w.failure);
  std::printf("state %s\nvalues %s\nworking %s\n", hex(iot::state_hash(w)).c_str(),
              hex(iot::values_hash(w.kinds[0])).c_str(), hex(iot::values_hash(w.working)).c_str());
}

shardkit::engine_options options(int stage, int group) {
  shardkit::engine_options eo;
  eo.shard_group_size = stage == 0 ? 0 : static_cast<std::size_t>(group);
  return eo;
}

int train_save(const args& a) {
  const std::string dir = a.pos.at(1);
  const int n = a.num("--ranks"), s = a.num("--stage"), steps = a.num("--steps", 2);
  const int g = a.num("--shard-group", 0);
  const auto ranks = iot::with_stage(s, [&]<int S>() {
    return shardkit::run_ranks(n, [&](thread_comm& c) {
      iot::engine_t<S> eng(c, iot::make_model(), iot::groups(), options(S, g));
      iot::train(eng, c.rank(), 1, steps);
      io::save(eng, dir);
      return iot::capture(eng);
    });
  });
  print_hashes(iot::assemble(ranks));
  return 0;
}

int load(const args& a) {
  const std::string dir = a.pos.at(1);
  const int n = a.num("--ranks"), s = a.num("--stage"), g = a.num("--shard-group", 0);
  const auto ranks = iot::with_stage(s, [&]<int S>() {
    return shardkit::run_ranks(n, [&](thread_comm& c) {
      iot::engine_t<S> eng(c, iot::make_model(), iot::groups(), options(S, g));
      io::load(eng, dir);
      return iot::capture(eng);
    });
  });
  print_hashes(iot::assemble(ranks));
  return 0;
}

int st_hash(const args& a) {
  io::safetensors_file f(a.pos.at(1));
  const auto& defs = iot::shaped_model();
  std::vector<std::vector<std::uint32_t>> values;
  std::string dtype;
  for (const auto& d : defs) {
    const auto& e = f.entry(d.name);
    if (e.shape != std::vector<std::uint64_t>(d.shape.begin(), d.shape.end())) {
      throw std::runtime_error("tensor '" + d.name + "' has another shape than the model's");
    }
    if (!dtype.empty() && e.dtype != dtype) throw std::runtime_error("tensors of two dtypes");
    dtype = e.dtype;
    std::vector<float> v(iot::numel(d.shape));
    f.read(d.name, 0, v);
    values.emplace_back();
    for (float x : v) {
      const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
      values.back().push_back(dtype == "BF16" ? b >> 16 : b);  // bf16: exactly its bits
    }
  }
  if (f.header().entries.size() != defs.size()) throw std::runtime_error("extra tensors");
  std::printf("%s %s\n", dtype.c_str(), hex(iot::values_hash(values)).c_str());
  return 0;
}

int export_file(const args& a) {
  const std::string path = a.pos.at(1);
  const int n = a.num("--ranks"), s = a.num("--stage");
  const std::string type = a.str("--dtype", "fp32");
  if (type != "fp32" && type != "bf16") throw std::runtime_error("--dtype fp32 or bf16");
  const auto ranks = iot::with_stage(s, [&]<int S>() {
    return shardkit::run_ranks(n, [&](thread_comm& c) {
      iot::engine_t<S> eng(c, iot::make_model(), iot::groups());
      iot::train(eng, c.rank(), 1, 2);
      io::export_safetensors(eng, path,
                             {.type = type == "bf16" ? shardkit::dtype::bf16 : shardkit::dtype::f32,
                              .metadata = {{"written_by", "shardkit_io_helper"}}});
      return iot::capture(eng);
    });
  });
  const auto w = iot::assemble(ranks);
  if (!w.failure.empty()) throw std::runtime_error(w.failure);
  const std::string expect = a.str("--expect");
  if (!expect.empty()) {
    nlohmann::json j;
    j["metadata"] = {{"format", "pt"},
                     {"shardkit_step", std::to_string(w.step)},
                     {"written_by", "shardkit_io_helper"}};
    j["dtype"] = type == "bf16" ? "BF16" : "F32";
    j["tensors"] = nlohmann::json::array();
    const auto& defs = iot::shaped_model();
    for (std::size_t p = 0; p < defs.size(); ++p) {
      j["tensors"].push_back({{"name", defs[p].name},
                              {"shape", defs[p].shape},
                              {"bits", type == "bf16" ? w.working[p] : w.kinds[0][p]}});
    }
    std::ofstream(expect) << j.dump(1) << "\n";
  }
  return 0;
}

int import_file(const args& a) {
  const std::string path = a.pos.at(1);
  const int n = a.num("--ranks"), s = a.num("--stage");
  std::vector<iot::param_def> defs;
  {
    io::safetensors_file f(path);
    for (const auto& e : f.header().entries) {
      defs.push_back({e.name, std::vector<std::size_t>(e.shape.begin(), e.shape.end()), false, 0});
    }
  }
  const auto ranks = iot::with_stage(s, [&]<int S>() {
    return shardkit::run_ranks(n, [&](thread_comm& c) {
      io::safetensors_file f(path);  // each rank its own reader
      shardkit::model_spec m;
      for (const auto& d : defs) io::add_from_safetensors(m, f, d.name);
      iot::engine_t<S> eng(c, m);
      return iot::capture(eng);
    });
  });
  const auto w = iot::assemble(ranks, defs);
  if (!w.failure.empty()) throw std::runtime_error(w.failure);
  nlohmann::json j = nlohmann::json::object();
  for (std::size_t p = 0; p < defs.size(); ++p) {
    j[defs[p].name] = {{"shape", defs[p].shape}, {"bits", w.kinds[0][p]}};
  }
  std::ofstream(a.str("--json")) << j.dump() << "\n";
  return 0;
}

int flip(const args& a) {
  const std::string path = a.pos.at(1);
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  f.seekg(0, std::ios::end);
  const long long size = f.tellg();
  long long at = std::stoll(a.pos.at(2));
  if (at < 0) at += size;
  if (at < 0 || at >= size) throw std::runtime_error("offset outside the file");
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(at);
  f.write(&c, 1);
  if (!f) throw std::runtime_error("cannot write " + path);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s.size() > 2 && s.rfind("--", 0) == 0 && i + 1 < argc) {
      a.opt[s] = argv[++i];
    } else {
      a.pos.push_back(s);
    }
  }
  try {
    if (a.pos.empty()) throw std::runtime_error("no command");
    const std::string& cmd = a.pos[0];
    if (cmd == "train-save") return train_save(a);
    if (cmd == "load") return load(a);
    if (cmd == "st-hash") return st_hash(a);
    if (cmd == "export") return export_file(a);
    if (cmd == "import") return import_file(a);
    if (cmd == "flip") return flip(a);
    throw std::runtime_error("unknown command '" + cmd + "'");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardkit_io_helper: %s\n", e.what());
    return 1;
  }
}
