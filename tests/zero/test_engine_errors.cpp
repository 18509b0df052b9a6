// Bad input and wrong use of the engine: a clear exception that names the problem, on every
// rank, never a hang. Written once over a World: test_engine runs these on the thread
// communicator, test_engine_mpi on mpi_comm under mpiexec.
#include <shardkit/shardkit.hpp>

#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

using namespace shardkit;

namespace {

using World = SHARDKIT_TEST_WORLDS;
using Comm = World::comm_type;

template <class F>
std::vector<std::string> errors_per_rank(int n, F fn) {
  return test::messages_on<World>(n, std::move(fn));
}

model_spec small_model(std::vector<std::vector<float>>& storage) {
  storage = {std::vector<float>(10, 0.5f), std::vector<float>(3, -0.5f),
             std::vector<float>(7, 1.0f)};
  model_spec m;
  m.add("fc.weight", storage[0]);
  m.add("fc.bias", storage[1]);
  m.begin_unit("head");
  m.add("head.weight", storage[2]);
  return m;
}

template <class P>
using host_engine = engine<Comm, P, bf16, adamw>;

// A framework tensor whose device is known only at run time (tensor_traits::memory).
struct device_tensor {
  std::vector<float> values;
  bool on_gpu = true;
};

}  // namespace

template <>
struct shardkit::tensor_traits<device_tensor> {
  static memory_kind memory(const device_tensor& t) {
    return t.on_gpu ? memory_kind::cuda : memory_kind::host;
  }
  using value_type = float;
  static float* data(device_tensor& t) { return t.values.data(); }
  static const float* data(const device_tensor& t) { return t.values.data(); }
  static std::size_t size(const device_tensor& t) { return t.values.size(); }
};

TEMPLATE_TEST_CASE("a gradient whose size differs from its parameter is rejected by name",
                   "[engine][errors]", zero0, zero1, zero2) {
  for (const auto& msg : errors_per_rank(3, [](Comm& c) {
         std::vector<std::vector<float>> st;
         host_engine<TestType> e(c, small_model(st));
         std::vector<float> g(9);
         e.grad_ready(0, g);
       })) {
    REQUIRE_THAT(msg, Catch::Contains("'fc.weight'") && Catch::Contains("has 9 elements") &&
                          Catch::Contains("expected 10"));
  }
}

TEMPLATE_TEST_CASE("gradients of unsupported element types, out-of-range indices",
                   "[engine][errors]", zero0, zero2) {
  for (const auto& msg : errors_per_rank(2, [](Comm& c) {
         std::vector<std::vector<float>> st;
         host_engine<TestType> e(c, small_model(st));
         std::vector<std::int32_t> g(3);
         e.grad_ready(1, g);
       })) {
    REQUIRE_THAT(msg, Catch::Contains("'fc.bias'") && Catch::Contains("int32") &&
                          Catch::Contains("expected fp32, bf16 or fp16"));
  }
  for (const auto& msg : errors_per_rank(2, [](Comm& c) {
         std::vector<std::vector<float>> st;
         host_engine<TestType> e(c, small_model(st));
         (void)e.param(3);
       })) {
    REQUIRE_THAT(msg, Catch::Contains("parameter index 3 out of range (3 parameters"));
  }
}

TEST_CASE("ZeRO-2: a step with missing gradients names them on every rank", "[engine][errors]") {
  for (const auto& msg : errors_per_rank(4, [](Comm& c) {
         std::vector<std::vector<float>> st;
         host_engine<zero2> e(c, small_model(st));
         std::vector<float> g(7, 1.0f);
         e.grad_ready(2, g);  // the head unit is complete; fc.weight and fc.bias never arrive
         e.step();
       })) {
    REQUIRE_THAT(msg, Catch::Contains("missing: 'fc.weight', 'fc.bias'") &&
                          Catch::Contains("allow_missing_grads"));
  }
}

TEST_CASE("ZeRO-2: allow_missing_grads treats missing gradients as zero", "[engine]") {
  auto run = [](bool explicit_zero) {
    return World::run(2, [&](Comm& c) {
      std::vector<std::vector<float>> st;
      engine_options o;
      o.allow_missing_grads = true;
      host_engine<zero2> e(c, small_model(st), {}, o);
      std::vector<float> g2(7, 1.0f), g1(3, 0.0f), g0(10, 0.0f);
      e.grad_ready(2, g2);
      if (explicit_zero) {
        e.grad_ready(1, g1);
        e.grad_ready(0, g0);
      } else {
        e.grad_ready(1, g1);  // fc.weight missing: its bucket is half full at step()
      }
      e.step();
      std::vector<std::uint16_t> bits;
      for (std::size_t i = 0; i < 3; ++i)
        for (auto v : e.param(i)) bits.push_back(v.bits);
      return bits;
    });
  };
  REQUIRE(run(false) == run(true));
}

TEST_CASE("ZeRO-2: gradients of interleaved buckets need enough staging buffers",
          "[engine][errors]") {
  auto interleaved = [](std::size_t buffers) {
    return errors_per_rank(2, [buffers](Comm& c) {
      std::vector<std::vector<float>> st;
      engine_options o;
      o.grad_buffers = buffers;
      host_engine<zero2> e(c, small_model(st), {}, o);  // buckets: {fc.weight, fc.bias}, {head}
      std::vector<float> g0(10, 1.0f), g1(3, 1.0f), g2(7, 1.0f);
      e.grad_ready(0, g0);  // opens bucket 0
      e.grad_ready(2, g2);  // bucket 1 while bucket 0 is still filling
      e.grad_ready(1, g1);
      e.step();
    });
  };
  for (const auto& msg : interleaved(1)) {
    REQUIRE_THAT(msg, Catch::Contains("'head.weight' belongs to bucket 1") &&
                          Catch::Contains("hold incomplete bucket(s) {0}") &&
                          Catch::Contains("grad_buffers"));
  }
  for (const auto& msg : interleaved(2)) REQUIRE(msg.empty());
}

TEST_CASE("bad engine options and hyper-parameters", "[engine][errors]") {
  auto make = [](engine_options o, adam_options a) {
    return errors_per_rank(1, [=](Comm& c) {
      std::vector<std::vector<float>> st;
      host_engine<zero2> e(c, small_model(st), a, o);
    });
  };
  engine_options zero_buffers;
  zero_buffers.grad_buffers = 0;
  REQUIRE_THAT(make(zero_buffers, {})[0], Catch::Contains("grad_buffers must be at least 1"));
  engine_options zero_align;
  zero_align.alignment = 0;
  REQUIRE_THAT(make(zero_align, {})[0], Catch::Contains("alignment must be at least 1"));
  REQUIRE_THAT(make({}, {.lr = -1.0f})[0], Catch::Contains("learning rate of parameter group 0"));
  REQUIRE_THAT(make({}, {.beta1 = 1.0f})[0], Catch::Contains("betas must lie in [0, 1)"));
  REQUIRE_THAT(make({}, {.eps = 0.0f})[0], Catch::Contains("eps must be positive"));
  for (const auto& msg : errors_per_rank(2, [](Comm& c) {
         std::vector<std::vector<float>> st;
         host_engine<zero1> e(c, small_model(st));
         e.step(NAN);
       })) {
    REQUIRE_THAT(msg, Catch::Contains("learning-rate scale must be finite"));
  }
}

TEST_CASE("model_spec rejects empty units and foreign memory", "[engine][errors]") {
  model_spec m;
  std::vector<float> w(4);
  m.begin_unit("a");
  m.add("w", w);
  m.begin_unit("b");
  REQUIRE_THROWS_WITH(m.begin_unit("c"), Catch::Contains("unit 'b' has no parameters"));
  // A trailing empty unit is caught when the engine is built.
  for (const auto& msg : errors_per_rank(1, [&](Comm& c) { host_engine<zero2> e(c, m); })) {
    REQUIRE_THAT(msg, Catch::Contains("last unit declared with begin_unit() has no parameters"));
  }
  std::vector<std::int64_t> ints(3);
  REQUIRE_THROWS_WITH(model_spec{}.add("i", ints), Catch::Contains("int64 elements"));
}

TEST_CASE("tensors whose device is known at run time are checked by parameter name",
          "[engine][errors]") {
  device_tensor w{std::vector<float>(4, 1.0f), true};
  REQUIRE_THROWS_WITH(model_spec{}.add("w", w),
                      Catch::Contains("parameter 'w' lives in cuda memory") &&
                          Catch::Contains("must be in host memory"));
  for (const auto& msg : errors_per_rank(2, [](Comm& c) {
         std::vector<std::vector<float>> st;
         host_engine<zero2> e(c, small_model(st));
         device_tensor g{std::vector<float>(10, 1.0f), true};
         e.grad_ready(0, g);
       })) {
    REQUIRE_THAT(msg, Catch::Contains("gradient of parameter 'fc.weight' is in cuda memory") &&
                          Catch::Contains("expected host memory"));
  }
  // The same type in host memory is an ordinary gradient.
  auto ok = World::run(2, [](Comm& c) {
    std::vector<std::vector<float>> st;
    host_engine<zero0> e(c, small_model(st));
    device_tensor g{std::vector<float>(10, 1.0f), false};
    e.grad_ready(0, g);
    return static_cast<float>(e.grad(0)[3]);
  });
  REQUIRE(ok[0] == 1.0f);
}

TEST_CASE("broadcast_init gives every rank rank 0's initial values", "[engine]") {
  auto r = World::run(3, [](Comm& c) {
    std::vector<float> w(5, static_cast<float>(c.rank() + 1));  // ranks disagree
    model_spec m;
    m.add("w", w);
    engine_options o;
    o.broadcast_init = true;
    engine<Comm, zero1, bf16, adamw> e(c, m, {}, o);
    std::vector<float> out(5);
    e.copy_param_to(0, out);
    return out;
  });
  for (const auto& v : r) REQUIRE(v == std::vector<float>(5, 1.0f));
}
