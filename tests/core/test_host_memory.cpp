// Long-lived host allocations of 2 MiB or more: aligned to 2 MiB, mappings of their own (fresh
// pages, returned to the system when freed), advised to use transparent huge pages (Linux: the
// mapping that holds them carries the "hg" flag in /proc/self/smaps), the advice turned off by
// SHARDKIT_HUGE_PAGES=0 and an unknown value refused; smaller ones, and transient ones (ZeRO-3's
// gathered units, I/O staging), untouched. Values never depend on it (every other test runs with
// the advice on).
#include <shardkit/comm/thread.hpp>
#include <shardkit/core/memory.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

// Every large malloc block its own fresh mapping, unmapped when freed: glibc otherwise raises
// its mmap threshold after the first large free and serves later blocks from the heap, where an
// earlier block's advice would still mark the reused range. The allocator maps long-lived large
// blocks itself (alloc::own_mappings); this is for the transient ones, and for builds where it
// does not (AddressSanitizer).
void fresh_mappings() {
#if defined(__GLIBC__)
  ::mallopt(M_MMAP_THRESHOLD, 128 * 1024);
#endif
}

using alloc = shardkit::space_allocator<shardkit::host_space>;

// The VmFlags of the mapping of /proc/self/smaps that holds `p`; nullopt if none does.
std::optional<std::string> vm_flags(const void* p) {
  std::ifstream in("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    std::uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = lo <= at && at < hi;
      continue;
    }
    if (inside && line.rfind("VmFlags:", 0) == 0) return line.substr(8) + " ";
  }
  return std::nullopt;
}

#if defined(__linux__)
// How many of the 4 KiB pages that hold [p, p + bytes) are resident (mincore); nullopt if the
// range is not mapped.
std::size_t pages_spanned(const void* p, std::size_t bytes) {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  return (at % 4096 + bytes + 4095) / 4096;
}
std::optional<std::size_t> resident_pages(const void* p, std::size_t bytes) {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t first = at - at % 4096;
  const std::size_t pages = pages_spanned(p, bytes);
  std::vector<unsigned char> in(pages);
  if (::mincore(reinterpret_cast<void*>(first), pages * 4096, in.data()) != 0) return std::nullopt;
  return static_cast<std::size_t>(
      std::count_if(in.begin(), in.end(), [](unsigned char c) { return (c & 1) != 0; }));
}
#endif

bool has_flag(const std::string& flags, const char* f) {
  return flags.find(std::string(" ") + f + " ") != std::string::npos;
}

// Transparent huge pages are in this kernel and allowed on request ("always" or "madvise").
bool thp_available() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(in, s);
  return s.find("[always]") != std::string::npos || s.find("[madvise]") != std::string::npos;
}

struct env_guard {
  explicit env_guard(const char* value) {
    if (value == nullptr) {
      ::unsetenv("SHARDKIT_HUGE_PAGES");
    } else {
      ::setenv("SHARDKIT_HUGE_PAGES", value, 1);
    }
  }
  ~env_guard() { ::unsetenv("SHARDKIT_HUGE_PAGES"); }
};

}  // namespace

TEST_CASE("host memory: large buffers sit on 2 MiB boundaries, smaller ones keep their alignment",
          "[memory]") {
  env_guard env(nullptr);
  for (std::size_t bytes : {alloc::huge_threshold, alloc::huge_threshold * 3 + 12345}) {
    for (int k = 0; k < 3; ++k) {  // three consecutive slots of the stagger
      shardkit::buffer<std::byte> b(bytes, nullptr, shardkit::memory_category::comm_scratch);
      INFO(bytes << " bytes, allocation " << k);
      // On a 2 MiB boundary, then this thread's slot of the stagger across threads, then the
      // stagger within a page.
      const auto at = reinterpret_cast<std::uintptr_t>(b.data());
      CHECK(at % alloc::huge_page - at % alloc::page == alloc::thread_step * alloc::thread_slot());
      CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % alloc::alignment == 0);
      CHECK(b.data()[bytes - 1] == std::byte{0});
    }
  }
  shardkit::buffer<std::byte> mid(alloc::huge_threshold - 1, nullptr,
                                  shardkit::memory_category::comm_scratch);
  CHECK(alloc::block_alignment(mid.size(), true) == alloc::page);
  CHECK(alloc::block_alignment(alloc::stagger_threshold - 1, true) == alloc::alignment);
  CHECK(alloc::block_alignment(alloc::huge_threshold, true) == alloc::huge_page);
  CHECK(alloc::block_alignment(alloc::huge_threshold, false) == alloc::page);
  CHECK(shardkit::long_lived(shardkit::memory_category::optimizer_moments));
  CHECK(shardkit::long_lived(shardkit::memory_category::grad_buckets));
  CHECK_FALSE(shardkit::long_lived(shardkit::memory_category::gathered_params));
  CHECK_FALSE(shardkit::long_lived(shardkit::memory_category::io_staging));
}

namespace {

// Distance of a and b modulo 2 MiB, the shorter way round.
std::uintptr_t distance_mod_huge_page(std::uintptr_t a, std::uintptr_t b) {
  const std::uintptr_t d = (a - b) % alloc::huge_page;
  return d < alloc::huge_page - d ? d : alloc::huge_page - d;
}

// The first pair of addresses closer than `least` modulo 2 MiB, as text; empty if none.
std::string closest_pair(const std::vector<std::uintptr_t>& at, std::uintptr_t least) {
  for (std::size_t i = 0; i < at.size(); ++i) {
    for (std::size_t j = i + 1; j < at.size(); ++j) {
      const auto d = distance_mod_huge_page(at[i], at[j]);
      if (d < least) {
        return "buffers " + std::to_string(i) + " and " + std::to_string(j) + " are " +
               std::to_string(d) + " bytes apart modulo 2 MiB";
      }
    }
  }
  return {};
}

}  // namespace

TEST_CASE("host memory: thread ranks' large buffers start on distinct slots modulo 2 MiB",
          "[memory][placement]") {
  // Every rank allocates the same buffers in the same order (as the engine does); the
  // collectives then stream all ranks' buffers at the same offsets. The stagger within a page
  // is the same on every rank, so the ranks' buffers are a whole thread_step apart.
  const std::size_t bytes = 4 * alloc::huge_page + 4096;
  for (const int ranks : {2, 4, 8}) {
    const auto at = shardkit::run_ranks(ranks, [&](shardkit::thread_comm& c) {
      shardkit::buffer<std::byte> first(alloc::huge_threshold, nullptr,
                                        shardkit::memory_category::grads);
      shardkit::buffer<std::byte> b(bytes, nullptr, shardkit::memory_category::grads);
      // Catch2's assertions are not thread-safe: the rank's slot is checked below.
      const bool own_slot = alloc::thread_slot() == static_cast<std::size_t>(c.rank());
      return own_slot ? reinterpret_cast<std::uintptr_t>(b.data()) : std::uintptr_t{0};
    });
    INFO(ranks << " ranks");
    CHECK(std::count(at.begin(), at.end(), std::uintptr_t{0}) == 0);
    const std::string close = closest_pair(at, alloc::thread_step);
    CHECK(close.empty());
    if (!close.empty()) WARN(close);
  }
  // Threads that are not ranks take the slots in turn.
  std::vector<std::uintptr_t> at(alloc::thread_slots);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < at.size(); ++t) {
    threads.emplace_back([&at, t, bytes] {
      shardkit::buffer<std::byte> b(bytes, nullptr, shardkit::memory_category::grads);
      at[t] = reinterpret_cast<std::uintptr_t>(b.data());
    });
    threads.back().join();  // one after another: each takes the next slot
  }
  const std::string close = closest_pair(at, alloc::thread_step);
  CHECK(close.empty());
  if (!close.empty()) WARN(close);
}

#if defined(__linux__)
TEST_CASE("host memory: huge-page advice on by default, off with SHARDKIT_HUGE_PAGES=0",
          "[memory]") {
  if (!thp_available()) {
    WARN(
        "this kernel offers no transparent huge pages on request "
        "(/sys/kernel/mm/transparent_hugepage/enabled): the advice is a no-op, not checked");
    return;
  }
  fresh_mappings();
  const std::size_t bytes = 4 * alloc::huge_page;
  {
    env_guard env(nullptr);
    shardkit::buffer<float> b(bytes / 4, nullptr, shardkit::memory_category::optimizer_moments);
    const auto flags = vm_flags(b.data());
    REQUIRE(flags.has_value());
    INFO("VmFlags:" << *flags);
    CHECK(has_flag(*flags, "hg"));
  }
  {
    env_guard env("1");
    shardkit::buffer<float> b(bytes / 4, nullptr, shardkit::memory_category::optimizer_moments);
    const auto flags = vm_flags(b.data());
    REQUIRE(flags.has_value());
    CHECK(has_flag(*flags, "hg"));
  }
  {
    env_guard env("0");
    shardkit::buffer<float> b(bytes / 4, nullptr, shardkit::memory_category::optimizer_moments);
    const auto flags = vm_flags(b.data());
    REQUIRE(flags.has_value());
    INFO("VmFlags:" << *flags);
    CHECK_FALSE(has_flag(*flags, "hg"));
  }
  for (const auto transient :
       {shardkit::memory_category::gathered_params, shardkit::memory_category::io_staging}) {
    env_guard env(nullptr);  // allocated and freed every step: no advice
    shardkit::buffer<float> b(bytes / 4, nullptr, transient);
    const auto flags = vm_flags(b.data());
    REQUIRE(flags.has_value());
    INFO(shardkit::name(transient) << ", VmFlags:" << *flags);
    CHECK_FALSE(has_flag(*flags, "hg"));
  }
  {
    env_guard env(nullptr);  // below the threshold: no advice
    shardkit::buffer<float> b(alloc::huge_threshold / 8, nullptr,
                              shardkit::memory_category::optimizer_moments);
    const auto flags = vm_flags(b.data());
    REQUIRE(flags.has_value());
    CHECK_FALSE(has_flag(*flags, "hg"));
  }
}
#endif

#if defined(__linux__)
// Pages faulted in on 4 KiB stay so whatever the advice: a long-lived block reusing memory an
// earlier block touched would lose its huge pages. glibc serves a large request from such memory
// once its mmap threshold has risen (it does at every large free, up to 32 MiB), which made an
// engine built after another one was destroyed run on 4 KiB pages. Emulated here by raising the
// thresholds by hand.
TEST_CASE("host memory: a long-lived large block is memory nothing touched, even after frees",
          "[memory]") {
  if (!alloc::own_mappings) {
    WARN(
        "long-lived blocks come from the system allocator in this build (AddressSanitizer, or "
        "not Linux): not checked");
    return;
  }
#if defined(__GLIBC__)
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
  const std::size_t bytes = 3 * alloc::huge_page + 12345;
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    void* p = alloc::allocate(bytes, 0, true);
    const auto before = resident_pages(p, bytes);
    REQUIRE(before.has_value());
    CHECK(*before == 0);
    std::memset(p, 1, bytes);
    const auto after = resident_pages(p, bytes);
    REQUIRE(after.has_value());
    CHECK(*after == pages_spanned(p, bytes));
    alloc::deallocate(p, bytes, true);
    // Returned to the system at once: the range is no longer mapped.
    CHECK_FALSE(resident_pages(p, bytes).has_value());
  }
  // Transient blocks stay with malloc (its heap, here).
  void* t = alloc::allocate(bytes, 0, false);
  std::memset(t, 1, bytes);
  CHECK(resident_pages(t, bytes).has_value());
  alloc::deallocate(t, bytes, false);
#if defined(__GLIBC__)
  ::mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  ::mallopt(M_TRIM_THRESHOLD, 128 * 1024);
#endif
}
#endif

TEST_CASE("host memory: an unknown SHARDKIT_HUGE_PAGES is refused, naming the accepted values",
          "[memory]") {
  env_guard env("yes");
  CHECK_THROWS_WITH(shardkit::buffer<float>(alloc::huge_threshold, nullptr,
                                            shardkit::memory_category::optimizer_moments),
                    Catch::Matchers::Contains("SHARDKIT_HUGE_PAGES=yes") &&
                        Catch::Matchers::Contains("accepted values are 0") &&
                        Catch::Matchers::Contains("1"));
  // Small allocations do not read it.
  CHECK_NOTHROW(shardkit::buffer<float>(16, nullptr, shardkit::memory_category::optimizer_moments));
}
