// The host-side logic of the CUDA backend, checked on the CPU (no GPU, no CUDA headers):
// launch geometry, when 16-byte vector accesses start and how runs are cut into chunks, the
// schedule of deterministic reductions, the device-allocation bookkeeping and resource hook, the
// calling thread's stream scope, and the error messages.
#include <shardkit/comm/deterministic.hpp>
#include <shardkit/core/device.hpp>
#include <shardkit/kernels/cuda/launch.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using namespace shardkit;

TEST_CASE("launch policies and grid sizes are compile-time data", "[cuda][launch]") {
  STATIC_REQUIRE(gpu::fused_step_policy.threads % 32 == 0);
  STATIC_REQUIRE(gpu::copy_policy.vector_bytes == 16);
  STATIC_REQUIRE(gpu::pack_elems(2) == 8);   // bf16/fp16: 8 per 16 bytes
  STATIC_REQUIRE(gpu::pack_elems(4) == 4);   // fp32
  STATIC_REQUIRE(gpu::pack_elems(8) == 2);   // fp64, int64
  STATIC_REQUIRE(gpu::pack_elems(1) == 16);  // uint8
  STATIC_REQUIRE(gpu::pack_elems(32) == 1);
  // enough blocks to cover the items, capped at blocks_per_sm per multiprocessor, at least one
  constexpr gpu::launch_policy p{256, 8, 16, 1};
  STATIC_REQUIRE(gpu::grid_blocks(0, p, 132) == 1);
  STATIC_REQUIRE(gpu::grid_blocks(1, p, 132) == 1);
  STATIC_REQUIRE(gpu::grid_blocks(256, p, 132) == 1);
  STATIC_REQUIRE(gpu::grid_blocks(257, p, 132) == 2);
  STATIC_REQUIRE(gpu::grid_blocks(std::size_t{1} << 30, p, 132) == 132 * 8);
  STATIC_REQUIRE(gpu::grid_blocks(std::size_t{1} << 30, p, 0) == 8);  // unknown SM count: 1
  // every shipped policy keeps 1024 threads per SM at most 64 registers each
  for (const auto& q :
       {gpu::fused_step_policy, gpu::copy_policy, gpu::reduce_policy, gpu::grad_stats_policy}) {
    CHECK(q.threads * q.blocks_per_sm == 1024);
    CHECK(q.unroll >= 1);
    CHECK(gpu::grid_blocks(std::size_t{1} << 30, q, 132) ==
          static_cast<std::size_t>(132 * q.blocks_per_sm));
  }
}

TEST_CASE("vector splits align every array's packs to 16 bytes", "[cuda][launch]") {
  const std::uintptr_t base = 0x10000;  // 16-byte aligned
  SECTION("all aligned: no head, whole packs, a scalar tail") {
    // bf16 gradients + fp32 params: packs of 8 elements
    const auto s = gpu::plan_vector_split({{base, 4}, {base + 0x1000, 2}}, 100);
    CHECK(s.vectorised);
    CHECK(s.pack == 8);
    CHECK(s.head == 0);
    CHECK(s.packs == 12);
    CHECK(s.body_end() == 96);  // 4 tail elements
  }
  SECTION("arrays offset by the same element count share a head") {
    // element 3 of both arrays: fp32 at +12 bytes, bf16 at +6 bytes; head 5 brings both to 16
    const auto s = gpu::plan_vector_split({{base + 12 + 0x40, 4}, {base + 6, 2}}, 100);
    // fp32: (12 + 0x40 + 4h) % 16 == 0 needs h ≡ 1 (mod 4); bf16: (6 + 2h) % 16 == 0 needs h ≡ 5
    // (mod 8)
    CHECK(s.vectorised);
    CHECK(s.head == 5);
    CHECK(s.packs == (100 - 5) / 8);
  }
  SECTION("arrays that cannot be aligned together are scalar") {
    const auto s = gpu::plan_vector_split({{base, 4}, {base + 2, 2}}, 1000);
    CHECK_FALSE(s.vectorised);
    CHECK(s.packs == 0);
    CHECK(s.head == 0);
  }
  SECTION("a pointer not aligned to its own element size is scalar") {
    CHECK_FALSE(gpu::plan_vector_split({{base + 1, 4}}, 1000).vectorised);
  }
  SECTION("too short for one pack") {
    CHECK_FALSE(gpu::plan_vector_split({{base, 4}}, 3).vectorised);
    CHECK_FALSE(gpu::plan_vector_split({{base + 4, 4}}, 4).vectorised);  // head 3 + 4 > 4
    CHECK(gpu::plan_vector_split({{base + 4, 4}}, 7).vectorised);
    CHECK_FALSE(gpu::plan_vector_split({{base, 4}}, 0).vectorised);
  }
  SECTION("typed pointers") {
    alignas(16) static float p[64];
    alignas(16) static std::uint16_t h[64];
    const auto s = gpu::plan_vector_split({gpu::ref(p + 1), gpu::ref(h + 1)}, 60);
    CHECK(s.vectorised);
    CHECK(s.head ==
          7);  // element 8 of both is 16-byte aligned (fp32 needs h ≡ 3 mod 4, bf16 7 mod 8)
  }
}

TEST_CASE("split_range cuts a range into scalar ends and whole packs", "[cuda][launch]") {
  gpu::vector_split s;
  s.vectorised = true;
  s.head = 3;
  s.pack = 8;
  s.packs = 10;  // body [3, 83)
  auto r = gpu::split_range(s, 0, 100);
  CHECK(r.vec_begin == 3);
  CHECK(r.vec_end == 83);
  r = gpu::split_range(s, 5, 50);  // partial packs at both ends stay scalar
  CHECK(r.vec_begin == 11);
  CHECK(r.vec_end == 43);
  r = gpu::split_range(s, 4, 10);  // no whole pack inside
  CHECK(r.vec_begin == 10);
  CHECK(r.vec_end == 10);
  r = gpu::split_range(s, 90, 100);  // all tail
  CHECK(r.vec_begin == 100);
  s.vectorised = false;
  r = gpu::split_range(s, 0, 100);
  CHECK(r.vec_begin == 100);
  CHECK(r.vec_end == 100);
}

TEST_CASE("multi-run launches cut runs into pack-aligned chunks, grouped", "[cuda][launch]") {
  gpu::vector_split v;
  v.vectorised = true;
  v.head = 5;
  v.pack = 8;
  v.packs = 1000;
  std::vector<gpu::run_extent> runs = {
      {8005, v, 1},  // group 1
      {0, {}, 0},    // empty: no chunk
      {300, {}, 0},  // scalar run, group 0
      {17, {}, 1},   // group 1
  };
  const auto plan = gpu::plan_chunks(runs, 2, 1000);
  // group 0 first: run 2 in chunks of 1000 -> one chunk
  REQUIRE(plan.group_begin.size() == 3);
  CHECK(plan.group_begin[0] == 0);
  CHECK(plan.group_begin[1] == 1);
  CHECK(plan.chunks[0] == gpu::work_chunk{2, 0, 0, 300});
  // group 1: run 0 (chunks of 1000 rounded to whole packs = 1000; boundaries at head + k·1000)
  std::size_t covered = 0;
  std::size_t k = plan.group_begin[1];
  for (; k < plan.chunks.size() && plan.chunks[k].run == 0; ++k) {
    const auto& c = plan.chunks[k];
    CHECK(c.begin == covered);
    if (c.begin != 0) CHECK((c.begin - 5) % 8 == 0);  // pack boundary after the head
    covered = c.end;
  }
  CHECK(covered == 8005);
  CHECK(plan.chunks[k] == gpu::work_chunk{3, 1, 0, 17});
  CHECK(plan.group_begin[2] == plan.chunks.size());
  CHECK(plan.chunks.size() == k + 1);

  SECTION("a group index out of range is an error that names it") {
    runs[2].group = 2;
    REQUIRE_THROWS_WITH(gpu::plan_chunks(runs, 2), Catch::Contains("run 2 belongs to group 2") &&
                                                       Catch::Contains("2 group(s)"));
  }
  SECTION("chunk lengths round up to whole packs") {
    const auto p = gpu::plan_chunks(std::vector<gpu::run_extent>{{100, v, 0}}, 1, 3);
    REQUIRE(p.chunks.size() > 2);
    CHECK(p.chunks[0] == gpu::work_chunk{0, 0, 0, 13});  // head 5 + one pack
    CHECK(p.chunks[1] == gpu::work_chunk{0, 0, 13, 21});
  }
}

TEST_CASE("shifted packs are the bytes of two aligned words at the shift", "[cuda][launch]") {
  gpu::words4 a{}, b{};
  unsigned char bytes[32];
  for (int i = 0; i < 32; ++i) bytes[i] = static_cast<unsigned char>(i * 7 + 1);
  std::memcpy(a.w, bytes, 16);
  std::memcpy(b.w, bytes + 16, 16);
  auto check_shift = [&]<int Q>(std::integral_constant<int, Q>) {
    for (unsigned byte = 0; byte < 4; ++byte) {
      const gpu::words4 got = gpu::shifted_pack<Q>(a, b, byte * 8);
      unsigned char want[16];
      std::memcpy(want, bytes + 4 * Q + byte, 16);
      CHECK(std::memcmp(got.w, want, 16) == 0);
    }
  };
  check_shift(std::integral_constant<int, 0>{});
  check_shift(std::integral_constant<int, 1>{});
  check_shift(std::integral_constant<int, 2>{});
  check_shift(std::integral_constant<int, 3>{});
  STATIC_REQUIRE(gpu::funnel_shift_right(0x11223344u, 0xaabbccddu, 8) == 0xdd112233u);
  STATIC_REQUIRE(gpu::funnel_shift_right(0x11223344u, 0xaabbccddu, 0) == 0x11223344u);
}

namespace {
// The shifted copy as the kernel walks it (convert.cuh, copy_range_shifted), on host memory:
// scalar head and tail, and per pack two aligned 16-byte loads combined by shifted_pack. Returns
// "" when every element arrived and every load stayed inside the source array.
std::string emulate_shifted_copy(std::size_t src_off, std::size_t dst_off, std::size_t n,
                                 std::size_t elem) {
  alignas(16) static unsigned char src_mem[4096 + 64], dst_mem[4096 + 64];
  for (std::size_t i = 0; i < sizeof(src_mem); ++i) src_mem[i] = static_cast<unsigned char>(i * 13);
  std::memset(dst_mem, 0, sizeof(dst_mem));
  const unsigned char* src = src_mem + src_off * elem;
  unsigned char* dst = dst_mem + dst_off * elem;
  const auto sh = gpu::plan_shifted_copy(reinterpret_cast<std::uintptr_t>(src),
                                         reinterpret_cast<std::uintptr_t>(dst), n, elem);
  if (!sh.split.vectorised) return "not vectorised";
  if (sh.shift == 0 || sh.shift % elem != 0) return "bad shift";
  const gpu::range_split r = gpu::split_range(sh.split, 0, n);
  if (r.vec_begin != sh.split.head) return "the body does not start at the head";
  for (std::size_t i = 0; i < r.vec_begin; ++i) std::memcpy(dst + i * elem, src + i * elem, elem);
  for (std::size_t i = r.vec_begin; i < r.vec_end; i += sh.split.pack) {
    if (reinterpret_cast<std::uintptr_t>(dst + i * elem) % 16 != 0) return "unaligned store";
    const unsigned char* at = src + i * elem - sh.shift;
    if (reinterpret_cast<std::uintptr_t>(at) % 16 != 0) return "unaligned load";
    if (at < src || at + 32 > src + n * elem) return "a load outside the source array";
    gpu::words4 lo{}, hi{};
    std::memcpy(lo.w, at, 16);
    std::memcpy(hi.w, at + 16, 16);
    gpu::words4 out{};
    const unsigned bits = (sh.shift % 4) * 8;
    switch (sh.shift / 4) {
      case 0:
        out = gpu::shifted_pack<0>(lo, hi, bits);
        break;
      case 1:
        out = gpu::shifted_pack<1>(lo, hi, bits);
        break;
      case 2:
        out = gpu::shifted_pack<2>(lo, hi, bits);
        break;
      default:
        out = gpu::shifted_pack<3>(lo, hi, bits);
        break;
    }
    std::memcpy(dst + i * elem, out.w, 16);
  }
  for (std::size_t i = r.vec_end; i < n; ++i) std::memcpy(dst + i * elem, src + i * elem, elem);
  if (std::memcmp(dst, src, n * elem) != 0) return "copy differs";
  for (std::size_t i = 0; i < sizeof(dst_mem); ++i) {
    if ((dst_mem + i < dst || dst_mem + i >= dst + n * elem) && dst_mem[i] != 0) {
      return "wrote outside the destination";
    }
  }
  return "";
}
}  // namespace

TEST_CASE("shifted copies: 16-byte stores from misaligned sources, loads in bounds",
          "[cuda][launch]") {
  for (std::size_t elem : {2u, 4u}) {
    const std::size_t pack = 16 / elem;
    for (std::size_t so = 0; so < pack; ++so) {
      for (std::size_t d = 0; d < pack; ++d) {
        for (std::size_t n : {3 * pack + 1, 4 * pack, 5 * pack + 3, std::size_t{1000}}) {
          if ((so + pack - d) % pack == 0) {  // alignable together: plan_vector_split's case
            CHECK_FALSE(gpu::plan_shifted_copy(0x1000 + so * elem, 0x2000 + d * elem, n, elem)
                            .split.vectorised);
            continue;
          }
          INFO("elem " << elem << " src offset " << so << " dst offset " << d << " n " << n);
          CHECK(emulate_shifted_copy(so, d, n, elem) == "");
        }
      }
    }
  }
  // too short for two aligned loads, or elements not aligned to their size: not vectorised
  CHECK_FALSE(gpu::plan_shifted_copy(0x1002, 0x2000, 8, 2).split.vectorised);
  CHECK_FALSE(gpu::plan_shifted_copy(0x1001, 0x2000, 1000, 2).split.vectorised);
  CHECK_FALSE(gpu::plan_shifted_copy(0x1002, 0x2000, 1000, 8).split.vectorised);
  const auto s = gpu::plan_shifted_copy(0x1002, 0x2000, 1000, 2);  // bf16, one element off
  CHECK(s.split.vectorised);
  CHECK(s.shift == 2);
  CHECK(s.split.head == 8);  // the first load of element 0's pack would start 2 bytes early
  CHECK(s.split.packs == (2000 - 14 - 32) / 16 + 1);
}

TEST_CASE("deterministic reductions stage in bounded, vector-aligned pieces", "[cuda][comm]") {
  using namespace shardkit::detail;
  STATIC_REQUIRE(staging_piece(1000, 4, 4, 1 << 20) == 1000);  // fits: one piece
  // 4 ranks x 2 bytes, 1000 bytes of staging: 125 elements fit, rounded down to 8 per 16 bytes
  STATIC_REQUIRE(staging_piece(100000, 4, 2, 1000) == 120);
  STATIC_REQUIRE(staging_piece(100000, 4, 2, 4) == 1);  // never zero
  STATIC_REQUIRE(staging_piece(0, 4, 2, 4) == 0);
  STATIC_REQUIRE(piece_count(1000, 120) == 9);
  STATIC_REQUIRE(piece_length(1000, 120, 0) == 120);
  STATIC_REQUIRE(piece_length(1000, 120, 8) == 40);
  STATIC_REQUIRE(piece_length(1000, 120, 9) == 0);
  STATIC_REQUIRE(piece_count(0, 120) == 0);
  // every element is covered exactly once
  for (std::size_t n : {0u, 1u, 119u, 120u, 121u, 100000u}) {
    const std::size_t p = staging_piece(n, 8, 4, 4096);
    std::size_t total = 0;
    for (std::size_t i = 0; i < piece_count(n, p); ++i) total += piece_length(n, p, i);
    CHECK(total == n);
  }
}

namespace {
// A device memory resource that hands out host memory: the bookkeeping needs no GPU.
class fake_resource final : public device_memory_resource {
 public:
  void* allocate(std::size_t bytes, device_stream stream) override {
    last_stream = stream;
    if (fail) throw std::bad_alloc();
    ++allocations;
    return std::malloc(bytes);
  }
  void deallocate(void* p, std::size_t, device_stream stream) noexcept override {
    last_stream = stream;
    ++frees;
    std::free(p);
  }
  const char* name() const noexcept override { return "fake"; }
  int allocations = 0;
  int frees = 0;
  bool fail = false;
  device_stream last_stream = nullptr;
};

class null_resource final : public device_memory_resource {
 public:
  void* allocate(std::size_t, device_stream) override { return nullptr; }
  void deallocate(void*, std::size_t, device_stream) noexcept override {}
  const char* name() const noexcept override { return "null"; }
};
}  // namespace

TEST_CASE("device allocations are counted and go to the installed resource", "[cuda][memory]") {
  fake_resource fallback, installed;
  const auto before = live_device_allocations();
  REQUIRE(before.count == 0);  // nothing else in this binary allocates device memory
  auto* s1 = reinterpret_cast<device_stream>(std::uintptr_t{0x1230});

  void* a = detail::allocate_device_bytes(fallback, 100, s1);
  CHECK(fallback.allocations == 1);
  CHECK(fallback.last_stream == s1);
  CHECK(live_device_allocations().count == 1);
  CHECK(live_device_allocations().bytes == 100);
  CHECK(detail::allocate_device_bytes(fallback, 0, s1) == nullptr);  // zero bytes: nothing
  CHECK(live_device_allocations().count == 1);

  SECTION("the resource cannot change while allocations are alive") {
    REQUIRE_THROWS_AS(set_device_memory_resource(&installed), usage_error);
    REQUIRE_THROWS_WITH(set_device_memory_resource(&installed),
                        Catch::Contains("1 device allocation(s)") && Catch::Contains("100 bytes") &&
                            Catch::Contains("cuda_malloc_async"));
    detail::deallocate_device_bytes(fallback, a, 100, s1);
  }
  SECTION("after the last free it can, and later allocations use it") {
    detail::deallocate_device_bytes(fallback, a, 100, s1);
    CHECK(fallback.frees == 1);
    CHECK(live_device_allocations().count == 0);
    CHECK(live_device_allocations().peak_bytes >= 100);
    REQUIRE(set_device_memory_resource(&installed) == nullptr);
    CHECK(get_device_memory_resource() == &installed);
    void* b = detail::allocate_device_bytes(fallback, 64, nullptr);
    CHECK(installed.allocations == 1);
    CHECK(fallback.allocations == 1);
    REQUIRE_THROWS_WITH(set_device_memory_resource(nullptr), Catch::Contains("'fake'"));
    detail::deallocate_device_bytes(fallback, b, 64, nullptr);
    CHECK(installed.frees == 1);
    CHECK(set_device_memory_resource(nullptr) == &installed);
    CHECK(get_device_memory_resource() == nullptr);
  }
  SECTION("a failed allocation is not counted") {
    detail::deallocate_device_bytes(fallback, a, 100, s1);
    fallback.fail = true;
    REQUIRE_THROWS_AS(detail::allocate_device_bytes(fallback, 10, s1), std::bad_alloc);
    CHECK(live_device_allocations().count == 0);
    null_resource none;
    REQUIRE_THROWS_WITH(detail::allocate_device_bytes(none, 10, s1),
                        Catch::Contains("'null' returned no memory for 10 bytes"));
    CHECK(live_device_allocations().count == 0);
  }
  CHECK(live_device_allocations().count == 0);
}

TEST_CASE("device_stream_scope sets the calling thread's stream only", "[cuda][memory]") {
  auto* a = reinterpret_cast<device_stream>(std::uintptr_t{0x10});
  auto* b = reinterpret_cast<device_stream>(std::uintptr_t{0x20});
  CHECK(current_device_stream() == nullptr);
  {
    device_stream_scope sa(a);
    CHECK(current_device_stream() == a);
    {
      device_stream_scope sb(b);
      CHECK(current_device_stream() == b);
      device_stream other = a;
      std::thread([&] { other = current_device_stream(); }).join();
      CHECK(other == nullptr);  // per thread
    }
    CHECK(current_device_stream() == a);
  }
  CHECK(current_device_stream() == nullptr);
}

TEST_CASE("CUDA and NCCL error messages name the call, the error and where", "[cuda][errors]") {
  CHECK(detail::format_cuda_error("cudaMallocAsync of 1024 bytes", 2, "cudaErrorMemoryAllocation",
                                  "out of memory") ==
        "cudaMallocAsync of 1024 bytes: cudaErrorMemoryAllocation (2): out of memory");
  CHECK(detail::format_cuda_error("x", 999, nullptr, nullptr) ==
        "x: unknown CUDA error (999): no description");
  CHECK(detail::describe_launch("gpu::fused_step", 528, 256, 1000000) ==
        "kernel gpu::fused_step (528 blocks of 256 threads, 1000000 elements)");
  const cuda_error e(2, "boom");
  CHECK(e.code() == 2);
  CHECK(std::string(e.what()) == "boom");
  CHECK(dynamic_cast<const error*>(&e) != nullptr);
  CHECK(detail::format_nccl_error("all_reduce(bf16, count 8, sum) #3", 1, 4, 1, 6,
                                  "remote process exited or there was a network error",
                                  "NET/IB : Got completion with error") ==
        "all_reduce(bf16, count 8, sum) #3 on rank 1 of 4 (device 1): remote process exited or "
        "there was a network error (6); NCCL: NET/IB : Got completion with error");
  CHECK(detail::format_nccl_error("ncclGroupEnd", 0, 2, 0, 3, "internal error", "") ==
        "ncclGroupEnd on rank 0 of 2 (device 0): internal error (3)");
  CHECK_THAT(detail::format_nccl_timeout("reduce_scatter(fp32, count 4, sum) #9", 2, 8, 2, 60000),
             Catch::StartsWith("reduce_scatter(fp32, count 4, sum) #9 on rank 2 of 8 (device 2) "
                               "did not complete within 60000 ms; the NCCL communicator was "
                               "aborted"));
}
