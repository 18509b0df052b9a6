// The LibTorch adapter: torch::Tensor through tensor_traits, torch tensors over shardkit memory
// (aliasing, re-pointing under autograd), and torch_hooks driving the engine from autograd.
#include <shardkit/adapters/torch.hpp>
#include <shardkit/shardkit.hpp>

#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <torch/torch.h>
#include <vector>

using namespace shardkit;

namespace {

template <class P, class W = float>
using torch_engine = engine<thread_comm, P, W, adamw>;

thread_comm_options quick() {
  thread_comm_options o;
  o.timeout = std::chrono::seconds(60);
  return o;
}

// A CUDA tensor object over host bytes: LibTorch's CPU build can describe one without a GPU,
// which is all the memory checks look at.
at::Tensor fake_cuda_tensor(float* p, std::int64_t n) {
  return at::for_blob(p, {n})
      .target_device(c10::Device(c10::kCUDA, 0))
      .options(at::TensorOptions().dtype(at::kFloat).device(c10::Device(c10::kCUDA, 0)))
      .make_tensor();
}

// Two units: Linear(4, 8) + LayerNorm + tanh, then Linear(8, 2); `extra` adds a parameter that
// no forward uses.
struct net {
  torch::nn::Sequential u0{torch::nn::Linear(4, 8),
                           torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})),
                           torch::nn::Tanh()};
  torch::nn::Sequential u1{torch::nn::Linear(8, 2)};
  std::vector<std::vector<at::Tensor>> units() { return {u0->parameters(), u1->parameters()}; }
};

struct data {
  at::Tensor x, y;
  std::vector<at::Tensor> init;  // initial parameter values, in unit order
  std::vector<std::string> names;
};

data make_data(int ranks, int per_rank) {
  torch::manual_seed(7);
  data d;
  d.x = torch::randn({ranks * per_rank, 4});
  d.y = torch::randn({ranks * per_rank, 2});
  net ref;
  for (auto* m : {&ref.u0, &ref.u1}) {
    for (const auto& p : (*m)->named_parameters()) {
      d.init.push_back(p.value().detach().clone());
      d.names.push_back((m == &ref.u0 ? "u0." : "u1.") + p.key());
    }
  }
  return d;
}

// `extra_in`: the unit (0 or 1) given one more parameter of 3 elements, "uN.unused"; -1: none.
model_spec spec_of(data& d, int extra_in = -1) {
  model_spec m;
  std::size_t i = 0;
  m.begin_unit("u0");
  for (; i < 4; ++i) m.add(d.names[i], d.init[i]);  // Linear weight, bias, LayerNorm weight, bias
  if (extra_in == 0) m.add("u0.unused", 3);
  m.begin_unit("u1");
  for (; i < d.init.size(); ++i) m.add(d.names[i], d.init[i]);
  if (extra_in == 1) m.add("u1.unused", 3);
  return m;
}

// Trains `steps` steps through torch_hooks on `ranks` ranks; returns rank 0's final parameters.
template <class P>
std::vector<float> train_with_hooks(data& d, int ranks, int steps, std::vector<net>& nets) {
  const std::int64_t per_rank = d.x.size(0) / ranks;
  auto out = run_ranks(
      ranks,
      [&](thread_comm& c) {
        net& n = nets[static_cast<std::size_t>(c.rank())];
        auto spec = spec_of(d);
        engine_options eo;
        eo.trace = true;
        torch_engine<P> eng(c, spec, {.lr = 1e-2f, .weight_decay = 0.01f}, eo);
        torch_hooks<torch_engine<P>> hooks(eng, n.units());
        const auto x = d.x.narrow(0, c.rank() * per_rank, per_rank);
        const auto y = d.y.narrow(0, c.rank() * per_rank, per_rank);
        std::string problem;
        for (int s = 0; s < steps; ++s) {
          at::Tensor h = hooks.forward(0, [&] { return n.u0->forward(x); });
          h = hooks.forward(1, [&] { return n.u1->forward(h); });
          torch::mse_loss(h, y).backward();
          hooks.finish_backward();
          if constexpr (P::shard_params) {
            // Outside the hooks, a ZeRO-3 rank holds no gathered parameters, and the module's
            // tensors point at nothing.
            if (eng.memory().current(memory_category::gathered_params) != 0)
              problem = "gathered parameters held after backward";
            if (n.u0[0]->as<torch::nn::Linear>()->weight.data_ptr() != nullptr)
              problem = "weight bound outside the hooks";
          }
          for (const auto& p : n.u0->parameters()) {
            if (p.grad().defined()) problem = "a .grad was left behind";
          }
          eng.step();
        }
        std::vector<float> params;
        for (std::size_t u = 0; u < eng.num_units(); ++u) {
          eng.pre_forward(u);
          for (std::size_t i = 0; i < eng.num_params(); ++i) {
            if (eng.unit_of(i) != u) continue;
            for (float v : eng.param(i)) params.push_back(v);
          }
          eng.post_forward(u);
        }
        if (!problem.empty()) throw std::runtime_error(problem);
        return params;
      },
      quick());
  return out.front();
}

}  // namespace

TEST_CASE("torch::Tensor is a shardkit tensor with run-time element type and memory",
          "[torch][tensor]") {
  STATIC_REQUIRE(tensor<at::Tensor>);
  STATIC_REQUIRE(tensor<const torch::Tensor&>);
  STATIC_REQUIRE(!typed_tensor<at::Tensor>);
  at::Tensor t = torch::arange(6, torch::kFloat32).reshape({2, 3});
  REQUIRE(tensor_dtype(t) == dtype::f32);
  REQUIRE(tensor_memory(t) == memory_kind::host);
  REQUIRE(tensor_numel(t) == 6);
  const any_tensor_view a = erase(t);
  REQUIRE(a.data == t.data_ptr());
  REQUIRE(a.as<float>()[4] == 4.0f);
  REQUIRE_FALSE(a.read_only);
  const at::Tensor& ct = t;
  REQUIRE(erase(ct).read_only);
  const at::Tensor b = t.to(torch::kBFloat16);
  REQUIRE(erase(b).type == dtype::bf16);
  REQUIRE(tensor_numel(at::Tensor()) == 0);
}

TEST_CASE("element types map both ways between shardkit and LibTorch", "[torch][dtype]") {
  const std::pair<c10::ScalarType, dtype> pairs[] = {
      {at::kFloat, dtype::f32}, {at::kDouble, dtype::f64}, {at::kBFloat16, dtype::bf16},
      {at::kHalf, dtype::f16},  {at::kInt, dtype::i32},    {at::kLong, dtype::i64},
      {at::kByte, dtype::u8}};
  for (auto [st, d] : pairs) {
    REQUIRE(dtype_from_torch(st) == d);
    REQUIRE(torch_scalar_type(d) == st);
  }
  STATIC_REQUIRE(torch_scalar_type_of<float> == at::kFloat);
  STATIC_REQUIRE(torch_scalar_type_of<bf16> == at::kBFloat16);
  STATIC_REQUIRE(torch_scalar_type_of<const fp16> == at::kHalf);
  REQUIRE_THROWS_WITH(dtype_from_torch(at::kComplexFloat),
                      Catch::Contains("ComplexFloat elements have no shardkit element type"));
  REQUIRE_THROWS_WITH(dtype_from_torch(at::kBool), Catch::Contains("Bool"));
  REQUIRE_THROWS_WITH(torch_scalar_type(dtype::u32), Catch::Contains("uint32"));
  // The 16-bit formats agree bit for bit.
  const float v = 1.0f / 3.0f;
  const bf16 b(v);
  const c10::BFloat16 tb(v);
  REQUIRE(b.bits == tb.x);
  const fp16 h(v);
  const c10::Half th(v);
  REQUIRE(h.bits == th.x);
}

TEST_CASE("non-contiguous, CUDA, meta and undefined torch tensors are rejected clearly",
          "[torch][errors]") {
  at::Tensor m = torch::arange(6, torch::kFloat32).reshape({2, 3});
  at::Tensor mt = m.t();
  REQUIRE_THROWS_WITH(erase(mt), Catch::Contains("shape [3, 2] with strides [1, 3] is not "
                                                 "contiguous") &&
                                     Catch::Contains("call .contiguous() first"));
  at::Tensor every_other = torch::arange(8, torch::kFloat32).slice(0, 0, 8, 2);
  REQUIRE_THROWS_WITH(erase(every_other), Catch::Contains("not contiguous"));
  const at::Tensor packed = every_other.contiguous();
  REQUIRE_NOTHROW(erase(packed));
  at::Tensor undefined;
  REQUIRE_THROWS_WITH(erase(undefined), Catch::Contains("undefined torch::Tensor"));
  at::Tensor meta = at::empty({2}, at::TensorOptions().device(at::kMeta));
  REQUIRE_THROWS_WITH(erase(meta), Catch::Contains("device 'meta'") &&
                                       Catch::Contains("host (CPU) and cuda memory only"));

  float bytes[10] = {};
  at::Tensor cuda = fake_cuda_tensor(bytes, 10);
  REQUIRE(tensor_memory(cuda) == memory_kind::cuda);
  REQUIRE_THROWS_WITH(model_spec{}.add("w", cuda),
                      Catch::Contains("parameter 'w' lives in cuda memory"));
  auto msgs = run_ranks(
      2,
      [&](thread_comm& c) -> std::string {
        std::vector<float> w(10, 1.0f);
        model_spec spec;
        spec.add("fc.weight", w);
        torch_engine<zero2> eng(c, spec);
        try {
          eng.grad_ready(0, cuda);
        } catch (const std::exception& e) {
          return e.what();
        }
        return "";
      },
      quick());
  for (const auto& msg : msgs) {
    REQUIRE_THAT(msg, Catch::Contains("gradient of parameter 'fc.weight' is in cuda memory") &&
                          Catch::Contains("expected host memory"));
  }
  REQUIRE_THROWS_WITH(torch_bind(cuda, tensor_view<float>(bytes, 10)),
                      Catch::Contains("on cuda:0") && Catch::Contains("CPU tensors only"));
}

TEST_CASE("torch_view aliases the engine's working parameters", "[torch][alias]") {
  auto check = run_ranks(
      2,
      [](thread_comm& c) -> std::string {
        std::vector<float> w(6);
        for (std::size_t k = 0; k < w.size(); ++k) w[k] = static_cast<float>(k);
        model_spec spec;
        spec.add("w", w);
        torch_engine<zero1> e32(c, spec);
        at::Tensor t = torch_view(e32.param(0), {2, 3});
        if (t.scalar_type() != at::kFloat || t.data_ptr() != e32.param(0).data())
          return "fp32 view does not share memory";
        if (!torch_is_bound(t)) return "torch_is_bound false";
        e32.param(0)[4] = 42.0f;  // written through the engine, read through torch
        if (t[1][1].item<float>() != 42.0f) return "engine write not visible in torch";
        t[0][2] = -1.0f;  // and the other way
        if (e32.param(0)[2] != -1.0f) return "torch write not visible in engine";

        torch_engine<zero2, bf16> e16(c, spec);
        at::Tensor b = torch_view(e16.param(0));
        if (b.scalar_type() != at::kBFloat16 || b.dim() != 1 || b.size(0) != 6)
          return "bf16 view has the wrong type or shape";
        if (b[5].item<float>() != 5.0f) return "bf16 values differ";
        if (torch_is_bound(torch::ones({2}))) return "an ordinary tensor reported as bound";
        try {
          torch_view(e32.param(0), {4, 2});
        } catch (const std::exception& ex) {
          return std::strstr(ex.what(), "holds 8 elements, the view has 6") ? "" : ex.what();
        }
        return "a wrong shape was accepted";
      },
      quick());
  for (const auto& s : check) REQUIRE(s == "");
}

TEST_CASE("torch_bind: a module's parameter aliases the engine and follows step()",
          "[torch][alias]") {
  auto check = run_ranks(
      2,
      [](thread_comm& c) -> std::string {
        torch::nn::Linear lin(3, 2);
        std::vector<float> w(6, 0.5f);
        model_spec spec;
        spec.add("w", w);
        torch_engine<zero1> eng(c, spec, {.lr = 0.1f});
        torch_bind(lin->weight, eng.param(0));
        if (lin->weight.data_ptr() != eng.param(0).data()) return "not aliased";
        if (!lin->weight.requires_grad() || !lin->weight.is_leaf()) return "lost autograd identity";
        if (lin->weight.sizes() != at::IntArrayRef({2, 3})) return "lost its shape";
        std::vector<float> g(6, 1.0f);
        eng.grad_ready(0, g);
        eng.step();  // Adam's first step moves every element by lr
        const float now = lin->weight[0][0].item<float>();
        if (std::fabs(now - 0.4f) > 1e-6f) return "step not visible: " + std::to_string(now);
        torch_unbind(lin->weight);
        if (lin->weight.data_ptr() != nullptr) return "unbind left memory";
        torch_bind(lin->weight, eng.param(0));
        if (lin->weight.data_ptr() != eng.param(0).data()) return "rebind failed";
        try {
          torch_bind(lin->bias, eng.param(0));
        } catch (const std::exception& ex) {
          return std::strstr(ex.what(), "shape [2] (2 elements) cannot alias a view of 6")
                     ? ""
                     : ex.what();
        }
        return "a size mismatch was accepted";
      },
      quick());
  for (const auto& s : check) REQUIRE(s == "");
}

TEST_CASE("rebinding moves the tensors autograd saved in forward (ZeRO-3's re-gather)",
          "[torch][alias]") {
  torch::manual_seed(3);
  torch::nn::Linear lin(4, 3);
  const at::Tensor w0 = lin->weight.detach().clone();
  const at::Tensor x = torch::randn({5, 4}, torch::requires_grad());
  // Reference: input gradient with the weight unchanged.
  const at::Tensor ref = torch::autograd::grad({lin->forward(x).pow(2).sum()}, {x})[0];

  std::vector<float> a(w0.data_ptr<float>(), w0.data_ptr<float>() + 12), b = a;
  torch_bind(lin->weight, tensor_view<float>(a.data(), a.size()));
  at::Tensor loss = lin->forward(x).pow(2).sum();  // saves weight.t(), a view over `a`
  torch_bind(lin->weight, tensor_view<float>(b.data(), b.size()));  // gathered anew, elsewhere
  std::fill(a.begin(), a.end(), 1e30f);                             // the forward buffer is gone
  const at::Tensor g = torch::autograd::grad({loss}, {x})[0];
  REQUIRE(torch::equal(g, ref));

  // The backward really reads the new buffer: different values there give a different result.
  at::Tensor loss2 = lin->forward(x).pow(2).sum();
  for (auto& v : a) v = 0.0f;
  torch_bind(lin->weight, tensor_view<float>(a.data(), a.size()));
  const at::Tensor g2 = torch::autograd::grad({loss2}, {x})[0];
  REQUIRE_FALSE(torch::equal(g2, ref));
}

TEST_CASE("torch_hooks: stages 0-3 give the same parameters as autograd's .grad in stage 0",
          "[torch][hooks]") {
  constexpr int ranks = 2, steps = 3;
  data d = make_data(ranks, 4);

  // Stage 0 without torch_hooks: gradients read from .grad after backward, written in place.
  std::vector<net> plain(ranks);
  auto manual = run_ranks(
      ranks,
      [&](thread_comm& c) {
        net& n = plain[static_cast<std::size_t>(c.rank())];
        auto spec = spec_of(d);
        torch_engine<zero0> eng(c, spec, {.lr = 1e-2f, .weight_decay = 0.01f});
        std::vector<at::Tensor> ps;
        for (auto& unit : n.units())
          for (auto& p : unit) ps.push_back(p);
        for (std::size_t i = 0; i < ps.size(); ++i) torch_bind(ps[i], eng.param(i));
        const auto x = d.x.narrow(0, c.rank() * 4, 4), y = d.y.narrow(0, c.rank() * 4, 4);
        for (int s = 0; s < steps; ++s) {
          torch::mse_loss(n.u1->forward(n.u0->forward(x)), y).backward();
          for (std::size_t i = 0; i < ps.size(); ++i) {
            torch_view(eng.grad(i)).copy_(ps[i].grad().reshape({-1}));
            ps[i].mutable_grad() = at::Tensor();
          }
          eng.step();
        }
        std::vector<float> params;
        for (std::size_t i = 0; i < eng.num_params(); ++i)
          for (float v : eng.param(i)) params.push_back(v);
        return params;
      },
      quick());

  std::vector<net> n0(ranks), n1(ranks), n2(ranks), n3(ranks);
  const auto p0 = train_with_hooks<zero0>(d, ranks, steps, n0);
  const auto p1 = train_with_hooks<zero1>(d, ranks, steps, n1);
  const auto p2 = train_with_hooks<zero2>(d, ranks, steps, n2);
  const auto p3 = train_with_hooks<zero3>(d, ranks, steps, n3);
  REQUIRE(p0.size() == 32 + 8 + 8 + 8 + 16 + 2);
  REQUIRE(p0 == manual.front());
  REQUIRE(p1 == p0);
  REQUIRE(p2 == p0);
  REQUIRE(p3 == p0);
  // Training moved the parameters.
  REQUIRE(p0[0] != d.init[0].data_ptr<float>()[0]);
}

TEST_CASE("torch_hooks: wrong parameter lists and missing gradients are named",
          "[torch][hooks][errors]") {
  data d = make_data(2, 2);
  // Runs one step of ZeRO-3 with parameter "uN.unused" in unit `extra_in` (in the engine and in
  // the torch lists, but used by no forward); returns each rank's messages.
  auto run = [&](int extra_in) {
    return run_ranks(
        2,
        [&](thread_comm& c) -> std::vector<std::string> {
          std::vector<std::string> out;
          auto record = [&](auto&& f) {
            try {
              f();
              out.push_back("");
            } catch (const std::exception& e) {
              out.push_back(e.what());
            }
          };
          net n;
          auto spec = spec_of(d, extra_in);
          torch_engine<zero3> eng(c, spec);
          using hooks_t = torch_hooks<torch_engine<zero3>>;
          record([&] { hooks_t h(eng, n.units()); });
          record([&] { hooks_t h(eng, {n.u0->parameters()}); });
          auto swapped = n.units();
          std::swap(swapped[0][0], swapped[0][2]);
          swapped[static_cast<std::size_t>(extra_in)].push_back(torch::zeros({3}));
          record([&] { hooks_t h(eng, swapped); });
          auto units = n.units();
          units[static_cast<std::size_t>(extra_in)].push_back(
              torch::zeros({3}, torch::requires_grad()));
          hooks_t h(eng, units);
          const auto x = d.x.narrow(0, c.rank() * 2, 2), y = d.y.narrow(0, c.rank() * 2, 2);
          record([&] {
            at::Tensor a = h.forward(0, [&] { return n.u0->forward(x); });
            a = h.forward(1, [&] { return n.u1->forward(a); });
            torch::mse_loss(a, y).backward();
            h.finish_backward();
          });
          return out;
        },
        quick());
  };
  for (const auto& m : run(1)) {
    REQUIRE(m.size() == 4);
    REQUIRE_THAT(m[0], Catch::Contains("6 torch parameters for the engine's 7"));
    REQUIRE_THAT(m[1], Catch::Contains("1 lists of parameters for an engine of 2 units"));
    REQUIRE_THAT(m[2], Catch::Contains("torch parameter for 'u0.0.weight' has shape [8]") &&
                           Catch::Contains("the engine's has 32"));
    // Unit 1 never gets all its gradients and keeps the staging buffer unit 0 needs.
    REQUIRE_THAT(m[3], Catch::Contains("staging buffer") &&
                           Catch::Contains("unit 'u1' still waits for the gradients of "
                                           "'u1.unused'"));
  }
  for (const auto& m : run(0)) {
    REQUIRE(m.size() == 4);
    // Unit 0's backward is the last: finish_backward ends it, and the engine names the gap.
    REQUIRE_THAT(m[3], Catch::Contains("post_backward(0): unit 'u0' finished its backward "
                                       "without the gradients of 'u0.unused'"));
  }
}
