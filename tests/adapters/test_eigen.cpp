// The Eigen adapter: dense contiguous Eigen objects as tensors, Eigen::Map over engine views.
#include <shardkit/adapters/eigen.hpp>
#include <shardkit/shardkit.hpp>

#include <catch2/catch.hpp>

#include <Eigen/Core>
#include <complex>
#include <cstring>
#include <string>
#include <vector>

using namespace shardkit;

TEST_CASE("contiguous Eigen objects are tensors, strided expressions are not", "[eigen][tensor]") {
  STATIC_REQUIRE(typed_tensor<Eigen::MatrixXf>);
  STATIC_REQUIRE(typed_tensor<Eigen::VectorXd>);
  STATIC_REQUIRE(typed_tensor<Eigen::ArrayXXf>);
  STATIC_REQUIRE(typed_tensor<Eigen::Matrix<float, 3, 4, Eigen::RowMajor>>);
  STATIC_REQUIRE(typed_tensor<Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1>>);
  STATIC_REQUIRE(typed_tensor<Eigen::Map<Eigen::MatrixXf>>);
  STATIC_REQUIRE(typed_tensor<Eigen::Map<const Eigen::VectorXf>>);
  STATIC_REQUIRE(typed_tensor<const Eigen::MatrixXf&>);
  STATIC_REQUIRE(std::is_same_v<tensor_space_t<Eigen::MatrixXf>, host_space>);
  // Not one contiguous block (or not an element type shardkit knows):
  STATIC_REQUIRE(!tensor<Eigen::Block<Eigen::MatrixXf>>);
  STATIC_REQUIRE(!tensor<Eigen::Ref<Eigen::MatrixXf>>);
  STATIC_REQUIRE(!tensor<Eigen::Map<Eigen::MatrixXf, 0, Eigen::OuterStride<>>>);
  STATIC_REQUIRE(!tensor<Eigen::Matrix<std::complex<float>, 2, 2>>);
  STATIC_REQUIRE(!tensor<Eigen::Matrix<short, 2, 2>>);

  Eigen::MatrixXf m(2, 3);
  m << 1, 2, 3, 4, 5, 6;
  const any_tensor_view a = erase(m);
  REQUIRE(a.data == m.data());
  REQUIRE(a.numel == 6);
  REQUIRE(a.type == dtype::f32);
  REQUIRE_FALSE(a.read_only);
  REQUIRE(view(m)[1] == 4.0f);  // column-major: element (1, 0)
  const Eigen::MatrixXf& cm = m;
  REQUIRE(erase(cm).read_only);
  Eigen::Map<const Eigen::VectorXf> cmap(m.data(), 6);
  REQUIRE(erase(cmap).read_only);
  REQUIRE(tensor_dtype(Eigen::VectorXd(3)) == dtype::f64);
}

TEST_CASE("eigen_map aliases the engine's parameters, and Eigen gradients go in directly",
          "[eigen][alias]") {
  auto results = run_ranks(2, [](thread_comm& c) -> std::string {
    Eigen::MatrixXf w(2, 3);
    w << 1, 2, 3, 4, 5, 6;
    Eigen::VectorXf b = Eigen::VectorXf::Constant(2, -1.0f);
    model_spec spec;
    spec.add("w", w);  // column-major storage: 1 4 2 5 3 6
    spec.add("b", b);
    engine<thread_comm, zero2, float, adamw> eng(c, spec, {.lr = 0.1f});
    auto W = eigen_map(eng.param(0), 2, 3);
    if (W.data() != eng.param(0).data()) return "the map copies";
    if (!W.isApprox(w)) return "column-major map differs from the initial matrix";
    auto R = eigen_map<Eigen::RowMajor>(eng.param(0), 3, 2);
    if (R(0, 1) != 4.0f || R(2, 0) != 3.0f) return "row-major map reads the wrong elements";
    W(1, 2) = 60.0f;  // through Eigen, seen by the engine (and by the other map)
    if (eng.param(0)[5] != 60.0f || R(2, 1) != 60.0f) return "a write through the map is lost";
    auto B = eigen_map(eng.param(1));
    if (B.size() != 2 || B(1) != -1.0f) return "vector map";
    const auto& ce = eng;
    auto CW = eigen_map(ce.param(0), 2, 3);  // a view of const elements maps a const matrix
    static_assert(std::is_same_v<decltype(CW), Eigen::Map<const Eigen::MatrixXf>>);
    // Gradients are Eigen matrices; the step moves every parameter by lr (Adam's first step).
    Eigen::MatrixXf gw = Eigen::MatrixXf::Ones(2, 3);
    Eigen::VectorXf gb = -Eigen::VectorXf::Ones(2);
    eng.grad_ready(1, gb);
    eng.grad_ready(0, gw);
    eng.step();
    if (std::fabs(W(0, 0) - 0.9f) > 1e-6f || std::fabs(B(0) + 0.9f) > 1e-6f)
      return "step not visible through the maps: " + std::to_string(W(0, 0));
    try {
      eigen_map(eng.param(0), 4, 2);
    } catch (const std::exception& e) {
      return std::strstr(e.what(), "a 4 x 2 matrix does not cover the view's 6 elements")
                 ? ""
                 : e.what();
    }
    return "a wrong shape was accepted";
  });
  for (const auto& r : results) REQUIRE(r == "");
}
