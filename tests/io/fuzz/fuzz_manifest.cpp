// libFuzzer target: io::parse_manifest on the input as it is, and signed again (its checksum
// field set to the checksum of the rest, when it is a JSON object with one), so that the
// fuzzer's mutations reach the checks behind the checksum. Rules: fuzz_cases.hpp.
#include "io/fuzz/fuzz_target.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  return fuzz::guarded([&] {
    (void)fuzz::check_manifest(text, "fuzz/manifest.json");
    const std::string signed_text = fuzz::resign_manifest(text);
    if (signed_text != text) (void)fuzz::check_manifest(signed_text, "fuzz/manifest.json");
  });
}
