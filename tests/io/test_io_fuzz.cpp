// Deterministic mutation tests of the parsers of io/ (a fixed-seed generator, thousands of
// mutations, seconds): manifests, safetensors headers and files, and block files are damaged
// at random (bytes flipped, cut, inserted, deleted or duplicated; numbers replaced by huge,
// negative or fractional ones; keys duplicated; values of other types) and, for manifests,
// signed again so that the mutation reaches past the checksum. Each must be accepted, and then
// hold what the format promises, or be rejected with a format_error naming the file: never
// another exception, never a crash, never wrong data without an error (fuzz_cases.hpp has the
// rules). The same rules are the libFuzzer targets' (fuzz/, SHARDKIT_BUILD_FUZZERS).
#include "io/fuzz_cases.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

using namespace shardkit;

namespace {

//! splitmix64: the same sequence on every platform (std:: distributions are not).
struct rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(next() % n); }
  bool chance(int percent) { return below(100) < static_cast<std::size_t>(percent); }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[below(v.size())];
  }
};

const std::vector<std::string> numbers = {"0",
                                          "1",
                                          "-1",
                                          "2",
                                          "7",
                                          "4294967295",
                                          "4294967296",
                                          "9223372036854775807",
                                          "9223372036854775808",
                                          "18446744073709551615",
                                          "18446744073709551616",
                                          "99999999999999999999999",
                                          "1.5",
                                          "-0",
                                          "0.0",
                                          "1e308",
                                          "1e309",
                                          "-1e308",
                                          "1e-400",
                                          "3.0e2",
                                          "00",
                                          "01",
                                          "-0.5",
                                          "NaN",
                                          "Infinity",
                                          "0x10",
                                          "1E2",
                                          "-9223372036854775808"};

const std::vector<std::string> tokens = {
    "{",       "}",       "[",    "]",        ",",        ":",    "\"",   "\\", "null",
    "true",    "false",   "0",    "-",        "e",        ".",    " ",    "\n", "\"\":",
    "\\u0000", "\\ud800", "\xff", "\xc3\xa9", "\"x\":1,", "[[[[", "]]]]", "{}", "[]"};

const std::vector<std::string> keys = {
    "format",     "version",      "checksum",     "model", "fingerprint",
    "parameters", "name",         "shape",        "group", "unit",
    "units",      "first",        "training",     "step",  "loss_scale",
    "layout",     "world_size",   "stage",        "kinds", "files",
    "rank",       "bytes",        "data_bytes",   "xxh64", "ranges",
    "dtype",      "data_offsets", "__metadata__", "x"};

//! Spans [begin, end) of the number and string tokens of JSON-like text (approximate: enough
//! to aim mutations at values).
void find_tokens(const std::string& s, std::vector<std::pair<std::size_t, std::size_t>>& nums,
                 std::vector<std::pair<std::size_t, std::size_t>>& strs) {
  for (std::size_t i = 0; i < s.size();) {
    if (s[i] == '"') {
      std::size_t j = i + 1;
      while (j < s.size() && s[j] != '"') j += s[j] == '\\' ? 2 : 1;
      if (j >= s.size()) break;
      strs.emplace_back(i, j + 1);
      i = j + 1;
    } else if ((s[i] >= '0' && s[i] <= '9') || s[i] == '-') {
      std::size_t j = i;
      while (j < s.size() && std::string_view("0123456789-+.eE").find(s[j]) != std::string::npos) {
        ++j;
      }
      nums.emplace_back(i, j);
      i = j;
    } else {
      ++i;
    }
  }
}

//! One random change to text.
std::string mutate_text(std::string s, rng& r) {
  const std::size_t n = s.size();
  const std::size_t how = r.below(10);
  switch (how) {
    case 0:  // flip bits
      for (std::size_t k = 0, m = 1 + r.below(4); k < m && n != 0; ++k) {
        s[r.below(n)] ^= static_cast<char>(1 << r.below(8));
      }
      return s;
    case 1:  // a byte set to anything
      if (n != 0) s[r.below(n)] = static_cast<char>(r.below(256));
      return s;
    case 2:  // cut
      s.resize(r.below(n + 1));
      return s;
    case 3:  // insert tokens
      for (std::size_t k = 0, m = 1 + r.below(3); k < m; ++k) {
        s.insert(r.below(s.size() + 1), r.pick(tokens));
      }
      return s;
    case 4: {  // delete a range
      const std::size_t at = r.below(n + 1);
      s.erase(at, 1 + r.below(16));
      return s;
    }
    case 5: {  // duplicate a range
      const std::size_t at = r.below(n + 1), len = 1 + r.below(64);
      const std::string piece = s.substr(at, len);
      s.insert(r.below(s.size() + 1), piece);
      return s;
    }
    case 6:
    case 7: {  // a number, or a string, replaced
      std::vector<std::pair<std::size_t, std::size_t>> nums, strs;
      find_tokens(s, nums, strs);
      const auto& v = (how == 7 || nums.empty()) ? strs : nums;
      if (v.empty()) return s;
      const auto [b, e] = r.pick(v);
      std::string with = r.pick(numbers);
      if (&v == &strs && r.chance(50)) with = r.chance(50) ? "\"\"" : "\"" + r.pick(keys) + "\"";
      if (r.chance(15)) with = r.pick(tokens);
      s.replace(b, e - b, with);
      return s;
    }
    case 8: {  // a key repeated with another value, right after an opening brace
      std::vector<std::size_t> braces;
      for (std::size_t i = 0; i < n; ++i)
        if (s[i] == '{') braces.push_back(i);
      if (braces.empty()) return s;
      s.insert(r.pick(braces) + 1, "\"" + r.pick(keys) + "\":" + r.pick(numbers) + ",");
      return s;
    }
    default: {  // two lines swapped
      std::vector<std::size_t> nl{0};
      for (std::size_t i = 0; i < n; ++i)
        if (s[i] == '\n') nl.push_back(i + 1);
      if (nl.size() < 3) return s;
      std::size_t a = r.below(nl.size() - 1), b = r.below(nl.size() - 1);
      if (a > b) std::swap(a, b);
      if (a == b) return s;
      const std::string la = s.substr(nl[a], nl[a + 1] - nl[a]);
      const std::string lb = s.substr(nl[b], nl[b + 1] - nl[b]);
      s.replace(nl[b], lb.size(), la);
      s.replace(nl[a], la.size(), lb);
      return s;
    }
  }
}

using json = nlohmann::json;

json interesting_value(rng& r) {
  switch (r.below(22)) {
    case 0:
      return nullptr;
    case 1:
      return true;
    case 2:
      return false;
    case 3:
      return 0;
    case 4:
      return 1;
    case 5:
      return -1;
    case 6:
      return std::uint64_t{1} << 63;
    case 7:
      return ~std::uint64_t{0};
    case 8:
      return 1.5;
    case 9:
      return -0.0;
    case 10:
      return 1e300;
    case 11:
      return "";
    case 12:
      return "values";
    case 13:
      return r.chance(50) ? "../escape" : "a/b";
    case 14:
      return ".hidden";
    case 15:
      return r.chance(50) ? "0000000000000000" : "ffffffffffffffff";
    case 16:
      return r.chance(50) ? "F32" : "BF16";
    case 17:
      return json::array();
    case 18:
      return json::object();
    case 19:
      return json::array({0, 0, 0, 0, 0, 0});
    case 20:
      return json::array({0, 4});
    default:
      return json{{"a", 1}};
  }
}

//! Every node of j (iteratively), the root first.
std::vector<json*> nodes_of(json& j) {
  std::vector<json*> out{&j}, todo{&j};
  while (!todo.empty()) {
    json* x = todo.back();
    todo.pop_back();
    if (x->is_structured()) {
      for (auto& c : *x) {
        out.push_back(&c);
        todo.push_back(&c);
      }
    }
  }
  return out;
}

//! One random change to one node of j.
void mutate_node(json& j, rng& r) {
  auto all = nodes_of(j);
  json& x = *all[r.below(all.size())];
  const std::size_t what = r.below(10);
  if (x.is_number_unsigned() && what < 4) {
    const std::uint64_t v = x.get<std::uint64_t>();
    switch (r.below(7)) {
      case 0:
        x = v + 1;
        return;
      case 1:
        x = v == 0 ? std::uint64_t{0} : v - 1;
        return;
      case 2:
        x = v * 2;
        return;
      case 3:
        x = v / 2;
        return;
      case 4:
        x = v + (std::uint64_t{1} << 32);
        return;
      case 5:
        x = -static_cast<std::int64_t>(v) - 1;
        return;
      default:
        x = static_cast<double>(v);
        return;
    }
  }
  if (x.is_array() && !x.empty() && what < 6) {
    switch (r.below(4)) {
      case 0:
        x.erase(x.begin() + static_cast<std::ptrdiff_t>(r.below(x.size())));
        return;
      case 1: {
        const json copy = x[r.below(x.size())];
        x.insert(x.begin() + static_cast<std::ptrdiff_t>(r.below(x.size() + 1)), copy);
        return;
      }
      case 2:
        x.push_back(interesting_value(r));
        return;
      default:
        std::swap(x[r.below(x.size())], x[r.below(x.size())]);
        return;
    }
  }
  if (x.is_object() && !x.empty() && what < 6) {
    auto it = x.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(r.below(x.size())));
    const std::string key = it.key();
    switch (r.below(3)) {
      case 0:
        x.erase(key);
        return;
      case 1:
        x[r.pick(keys)] = interesting_value(r);
        return;
      default: {
        json v = *it;
        x.erase(key);
        x[r.pick(keys)] = std::move(v);
        return;
      }
    }
  }
  if (x.is_string() && what < 5) {
    std::string s = x.get<std::string>();
    if (r.chance(50))
      s.push_back("a/.0\\"[r.below(5)]);
    else
      s.resize(r.below(s.size() + 1));
    x = s;
    return;
  }
  x = interesting_value(r);
}

std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s.substr(0, 3000)) {
    if (c >= 32 && c < 127) {
      out.push_back(static_cast<char>(c));
    } else {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    }
  }
  return s.size() > 3000 ? out + "..." : out;
}

//! A scratch directory of this process, removed at exit.
struct scratch_dir {
  std::string path;
  scratch_dir() {
    path = (std::filesystem::temp_directory_path() /
            ("shardkit-io-fuzz-" + std::to_string(::getpid())))
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
const std::string& work_dir() {
  static const scratch_dir d;
  return d.path;
}

struct tally {
  int accepted = 0, rejected = 0;
  void operator()(bool a) { ++(a ? accepted : rejected); }
};

//! Runs check(input) and fails the test with the input, kept in a file, on a violation.
template <class Check>
bool run_case(const char* what, int iteration, const std::string& input, Check&& check) {
  try {
    return check();
  } catch (const fuzz::violation& v) {
    const std::string keep = work_dir() + "/../shardkit-io-fuzz-failure-" + what;
    fuzz::write_file(keep, input);
    FAIL(what << " #" << iteration << ": " << v.what() << "\n(input kept in " << keep << ")\n"
              << printable(input));
  }
  return false;
}

}  // namespace

TEST_CASE(
    "mutated manifests: a format_error naming the file, or a manifest that covers every "
    "element exactly once",
    "[io][fuzz][manifest]") {
  const std::string path = "fuzz-dir/manifest.json";
  const std::string base = io::to_json(fuzz::sample_manifest());
  REQUIRE(fuzz::check_manifest(base, path));
  rng r{20240615};
  tally raw, signed_text, structured;
  for (int i = 0; i < 2000; ++i) {  // text mutations, as damage leaves them
    std::string t = base;
    for (std::size_t k = 0, m = 1 + r.below(3); k < m; ++k) t = mutate_text(t, r);
    raw(run_case("manifest-raw", i, t, [&] { return fuzz::check_manifest(t, path); }));
  }
  for (int i = 0; i < 2500; ++i) {  // text mutations signed again: the parser past the checksum
    std::string t = base;
    for (std::size_t k = 0, m = 1 + r.below(3); k < m; ++k) t = mutate_text(t, r);
    t = fuzz::resign_manifest(t);
    signed_text(run_case("manifest-text", i, t, [&] { return fuzz::check_manifest(t, path); }));
  }
  for (int i = 0; i < 3500; ++i) {  // values of other types, keys removed and added, signed
    json j = json::parse(base);
    for (std::size_t k = 0, m = 1 + r.below(3); k < m; ++k) mutate_node(j, r);
    std::string t = r.chance(50) ? j.dump(1) : j.dump();
    if (r.chance(90)) t = fuzz::resign_manifest(t);
    structured(run_case("manifest-json", i, t, [&] { return fuzz::check_manifest(t, path); }));
  }
  CAPTURE(raw.accepted, raw.rejected, signed_text.accepted, signed_text.rejected,
          structured.accepted, structured.rejected);
  CHECK(raw.rejected > 1700);  // damage is found (by the checksum, mostly)
  // signed mutations reach the checks behind the checksum: some pass them, many do not
  CHECK(signed_text.accepted > 50);
  CHECK(signed_text.rejected > 1500);
  CHECK(structured.accepted > 150);
  CHECK(structured.rejected > 2000);
}

TEST_CASE(
    "mutated safetensors headers: a format_error naming the file, or entries that tile "
    "the data exactly",
    "[io][fuzz][safetensors]") {
  const std::string path = "fuzz-dir/model.safetensors";
  const auto [base, data] = fuzz::sample_safetensors_header();
  REQUIRE(fuzz::check_safetensors_header(base, data, path));
  rng r{777};
  tally text, structured;
  for (int i = 0; i < 3000; ++i) {
    std::string t = base;
    for (std::size_t k = 0, m = 1 + r.below(3); k < m; ++k) t = mutate_text(t, r);
    text(run_case("header-text", i, t,
                  [&] { return fuzz::check_safetensors_header(t, data, path); }));
  }
  for (int i = 0; i < 3000; ++i) {
    json j = json::parse(base);
    for (std::size_t k = 0, m = 1 + r.below(3); k < m; ++k) mutate_node(j, r);
    const std::string t = j.dump();
    std::uint64_t d = data;
    if (r.chance(10))
      d = r.pick(std::vector<std::uint64_t>{0, data - 1, data + 1, ~std::uint64_t{0}});
    structured(
        run_case("header-json", i, t, [&] { return fuzz::check_safetensors_header(t, d, path); }));
  }
  CAPTURE(text.accepted, text.rejected, structured.accepted, structured.rejected);
  CHECK(text.accepted > 100);  // (spaces, reordered keys, metadata changes pass)
  CHECK(text.rejected > 1200);
  CHECK(structured.accepted > 50);
  CHECK(structured.rejected > 1200);
}

TEST_CASE(
    "mutated safetensors files: a format_error naming the file, or tensors that read as "
    "their bytes",
    "[io][fuzz][safetensors]") {
  const std::string path = work_dir() + "/mutated.safetensors";
  const auto [header, data] = fuzz::sample_safetensors_header();
  const std::string base = fuzz::safetensors_bytes(header, data);
  REQUIRE(fuzz::check_safetensors_file(base, path));
  rng r{4242};
  tally t;
  const std::vector<std::uint64_t> sizes = {0,
                                            1,
                                            7,
                                            8,
                                            header.size() - 1,
                                            header.size() + 1,
                                            base.size() - 8,
                                            base.size() - 7,
                                            std::uint64_t{1} << 63,
                                            ~std::uint64_t{0},
                                            100'000'001};
  for (int i = 0; i < 3000; ++i) {
    std::string b = base;
    switch (r.below(4)) {
      case 0:  // the bytes of the file
        for (std::size_t k = 0, m = 1 + r.below(3); k < m; ++k) b = mutate_text(b, r);
        break;
      case 1: {  // the header size
        std::uint64_t h = r.pick(sizes);
        for (int k = 0; k < 8; ++k, h >>= 8) b[static_cast<std::size_t>(k)] = static_cast<char>(h);
        break;
      }
      case 2: {  // the header's JSON, with its true size
        json j = json::parse(header);
        for (std::size_t k = 0, m = 1 + r.below(3); k < m; ++k) mutate_node(j, r);
        b = fuzz::safetensors_bytes(j.dump(), data + (r.chance(20) ? r.below(9) : 0));
        break;
      }
      default: {  // the header's text, with its true size
        std::string h = header;
        for (std::size_t k = 0, m = 1 + r.below(2); k < m; ++k) h = mutate_text(h, r);
        b = fuzz::safetensors_bytes(h, data);
        break;
      }
    }
    t(run_case("safetensors-file", i, b, [&] { return fuzz::check_safetensors_file(b, path); }));
  }
  CAPTURE(t.accepted, t.rejected);
  CHECK(t.accepted > 100);
  CHECK(t.rejected > 1000);
}

TEST_CASE("damaged block files: a format_error naming the file, or the right bytes",
          "[io][fuzz][block_file]") {
  const std::string path = work_dir() + "/rank.bin";
  rng r{99};
  struct variant {
    std::size_t data, block;
  };
  tally t;
  for (const variant v :
       {variant{1000, 64}, variant{1024, 64}, variant{0, 64}, variant{50, 1}, variant{300, 4096}}) {
    CAPTURE(v.data, v.block);
    std::string data;
    for (std::size_t k = 0; k < v.data; ++k) data.push_back(static_cast<char>(r.next()));
    const std::string base = fuzz::block_file_bytes(path, data, v.block);
    const std::uint64_t D = data.size(), B = v.block, K = (D + B - 1) / B;
    auto ranges_for = [&](std::uint64_t d) {
      std::vector<std::pair<std::uint64_t, std::uint64_t>> out = {
          {0, d},
          {0, std::min<std::uint64_t>(d, 1)},
          {d, 0},
          {d, 1},
          {d + 1, 0},
          {0, d + 1},
          {~std::uint64_t{0}, 2},
          {1, ~std::uint64_t{0}}};
      for (std::uint64_t b = 0; b * B < d && out.size() < 40; ++b) out.push_back({b * B, 1});
      for (int k = 0; k < 8 && d != 0; ++k) {
        const std::uint64_t a = r.below(d);
        out.push_back({a, r.below(d - a + 1)});
      }
      return out;
    };
    REQUIRE(fuzz::check_block_file(base, path, ranges_for(D), &data));
    const std::vector<std::uint64_t> Bs = {0,
                                           1,
                                           B - 1,
                                           B,
                                           B + 1,
                                           D,
                                           D + 1,
                                           std::uint64_t{1} << 32,
                                           std::uint64_t{1} << 63,
                                           ~std::uint64_t{0},
                                           ~std::uint64_t{0} - B};
    const std::vector<std::uint64_t> Ds = {
        D, D + 1, D - 1, D + 8, D - 8, 0, ~std::uint64_t{0}, ~std::uint64_t{0} - 7, base.size()};
    const std::vector<std::uint64_t> Ks = {
        K, K + 1, K - 1, 0, 1, base.size() / 8, std::uint64_t{1} << 61};
    for (int i = 0; i < 800; ++i) {
      std::string b = base;
      switch (r.below(6)) {
        case 0:  // bits flipped anywhere
        case 1:
          for (std::size_t k = 0, m = 1 + r.below(3); k < m; ++k) {
            b[r.below(b.size())] ^= static_cast<char>(1 << r.below(8));
          }
          break;
        case 2:  // cut, grown, bytes inserted or deleted
          if (r.chance(50)) {
            b.resize(r.below(b.size() + 1));
          } else if (r.chance(50)) {
            b.insert(r.below(b.size() + 1), std::string(1 + r.below(16), '\0'));
          } else {
            b.erase(r.below(b.size() + 1), 1 + r.below(16));
          }
          break;
        case 3: {  // a word of the footer or table overwritten
          if (b.size() < 8) break;
          const std::uint64_t w = r.pick(Bs);
          std::memcpy(
              b.data() + (b.size() - 8 * (1 + r.below(std::min<std::size_t>(b.size() / 8, 10)))),
              &w, 8);
          break;
        }
        case 4:  // the footer rewritten with other sizes, and checksummed
          b = fuzz::refoot(b, r.chance(70) ? r.pick(Bs) : B, r.chance(50) ? r.pick(Ds) : D,
                           r.chance(50) ? r.pick(Ks) : K);
          break;
        default: {  // the table dropped (or cut), the footer rewritten to match its new size
          const std::uint64_t keep = r.below(K + 1);
          b.erase(D + keep * 8, (K - keep) * 8);
          b = fuzz::refoot(b, r.pick(Bs), D, keep);
          break;
        }
      }
      if (b == base) continue;
      t(run_case("block-file", i, b,
                 [&] { return fuzz::check_block_file(b, path, ranges_for(D), &data); }));
    }
  }
  CAPTURE(t.accepted, t.rejected);
  CHECK(t.accepted > 100);  // a damaged block still leaves the file open for other reads
  CHECK(t.rejected > 1000);
}

TEST_CASE("known hostile inputs: deep nesting, a footer that claims no blocks",
          "[io][fuzz][regressions]") {
  SECTION("a manifest nested 100000 levels deep is a format_error, not a stack overflow") {
    std::string t =
        R"({"checksum":"0000000000000000","format":"shardkit-checkpoint","version":1,"x":)";
    t += std::string(100000, '[') + std::string(100000, ']') + "}";
    CHECK_THROWS_AS(io::parse_manifest(t, "deep/manifest.json"), format_error);
    CHECK_THROWS_WITH(io::parse_manifest(t, "deep/manifest.json"),
                      Catch::Contains("deep/manifest.json"));
    // a legitimate manifest is far shallower than any limit
    CHECK(fuzz::check_manifest(io::to_json(fuzz::sample_manifest()), "m.json"));
  }
  SECTION("a safetensors header nested 1000000 levels deep is a format_error") {
    std::string t = "{\"a\":" + std::string(1000000, '[') + std::string(1000000, ']') + "}";
    CHECK_THROWS_AS(io::parse_safetensors_header(t, 0, "deep.safetensors"), format_error);
    t = "{\"__metadata__\":{\"k\":" + std::string(1000000, '{') + "}";
    CHECK_THROWS_AS(io::parse_safetensors_header(t, 0, "deep.safetensors"), format_error);
  }
  SECTION("a block file whose footer claims 0 blocks of 2^64 - 1 bytes for its data") {
    // data_bytes + block_bytes - 1 wraps around: the block count 0 must not pass for 100 bytes
    // of data, which would then be read unchecked (and the table indexed past its end)
    const std::string path = work_dir() + "/no-blocks.bin";
    std::string data(100, '\x07');
    std::string b = fuzz::block_file_bytes(path, data, 64);
    b.erase(100, 16);  // the table of 2 blocks
    for (const std::uint64_t B : {~std::uint64_t{0}, ~std::uint64_t{0} - 50}) {
      CAPTURE(B);
      const std::string forged = fuzz::refoot(b, B, 100, 0);
      fuzz::write_file(path, forged);
      CHECK_THROWS_WITH(io::block_file_reader(path),
                        Catch::Contains(path) && Catch::Contains("inconsistent footer"));
      CHECK_FALSE(fuzz::check_block_file(forged, path, {{0, 10}, {0, 100}}, &data));
    }
  }
}
