// Compiled twice by ctest: as is, it must compile; with one of the SHARDKIT_BREAK_* macros it
// must fail with the static_assert message the test expects.
#include <shardkit/shardkit.hpp>

using namespace shardkit;

void use(thread_comm& c, const model_spec& m) {
#if defined(SHARDKIT_BREAK_GRADS_WITHOUT_OPTIMIZER)
  engine<thread_comm, policies<ShardGrads>> e(c, m);
#elif defined(SHARDKIT_BREAK_PARAMS_WITHOUT_GRADS)
  engine<thread_comm, policies<ShardOptimizer, ShardParams>> e(c, m);
#elif defined(SHARDKIT_BREAK_DUPLICATE)
  engine<thread_comm, policies<ShardOptimizer, ShardOptimizer>> e(c, m);
#elif defined(SHARDKIT_BREAK_NOT_A_POLICY)
  engine<thread_comm, policies<ShardOptimizer, int>> e(c, m);
#elif defined(SHARDKIT_BREAK_NOT_A_POLICY_SET)
  engine<thread_comm, ShardOptimizer> e(c, m);
#elif defined(SHARDKIT_BREAK_GRAD_VIEW_IN_ZERO2)
  engine<thread_comm, zero2> e(c, m);
  (void)e.grad(0);
#elif defined(SHARDKIT_BREAK_DEVICE_ENGINE_WITHOUT_CUDA_HEADER)
  (void)c;
  using device_comm = thread_communicator<cuda_space>;
  engine<device_comm, zero2>* e = nullptr;
  (void)sizeof(*e);
#elif defined(SHARDKIT_BREAK_OFFLOAD_AT_STAGE_0)
  engine<thread_comm, policies<OffloadOptimizer>> e(c, m);
#else
  engine<thread_comm, zero2_offload> eo(c, m);
  static_assert(decltype(eo)::stage == 2);
  engine<thread_comm, policies<ShardGrads, ShardOptimizer>> e(c, m);  // order does not matter
  static_assert(decltype(e)::stage == 2);
  engine<thread_comm, zero1> e1(c, m);
  (void)e1.grad(0);
#endif
}
