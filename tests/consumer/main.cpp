// A minimal user of shardkit: two ranks, ZeRO-2, one step; prints the updated parameter.
#include <shardkit/shardkit.hpp>

#include <cstdio>
#include <vector>

int main() {
  auto r = shardkit::run_ranks(2, [](shardkit::thread_comm& comm) {
    std::vector<float> w(10, 1.0f);
    shardkit::model_spec model;
    model.add("w", w);
    shardkit::engine<shardkit::thread_comm, shardkit::zero2> eng(comm, model, {.lr = 0.5f});
    std::vector<float> g(10, 1.0f);
    eng.grad_ready(0, g);
    eng.step();
    return static_cast<float>(eng.param(0)[0]);
  });
  // One AdamW step of lr 0.5 on a gradient of 1 moves 1.0 to 0.5 on both ranks.
  const bool ok = r[0] == 0.5f && r[1] == 0.5f;
  std::printf("consumer %s: %g %g (expected 0.5 0.5)\n", ok ? "ok" : "FAILED", r[0], r[1]);
  return ok ? 0 : 1;
}
