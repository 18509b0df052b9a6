// safetensors (include/shardkit/io/safetensors.hpp, io/export.hpp): files that lie are each
// rejected with a format_error that names the file and the problem; an engine exported at any
// stage, world size and element type and imported into a fresh engine of another world size
// and stage holds exactly the exported values; a failed export leaves the file at its path as
// it was and raises on every rank.
#include <shardkit/io/export.hpp>
#include <shardkit/io/file.hpp>
#include <shardkit/io/safetensors.hpp>

#include "io/io_model.hpp"
#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

using namespace shardkit;
using Catch::Contains;

namespace {

//! A scratch directory of this process (test binaries of other builds may run at the same
//! time), removed at exit.
struct scratch_dir {
  std::string path;
  scratch_dir() {
    path = (std::filesystem::temp_directory_path() /
            ("shardkit-safetensors-" + std::to_string(::getpid())))
               .string();
    std::filesystem::create_directories(path);
  }
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
};
const std::string& test_dir() {
  static const scratch_dir d;
  return d.path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int b = 0; b < 8; ++b, v >>= 8) s[static_cast<std::size_t>(b)] = static_cast<char>(v & 0xff);
  return s;
}

//! A safetensors file of `header` and `data` bytes of data (the header size written as is).
std::string st_bytes(const std::string& header, std::size_t data) {
  return le64(header.size()) + header + std::string(data, '\x3c');
}

//! Writes `bytes` as <name>.safetensors; opening it must raise format_error naming the file and
//! `problem`.
void expect_rejected(const std::string& name, const std::string& bytes,
                     const std::string& problem) {
  const std::string path = test_dir() + "/" + name + ".safetensors";
  write_bytes(path, bytes);
  INFO("file " << name);
  try {
    io::safetensors_file f(path);
    FAIL("accepted: " << name);
  } catch (const format_error& e) {
    CHECK_THAT(e.what(), Contains("'" + path + "'") && Contains(problem));
  }
}

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  std::uint64_t begin, std::uint64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(end) + "]}";
}

}  // namespace

TEST_CASE("a safetensors file that lies is a format_error naming the file and the problem",
          "[io][safetensors][errors]") {
  const std::string f32x2 = entry("a", "F32", "[2]", 0, 8);
  SECTION("the header size") {
    // 2^63: far more than any file (and than the 100 MB limit)
    expect_rejected("header-2-63", le64(std::uint64_t{1} << 63) + "{}",
                    "gives a header of 9223372036854775808 bytes, more than the file's 2");
    expect_rejected("header-all-ones", le64(~std::uint64_t{0}) + "{}",
                    "gives a header of 18446744073709551615 bytes");
    expect_rejected("header-past-end", le64(100) + "{}" + std::string(4, ' '),
                    "gives a header of 100 bytes, more than the file's 6");
    expect_rejected("header-one-past-end", le64(3) + "{}", "gives a header of 3 bytes");
    for (std::size_t n = 0; n < 8; ++n) {
      expect_rejected("short-" + std::to_string(n), std::string(n, '\x02'),
                      "is shorter than the 8-byte header size");
    }
  }
  SECTION("a header above the 100 MB limit, within the file") {
    // A sparse file: the size is checked before anything is read.
    const std::string path = test_dir() + "/header-100mb.safetensors";
    write_bytes(path, le64(100'000'001));
    std::filesystem::resize_file(path, 8 + 100'000'001 + 16);
    try {
      io::safetensors_file f(path);
      FAIL("accepted a 100 MB header");
    } catch (const format_error& e) {
      CHECK_THAT(e.what(), Contains(path) && Contains("100000001 bytes") && Contains("100 MB"));
    }
    std::filesystem::remove(path);
  }
  SECTION("offsets past the end of the data") {
    expect_rejected("past-end", st_bytes("{" + entry("a", "F32", "[4]", 0, 16) + "}", 8),
                    "tensor 'a': data_offsets end at 16, past the 8 bytes of data");
    expect_rejected("past-end-second",
                    st_bytes("{" + f32x2 + "," + entry("b", "F32", "[2]", 8, 16) + "}", 12),
                    "tensor 'b': data_offsets end at 16, past the 12 bytes of data");
    expect_rejected(
        "huge-offsets",
        st_bytes(
            "{" + entry("a", "F32", "[1]", 18446744073709551610ull, 18446744073709551614ull) + "}",
            4),
        "past the 4 bytes of data");
  }
  SECTION("overlapping tensors") {
    expect_rejected("overlap",
                    st_bytes("{" + f32x2 + "," + entry("b", "F32", "[2]", 4, 12) + "}", 12),
                    "tensor 'b' starts at 4, overlapping the tensor before it (which ends at 8)");
    expect_rejected("same-range",
                    st_bytes("{" + f32x2 + "," + entry("b", "F32", "[2]", 0, 8) + "}", 8),
                    "overlapping the tensor before it");
    // a zero-size tensor inside another one
    expect_rejected("empty-inside",
                    st_bytes("{" + f32x2 + "," + entry("z", "F32", "[0]", 4, 4) + "}", 8),
                    "tensor 'z' starts at 4, overlapping");
  }
  SECTION("a hole between tensors, or before the first") {
    expect_rejected("hole",
                    st_bytes("{" + f32x2 + "," + entry("b", "F32", "[1]", 12, 16) + "}", 16),
                    "tensor 'b' starts at 12, leaving a hole after the tensor before it (which "
                    "ends at 8)");
    expect_rejected("hole-at-start", st_bytes("{" + entry("a", "F32", "[1]", 4, 8) + "}", 8),
                    "tensor 'a' starts at 4, leaving a hole");
  }
  SECTION("data not covered to its end") {
    expect_rejected("tail", st_bytes("{" + f32x2 + "}", 12),
                    "the tensors cover 8 of the 12 data bytes");
    expect_rejected("no-tensors", st_bytes("{}", 4), "the tensors cover 0 of the 4 data bytes");
  }
  SECTION("an unknown dtype, or one that is not a string") {
    expect_rejected("dtype-f33", st_bytes("{" + entry("a", "F33", "[2]", 0, 8) + "}", 8),
                    "tensor 'a': unknown dtype 'F33'");
    expect_rejected("dtype-lower", st_bytes("{" + entry("a", "f32", "[2]", 0, 8) + "}", 8),
                    "unknown dtype 'f32'");
    expect_rejected("dtype-number",
                    st_bytes("{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4),
                    "tensor 'a': dtype is not a string");
  }
  SECTION("a shape whose product overflows") {
    expect_rejected("shape-overflow",
                    st_bytes("{" + entry("a", "U8", "[4294967296,4294967296,2]", 0, 0) + "}", 0),
                    "tensor 'a': shape overflows");
    // elements fit in 64 bits, their bytes do not
    expect_rejected("bytes-overflow",
                    st_bytes("{" + entry("a", "F32", "[4611686018427387904]", 0, 0) + "}", 0),
                    "tensor 'a': data_offsets [0, 0) do not hold 4611686018427387904 elements");
  }
  SECTION("a shape that does not match end - begin") {
    expect_rejected("shape-mismatch", st_bytes("{" + entry("a", "F32", "[3]", 0, 8) + "}", 8),
                    "tensor 'a': data_offsets [0, 8) do not hold 3 elements of F32");
    expect_rejected("dtype-size-mismatch", st_bytes("{" + entry("a", "BF16", "[2]", 0, 8) + "}", 8),
                    "do not hold 2 elements of BF16");
    expect_rejected("end-before-begin", st_bytes("{" + entry("a", "F32", "[0]", 8, 4) + "}", 8),
                    "tensor 'a': data_offsets [8, 4) do not hold 0 elements");
    expect_rejected("scalar-mismatch", st_bytes("{" + entry("a", "F64", "[]", 0, 4) + "}", 4),
                    "do not hold 1 elements of F64");
  }
  SECTION("a header that is not JSON, or not an object") {
    for (const char* h : {"{\"a\": ", "{\"a\":{\"dtype\":\"F32\",}", "not json", "{} trailing",
                          "{\"a\":\"\xff\xfe\"}"}) {
      CAPTURE(h);
      expect_rejected("not-json", st_bytes(h, 0), "the header is not a JSON object");
    }
    for (const char* h : {"[]", "[1,2]", "\"text\"", "42", "null", "true"}) {
      CAPTURE(h);
      expect_rejected("not-object", st_bytes(h, 0), "the header is not a JSON object");
    }
    expect_rejected("empty-header", st_bytes("", 0), "the header is not a JSON object");
  }
  SECTION("a tensor entry that is missing fields or has fields of the wrong type") {
    expect_rejected("no-offsets", st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4),
                    "tensor 'a' lacks dtype, shape or data_offsets");
    expect_rejected("no-dtype", st_bytes("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4),
                    "tensor 'a' lacks dtype, shape or data_offsets");
    expect_rejected("no-shape", st_bytes("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4),
                    "tensor 'a' lacks dtype, shape or data_offsets");
    expect_rejected("entry-number", st_bytes("{\"a\":5}", 0), "tensor 'a' lacks dtype");
    expect_rejected("entry-array", st_bytes("{\"a\":[\"F32\",[1],[0,4]]}", 4),
                    "tensor 'a' lacks dtype");
    expect_rejected(
        "shape-string",
        st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":\"1\",\"data_offsets\":[0,4]}}", 4),
        "tensor 'a': shape is not an array");
    for (const char* dim : {"-1", "1.0", "\"1\"", "null", "[1]", "18446744073709551616"}) {
      CAPTURE(dim);
      expect_rejected(
          "shape-dim",
          st_bytes("{" + entry("a", "F32", std::string("[") + dim + "]", 0, 4) + "}", 4),
          "tensor 'a': shape holds a value that is not a size");
    }
    for (const char* off : {"[0]", "[0,4,8]", "[\"0\",\"4\"]", "[-4,0]", "[0,4.0]", "{}", "4"}) {
      CAPTURE(off);
      expect_rejected(
          "offsets",
          st_bytes(
              std::string("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":") + off + "}}",
              4),
          "tensor 'a': data_offsets is not [begin, end]");
    }
  }
  SECTION("__metadata__ that is not an object of strings") {
    expect_rejected("meta-number", st_bytes("{\"__metadata__\":{\"format\":\"pt\",\"k\":1}}", 0),
                    "__metadata__ 'k' is not a string");
    expect_rejected("meta-null", st_bytes("{\"__metadata__\":{\"k\":null}}", 0),
                    "__metadata__ 'k' is not a string");
    expect_rejected("meta-nested", st_bytes("{\"__metadata__\":{\"k\":{\"x\":\"y\"}}}", 0),
                    "__metadata__ 'k' is not a string");
    expect_rejected("meta-array", st_bytes("{\"__metadata__\":[\"pt\"]}", 0),
                    "__metadata__ is not an object");
  }
  SECTION("a file that does not exist is an io_error naming it") {
    const std::string path = test_dir() + "/no-such-file.safetensors";
    std::filesystem::remove(path);
    CHECK_THROWS_WITH(io::safetensors_file(path), Contains(path) && Contains("No such file"));
  }
}

TEST_CASE("parse_safetensors_header checks the header against the data size it is given",
          "[io][safetensors][errors]") {
  const std::string h = "{" + entry("a", "F32", "[2]", 0, 8) + "}";
  const auto ok = io::parse_safetensors_header(h, 8, "x.safetensors");
  REQUIRE(ok.entries.size() == 1);
  CHECK(ok.entries[0].numel() == 2);
  CHECK_THROWS_MATCHES(io::parse_safetensors_header(h, 12, "x.safetensors"), format_error,
                       Catch::Matchers::Message(
                           "safetensors file 'x.safetensors': the tensors cover 8 of the 12 data "
                           "bytes"));
  CHECK_THROWS_MATCHES(io::parse_safetensors_header(h, 4, "x.safetensors"), format_error,
                       Catch::Matchers::Message("safetensors file 'x.safetensors': tensor 'a': "
                                                "data_offsets end at 8, past the 4 bytes of data"));
}

TEST_CASE(
    "a valid safetensors file is read as written: every dtype shardkit reads, padding, "
    "zero-size and scalar tensors, metadata",
    "[io][safetensors]") {
  // a scalar F32 (3.5), an empty tensor, a BF16 [2] (1, -2), an F16 [2] (0.5, 65504), an I32
  std::string data;
  auto put = [&](const void* p, std::size_t n) { data.append(static_cast<const char*>(p), n); };
  const float scalar = 3.5f;
  put(&scalar, 4);
  const std::uint16_t b16[2] = {0x3f80, 0xc000};
  put(b16, 4);
  const std::uint16_t h16[2] = {0x3800, 0x7bff};
  put(h16, 4);
  const std::int32_t i32 = 7;
  put(&i32, 4);
  std::string header =
      "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"hi\"}," + entry("s", "F32", "[]", 0, 4) +
      "," + entry("e", "F32", "[0,3]", 4, 4) + "," + entry("b", "BF16", "[2]", 4, 8) + "," +
      entry("h", "F16", "[1,2]", 8, 12) + "," + entry("i", "I32", "[1]", 12, 16) + "}";
  header.append((8 - header.size() % 8) % 8 + 8, ' ');  // trailing spaces, as writers pad
  const std::string path = test_dir() + "/valid.safetensors";
  write_bytes(path, le64(header.size()) + header + data);
  io::safetensors_file f(path);
  CHECK(f.header().metadata.at("note") == "hi");
  CHECK(f.header().entries.size() == 5);
  CHECK(f.entry("s").shape.empty());
  CHECK(f.entry("s").numel() == 1);
  CHECK(f.entry("e").shape == std::vector<std::uint64_t>{0, 3});
  std::vector<float> out(2);
  f.read("s", 0, std::span(out).first(1));
  CHECK(out[0] == 3.5f);
  f.read("b", 0, out);
  CHECK(out == std::vector<float>{1.0f, -2.0f});
  f.read("h", 0, out);
  CHECK(out == std::vector<float>{0.5f, 65504.0f});
  f.read("h", 1, std::span(out).first(1));
  CHECK(out[0] == 65504.0f);
  f.read("e", 0, std::span(out).first(0));
  CHECK_THROWS_MATCHES(f.read("i", 0, std::span(out).first(1)), format_error,
                       Catch::Matchers::Message("safetensors file '" + path +
                                                "' holds 'i' as I32; shardkit reads F32, BF16, "
                                                "F16"));
  CHECK_THROWS_MATCHES(f.read("b", 1, out), format_error,
                       Catch::Matchers::Message("safetensors file '" + path +
                                                "' has 2 elements in 'b'; [1, 3) were asked for"));
  CHECK_THROWS_MATCHES(
      f.entry("missing"), format_error,
      Catch::Matchers::Message("safetensors file '" + path + "' has no tensor 'missing'"));
  model_spec m;
  CHECK_THROWS_AS(io::add_from_safetensors(m, f, "missing"), format_error);
}

// ---- export and import ------------------------------------------------------------------------

namespace {

//! Trains the model two steps on n ranks at stage S (working type W), exports it to `path` as
//! `type`, and returns what each rank held.
template <int S, class W>
std::vector<iot::rank_state> export_run(int n, const std::string& path, dtype type,
                                        std::size_t shard_group = 0,
                                        std::map<std::string, std::string> meta = {}) {
  return run_ranks(n, [&](thread_comm& c) {
    engine_options eo;
    eo.shard_group_size = S == 0 ? 0 : shard_group;
    iot::engine_t<S, W> eng(c, iot::make_model(), iot::groups(), eo);
    iot::train(eng, c.rank(), 1, 2);
    io::export_safetensors(eng, path, {.type = type, .metadata = meta});
    return iot::capture(eng);
  });
}

//! A fresh engine of n ranks at stage S built from the file (each rank reads its own ranges
//! through its own reader), and what each rank holds.
template <int S, class W>
std::vector<iot::rank_state> import_run(int n, const std::string& path) {
  return run_ranks(n, [&](thread_comm& c) {
    io::safetensors_file f(path);
    model_spec m;
    for (const auto& d : iot::shaped_model()) {
      if (d.starts_unit) m.begin_unit(d.name.substr(0, d.name.find('.')));
      io::add_from_safetensors(m, f, d.name, d.group);
    }
    iot::engine_t<S, W> eng(c, m, iot::groups());
    for (std::size_t i = 0; i < iot::shaped_model().size(); ++i) {
      if (eng.registry().shape(i) != iot::shaped_model()[i].shape) {
        throw std::runtime_error("imported parameter " + eng.registry().name(i) +
                                 " has another shape");
      }
    }
    return iot::capture(eng);
  });
}

//! The file's header: names in registration order, the registered shapes, one dtype, the
//! metadata; its values read back as fp32 bits.
std::vector<std::vector<std::uint32_t>> file_values(const std::string& path, const char* dtype,
                                                    const std::string& step) {
  io::safetensors_file f(path);
  const auto& h = f.header();
  CHECK(h.header_bytes % 8 == 0);
  CHECK(h.metadata.at("format") == "pt");
  CHECK(h.metadata.at("shardkit_step") == step);
  const auto& defs = iot::shaped_model();
  REQUIRE(h.entries.size() == defs.size());
  std::vector<std::vector<std::uint32_t>> out;
  for (std::size_t i = 0; i < defs.size(); ++i) {
    CHECK(h.entries[i].name == defs[i].name);
    CHECK(h.entries[i].dtype == dtype);
    CHECK(h.entries[i].shape ==
          std::vector<std::uint64_t>(defs[i].shape.begin(), defs[i].shape.end()));
    std::vector<float> v(iot::numel(defs[i].shape));
    f.read(defs[i].name, 0, v);
    out.emplace_back();
    for (float x : v) out.back().push_back(std::bit_cast<std::uint32_t>(x));
  }
  return out;
}

std::vector<std::vector<std::uint32_t>> initial_values() {
  std::vector<std::vector<std::uint32_t>> out;
  const auto& defs = iot::shaped_model();
  for (std::size_t i = 0; i < defs.size(); ++i) {
    out.emplace_back();
    for (std::size_t k = 0; k < iot::numel(defs[i].shape); ++k) {
      out.back().push_back(std::bit_cast<std::uint32_t>(iot::init_value(i, k)));
    }
  }
  return out;
}

//! fp32 export at stage S on n ranks, import at stage t on m: the fp32 master, bit for bit.
template <int S>
void fp32_round_trip(int n, int t, int m, const std::string& path) {
  const auto a = iot::assemble(export_run<S, bf16>(n, path, dtype::f32));
  REQUIRE(a.failure == "");
  REQUIRE(a.kinds[0] != initial_values());  // it trained: not the initial values
  CHECK(file_values(path, "F32", "2") == a.kinds[0]);
  const auto b =
      iot::assemble(iot::with_stage(t, [&]<int T>() { return import_run<T, bf16>(m, path); }));
  REQUIRE(b.failure == "");
  CHECK(b.kinds[0] == a.kinds[0]);  // master
  CHECK(b.working == a.working);    // and the bf16 working copy, its rounding
}

//! bf16 export: the file holds the bf16 working values, and so does the imported engine.
template <int S>
void bf16_round_trip(int n, int t, int m, const std::string& path) {
  const auto a = iot::assemble(export_run<S, bf16>(n, path, dtype::bf16));
  REQUIRE(a.failure == "");
  auto widened = a.working;  // fp32 of a bf16: its bits, then 16 zero bits
  for (auto& p : widened)
    for (auto& x : p) x <<= 16;
  CHECK(file_values(path, "BF16", "2") == widened);
  const auto b =
      iot::assemble(iot::with_stage(t, [&]<int T>() { return import_run<T, bf16>(m, path); }));
  REQUIRE(b.failure == "");
  CHECK(b.working == a.working);
  CHECK(b.kinds[0] == widened);  // the new master is exactly the bf16 values
}

}  // namespace

TEST_CASE("an export imported at another world size and stage holds the exported values exactly",
          "[io][safetensors][export]") {
  const std::string dir = test_dir();
  for (int s = 0; s < 4; ++s) {
    for (int n = 1; n <= 4; ++n) {
      const int m = n % 4 + 1;    // always another world size: 2, 3, 4, 1
      const int t = (s + n) % 4;  // every (from, to) pair of stages once, s to s included
      CAPTURE(s, n, t, m);
      const std::string tag = std::to_string(s) + "-" + std::to_string(n);
      iot::with_stage(s, [&]<int S>() {
        fp32_round_trip<S>(n, t, m, dir + "/fp32-" + tag + ".safetensors");
        bf16_round_trip<S>(n, t, m, dir + "/bf16-" + tag + ".safetensors");
      });
    }
  }
}

TEST_CASE("fp32 training (no master: the working values) and hybrid sharding export exactly",
          "[io][safetensors][export]") {
  const std::string dir = test_dir();
  SECTION("fp32 working values, stage 1 on 3 ranks to stage 3 on 2") {
    const auto saved = export_run<1, float>(3, dir + "/f32w", dtype::f32);
    const auto a = iot::assemble(saved);
    REQUIRE(a.failure == "");
    CHECK(file_values(dir + "/f32w", "F32", "2") == a.kinds[0]);
    const auto b = iot::assemble(import_run<3, float>(2, dir + "/f32w"));
    REQUIRE(b.failure == "");
    CHECK(b.kinds[0] == a.kinds[0]);
    CHECK(b.working == a.working);
  }
  SECTION("fp32 working values, stage 3 on 4 ranks to stage 0 on 1") {
    const auto a = iot::assemble(export_run<3, float>(4, dir + "/f32w3", dtype::f32));
    const auto b = iot::assemble(import_run<0, float>(1, dir + "/f32w3"));
    REQUIRE(a.failure == "");
    REQUIRE(b.failure == "");
    CHECK(b.working == a.working);
  }
  SECTION("hybrid 2 x 2 at stage 3 (the second replica writes nothing) to stage 2 on 3") {
    const auto a = iot::assemble(export_run<3, bf16>(4, dir + "/hybrid", dtype::f32, 2));
    REQUIRE(a.failure == "");
    CHECK(file_values(dir + "/hybrid", "F32", "2") == a.kinds[0]);
    const auto b = iot::assemble(import_run<2, bf16>(3, dir + "/hybrid"));
    REQUIRE(b.failure == "");
    CHECK(b.kinds[0] == a.kinds[0]);
  }
  SECTION("fp16 export, the user's metadata kept") {
    const auto a = iot::assemble(
        export_run<2, bf16>(2, dir + "/fp16", dtype::f16, 0, {{"author", "shardkit tests"}}));
    io::safetensors_file f(dir + "/fp16");
    CHECK(f.header().metadata.at("author") == "shardkit tests");
    CHECK(f.header().metadata.at("format") == "pt");
    CHECK(f.entry("block1.weight").dtype == "F16");
    // the file holds the master rounded to fp16 (to nearest even), and the imported engine's
    // master is exactly that
    auto want = a.kinds[0];
    for (auto& p : want) {
      for (auto& x : p) {
        const float v = std::bit_cast<float>(x);
        fp16 h{};
        host::convert(&v, dtype::f32, &h, dtype::f16, 1);
        float back = 0;
        host::convert(&h, dtype::f16, &back, dtype::f32, 1);
        x = std::bit_cast<std::uint32_t>(back);
      }
    }
    REQUIRE(want != a.kinds[0]);  // fp16 rounding changed some values
    const auto b = iot::assemble(import_run<1, bf16>(3, dir + "/fp16"));
    REQUIRE(b.failure == "");
    CHECK(b.kinds[0] == want);
  }
}

namespace {
thread_local int t_rank = -1;  // the thread rank whose I/O the fault injector is asked about

struct injector_guard {
  explicit injector_guard(std::function<int(std::string_view, const std::string&)> f) {
    io::detail::fault_injector() = std::move(f);
  }
  ~injector_guard() { io::detail::fault_injector() = nullptr; }
  injector_guard(const injector_guard&) = delete;
  injector_guard& operator=(const injector_guard&) = delete;
};

std::vector<std::string> export_errors(int n, const std::string& path, io::export_options o = {}) {
  return test::errors_per_rank(n, [&](thread_comm& c) {
    t_rank = c.rank();
    iot::engine_t<3> eng(c, iot::make_model(), iot::groups());
    iot::train(eng, c.rank(), 1, 1);
    io::export_safetensors(eng, path, o);
  });
}
}  // namespace

TEST_CASE("a failed export raises on every rank and leaves the file at its path untouched",
          "[io][safetensors][export][faults]") {
  const std::string path = test_dir() + "/faulty.safetensors";
  const std::string before = "the previous contents of this path";
  struct fault {
    const char* op;
    int rank;
    int err;
    const char* reason;
    const char* when;
  };
  const fault cases[] = {
      {"write", 2, ENOSPC, "No space left on device", "writing the tensors"},  // one rank's write
      {"create", 0, EROFS, "Read-only file system", "preparing the file"},
      {"write", 0, EDQUOT, "Disk quota exceeded", "preparing the file"},  // the header
      {"sync", 1, EIO, "Input/output error", "writing the tensors"},
      {"rename", 0, ENOSPC, "No space left on device", "putting the file in place"},
  };
  for (const auto& f : cases) {
    CAPTURE(f.op, f.rank);
    write_bytes(path, before);
    std::vector<std::string> msgs;
    {
      injector_guard guard([&](std::string_view op, const std::string& p) {
        return op == f.op && t_rank == f.rank && p.find("faulty.safetensors") != std::string::npos
                   ? f.err
                   : 0;
      });
      msgs = export_errors(3, path);
    }
    REQUIRE(msgs.size() == 3);
    for (const auto& m : msgs) {  // every rank raised, naming the file, the rank and the reason
      CHECK_THAT(m, Contains("safetensors export to '" + path + "' failed " + f.when) &&
                        Contains("is unchanged") &&
                        Contains("rank " + std::to_string(f.rank) + ": ") && Contains(f.reason));
    }
    CHECK(read_bytes(path) == before);
    CHECK_FALSE(std::filesystem::exists(path + ".partial"));
  }
  // Without faults the same export replaces the file.
  const auto ok = export_errors(3, path);
  CHECK(ok == std::vector<std::string>(3, ""));
  io::safetensors_file f(path);
  CHECK(f.header().entries.size() == iot::shaped_model().size());
}

TEST_CASE("an export safetensors cannot hold is refused on every rank, the path untouched",
          "[io][safetensors][export][errors]") {
  const std::string path = test_dir() + "/refused.safetensors";
  write_bytes(path, "old");
  SECTION("an element type that is not a float safetensors shardkit writes") {
    const auto msgs = export_errors(2, path, {.type = dtype::u8, .metadata = {}});
    REQUIRE(msgs.size() == 2);
    for (const auto& m : msgs) {
      CHECK_THAT(m, Contains("safetensors export to '" + path + "' failed preparing the file") &&
                        Contains("F32, BF16 and F16"));
    }
  }
  SECTION("a parameter named __metadata__") {
    const auto msgs = test::errors_per_rank(2, [&](thread_comm& c) {
      model_spec m;
      m.add("__metadata__", std::size_t{4});
      iot::engine_t<2> eng(c, m);
      io::export_safetensors(eng, path);
    });
    REQUIRE(msgs.size() == 2);
    for (const auto& m : msgs) {
      CHECK_THAT(m, Contains("parameter #0 is named '__metadata__'") && Contains("unchanged"));
    }
  }
  CHECK(read_bytes(path) == "old");
  CHECK_FALSE(std::filesystem::exists(path + ".partial"));
}
