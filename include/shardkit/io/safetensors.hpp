//! \file io/safetensors.hpp
//! The safetensors format (the Hugging Face weights file): an 8-byte little-endian header size
//! H, H bytes of JSON, then the data. The JSON maps each tensor's name to its "dtype", "shape"
//! and "data_offsets" [begin, end) relative to the data, plus an optional "__metadata__" object
//! of strings. shardkit reads and writes it without ever holding the whole model on one rank:
//! a reader reads any element range of a tensor (safetensors_file::read, and as an initialiser
//! for model_spec, safetensors_file::initializer), and io/export.hpp writes one from an engine.
//!
//! A header is checked before anything is read, as the reference implementation does: H within
//! the file and at most 100 MB, valid JSON, an object; every entry a known dtype, a shape whose
//! elements times the dtype's size is end − begin, offsets within the data; the entries do not
//! overlap and cover the data exactly. Each failure is a format_error naming the file and the
//! entry.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/dtype.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/io/file.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/zero/model.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace io {

//! One tensor of a safetensors file.
struct safetensors_entry {
  std::string name;
  std::string dtype;  //!< "F32", "BF16", "F16", ... as the file names it
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;  //!< data_offsets, relative to the data section
  std::uint64_t numel() const {
    std::uint64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

//! Bytes per element of a safetensors dtype, or 0 when it is not one.
inline std::uint64_t safetensors_dtype_bytes(std::string_view t) {
  if (t == "BOOL" || t == "U8" || t == "I8" || t == "F8_E4M3" || t == "F8_E5M2") return 1;
  if (t == "I16" || t == "U16" || t == "F16" || t == "BF16") return 2;
  if (t == "I32" || t == "U32" || t == "F32") return 4;
  if (t == "I64" || t == "U64" || t == "F64") return 8;
  return 0;
}

//! The safetensors name of a floating-point dtype shardkit reads and writes.
inline const char* safetensors_dtype(dtype t) {
  switch (t) {
    case dtype::f32:
      return "F32";
    case dtype::bf16:
      return "BF16";
    case dtype::f16:
      return "F16";
    default:
      shardkit::detail::raise(
          "safetensors: shardkit reads and writes F32, BF16 and F16 tensors, "
          "not ",
          name(t));
  }
}

//! The largest header shardkit accepts (the reference implementation's limit).
inline constexpr std::uint64_t safetensors_max_header = 100'000'000;

//! A parsed, validated header (see the file comment).
struct safetensors_header {
  std::vector<safetensors_entry> entries;  //!< in data order
  std::map<std::string, std::string> metadata;
  std::uint64_t header_bytes = 0;  //!< H
  std::uint64_t data_start() const { return 8 + header_bytes; }
  const safetensors_entry* find(std::string_view name) const {
    for (const auto& e : entries)
      if (e.name == name) return &e;
    return nullptr;
  }
};

//! Parses and checks a header of `text` for a file whose data section has `data_bytes` bytes.
inline safetensors_header parse_safetensors_header(std::string_view text, std::uint64_t data_bytes,
                                                   const std::string& path) {
  using json = nlohmann::json;
  auto bad = [&](const std::string& what) -> void {
    throw format_error(shardkit::detail::concat("safetensors file '", path, "': ", what));
  };
  json j = json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) bad("the header is not a JSON object");
  safetensors_header h;
  h.header_bytes = text.size();
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) bad("__metadata__ '" + m.key() + "' is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string w = "tensor '" + key + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets")) {
      bad(w + " lacks dtype, shape or data_offsets");
    }
    safetensors_entry e;
    e.name = key;
    if (!v["dtype"].is_string()) bad(w + ": dtype is not a string");
    e.dtype = v["dtype"].get<std::string>();
    const std::uint64_t esize = safetensors_dtype_bytes(e.dtype);
    if (esize == 0) bad(w + ": unknown dtype '" + e.dtype + "'");
    if (!v["shape"].is_array()) bad(w + ": shape is not an array");
    std::uint64_t n = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) bad(w + ": shape holds a value that is not a size");
      e.shape.push_back(d.get<std::uint64_t>());
      if (__builtin_mul_overflow(n, e.shape.back(), &n)) bad(w + ": shape overflows");
    }
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      bad(w + ": data_offsets is not [begin, end]");
    }
    e.begin = off[0].get<std::uint64_t>();
    e.end = off[1].get<std::uint64_t>();
    std::uint64_t bytes = 0;
    if (e.end < e.begin || __builtin_mul_overflow(n, esize, &bytes) || e.end - e.begin != bytes) {
      bad(shardkit::detail::concat(w, ": data_offsets [", e.begin, ", ", e.end, ") do not hold ", n,
                                   " elements of ", e.dtype));
    }
    if (e.end > data_bytes) {
      bad(shardkit::detail::concat(w, ": data_offsets end at ", e.end, ", past the ", data_bytes,
                                   " bytes of data"));
    }
    h.entries.push_back(std::move(e));
  }
  std::sort(h.entries.begin(), h.entries.end(), [](const auto& a, const auto& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  std::uint64_t at = 0;
  for (const auto& e : h.entries) {
    if (e.begin != at) {
      bad(shardkit::detail::concat("tensor '", e.name, "' starts at ", e.begin,
                                   e.begin < at ? ", overlapping the tensor before it"
                                                : ", leaving a hole after the tensor before it",
                                   " (which ends at ", at, ")"));
    }
    at = e.end;
  }
  if (at != data_bytes) {
    bad(shardkit::detail::concat("the tensors cover ", at, " of the ", data_bytes, " data bytes"));
  }
  return h;
}

//! A safetensors file opened for reading ranges.
class safetensors_file {
 public:
  explicit safetensors_file(const std::string& path) : file_(file::open_read(path)) {
    const std::uint64_t size = file_.size();
    if (size < 8) bad("is shorter than the 8-byte header size");
    std::uint64_t h = 0;
    unsigned char b[8];
    file_.read_at(b, 8, 0);
    for (int i = 7; i >= 0; --i) h = h << 8 | b[i];
    if (h > safetensors_max_header || h > size - 8) {
      bad(shardkit::detail::concat("gives a header of ", h, " bytes, more than the file's ",
                                   size - 8, " (or than the 100 MB limit)"));
    }
    std::string text(static_cast<std::size_t>(h), '\0');
    file_.read_at(text.data(), text.size(), 8);
    // Trailing spaces pad the header to 8 bytes (the reference implementation accepts them).
    header_ = parse_safetensors_header(text, size - 8 - h, path);
  }

  const safetensors_header& header() const noexcept { return header_; }
  const std::string& path() const noexcept { return file_.path(); }

  //! The entry of tensor `name` (format_error naming the file when it has none).
  const safetensors_entry& entry(std::string_view name) const {
    const auto* e = header_.find(name);
    if (e == nullptr) {
      throw format_error(shardkit::detail::concat("safetensors file '", file_.path(),
                                                  "' has no tensor '", name, "'"));
    }
    return *e;
  }

  //! Elements [offset, offset + out.size()) of tensor `name` (F32, BF16 or F16), as fp32.
  void read(std::string_view name, std::uint64_t offset, std::span<float> out) {
    const auto& e = entry(name);
    const std::uint64_t esize = safetensors_dtype_bytes(e.dtype);
    if (offset > e.numel() || out.size() > e.numel() - offset) {
      bad(shardkit::detail::concat("has ", e.numel(), " elements in '", name, "'; [", offset, ", ",
                                   offset + out.size(), ") were asked for"));
    }
    const dtype t = e.dtype == "F32"    ? dtype::f32
                    : e.dtype == "BF16" ? dtype::bf16
                    : e.dtype == "F16"  ? dtype::f16
                                        : dtype::u8;
    if (t == dtype::u8) {
      bad("holds '" + std::string(name) + "' as " + e.dtype + "; shardkit reads F32, BF16, F16");
    }
    raw_.resize(out.size() * esize);
    file_.read_at(raw_.data(), raw_.size(), header_.data_start() + e.begin + offset * esize);
    host::convert(raw_.data(), t, out.data(), dtype::f32, out.size());
  }

  //! A model_spec initialiser that reads tensor `name` range by range (checking now that the
  //! file has it; the file must stay open while the engine is built).
  param_initializer initializer(std::string name) {
    (void)entry(name);
    return [this, n = std::move(name)](std::size_t offset, std::span<float> out) {
      read(n, offset, out);
    };
  }

 private:
  [[noreturn]] void bad(const std::string& what) const {
    throw format_error(shardkit::detail::concat("safetensors file '", file_.path(), "' ", what));
  }
  file file_;
  safetensors_header header_;
  std::vector<unsigned char> raw_;
};

}  // namespace io
SHARDKIT_NAMESPACE_END
