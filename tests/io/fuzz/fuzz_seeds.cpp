// shardkit_fuzz_seeds DIR: writes seed corpora for the libFuzzer targets (a manifest, a
// safetensors file, block files) to DIR/manifest, DIR/safetensors and DIR/block_file.
#include "io/fuzz_cases.hpp"

#include <cstdio>
#include <filesystem>
#include <string>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: shardkit_fuzz_seeds DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  for (const char* d : {"manifest", "safetensors", "block_file"}) {
    std::filesystem::create_directories(dir / d);
  }
  fuzz::write_file((dir / "manifest" / "sample.json").string(),
                   shardkit::io::to_json(fuzz::sample_manifest()));
  const auto [header, data] = fuzz::sample_safetensors_header();
  fuzz::write_file((dir / "safetensors" / "sample.safetensors").string(),
                   fuzz::safetensors_bytes(header, data));
  std::string payload;
  for (int i = 0; i < 300; ++i) payload.push_back(static_cast<char>(i * 7));
  int n = 0;
  for (const std::size_t block : {64, 1, 4096}) {
    const std::string p = (dir / "block_file" / ("sample" + std::to_string(n++) + ".bin")).string();
    (void)fuzz::block_file_bytes(p, block == 1 ? payload.substr(0, 20) : payload, block);
  }
  // one block of up to 2^63 bytes: the same file, but sizes near the edge of 64 bits
  const std::string big = (dir / "block_file" / "sample-huge-block.bin").string();
  const std::string one = fuzz::block_file_bytes(big, payload, 4096);
  fuzz::write_file(big, fuzz::refoot(one, std::uint64_t{1} << 63, payload.size(), 1));
  std::printf("seeds written to %s\n", argv[1]);
  return 0;
}
