// shardkit's fused AdamW step behind a C interface, so that benchmarks/peers.py can run it in the
// same Python process as torch's and DeepSpeed's optimizers, on tensors allocated by torch, on
// the same sizes and thread counts, interleaved (scripts/bench --peers).
//
//   team = shardkit_peer_team(threads)          a persistent host::thread_team (or none for 1)
//   shardkit_peer_adamw_fp32(team, p, m, v, g, n, step, lr, beta1, beta2, eps, weight_decay)
//   shardkit_peer_adamw_bf16(team, master, m, v, g_bf16, out_bf16, n, step, ...)
//   shardkit_peer_team_free(team);  shardkit_peer_isa()
//
// Bias corrections and all per-step constants come from shardkit::adamw::prepare, as in the
// engine; the gradient multiplier is 1.
#include <shardkit/kernels/host/isa.hpp>
#include <shardkit/kernels/host/optimizer.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/math.hpp>

#include <cstddef>
#include <cstdint>

namespace {
shardkit::adamw::constants constants(std::uint64_t step, float lr, float beta1, float beta2,
                                     float eps, float weight_decay) {
  const shardkit::adam_options o{
      .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay};
  return shardkit::adamw::prepare(o, step, lr, 1.0f);
}
}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* shardkit_peer_team(int threads) {
  if (threads <= 1) return nullptr;
  return new shardkit::host::thread_team(static_cast<std::size_t>(threads));
}

__attribute__((visibility("default"))) void shardkit_peer_team_free(void* team) {
  delete static_cast<shardkit::host::thread_team*>(team);
}

__attribute__((visibility("default"))) const char* shardkit_peer_isa() {
  return shardkit::host_isa();
}

__attribute__((visibility("default"))) void shardkit_peer_adamw_fp32(
    void* team, float* p, float* m, float* v, const float* g, std::size_t n, std::uint64_t step,
    float lr, float beta1, float beta2, float eps, float weight_decay) {
  float* state[2] = {m, v};
  shardkit::host::parallel_fused_step<shardkit::adamw, float, float>(
      static_cast<shardkit::host::executor*>(static_cast<shardkit::host::thread_team*>(team)),
      constants(step, lr, beta1, beta2, eps, weight_decay), p, state, g, nullptr, n);
}

__attribute__((visibility("default"))) void shardkit_peer_adamw_bf16(
    void* team, float* master, float* m, float* v, const std::uint16_t* g, std::uint16_t* out,
    std::size_t n, std::uint64_t step, float lr, float beta1, float beta2, float eps,
    float weight_decay) {
  float* state[2] = {m, v};
  shardkit::host::parallel_fused_step<shardkit::adamw, shardkit::bf16, shardkit::bf16>(
      static_cast<shardkit::host::executor*>(static_cast<shardkit::host::thread_team*>(team)),
      constants(step, lr, beta1, beta2, eps, weight_decay), master, state,
      reinterpret_cast<const shardkit::bf16*>(g), reinterpret_cast<shardkit::bf16*>(out), n);
}
}
