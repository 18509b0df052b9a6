// GPU tests of device memory and the communicators on it: device buffers and the allocator
// hook, the thread communicator on device memory and (where NCCL was found) the NCCL
// communicator against the rank-order reference of tests/comm/test_collectives.cpp. Runs only
// where a CUDA device exists (test_cuda_main.cpp skips otherwise).
#include <shardkit/kernels/host/reduce.hpp>

#include "cuda/gpu_support.cuh"
#include "support/world.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using namespace shardkit;
using namespace shardkit_test_gpu;

// ---- device memory ---------------------------------------------------------------------------

namespace {
class counting_resource final : public device_memory_resource {
 public:
  void* allocate(std::size_t bytes, device_stream stream) override {
    ++allocations;
    last_stream = stream;
    return inner.allocate(bytes, stream);
  }
  void deallocate(void* p, std::size_t bytes, device_stream stream) noexcept override {
    ++frees;
    inner.deallocate(p, bytes, stream);
  }
  const char* name() const noexcept override { return "counting"; }
  cuda_async_resource inner;
  int allocations = 0;
  int frees = 0;
  device_stream last_stream = nullptr;
};
}  // namespace

TEST_CASE("device buffers are zeroed, counted by the ledger, and use the installed resource",
          "[memory]") {
  REQUIRE(live_device_allocations().count == 0);
  memory_ledger ledger;
  {
    buffer<float, cuda_space> b(1000, &ledger, memory_category::grads);
    CHECK(ledger.current(memory_category::grads) == 4000);
    CHECK(live_device_allocations().count == 1);
    CHECK(live_device_allocations().bytes == 4000);
    std::vector<float> h(1000, 1.0f);
    copy_elements(h.data(), b.data(), h.size());
    CHECK(std::all_of(h.begin(), h.end(), [](float x) { return x == 0.0f; }));
    cudaPointerAttributes a{};
    REQUIRE(cudaPointerGetAttributes(&a, b.data()) == cudaSuccess);
    CHECK(a.type == cudaMemoryTypeDevice);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 16 == 0);
  }
  CHECK(ledger.current(memory_category::grads) == 0);
  CHECK(ledger.peak(memory_category::grads) == 4000);
  CHECK(live_device_allocations().count == 0);

  counting_resource r;
  REQUIRE(set_device_memory_resource(&r) == nullptr);
  {
    cuda_stream s;
    device_stream_scope scope(s);
    buffer<bf16, cuda_space> b(4096, &ledger, memory_category::working_params);
    CHECK(r.allocations == 1);
    CHECK(r.last_stream == s.get());
    REQUIRE_THROWS_AS(set_device_memory_resource(nullptr), usage_error);
    b.release();
    CHECK(r.frees == 1);
    s.synchronize();
  }
  CHECK(set_device_memory_resource(nullptr) == &r);
}
// ---- communicators on device memory --------------------------------------------------------

namespace {

// Host-pointer collectives over a device communicator: copy in, run on device buffers, copy
// out. In-place calls stay in place on the device. So the rank-order checks below (those of
// tests/comm/test_collectives.cpp) run unchanged against device communicators.
template <class Comm>
class staged {
 public:
  explicit staged(Comm& c) : c_(c) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  const traffic_ledger& traffic() const { return c_.traffic(); }

  template <class T>
  void all_reduce(const T* in, T* out, std::size_t n, reduce_op op) {
    dev_array<T> d(host(in, n));
    if (in == out) {
      c_.all_reduce(d.data(), d.data(), n, op);
      store(out, d);
    } else {
      dev_array<T> o(n);
      c_.all_reduce(d.data(), o.data(), n, op);
      store(out, o);
    }
  }
  template <class T>
  void reduce_scatter(const T* in, T* out, std::size_t count, reduce_op op) {
    const std::size_t N = static_cast<std::size_t>(size()), r = static_cast<std::size_t>(rank());
    dev_array<T> d(host(in, N * count));
    if (out == in + r * count) {
      c_.reduce_scatter(d.data(), d.data() + r * count, count, op);
      const auto h = d.download();
      std::copy(h.begin() + static_cast<std::ptrdiff_t>(r * count),
                h.begin() + static_cast<std::ptrdiff_t>((r + 1) * count), out);
    } else {
      dev_array<T> o(count);
      c_.reduce_scatter(d.data(), o.data(), count, op);
      store(out, o);
    }
  }
  template <class T>
  void all_gather(const T* in, T* out, std::size_t count) {
    const std::size_t N = static_cast<std::size_t>(size()), r = static_cast<std::size_t>(rank());
    dev_array<T> o(host(out, N * count));
    if (in == out + r * count) {
      c_.all_gather(o.data() + r * count, o.data(), count);
    } else {
      dev_array<T> d(host(in, count));
      c_.all_gather(d.data(), o.data(), count);
    }
    store(out, o);
  }
  template <class T>
  void broadcast(T* buf, std::size_t n, int root) {
    dev_array<T> d(host(buf, n));
    c_.broadcast(d.data(), n, root);
    store(buf, d);
  }
  template <class T>
  void all_to_all(const T* in, T* out, std::size_t count) {
    const std::size_t N = static_cast<std::size_t>(size());
    dev_array<T> d(host(in, N * count)), o(N * count);
    c_.all_to_all(d.data(), o.data(), count);
    store(out, o);
  }

 private:
  template <class T>
  static std::vector<T> host(const T* p, std::size_t n) {
    return std::vector<T>(p, p + n);
  }
  template <class T>
  static void store(T* out, const dev_array<T>& d) {
    const auto h = d.download();
    std::copy(h.begin(), h.end(), out);
  }
  Comm& c_;
};

// ---- the rank-order reference and checks of tests/comm/test_collectives.cpp ----

template <class T>
T input(int r, std::size_t i, std::uint64_t salt) {
  std::uint64_t z = (static_cast<std::uint64_t>(r) << 40) ^ (i * 0x9e3779b97f4a7c15ull) ^ salt;
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  z ^= z >> 29;
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(z % 1000);
  } else {
    const double u = static_cast<double>(z >> 11) * 0x1.0p-53 * 2 - 1;
    return T(static_cast<float>(u * 100.0));
  }
}

template <class T>
T reduced(int n, std::size_t i, reduce_op op, std::uint64_t salt) {
  using acc_t = std::conditional_t<std::is_integral_v<T> || std::is_same_v<T, double>, T, float>;
  acc_t acc = static_cast<acc_t>(input<T>(0, i, salt));
  for (int q = 1; q < n; ++q) {
    const acc_t x = static_cast<acc_t>(input<T>(q, i, salt));
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg:
        acc = static_cast<acc_t>(acc + x);
        break;
      case reduce_op::max:
        acc = x > acc ? x : acc;
        break;
      case reduce_op::min:
        acc = x < acc ? x : acc;
        break;
    }
  }
  if (op == reduce_op::avg) acc = static_cast<acc_t>(acc / static_cast<acc_t>(n));
  if constexpr (std::is_same_v<acc_t, T>)
    return acc;
  else
    return T(acc);
}

// exact: bit for bit against the rank-order reference; otherwise within a relative tolerance
// (NCCL's native reductions)
template <class T>
bool matches(T got, T want, bool exact) {
  if (exact || std::is_integral_v<T>) return bits_of(got) == bits_of(want);
  const double g = static_cast<double>(static_cast<float>(got));
  const double w = static_cast<double>(static_cast<float>(want));
  const double tol = std::is_same_v<T, float> || std::is_same_v<T, double> ? 1e-5 : 1e-1;
  return std::abs(g - w) <= tol * (1.0 + std::abs(w));
}

template <class Comm, class T>
std::string check_all_reduce(Comm& c, std::size_t n, reduce_op op, bool in_place, bool exact) {
  const std::uint64_t salt = n * 31 + static_cast<std::uint64_t>(op);
  std::vector<T> in(n), out(n);
  for (std::size_t i = 0; i < n; ++i) in[i] = input<T>(c.rank(), i, salt);
  const auto before = c.traffic();
  if (in_place)
    c.all_reduce(in.data(), in.data(), n, op);
  else
    c.all_reduce(in.data(), out.data(), n, op);
  const auto& res = in_place ? in : out;
  for (std::size_t i = 0; i < n; ++i) {
    if (!matches(res[i], reduced<T>(c.size(), i, op, salt), exact)) {
      return "all_reduce(" + std::string(name(dtype_of<T>)) + ", " + name(op) + ") wrong at " +
             std::to_string(i);
    }
  }
  const auto d = c.traffic().since(before);
  if (d.bytes_sent(collective::all_reduce) !=
          ring_bytes_sent(collective::all_reduce, n, sizeof(T), c.size(), c.rank()) ||
      d.calls(collective::all_reduce) != 1) {
    return "all_reduce recorded the wrong traffic";
  }
  return {};
}

template <class Comm, class T>
std::string check_reduce_scatter(Comm& c, std::size_t count, reduce_op op, bool in_place,
                                 bool exact) {
  const int N = c.size(), r = c.rank();
  const std::uint64_t salt = count * 131 + static_cast<std::uint64_t>(op);
  std::vector<T> in(count * N), out(count);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = input<T>(r, i, salt);
  const auto before = c.traffic();
  T* dst = in_place ? in.data() + static_cast<std::size_t>(r) * count : out.data();
  c.reduce_scatter(in.data(), dst, count, op);
  for (std::size_t i = 0; i < count; ++i) {
    if (!matches(dst[i], reduced<T>(N, static_cast<std::size_t>(r) * count + i, op, salt), exact)) {
      return "reduce_scatter(" + std::string(name(dtype_of<T>)) + ", " + name(op) + ") wrong at " +
             std::to_string(i);
    }
  }
  if (c.traffic().since(before).bytes_sent(collective::reduce_scatter) !=
      ring_bytes_sent(collective::reduce_scatter, count, sizeof(T), N, r)) {
    return "reduce_scatter recorded the wrong traffic";
  }
  return {};
}

template <class Comm, class T>
std::string check_all_gather(Comm& c, std::size_t count, bool in_place) {
  const int N = c.size(), r = c.rank();
  std::vector<T> mine(count), out(count * N);
  for (std::size_t i = 0; i < count; ++i) mine[i] = input<T>(r, i, count);
  const T* src = mine.data();
  if (in_place) {
    std::copy(mine.begin(), mine.end(), out.begin() + static_cast<std::ptrdiff_t>(r * count));
    src = out.data() + static_cast<std::size_t>(r) * count;
  }
  const auto before = c.traffic();
  c.all_gather(src, out.data(), count);
  for (int q = 0; q < N; ++q) {
    for (std::size_t i = 0; i < count; ++i) {
      if (bits_of(out[q * count + i]) != bits_of(input<T>(q, i, count))) {
        return "all_gather wrong at " + std::to_string(q * count + i);
      }
    }
  }
  if (c.traffic().since(before).bytes_sent(collective::all_gather) !=
      ring_bytes_sent(collective::all_gather, count, sizeof(T), N, r)) {
    return "all_gather recorded the wrong traffic";
  }
  return {};
}

template <class Comm, class T>
std::string check_broadcast(Comm& c, std::size_t n) {
  for (int root = 0; root < c.size(); ++root) {
    std::vector<T> buf(n);
    for (std::size_t i = 0; i < n; ++i) buf[i] = input<T>(c.rank(), i, 77);
    c.broadcast(buf.data(), n, root);
    for (std::size_t i = 0; i < n; ++i) {
      if (bits_of(buf[i]) != bits_of(input<T>(root, i, 77))) {
        return "broadcast from root " + std::to_string(root) + " wrong at " + std::to_string(i);
      }
    }
  }
  return {};
}

template <class Comm, class T>
std::string check_everything(Comm& c, bool exact) {
  for (std::size_t n : {0u, 1u, 5u, 1000u, 70001u}) {
    for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
      if (!exact && op == reduce_op::avg && std::is_integral_v<T>) continue;
      for (bool ip : {false, true}) {
        if (auto e = check_all_reduce<Comm, T>(c, n, op, ip, exact); !e.empty()) return e;
        if (auto e = check_reduce_scatter<Comm, T>(c, n, op, ip, exact); !e.empty()) return e;
      }
    }
    for (bool ip : {false, true}) {
      if (auto e = check_all_gather<Comm, T>(c, n, ip); !e.empty()) return e;
    }
    if (auto e = check_broadcast<Comm, T>(c, n); !e.empty()) return e;
  }
  return {};
}

template <class Comm>
std::string check_all_types(Comm& c, bool exact) {
  for (auto e : {check_everything<Comm, float>(c, exact), check_everything<Comm, bf16>(c, exact),
                 check_everything<Comm, fp16>(c, exact), check_everything<Comm, double>(c, exact),
                 check_everything<Comm, std::int32_t>(c, exact),
                 check_everything<Comm, std::int64_t>(c, exact)}) {
    if (!e.empty()) return e;
  }
  // all_to_all: rank q's block r arrives at block q
  const int N = c.size(), r = c.rank();
  const std::size_t count = 3;
  std::vector<std::int32_t> in(count * N), out(count * N);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = r * 1000 + static_cast<int>(i);
  c.all_to_all(in.data(), out.data(), count);
  for (int q = 0; q < N; ++q) {
    for (std::size_t i = 0; i < count; ++i) {
      if (out[q * count + i] != q * 1000 + static_cast<int>(r * count + i))
        return "all_to_all wrong";
    }
  }
  return {};
}

}  // namespace

TEST_CASE("thread communicator on device memory: rank-order results bit for bit", "[thread_cuda]") {
  for (int n : {1, 2, 3, 4, 8}) {
    CAPTURE(n);
    test::require_all_ok(run_ranks<cuda_space>(
        n,
        [](thread_cuda_comm& c) -> std::string {
          staged<thread_cuda_comm> s(c);
          auto e = check_all_types(s, true);
          c.barrier();
          return e;
        },
        short_timeout()));
  }
}

TEST_CASE("thread communicator on device memory: asynchronous collectives overlap rank streams",
          "[thread_cuda]") {
  test::require_all_ok(run_ranks<cuda_space>(
      4,
      [](thread_cuda_comm& c) -> std::string {
        const int N = c.size();
        const std::size_t count = 1 << 16;
        cuda_stream own;  // this rank's compute stream
        device_stream_scope scope(own);
        std::vector<dev_array<float>> mine, full;
        std::vector<thread_work> works;
        for (int k = 0; k < 4; ++k) {
          mine.emplace_back(std::vector<float>(count, static_cast<float>(k * 10 + c.rank())));
          full.emplace_back(count * N);
        }
        own.synchronize();  // inputs (and the zeroing of the outputs) complete before the calls
        for (int k = 0; k < 4; ++k) {
          works.push_back(c.all_gather_async(mine[k].data(), full[k].data(), count));
        }
        // meanwhile, unrelated work on this rank's stream
        dev_array<float> scratch(count);
        gpu::convert(mine[0].data(), scratch.data(), count, own.get());
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        for (auto& w : works) {
          while (!w.test()) {
            if (std::chrono::steady_clock::now() > deadline) return "no progress";
            std::this_thread::sleep_for(std::chrono::microseconds(100));
          }
          w.wait();
        }
        own.synchronize();
        for (int k = 0; k < 4; ++k) {
          const auto h = full[k].download();
          for (int q = 0; q < N; ++q) {
            if (h[static_cast<std::size_t>(q) * count] != static_cast<float>(k * 10 + q) ||
                h[static_cast<std::size_t>(q + 1) * count - 1] != static_cast<float>(k * 10 + q)) {
              return "async all_gather wrong";
            }
          }
        }
        return {};
      },
      short_timeout()));
}

TEST_CASE("thread communicator on device memory refuses host buffers", "[thread_cuda]") {
  REQUIRE_THROWS_WITH(run_ranks<cuda_space>(
                          2,
                          [](thread_cuda_comm& c) {
                            std::vector<float> h(4);
                            c.all_reduce(h.data(), h.data(), h.size());
                          },
                          short_timeout()),
                      Catch::Contains("is not device memory"));
  // a host source with a device output: every source is checked, not only the output
  REQUIRE_THROWS_WITH(run_ranks<cuda_space>(
                          2,
                          [](thread_cuda_comm& c) {
                            std::vector<float> h(64, 1.0f);
                            dev_array<float> in(h), out(64);
                            c.all_reduce(c.rank() == 1 ? h.data() : in.data(), out.data(), 64);
                          },
                          short_timeout()),
                      Catch::Contains("source") && Catch::Contains("is not device memory"));
}

// ---- NCCL (built where NCCL was found) -------------------------------------------------------
#if defined(SHARDKIT_TEST_NCCL)

TEST_CASE("NCCL communicator, deterministic: rank-order results bit for bit", "[nccl]") {
  int version = 0;
  REQUIRE(ncclGetVersion(&version) == ncclSuccess);
  WARN("NCCL " << version << " (the library loaded); the NCCL tests run on " << nccl_ranks()
               << " rank(s), one per GPU (NCCL allows one rank per GPU)");
  for (std::size_t staging : {std::size_t{64} << 20, std::size_t{256}}) {  // 256 bytes: many rounds
    CAPTURE(staging);
    nccl_options o;
    o.staging_bytes = staging;
    test::require_all_ok(on_nccl_ranks(
        [](nccl_communicator& c, thread_comm&) -> std::string {
          staged<nccl_communicator> s(c);
          auto e = check_all_types(s, true);
          c.barrier();
          return e;
        },
        o));
  }
}

TEST_CASE("NCCL communicator, native reductions: correct within rounding", "[nccl]") {
  nccl_options o;
  o.reduction = nccl_reduction::native;
  test::require_all_ok(on_nccl_ranks(
      [](nccl_communicator& c, thread_comm&) -> std::string {
        staged<nccl_communicator> s(c);
        return check_all_types(s, c.size() == 1);
      },
      o));
}

TEST_CASE("NCCL communicator: grouped collectives and stream-ordered waits", "[nccl]") {
  test::require_all_ok(on_nccl_ranks([](nccl_communicator& c, thread_comm&) -> std::string {
    const int N = c.size(), r = c.rank();
    const std::size_t count = 1 << 20;
    cuda_stream compute;
    c.set_compute_stream(compute);
    device_stream_scope scope(compute);  // allocations, zeroing and copies on the compute stream
    // inputs written on the compute stream; the collective waits for them (no host sync)
    dev_array<float> src(std::vector<float>(count, static_cast<float>(r + 1)));
    dev_array<bf16> mine(count), full(count * N), other(count * N);
    gpu::convert(src.data(), mine.data(), count, compute.get());
    {
      auto g = c.group();
      auto w1 = c.all_gather_async(mine.data(), full.data(), count);
      auto w2 = c.all_gather_async(mine.data(), other.data(), count);
      bool refused = false;
      try {
        c.barrier();
      } catch (const usage_error&) {
        refused = true;
      }
      if (!refused) return "a synchronous call inside a group was not refused";
      g.end();
      // stream-ordered: the compute stream waits, the host does not
      w1.wait_on(compute);
      w2.wait_on(compute);
    }
    std::vector<bf16> h(count * N);
    if (cudaMemcpyAsync(h.data(), full.data(), h.size() * sizeof(bf16), cudaMemcpyDefault,
                        compute.get()) != cudaSuccess) {
      return "copy failed";
    }
    compute.synchronize();
    for (int q = 0; q < N; ++q) {
      if (static_cast<float>(h[static_cast<std::size_t>(q) * count]) != static_cast<float>(q + 1)) {
        return "grouped all_gather wrong";
      }
    }
    if (first_difference(other.download(), full.download(), "second gather") != "") {
      return "second grouped all_gather wrong";
    }
    c.set_compute_stream(nullptr);  // the stream ends here; the communicator lives on
    return {};
  }));
}

TEST_CASE("NCCL communicator: split", "[nccl]") {
  test::require_all_ok(on_nccl_ranks([](nccl_communicator& c, thread_comm&) -> std::string {
    const int N = c.size(), r = c.rank();
    // even and odd ranks
    auto sub = c.split(r % 2, r);
    if (sub.size() != (N + 1 - r % 2) / 2 || sub.rank() != r / 2) return "split ranks wrong";
    dev_array<std::int32_t> one(std::vector<std::int32_t>{1});
    sub.all_reduce(one.data(), one.data(), 1);
    if (one.download()[0] != sub.size()) return "all_reduce on the split communicator wrong";
    dev_array<std::int32_t> mine(std::vector<std::int32_t>{r}), all(sub.size());
    sub.all_gather(mine.data(), all.data(), 1);
    const auto got = all.download();
    for (int q = 0; q < sub.size(); ++q) {
      if (got[static_cast<std::size_t>(q)] != 2 * q + r % 2)
        return "all_gather on the split communicator wrong";
    }
    return {};
  }));
}

TEST_CASE("NCCL communicator: abort", "[nccl]") {
  test::require_all_ok(on_nccl_ranks([](nccl_communicator& c, thread_comm&) -> std::string {
    c.barrier();
    // later calls fail with the reason
    c.abort("testing abort");
    try {
      c.barrier();
      return "a call after abort() did not raise";
    } catch (const comm_aborted& e) {
      if (std::string(e.what()).find("testing abort") == std::string::npos) {
        return std::string("comm_aborted without the reason: ") + e.what();
      }
    }
    return {};
  }));
}

TEST_CASE("NCCL bootstrap composes with any host communicator that broadcasts bytes", "[nccl]") {
  STATIC_REQUIRE(byte_broadcaster<thread_comm>);
  STATIC_REQUIRE(communicator<nccl_communicator>);
  // a user-distributed id: one rank, made here
  const ncclUniqueId id = nccl_unique_id();
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  nccl_communicator c(id, 0, 1);
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  CHECK(c.device() == 0);
  CHECK(c.native_handle() != nullptr);
  c.check();
  REQUIRE_THROWS_AS(nccl_communicator(id, 1, 1), invalid_argument);
}

#endif  // SHARDKIT_TEST_NCCL
