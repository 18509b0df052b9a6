// The training text: every `.py` file under a directory (by default the Python standard library
// that Debian's python3 puts on every machine), in sorted path order, read as bytes and cut into
// a training part and a validation part (the last `val_fraction` of the bytes). Batches are drawn
// from a generator seeded by (seed, step, sequence index): sequence s of step t is the same
// whatever the number of ranks or micro-batches, so runs at different N train on the same global
// batches and a resumed run sees the batches the uninterrupted one did.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <torch/torch.h>
#include <vector>

namespace gpt {

struct corpus {
  std::string root;                 // the directory read
  std::size_t files = 0;            // .py files read
  std::vector<std::uint8_t> train;  // bytes
  std::vector<std::uint8_t> val;
};

//! The first /usr/lib/python3.* directory, where Debian's python3 keeps the standard library.
inline std::string default_corpus_dir() {
  namespace fs = std::filesystem;
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/usr/lib", ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("python3", 0) == 0 && name != "python3") {
      found.push_back(e.path().string());
    }
  }
  std::sort(found.begin(), found.end());
  return found.empty() ? std::string("/usr/lib/python3") : found.front();
}

//! Reads up to `max_bytes` of `.py` files under `dir`. Raises std::runtime_error when the
//! directory is missing or holds too little text for sequences of `context` tokens.
inline corpus load_corpus(const std::string& dir, std::size_t max_bytes, double val_fraction,
                          int context) {
  namespace fs = std::filesystem;
  corpus c;
  c.root = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw std::runtime_error("corpus directory '" + dir +
                             "' does not exist (pass --data DIR, a directory of .py files; "
                             "Debian's python3 package puts one under /usr/lib/python3.*)");
  }
  std::vector<fs::path> paths;
  for (auto it =
           fs::recursive_directory_iterator(dir, fs::directory_options::skip_permission_denied, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) break;
    if (it->is_regular_file(ec) && it->path().extension() == ".py") paths.push_back(it->path());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<std::uint8_t> all;
  for (const auto& p : paths) {
    if (all.size() >= max_bytes) break;
    std::ifstream in(p, std::ios::binary);
    std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                    std::istreambuf_iterator<char>());
    if (bytes.empty()) continue;
    const std::size_t take = std::min(bytes.size(), max_bytes - all.size());
    all.insert(all.end(), bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(take));
    ++c.files;
  }
  const std::size_t need = 4 * static_cast<std::size_t>(context + 1);
  const auto n_val = static_cast<std::size_t>(static_cast<double>(all.size()) * val_fraction);
  if (all.size() < 2 * need || n_val < need) {
    throw std::runtime_error("corpus directory '" + dir + "' holds " + std::to_string(all.size()) +
                             " bytes of .py files in " + std::to_string(c.files) +
                             " files; at least " + std::to_string(2 * need) +
                             " are needed for sequences of " + std::to_string(context) +
                             " tokens (pass --data DIR with more text)");
  }
  c.val.assign(all.end() - static_cast<std::ptrdiff_t>(n_val), all.end());
  all.resize(all.size() - n_val);
  c.train = std::move(all);
  return c;
}

//! Token ids and next-token targets of `count` sequences of `context` bytes.
struct batch {
  torch::Tensor idx, targets;  // (count, context) int64
};

// Sequences at the given starting offsets of `text`.
inline batch sequences_at(const std::vector<std::uint8_t>& text, const std::vector<std::size_t>& at,
                          int context) {
  const auto n = static_cast<std::int64_t>(at.size());
  auto idx = torch::empty({n, context}, torch::kInt64);
  auto tgt = torch::empty({n, context}, torch::kInt64);
  auto* pi = idx.data_ptr<std::int64_t>();
  auto* pt = tgt.data_ptr<std::int64_t>();
  for (std::int64_t s = 0; s < n; ++s) {
    for (int t = 0; t < context; ++t) {
      pi[s * context + t] = text[at[static_cast<std::size_t>(s)] + static_cast<std::size_t>(t)];
      pt[s * context + t] = text[at[static_cast<std::size_t>(s)] + static_cast<std::size_t>(t) + 1];
    }
  }
  return {idx, tgt};
}

//! Sequences [first, first + count) of the global batch of step `step` (0-based).
inline batch train_batch(const corpus& c, std::uint64_t seed, std::uint64_t step, std::size_t first,
                         std::size_t count, int context) {
  std::vector<std::size_t> at;
  const std::size_t span = c.train.size() - static_cast<std::size_t>(context) - 1;
  for (std::size_t s = first; s < first + count; ++s) {
    std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                      static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32),
                      static_cast<std::uint32_t>(s)};
    std::mt19937_64 gen(seq);
    at.push_back(static_cast<std::size_t>(gen() % span));
  }
  return sequences_at(c.train, at, context);
}

//! The validation set: `count` sequences evenly spaced over the validation text.
inline batch val_batch(const corpus& c, std::size_t count, int context) {
  std::vector<std::size_t> at;
  const std::size_t span = c.val.size() - static_cast<std::size_t>(context) - 1;
  for (std::size_t s = 0; s < count; ++s) at.push_back(span * s / count);
  return sequences_at(c.val, at, context);
}

}  // namespace gpt
