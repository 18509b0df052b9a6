// shardkit example 04: a tiny MLP written with Eigen matrices, trained with ZeRO stages 0-3 on N
// in-process ranks (shardkit/adapters/eigen.hpp).
//
// Eigen plays the user's framework: forward and backward are a few lines of matrix algebra.
// shardkit owns the parameters: each layer reads its weights through an Eigen::Map over the
// engine's working parameters (no copy; with --dtype bf16 the 16-bit working values are copied
// into Eigen matrices with engine::copy_param_to instead, since Eigen does no bf16 arithmetic
// here). Gradients are Eigen matrices handed to engine::grad_ready. The model is regression
// y = W2 tanh(W1 x + b1) + b2 on a synthetic teacher; the reference is the same training on
// one rank, unsharded, with the full global batch.
//
//   shardkit_example_04_eigen --stage 3 --ranks 4 --steps 30
//   shardkit_example_04_eigen --stage 2 --ranks 3 --json
#include <shardkit/adapters/eigen.hpp>
#include <shardkit/shardkit.hpp>

#include "../common/args.hpp"
#include "../common/mlp.hpp"  // counter-based random numbers

#include <Eigen/Core>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <type_traits>
#include <vector>

namespace {

struct config {
  int stage = 3;
  int ranks = 4;
  int steps = 30;
  std::string dtype = "fp32";
  Eigen::Index inputs = 8, hidden = 32, outputs = 2;
  Eigen::Index batch = 64;  // global batch per step
  float lr = 1e-2f;
  std::uint64_t seed = 5;
  bool json = false;
};

constexpr const char* usage_text =
    "usage: shardkit_example_04_eigen [--stage 0|1|2|3] [--ranks N] [--steps K]\n"
    "         [--dtype fp32|bf16] [--hidden H] [--batch GLOBAL_BATCH] [--json]\n"
    "  --batch is the global batch: the samples of one step over all ranks (a multiple of\n"
    "  --ranks, split evenly)\n";

//! A command line that cannot be used: the reason and the usage on stderr, exit status 2.
[[noreturn]] void usage(const std::string& why) {
  std::cerr << "error: " << why << "\n" << usage_text;
  std::exit(2);
}

long parse_int(const std::string& flag, const char* v, long lo, long hi) {
  return examples::parse_int(flag, v, lo, hi, usage);
}

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--stage")
      c.stage = static_cast<int>(parse_int(a, value(), 0, 3));
    else if (a == "--ranks")
      c.ranks = static_cast<int>(parse_int(a, value(), 1, 64));
    else if (a == "--steps")
      c.steps = static_cast<int>(parse_int(a, value(), 1, 100000));
    else if (a == "--hidden")
      c.hidden = parse_int(a, value(), 1, 1 << 14);
    else if (a == "--batch")
      c.batch = parse_int(a, value(), 1, 1 << 20);
    else if (a == "--dtype") {
      c.dtype = value();
      if (c.dtype != "fp32" && c.dtype != "bf16") usage("--dtype must be fp32 or bf16");
    } else if (a == "--json")
      c.json = true;
    else if (a == "--help" || a == "-h") {
      std::fputs(usage_text, stdout);  // asked for: the usage on stdout, exit status 0
      std::exit(0);
    } else
      usage("unknown argument '" + a + "'");
  }
  if (c.batch % c.ranks != 0) {
    usage("--batch " + std::to_string(c.batch) + " must be a multiple of --ranks " +
          std::to_string(c.ranks));
  }
  return c;
}

// Sample j of the data set: features x_j (inputs) and targets (outputs) from a fixed teacher.
void sample(const config& c, std::uint64_t j, float* x, float* y) {
  for (Eigen::Index k = 0; k < c.inputs; ++k)
    x[k] = mlp::normal(c.seed, j * 64 + static_cast<std::uint64_t>(k));
  for (Eigen::Index o = 0; o < c.outputs; ++o) {
    float s = 0.0f;
    for (Eigen::Index k = 0; k < c.inputs; ++k) {
      s += mlp::uniform(c.seed + 1, static_cast<std::uint64_t>(o * c.inputs + k)) * x[k];
    }
    y[o] = std::sin(s);
  }
}

// The parameter's working values as a matrix: a Map over the engine's memory (fp32), or a
// converted copy (bf16).
template <class Engine>
Eigen::Ref<const Eigen::MatrixXf> weights(Engine& eng, std::size_t i, Eigen::Index rows,
                                          Eigen::Index cols, Eigen::MatrixXf& scratch) {
  if constexpr (std::is_same_v<typename Engine::working_type, float>) {
    return shardkit::eigen_map(eng.param(i), rows, cols);
  } else {
    scratch.resize(rows, cols);
    eng.copy_param_to(i, scratch);
    return scratch;
  }
}

struct run_result {
  std::vector<double> losses;
  std::vector<float> params;
};

template <class Policies, class W>
run_result train(const config& c, int ranks, Eigen::Index batch) {
  using engine_t = shardkit::engine<shardkit::thread_comm, Policies, W, shardkit::adamw>;
  auto per_rank = shardkit::run_ranks(ranks, [&](shardkit::thread_comm& comm) {
    // Initial values as Eigen matrices, registered through tensor_traits.
    const Eigen::Index D = c.inputs, H = c.hidden, O = c.outputs;
    Eigen::MatrixXf W1(H, D), W2(O, H);
    Eigen::VectorXf b1 = Eigen::VectorXf::Zero(H), b2 = Eigen::VectorXf::Zero(O);
    for (Eigen::Index k = 0; k < W1.size(); ++k)
      W1.data()[k] = mlp::uniform(c.seed + 2, static_cast<std::uint64_t>(k)) /
                     std::sqrt(static_cast<float>(D));
    for (Eigen::Index k = 0; k < W2.size(); ++k)
      W2.data()[k] = mlp::uniform(c.seed + 3, static_cast<std::uint64_t>(k)) /
                     std::sqrt(static_cast<float>(H));
    shardkit::model_spec model;
    model.begin_unit("layer0");
    model.add("layer0.weight", W1);
    model.add("layer0.bias", b1);
    model.begin_unit("layer1");
    model.add("layer1.weight", W2);
    model.add("layer1.bias", b2);
    engine_t eng(comm, model, {.lr = c.lr, .weight_decay = 0.01f});

    run_result r;
    Eigen::MatrixXf X(D, batch), T(O, batch), s1, s2, s3, s4;  // s*: bf16 copies
    for (int step = 0; step < c.steps; ++step) {
      const std::uint64_t first = static_cast<std::uint64_t>(step) * c.batch +
                                  static_cast<std::uint64_t>(comm.rank() * batch);
      for (Eigen::Index j = 0; j < batch; ++j) sample(c, first + j, &X(0, j), &T(0, j));
      // Forward, layer by layer (ZeRO-3 gathers each layer's parameters in its hooks).
      eng.pre_forward(0);
      const Eigen::MatrixXf A1 =
          ((weights(eng, 0, H, D, s1) * X).colwise() + weights(eng, 1, H, 1, s3).col(0))
              .array()
              .tanh()
              .matrix();
      eng.post_forward(0);
      eng.pre_forward(1);
      const Eigen::MatrixXf Y =
          (weights(eng, 2, O, H, s2) * A1).colwise() + weights(eng, 3, O, 1, s4).col(0);
      eng.post_forward(1);
      const Eigen::MatrixXf E = Y - T;
      double loss = E.squaredNorm() / static_cast<double>(E.size());
      // Backward, last layer first; each gradient is an Eigen matrix handed to the engine.
      const Eigen::MatrixXf dY = E * (2.0f / static_cast<float>(E.size()));
      eng.pre_backward(1);
      const Eigen::MatrixXf dW2 = dY * A1.transpose();
      const Eigen::VectorXf db2 = dY.rowwise().sum();
      const Eigen::MatrixXf dA1 = weights(eng, 2, O, H, s2).transpose() * dY;
      eng.grad_ready(3, db2);
      eng.grad_ready(2, dW2);
      eng.post_backward(1);
      eng.pre_backward(0);
      const Eigen::MatrixXf dZ1 = (dA1.array() * (1.0f - A1.array().square())).matrix();
      const Eigen::MatrixXf dW1 = dZ1 * X.transpose();
      const Eigen::VectorXf db1 = dZ1.rowwise().sum();
      eng.grad_ready(1, db1);
      eng.grad_ready(0, dW1);
      eng.post_backward(0);
      eng.step();
      comm.all_reduce(&loss, &loss, 1, shardkit::reduce_op::sum);
      r.losses.push_back(loss / ranks);
    }
    for (std::size_t u = 0; u < eng.num_units(); ++u) {
      eng.pre_forward(u);
      for (std::size_t i = 2 * u; i < 2 * u + 2; ++i) {
        for (auto v : eng.param(i)) r.params.push_back(static_cast<float>(v));
      }
      eng.post_forward(u);
    }
    return r;
  });
  return per_rank.front();
}

template <class W>
run_result train_stage(const config& c, int stage, int ranks, Eigen::Index batch) {
  switch (stage) {
    case 0:
      return train<shardkit::zero0, W>(c, ranks, batch);
    case 1:
      return train<shardkit::zero1, W>(c, ranks, batch);
    case 2:
      return train<shardkit::zero2, W>(c, ranks, batch);
    default:
      return train<shardkit::zero3, W>(c, ranks, batch);
  }
}

run_result train_any(const config& c, int stage, int ranks, Eigen::Index batch) {
  return c.dtype == "bf16" ? train_stage<shardkit::bf16>(c, stage, ranks, batch)
                           : train_stage<float>(c, stage, ranks, batch);
}

}  // namespace

int main(int argc, char** argv) try {
  const config c = parse(argc, argv);
  const run_result r = train_any(c, c.stage, c.ranks, c.batch / c.ranks);
  // The same global batch on one rank, unsharded: the reference.
  const run_result ref = train_any(c, 0, 1, c.batch);
  double max_diff = 0.0;
  for (std::size_t i = 0; i < r.params.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(r.params[i]) - ref.params[i]));
  }
  if (c.json) {
    std::printf("{\"stage\": %d, \"ranks\": %d, \"dtype\": \"%s\", \"params\": %zu, \"losses\": [",
                c.stage, c.ranks, c.dtype.c_str(), r.params.size());
    for (std::size_t i = 0; i < r.losses.size(); ++i)
      std::printf("%s%.7g", i ? ", " : "", r.losses[i]);
    std::printf("], \"max_abs_diff_vs_unsharded\": %.6g}\n", max_diff);
  } else {
    std::printf(
        "shardkit %s example 04: Eigen MLP %ld-%ld-%ld (%zu parameters), ZeRO stage %d on %d "
        "in-process ranks, %s working parameters\n\nstep   loss (global batch of %ld)\n",
        SHARDKIT_VERSION_STRING, static_cast<long>(c.inputs), static_cast<long>(c.hidden),
        static_cast<long>(c.outputs), r.params.size(), c.stage, c.ranks, c.dtype.c_str(),
        static_cast<long>(c.batch));
    for (std::size_t i = 0; i < r.losses.size(); ++i)
      std::printf("%4zu   %.6f\n", i + 1, r.losses[i]);
    std::printf("\nmax |param - unsharded single-rank run of the same global batch| = %.3g\n",
                max_diff);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
