// The Tensor concept and its customisation point; buffers and the memory and traffic ledgers.
#include <shardkit/comm/volume.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>
#include <shardkit/core/tensor.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <span>
#include <vector>

namespace fw {  // a framework's own tensor type, with its element type known at run time
struct Tensor {
  std::vector<unsigned char> bytes;
  shardkit::dtype type;
  std::size_t n;
};
}  // namespace fw

template <>
struct shardkit::tensor_traits<fw::Tensor> {
  using memory_space = shardkit::host_space;
  static shardkit::dtype dtype(const fw::Tensor& t) { return t.type; }
  static void* data(fw::Tensor& t) { return t.bytes.data(); }
  static const void* data(const fw::Tensor& t) { return t.bytes.data(); }
  static std::size_t size(const fw::Tensor& t) { return t.n; }
};

namespace dev {  // a framework tensor that knows its device only at run time (like torch::Tensor)
struct Tensor {
  std::vector<float> values;
  bool on_gpu = false;
};
}  // namespace dev

template <>
struct shardkit::tensor_traits<dev::Tensor> {
  static shardkit::memory_kind memory(const dev::Tensor& t) {
    return t.on_gpu ? shardkit::memory_kind::cuda : shardkit::memory_kind::host;
  }
  using value_type = float;
  static float* data(dev::Tensor& t) { return t.values.data(); }
  static const float* data(const dev::Tensor& t) { return t.values.data(); }
  static std::size_t size(const dev::Tensor& t) { return t.values.size(); }
};

using namespace shardkit;

TEST_CASE("standard contiguous ranges are host tensors", "[tensor]") {
  STATIC_REQUIRE(tensor<std::vector<float>>);
  STATIC_REQUIRE(tensor<const std::vector<bf16>>);
  STATIC_REQUIRE(tensor<std::array<fp16, 4>>);
  STATIC_REQUIRE(tensor<std::span<float>>);
  STATIC_REQUIRE(typed_tensor<std::vector<float>>);
  STATIC_REQUIRE(!tensor<int>);
  STATIC_REQUIRE(!tensor<std::vector<std::string>>);
  STATIC_REQUIRE(std::is_same_v<tensor_space_t<std::vector<float>>, host_space>);

  std::vector<float> v{1, 2, 3};
  auto tv = view(v);
  STATIC_REQUIRE(std::is_same_v<decltype(tv), tensor_view<float, host_space>>);
  REQUIRE(tv.size() == 3);
  REQUIRE(tv[2] == 3.0f);
  const std::vector<float>& cv = v;
  auto ctv = view(cv);
  STATIC_REQUIRE(std::is_same_v<decltype(ctv), tensor_view<const float, host_space>>);
  REQUIRE(erase(cv).read_only);
  REQUIRE(tensor_dtype(v) == dtype::f32);
}

TEST_CASE("a framework tensor adapts through tensor_traits, with a run-time dtype", "[tensor]") {
  STATIC_REQUIRE(tensor<fw::Tensor>);
  STATIC_REQUIRE(!typed_tensor<fw::Tensor>);
  fw::Tensor t{std::vector<unsigned char>(8), dtype::bf16, 4};
  const any_tensor_view a = erase(t);
  REQUIRE(a.type == dtype::bf16);
  REQUIRE(a.numel == 4);
  REQUIRE(a.space == memory_kind::host);
  auto typed = a.as<bf16>();
  REQUIRE(typed.size() == 4);
  REQUIRE_THROWS_WITH(a.as<float>(), Catch::Contains("bf16") && Catch::Contains("fp32"));
  REQUIRE_THROWS_WITH((a.as<bf16, cuda_space>()), Catch::Contains("host memory viewed as cuda"));
}

TEST_CASE("a framework tensor may report its memory at run time", "[tensor]") {
  STATIC_REQUIRE(tensor<dev::Tensor>);
  STATIC_REQUIRE(tensor<const dev::Tensor&>);
  // Static element type, but no static memory space: not typed, so view() does not apply.
  STATIC_REQUIRE(!typed_tensor<dev::Tensor>);
  dev::Tensor host{{1.0f, 2.0f, 3.0f}, false};
  dev::Tensor gpu{{1.0f, 2.0f}, true};
  REQUIRE(tensor_memory(host) == memory_kind::host);
  REQUIRE(tensor_memory(gpu) == memory_kind::cuda);
  REQUIRE(tensor_memory(std::vector<float>{}) == memory_kind::host);
  const any_tensor_view a = erase(gpu);
  REQUIRE(a.space == memory_kind::cuda);
  REQUIRE(a.type == dtype::f32);
  REQUIRE(a.numel == 2);
  REQUIRE_THROWS_WITH(a.as<float>(), Catch::Contains("cuda memory viewed as host"));
  REQUIRE(erase(host).as<float>().data() == host.values.data());
  const dev::Tensor& ch = host;
  REQUIRE(erase(ch).read_only);
}

TEST_CASE("tensor_view subviews are bounds-checked", "[tensor]") {
  std::vector<int32_t> v(10);
  tensor_view<int32_t> tv(v.data(), v.size());
  REQUIRE(tv.subview(2, 8).size() == 8);
  REQUIRE_THROWS_WITH(tv.subview(5, 6), Catch::Contains("exceeds the view's 10 elements"));
  tensor_view<const int32_t> c = tv;  // mutable -> const
  REQUIRE(c.data() == v.data());
}

TEST_CASE("buffers are zeroed, aligned, and tracked by the memory ledger", "[memory][ledger]") {
  memory_ledger L;
  {
    buffer<float> a(100, &L, memory_category::master_params);
    REQUIRE(reinterpret_cast<std::uintptr_t>(a.data()) % 64 == 0);
    for (float x : a.span()) REQUIRE(x == 0.0f);
    REQUIRE(L.current(memory_category::master_params) == 400);
    buffer<bf16> b(10, &L, memory_category::grads);
    REQUIRE(L.total() == 420);
    buffer<bf16> moved = std::move(b);
    REQUIRE(L.total() == 420);
    moved.release();
    REQUIRE(L.current(memory_category::grads) == 0);
    REQUIRE(L.peak(memory_category::grads) == 20);
  }
  REQUIRE(L.total() == 0);
  REQUIRE(L.total_peak() == 420);
  L.reset_peaks();
  REQUIRE(L.total_peak() == 0);
  REQUIRE_THROWS_AS(L.remove(memory_category::grads, 1), error);
}

TEST_CASE("traffic ledger counts calls and bytes", "[ledger]") {
  traffic_ledger t;
  t.record(collective::all_gather, 100);
  t.record(collective::all_gather, 50);
  t.record(collective::reduce_scatter, 7);
  REQUIRE(t.calls(collective::all_gather) == 2);
  REQUIRE(t.bytes_sent(collective::all_gather) == 150);
  REQUIRE(t.total_bytes_sent() == 157);
  const traffic_ledger snap = t;
  t.record(collective::broadcast, 3);
  REQUIRE(t.since(snap).total_bytes_sent() == 3);
  REQUIRE(t.since(snap).calls(collective::broadcast) == 1);
}

TEST_CASE("ring volumes", "[volume]") {
  // reduce-scatter / all-gather: (N-1) * count * e
  REQUIRE(ring_bytes_sent(collective::reduce_scatter, 100, 2, 4, 0) == 600);
  REQUIRE(ring_bytes_sent(collective::all_gather, 100, 2, 4, 3) == 600);
  // all-reduce of n divisible by N: 2 (N-1)/N n e
  REQUIRE(ring_bytes_sent(collective::all_reduce, 400, 2, 4, 1) == 1200);
  // all-reduce of n not divisible by N: every rank sends all chunks but two; summed over
  // ranks it is 2 (N-1) n e
  for (std::size_t n : {1u, 7u, 19'210u, 1'000'003u}) {
    for (std::size_t N : {2u, 3u, 7u, 8u}) {
      std::uint64_t total = 0;
      for (std::size_t r = 0; r < N; ++r)
        total += ring_bytes_sent(collective::all_reduce, n, 2, N, r);
      REQUIRE(total == 2 * (N - 1) * n * 2);
    }
  }
  REQUIRE(ring_bytes_sent(collective::all_reduce, 1000, 2, 1, 0) == 0);
  // broadcast: everyone but the end of the chain sends n
  REQUIRE(ring_bytes_sent(collective::broadcast, 10, 4, 4, 2, 3) == 0);
  REQUIRE(ring_bytes_sent(collective::broadcast, 10, 4, 4, 3, 3) == 40);
  REQUIRE(ring_bytes_sent(collective::barrier, 10, 4, 4, 3) == 0);
  // chunking
  std::size_t sum = 0;
  for (std::size_t q = 0; q < 7; ++q) sum += chunk_size(100, 7, q);
  REQUIRE(sum == 100);
  REQUIRE(chunk_begin(static_cast<std::size_t>(-1) / 2, 3, 2) > 0);  // no overflow
}
