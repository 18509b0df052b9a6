// What the parsers of io/ must do with any input, shared by the deterministic mutation test
// (test_io_fuzz.cpp) and the libFuzzer targets (fuzz/): accept it, and then hold what they
// promise, or reject it with a format_error naming the file; never another exception, never a
// crash. Each check_* function raises fuzz::violation (deliberately not a shardkit::error) when
// the library breaks that rule, and returns whether the input was accepted.
//
//  - manifests (io::parse_manifest): an accepted manifest's ranges lie within their parameter
//    and file and cover every (parameter, kind) exactly once; it writes back (io::to_json) to
//    text that parses to the same manifest;
//  - safetensors headers (io::parse_safetensors_header) and files (io::safetensors_file): the
//    accepted entries have known dtypes, sizes that match their shapes, and tile the data from 0
//    to its end; reading any float tensor of an accepted file gives its bytes;
//  - block files (io::block_file_reader): checked against an independent model of the format
//    (written here from the layout in io/block_file.hpp, with exact 128-bit arithmetic): the
//    reader accepts a file exactly when its footer and table check, a read succeeds exactly
//    when every block it touches checks, and what it returns is the file's bytes.
#pragma once

#include <shardkit/core/error.hpp>
#include <shardkit/io/block_file.hpp>
#include <shardkit/io/checksum.hpp>
#include <shardkit/io/manifest.hpp>
#include <shardkit/io/safetensors.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <typeinfo>
#include <vector>

namespace fuzz {

namespace io = shardkit::io;

//! The library broke its rule for an input.
struct violation : std::logic_error {
  using std::logic_error::logic_error;
};

//! Runs f(): true when it returns, false when it raises a format_error that names `path`;
//! anything else is a violation (f's own violations pass through).
template <class F>
bool accepted(const std::string& path, F&& f) {
  try {
    f();
    return true;
  } catch (const violation&) {
    throw;
  } catch (const shardkit::format_error& e) {
    if (std::string_view(e.what()).find(path) == std::string_view::npos) {
      throw violation(std::string("a format_error that does not name the file: ") + e.what());
    }
    return false;
  } catch (const std::exception& e) {
    throw violation(std::string("an exception other than format_error (") + typeid(e).name() +
                    "): " + e.what());
  } catch (...) {
    throw violation("a non-standard exception");
  }
}

inline void write_file(const std::string& path, std::string_view bytes) {
  // a new file, not a truncated one: ext4 flushes a truncated file's new data on close
  // (auto_da_alloc), which made each case cost milliseconds
  std::remove(path.c_str());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) throw std::runtime_error("cannot write " + path);
}

__extension__ using u128 = unsigned __int128;  // exact sizes: no overflow to reason about

// ---- manifests ------------------------------------------------------------------------------

//! A manifest of 3 writing ranks with every kind of parameter (matrices, a scalar, zero-size
//! ones), as a checkpoint of stage 0 on 3 ranks would list it (the flat model cut in 3 chunks).
inline io::manifest sample_manifest() {
  io::manifest m;
  m.fingerprint = 0x0123456789abcdefull;
  m.params = {{"embed.weight", {7, 5}, 0, 0},    {"embed.scale", {}, 1, 0},
              {"block.empty", {3, 0}, 1, 1},     {"block.bias", {13}, 1, 1},
              {"block.weight", {4, 3, 2}, 0, 1}, {"head.weight", {2, 4}, 0, 2}};
  m.units = {{"embed", 0, true}, {"block", 2, false}, {"head", 5, true}};
  m.working_dtype = "bf16";
  m.grad_dtype = "bf16";
  m.optimizer = "adamw";
  m.group_options = {{{"beta1", 0.9}, {"lr", 0.01}, {"weight_decay", 0.05}}, {{"lr", 0.02}}};
  m.step = 7;
  m.loss_scaling = true;
  m.loss_scale = 1024;
  m.good_steps = 3;
  m.world_size = 3;
  m.stage = 0;
  m.shard_group_size = 1;
  m.alignment = 1;
  m.kinds = {"values", "exp_avg", "exp_avg_sq"};
  std::uint64_t total = 0;
  for (const auto& p : m.params) total += p.numel();
  const std::uint64_t ranks = 3;
  for (std::uint64_t r = 0; r < ranks; ++r) {
    const std::uint64_t lo = total * r / ranks, hi = total * (r + 1) / ranks;
    struct piece {
      std::uint64_t param, param_offset, count;
    };
    std::vector<piece> pieces;
    std::uint64_t start = 0;
    for (std::uint64_t i = 0; i < m.params.size(); ++i) {
      const std::uint64_t n = m.params[i].numel();
      const std::uint64_t b = std::max(lo, start), e = std::min(hi, start + n);
      if (b < e) pieces.push_back({i, b - start, e - b});
      start += n;
    }
    const std::uint64_t file = m.files.size();
    std::uint64_t at = 0;
    for (const auto& pc : pieces) {
      for (std::uint64_t k = 0; k < m.kinds.size(); ++k) {
        m.ranges.push_back(
            {pc.param, k, file, (k * (hi - lo) + at) * 4, pc.param_offset, pc.count});
      }
      at += pc.count;
    }
    char name[32];
    std::snprintf(name, sizeof name, "rank-%05llu.bin", static_cast<unsigned long long>(r));
    const std::uint64_t data = (hi - lo) * 4 * m.kinds.size();
    m.files.push_back(
        {name, r, data + 8 * ((data + 1023) / 1024) + 48, data, 0x1111111111111111ull * (r + 1)});
  }
  return m;
}

//! What an accepted manifest must be (see the file comment), checked without the library's
//! own coverage loop: the non-empty ranges of each (parameter, kind), sorted, start at 0, each
//! where the one before ends, and end at the parameter's size.
inline void check_manifest_invariants(const io::manifest& m) {
  auto fail = [](const std::string& s) { throw violation("accepted a manifest where " + s); };
  if (m.version == 0 || m.version > io::manifest::current_version) fail("the version is unknown");
  if (m.kinds.empty() || m.kinds[0] != "values") fail("the kinds do not start with values");
  if (m.world_size == 0 || m.stage > 3 || m.shard_group_size == 0 || m.alignment == 0) {
    fail("the layout is impossible");
  }
  std::vector<u128> numels;
  for (const auto& p : m.params) {
    u128 n = 1;
    for (auto d : p.shape) {
      n *= d;
      if (n > ~std::uint64_t{0}) fail("a shape overflows");
    }
    numels.push_back(n);
  }
  for (const auto& f : m.files) {
    if (f.name.empty() || f.name.find('/') != std::string::npos || f.name[0] == '.') {
      fail("a file name is not a plain name: '" + f.name + "'");
    }
  }
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::vector<std::pair<u128, u128>>> cover;
  for (const auto& r : m.ranges) {
    if (r.param >= m.params.size() || r.kind >= m.kinds.size() || r.file >= m.files.size()) {
      fail("a range names what does not exist");
    }
    if (u128{r.param_offset} + r.count > numels[r.param]) fail("a range lies outside its param");
    if (u128{r.offset} + u128{r.count} * 4 > m.files[r.file].data_bytes) {
      fail("a range lies outside its file");
    }
    if (r.count != 0) cover[{r.param, r.kind}].push_back({r.param_offset, r.count});
  }
  for (std::uint64_t p = 0; p < m.params.size(); ++p) {
    for (std::uint64_t k = 0; k < m.kinds.size(); ++k) {
      auto& v = cover[{p, k}];
      std::sort(v.begin(), v.end());
      u128 at = 0;
      for (const auto& [off, n] : v) {
        if (off != at) fail("a range leaves a gap or overlaps in parameter " + std::to_string(p));
        at += n;
      }
      if (at != numels[p]) fail("the ranges do not cover parameter " + std::to_string(p));
    }
  }
}

inline auto manifest_fields(const io::manifest& m) {
  std::vector<std::tuple<std::string, std::vector<std::uint64_t>, std::uint64_t, std::uint64_t>> p;
  for (const auto& x : m.params) p.emplace_back(x.name, x.shape, x.group, x.unit);
  std::vector<std::tuple<std::string, std::uint64_t, bool>> u;
  for (const auto& x : m.units) u.emplace_back(x.name, x.first, x.reshard_after_forward);
  std::vector<std::tuple<std::string, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t>>
      f;
  for (const auto& x : m.files) f.emplace_back(x.name, x.rank, x.bytes, x.data_bytes, x.xxh64);
  std::vector<std::array<std::uint64_t, 6>> r;
  for (const auto& x : m.ranges) {
    r.push_back({x.param, x.kind, x.file, x.offset, x.param_offset, x.count});
  }
  return std::make_tuple(m.version, m.fingerprint, p, u, m.working_dtype, m.grad_dtype, m.optimizer,
                         m.group_options, m.step, m.loss_scaling, m.loss_scale, m.good_steps,
                         m.world_size, m.stage, m.shard_group_size, m.alignment, m.kinds, f, r);
}

//! parse_manifest on `text`: see the file comment.
inline bool check_manifest(std::string_view text, const std::string& path) {
  return accepted(path, [&] {
    const io::manifest m = io::parse_manifest(text, path);
    check_manifest_invariants(m);
    std::string again;
    try {
      again = io::to_json(m);
    } catch (const std::exception& e) {
      throw violation(std::string("an accepted manifest cannot be written back: ") + e.what());
    }
    try {
      const io::manifest m2 = io::parse_manifest(again, path);
      if (manifest_fields(m2) != manifest_fields(m)) {
        throw violation("an accepted manifest, written back and parsed, differs");
      }
    } catch (const shardkit::format_error& e) {
      throw violation(std::string("an accepted manifest, written back, is rejected: ") + e.what());
    }
  });
}

//! `text` with its "checksum" field set to the checksum of the rest (as parse_manifest computes
//! it: the canonical dump of the object without it), or unchanged when it is not an object with
//! a 16-character checksum string. Lets mutations reach past the checksum.
inline std::string resign_manifest(const std::string& text) {
  using json = nlohmann::json;
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return text;
  j.erase("checksum");
  std::string canonical;
  try {
    canonical = j.dump();
  } catch (...) {
    return text;
  }
  const std::string sum = io::to_hex(io::xxh64(canonical.data(), canonical.size()));
  // replace the last "checksum" value in the text (the one a parser keeps)
  const auto key = text.rfind("\"checksum\"");
  if (key == std::string::npos) return text;
  auto q = text.find('"', key + 10);
  if (q == std::string::npos || q + 17 > text.size() || text[q + 17] != '"') return text;
  for (std::size_t c = key + 10; c < q; ++c) {
    if (text[c] != ':' && text[c] != ' ' && text[c] != '\n') return text;
  }
  std::string out = text;
  out.replace(q + 1, 16, sum);
  return out;
}

// ---- safetensors -----------------------------------------------------------------------------

//! A valid header and its data size: every dtype size, a scalar, zero-size tensors, metadata.
inline std::pair<std::string, std::uint64_t> sample_safetensors_header() {
  nlohmann::json j = nlohmann::json::object();
  std::uint64_t at = 0;
  auto add = [&](const std::string& name, const char* dtype, std::vector<std::uint64_t> shape) {
    std::uint64_t n = io::safetensors_dtype_bytes(dtype);
    for (auto d : shape) n *= d;
    j[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {at, at + n}}};
    at += n;
  };
  add("embed.weight", "F32", {3, 4});
  add("embed.scale", "F32", {});
  add("empty", "BF16", {2, 0});
  add("block.weight", "BF16", {5, 2});
  add("block.bias", "F16", {3});
  add("head.weight", "F32", {1, 6});
  add("ids", "I64", {2});
  add("mask", "BOOL", {5});
  add("tail", "F32", {0});
  j["__metadata__"] = {{"format", "pt"}, {"shardkit_step", "12"}};
  std::string text = j.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return {text, at};
}

//! The file of a header (its size written in front) and `data` bytes of data.
inline std::string safetensors_bytes(const std::string& header, std::uint64_t data) {
  std::string out(8, '\0');
  std::uint64_t h = header.size();
  for (int b = 0; b < 8; ++b, h >>= 8) out[static_cast<std::size_t>(b)] = static_cast<char>(h);
  out += header;
  for (std::uint64_t i = 0; i < data; ++i) out.push_back(static_cast<char>((i * 37 + 11) & 0xff));
  return out;
}

inline void check_header_invariants(const io::safetensors_header& h, std::uint64_t data_bytes,
                                    std::uint64_t header_bytes) {
  auto fail = [](const std::string& s) {
    throw violation("accepted a safetensors header where " + s);
  };
  if (h.header_bytes != header_bytes) fail("the header size is not the text's");
  std::uint64_t at = 0;
  std::set<std::string> names;
  for (const auto& e : h.entries) {
    if (e.name == "__metadata__") fail("__metadata__ is a tensor");
    if (!names.insert(e.name).second) fail("a name repeats");
    const std::uint64_t esize = io::safetensors_dtype_bytes(e.dtype);
    if (esize == 0) fail("the dtype '" + e.dtype + "' is unknown");
    u128 n = esize;  // (a zero dimension makes any shape empty)
    const bool empty = std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end();
    for (auto d : e.shape) {
      n = empty ? 0 : n * d;
      if (n > ~std::uint64_t{0}) fail("a tensor's bytes overflow");
    }
    if (e.begin != at) fail("the tensors do not tile the data (at '" + e.name + "')");
    if (e.end < e.begin || e.end - e.begin != n) fail("'" + e.name + "' has the wrong size");
    at = e.end;
  }
  if (at != data_bytes) fail("the tensors do not reach the end of the data");
}

//! parse_safetensors_header(text, data_bytes): see the file comment.
inline bool check_safetensors_header(std::string_view text, std::uint64_t data_bytes,
                                     const std::string& path) {
  return accepted(path, [&] {
    const auto h = io::parse_safetensors_header(text, data_bytes, path);
    check_header_invariants(h, data_bytes, text.size());
  });
}

//! io::safetensors_file on a file of `bytes` (written to `path`): see the file comment.
inline bool check_safetensors_file(std::string_view bytes, const std::string& path) {
  write_file(path, bytes);
  return accepted(path, [&] {
    io::safetensors_file f(path);
    std::uint64_t h = 0;
    for (int i = 7; i >= 0; --i) h = h << 8 | static_cast<unsigned char>(bytes[i]);
    if (h > io::safetensors_max_header || h > bytes.size() - 8) {
      throw violation("accepted a header size beyond the file or the limit");
    }
    check_header_invariants(f.header(), bytes.size() - 8 - h, h);
    for (const auto& e : f.header().entries) {
      const std::uint64_t n = e.numel();
      std::vector<float> v(static_cast<std::size_t>(n));
      const bool is_float = e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F16";
      bool read_ok = true;
      try {
        f.read(e.name, 0, v);
      } catch (const shardkit::format_error& x) {
        read_ok = false;
        if (is_float)
          throw violation(std::string("a float tensor of an accepted file does not read: ") +
                          x.what());
      }
      if (!is_float && read_ok) throw violation("read a " + e.dtype + " tensor as floats");
      if (!is_float) continue;
      const std::string_view raw = bytes.substr(8 + h + e.begin, e.end - e.begin);
      for (std::size_t k = 0; k < v.size(); ++k) {
        std::uint32_t want = 0;
        if (e.dtype == "F32") {
          std::memcpy(&want, raw.data() + 4 * k, 4);
        } else if (e.dtype == "BF16") {
          std::uint16_t b = 0;
          std::memcpy(&b, raw.data() + 2 * k, 2);
          want = std::uint32_t{b} << 16;
        } else {
          continue;  // F16: the conversion is tested elsewhere
        }
        const std::uint32_t got = std::bit_cast<std::uint32_t>(v[k]);
        const bool both_nan = std::isnan(v[k]) && std::isnan(std::bit_cast<float>(want));
        if (got != want && !both_nan) throw violation("read '" + e.name + "' wrongly");
      }
      // past its end: a format_error
      std::vector<float> one(1);
      try {
        f.read(e.name, n, one);
        throw violation("read past the end of '" + e.name + "'");
      } catch (const shardkit::format_error&) {
      }
    }
  });
}

// ---- block files -----------------------------------------------------------------------------

//! An independent reading of a block file's layout (see io/block_file.hpp).
struct block_model {
  bool footer_ok = false;  // size, magic, self-checksum, consistent fields, table checksum
  std::uint64_t block_bytes = 0, data_bytes = 0, blocks = 0;
  std::vector<std::uint64_t> table;
};

inline block_model model_block_file(std::string_view bytes) {
  block_model m;
  const u128 size = bytes.size();
  if (size < 48) return m;
  const char* f = bytes.data() + bytes.size() - 48;
  if (std::memcmp(f, "SKBLK001", 8) != 0) return m;
  std::uint64_t self = 0, fields[4];
  std::memcpy(&self, f + 40, 8);
  if (io::xxh64(f, 40) != self) return m;
  std::memcpy(fields, f + 8, 32);
  m.block_bytes = fields[0];
  m.data_bytes = fields[1];
  m.blocks = fields[2];
  if (m.block_bytes == 0) return m;
  const u128 need = (u128{m.data_bytes} + m.block_bytes - 1) / m.block_bytes;
  if (need != m.blocks || u128{m.data_bytes} + u128{m.blocks} * 8 + 48 != size) return m;
  m.table.resize(static_cast<std::size_t>(m.blocks));
  if (!m.table.empty()) {
    std::memcpy(m.table.data(), bytes.data() + m.data_bytes, m.table.size() * 8);
  }
  if (io::xxh64(m.table.data(), m.table.size() * 8) != fields[3]) return m;
  m.footer_ok = true;
  return m;
}

inline bool model_block_ok(const block_model& m, std::string_view bytes, std::uint64_t b) {
  const std::uint64_t begin = b * m.block_bytes;
  const std::uint64_t len = std::min<std::uint64_t>(m.block_bytes, m.data_bytes - begin);
  return io::xxh64(bytes.data() + begin, len) == m.table[b];
}

//! io::block_file_reader on a file of `bytes` (written to `path`), against the model: see the
//! file comment. `original` (when given) is the data the file held before it was damaged: what
//! a read returns must be it. `ranges` are (offset, size) pairs to read.
inline bool check_block_file(std::string_view bytes, const std::string& path,
                             const std::vector<std::pair<std::uint64_t, std::uint64_t>>& ranges,
                             const std::string* original = nullptr) {
  write_file(path, bytes);
  const block_model m = model_block_file(bytes);
  return accepted(path, [&] {
    std::unique_ptr<io::block_file_reader> r;
    try {
      r = std::make_unique<io::block_file_reader>(path);
    } catch (const shardkit::format_error&) {
      if (m.footer_ok) throw violation("rejected a block file whose footer and table check");
      throw;
    }
    if (!m.footer_ok) throw violation("accepted a block file whose footer or table does not check");
    if (r->data_bytes() != m.data_bytes) throw violation("data_bytes() is not the footer's");
    std::vector<char> out;
    for (auto [offset, n] : ranges) {
      bool expect = u128{offset} + n <= m.data_bytes;
      if (expect && n != 0) {
        for (std::uint64_t b = offset / m.block_bytes; b <= (offset + n - 1) / m.block_bytes; ++b) {
          expect = expect && model_block_ok(m, bytes, b);
        }
      }
      out.assign(static_cast<std::size_t>(std::min<std::uint64_t>(n, 1 << 20)), '\0');
      if (n > out.size()) continue;  // a read larger than any test file: not tried
      bool ok = true;
      try {
        r->read(offset, static_cast<std::size_t>(n), out.data());
      } catch (const shardkit::format_error& e) {
        if (std::string_view(e.what()).find(path) == std::string_view::npos) {
          throw violation(std::string("a read's format_error does not name the file: ") + e.what());
        }
        ok = false;
      }
      if (ok != expect) {
        throw violation(ok ? "a read of damaged or absent blocks succeeded"
                           : "a read of blocks that check failed");
      }
      if (!ok) continue;
      if (std::string_view(out.data(), out.size()) != bytes.substr(offset, n)) {
        throw violation("a read returned other bytes than the file's");
      }
      if (original != nullptr &&
          (offset + n > original->size() || std::string_view(out.data(), out.size()) !=
                                                std::string_view(*original).substr(offset, n))) {
        throw violation("a read of a damaged file returned wrong data without an error");
      }
    }
    bool all = true;
    for (std::uint64_t b = 0; b < m.blocks; ++b) all = all && model_block_ok(m, bytes, b);
    std::uint64_t sum = 0;
    try {
      sum = r->verify();
    } catch (const shardkit::format_error&) {
      if (all) throw violation("verify() failed on a file whose every block checks");
      throw;
    }
    if (!all) throw violation("verify() passed a file with a damaged block");
    if (sum != io::xxh64(bytes.data(), bytes.size()))
      throw violation("verify()'s checksum is wrong");
  });
}

//! A block file of `data` in blocks of `block_bytes`, written by the library's writer.
inline std::string block_file_bytes(const std::string& path, const std::string& data,
                                    std::size_t block_bytes) {
  io::block_file_writer w(path, block_bytes);
  w.append(data.data(), data.size() / 2);
  w.append(data.data() + data.size() / 2, data.size() - data.size() / 2);
  (void)w.finish();
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

//! `bytes` (a block file) with its footer rewritten to the given fields and checksummed, so that
//! the reader's consistency checks are what decides; the table checksum covers the 8·blocks
//! bytes that follow data_bytes, when the file has them.
inline std::string refoot(std::string bytes, std::uint64_t block_bytes, std::uint64_t data_bytes,
                          std::uint64_t blocks) {
  if (bytes.size() < 48) return bytes;
  char* f = bytes.data() + bytes.size() - 48;
  std::uint64_t table_sum = 0;
  if (u128{data_bytes} + u128{blocks} * 8 <= bytes.size() - 48) {
    table_sum = io::xxh64(bytes.data() + data_bytes, static_cast<std::size_t>(blocks * 8));
  }
  const std::uint64_t fields[4] = {block_bytes, data_bytes, blocks, table_sum};
  std::memcpy(f, "SKBLK001", 8);
  std::memcpy(f + 8, fields, 32);
  const std::uint64_t self = io::xxh64(f, 40);
  std::memcpy(f + 40, &self, 8);
  return bytes;
}

}  // namespace fuzz
