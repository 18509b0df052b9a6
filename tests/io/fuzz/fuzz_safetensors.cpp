// libFuzzer target: the input is a safetensors file. io::parse_safetensors_header on its header
// (when its 8-byte size fits the input) with the data size that follows, and the whole file
// through io::safetensors_file (opened, every float tensor read). Rules: fuzz_cases.hpp.
#include "io/fuzz/fuzz_target.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  return fuzz::guarded([&] {
    if (size >= 8) {
      std::uint64_t h = 0;
      for (int i = 7; i >= 0; --i) h = h << 8 | data[i];
      if (h <= size - 8) {
        (void)fuzz::check_safetensors_header(in.substr(8, h), size - 8 - h, "fuzz.safetensors");
      }
    }
    (void)fuzz::check_safetensors_file(in, fuzz::scratch_file());
  });
}
