// libFuzzer target: the input is a block file, opened with io::block_file_reader, read over a
// few ranges and verified, and judged against fuzz_cases.hpp's independent model of the
// format: accepted exactly when its footer and table check, a read succeeds exactly when its
// blocks check and returns the file's bytes.
#include "io/fuzz/fuzz_target.hpp"

#include <cstring>
#include <utility>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  return fuzz::guarded([&] {
    const auto m = fuzz::model_block_file(in);
    const std::uint64_t d = m.footer_ok ? m.data_bytes : size;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges = {
        {0, d}, {0, d < 1 ? d : 1}, {d / 3, d / 3}, {d, 0}, {d, 1}, {0, d + 1}};
    for (std::uint64_t b = 0; m.footer_ok && b < m.blocks && b < 16; ++b) {
      ranges.push_back({b * m.block_bytes, 1});
    }
    (void)fuzz::check_block_file(in, fuzz::scratch_file(), ranges);
    // The same sizes with the footer's and the table's checksums made right, so that the
    // fuzzer's choice of block size, data size and block count reaches the reader's
    // consistency checks and the block reads (a fuzzer cannot forge an XXH64 by itself).
    if (size >= 48) {
      std::uint64_t f[3];
      std::memcpy(f, data + size - 40, sizeof f);
      const std::string signed_in = fuzz::refoot(std::string(in), f[0], f[1], f[2]);
      if (signed_in != in) {
        const auto s = fuzz::model_block_file(signed_in);
        std::vector<std::pair<std::uint64_t, std::uint64_t>> r2 = {
            {0, 1}, {0, f[1]}, {f[1] / 2, 1}};
        for (std::uint64_t b = 0; s.footer_ok && b < s.blocks && b < 16; ++b) {
          r2.push_back({b * s.block_bytes, 1});
        }
        (void)fuzz::check_block_file(signed_in, fuzz::scratch_file(), r2);
      }
    }
  });
}
