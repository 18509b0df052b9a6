// One rank's training loop: the GPT's parameters registered with a shardkit engine unit by unit
// (a root unit for the embeddings and the final norm, which the tied output projection uses
// again at the end of the forward; one unit per block), bound to the engine's memory, the
// model's forward and autograd driving the engine's hooks (shardkit::torch_hooks), and the
// engine's step. The same code runs on thread ranks and on MPI processes (Comm).
#pragma once

#include <shardkit/adapters/torch.hpp>
#include <shardkit/core/hash.hpp>
#include <shardkit/io/checkpoint.hpp>
#include <shardkit/io/export.hpp>
#include <shardkit/plan/planner.hpp>
#include <shardkit/shardkit.hpp>

#include "config.hpp"
#include "corpus.hpp"
#include "gpt.hpp"

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace gpt {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

//! The planner's figures for this model and set-up (independent of the engine: from the
//! parameter sizes and the closed forms of shardkit/plan).
inline shardkit::plan::memory_bytes planned_memory(const config& c, int ranks,
                                                   const std::vector<std::uint64_t>& unit_numels) {
  namespace plan = shardkit::plan;
  plan::setup s;
  s.stage = c.stage;
  s.ranks = static_cast<std::uint64_t>(ranks);
  s.bytes = plan::precision_of(c.dtype == "bf16" ? shardkit::dtype::bf16 : shardkit::dtype::f32,
                               plan::optimizer_kind::adamw);
  s.micro_batches = static_cast<std::uint64_t>(c.micro);
  s.prefetch = c.prefetch;
  s.grad_buffers = c.grad_buffers;
  std::vector<plan::unit> units;
  if (c.stage <= 1) {  // stages 0 and 1 shard the model as one flat group
    std::uint64_t psi = 0;
    for (auto n : unit_numels) psi += n;
    units.push_back({psi});
  } else {  // the units are ZeRO-2's buckets and ZeRO-3's gather units; the root stays gathered
    for (std::size_t u = 0; u < unit_numels.size(); ++u) units.push_back({unit_numels[u], u != 0});
  }
  return plan::memory_per_rank(s, units);
}

//! Mean validation loss of `net` (every rank evaluates the same sequences: the result does not
//! depend on N, and under ZeRO-3 every rank takes part in the gathers anyway).
inline double validation_loss(GPT& net, const batch& val) {
  torch::NoGradGuard no_grad;
  return net->loss(val.idx, val.targets).item<double>();
}

template <class Comm, class Policies, class W>
run_result train_rank(Comm& comm, const config& c, const corpus& data, GPT& net) {
  using engine_t = shardkit::engine<Comm, Policies, W, shardkit::adamw>;
  const int N = comm.size(), rank = comm.rank();
  const bool printer = rank == 0;
  const auto start = std::chrono::steady_clock::now();

  // 1. The model: a root unit (embeddings, final norm: used at both ends of the forward, kept
  //    gathered for the step), then one unit per block. Matrices decay, vectors do not.
  shardkit::model_spec model;
  std::vector<std::vector<torch::Tensor>> unit_params;
  std::vector<std::uint64_t> unit_numels;
  auto add_unit = [&](const std::string& name, shardkit::unit_options uo,
                      std::vector<std::pair<std::string, torch::Tensor>> params) {
    model.begin_unit(name, uo);
    unit_params.emplace_back();
    unit_numels.push_back(0);
    for (auto& [pname, t] : params) {
      model.add(pname, t, t.dim() >= 2 ? 0 : 1);
      unit_params.back().push_back(t);
      unit_numels.back() += static_cast<std::uint64_t>(t.numel());
    }
  };
  add_unit("root", {.reshard_after_forward = false}, net->root_parameters());
  for (std::size_t b = 0; b < net->blocks.size(); ++b) {
    add_unit("h" + std::to_string(b), {}, net->block_parameters(b));
  }
  shardkit::engine_options eo;
  eo.prefetch = c.prefetch;
  eo.grad_buffers = c.grad_buffers;
  eo.clip_grad_norm = c.clip;
  eo.report_grad_norm = true;
  eo.trace = Policies::stage == 3;
  const shardkit::adamw::options decay{
      .lr = c.lr, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = c.weight_decay};
  shardkit::adamw::options no_decay = decay;
  no_decay.weight_decay = 0.0f;
  engine_t eng(comm, model, shardkit::param_groups<shardkit::adamw::options>({decay, no_decay}),
               eo);
  eng.set_lr_schedule([&c](std::uint64_t t) { return c.lr_factor(t); });
  if (!c.resume.empty()) shardkit::io::load(eng, c.resume);

  // 2. The torch parameters alias the engine's memory from here on; autograd drives the hooks.
  shardkit::torch_hooks<engine_t> hooks(eng, unit_params, {.root_units = {0}});
  net->around_model = [&](const std::function<torch::Tensor()>& body) {
    return hooks.forward_root(0, body);
  };
  net->around_block = [&](std::size_t b, const std::function<torch::Tensor()>& run) {
    return hooks.forward(b + 1, run);
  };

  run_result r;
  for (auto n : unit_numels) r.params += n;
  const batch val = val_batch(data, static_cast<std::size_t>(c.val_seqs), c.model.context);
  const std::size_t local = static_cast<std::size_t>(c.batch / (N * c.micro));
  std::optional<shardkit::io::pending_save<engine_t>> pending;
  const auto train_start = std::chrono::steady_clock::now();
  for (int step = c.first_step; step < c.last_step(); ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    hooks.reset_engine_seconds();
    if (eo.trace) eng.clear_trace();
    double loss_sum = 0.0;
    // 3. Forward and backward of each micro-batch: this rank's share of the global batch.
    for (int m = 0; m < c.micro; ++m) {
      if (c.micro > 1) eng.begin_micro_batch(m == c.micro - 1);
      const std::size_t first = (static_cast<std::size_t>(m) * N + rank) * local;
      const batch b = train_batch(data, c.seed, static_cast<std::uint64_t>(step), first, local,
                                  c.model.context);
      torch::Tensor loss = net->loss(b.idx, b.targets);
      loss_sum += loss.item<double>();
      (loss * eng.loss_scale()).backward();
      hooks.finish_backward();
    }
    const double fwd_bwd = seconds_since(t0);
    const double in_hooks = hooks.engine_seconds();
    // 4. The optimizer step on this rank's shard; the torch parameters see the new values.
    const auto t1 = std::chrono::steady_clock::now();
    const shardkit::step_report rep = eng.step();
    const double step_s = seconds_since(t1);
    comm.all_reduce(&loss_sum, &loss_sum, 1, shardkit::reduce_op::sum);

    step_record rec;
    rec.step = step + 1;
    rec.loss = loss_sum / (N * c.micro);
    rec.seconds = seconds_since(t0);
    rec.compute = fwd_bwd - in_hooks;
    rec.optimizer = rep.optimizer_seconds;
    rec.comm = in_hooks + (step_s - rep.optimizer_seconds);
    rec.lr = rep.lr;
    rec.grad_norm = rep.grad_norm;
    rec.loss_scale = rep.loss_scale;
    rec.tokens_per_s = static_cast<double>(c.batch) * c.model.context / rec.seconds;
    if (eo.trace) {  // all-gathers per unit in this step (the root: once, kept for backward)
      r.gathers_forward.assign(eng.num_units(), 0);
      r.gathers_backward.assign(eng.num_units(), 0);
      for (const auto& e : eng.trace()) {
        if (e.what != shardkit::trace_event::kind::gather_issued) continue;
        (e.backward ? r.gathers_backward : r.gathers_forward)[e.unit]++;
      }
    }
    const bool last = step + 1 == c.last_step();
    if ((c.eval_every > 0 && (step + 1) % c.eval_every == 0) || last) {
      rec.val_loss = validation_loss(net, val);
      if (last) r.final_val_loss = rec.val_loss;
    }
    // 5. Checkpoints: asynchronous, every save_every steps, written while training goes on.
    if (!c.save.empty() && ((c.save_every > 0 && (step + 1) % c.save_every == 0) || last)) {
      if (pending) pending->wait();
      pending.reset();
      if (last) {
        shardkit::io::save(eng, c.save);
      } else {
        pending.emplace(shardkit::io::save_async(eng, c.save));
      }
      r.saved = c.save;
    }
    if (printer && !c.quiet && !c.json &&
        ((c.log_every > 0 && (step + 1) % c.log_every == 0) || last || !std::isnan(rec.val_loss))) {
      std::printf(
          "step %4d  loss %.4f  val %s  %7.0f tok/s  %6.1f ms (compute %6.1f, comm %5.1f, "
          "optimizer %5.2f)  lr %.2e  |g| %.3f  scale %g\n",
          rec.step, rec.loss,
          std::isnan(rec.val_loss) ? "  -   " : std::to_string(rec.val_loss).substr(0, 6).c_str(),
          rec.tokens_per_s, 1e3 * rec.seconds, 1e3 * rec.compute, 1e3 * rec.comm,
          1e3 * rec.optimizer, rec.lr, rec.grad_norm, rec.loss_scale);
      std::fflush(stdout);
    }
    r.records.push_back(rec);
  }
  r.train_seconds = seconds_since(train_start);
  r.tokens = static_cast<std::uint64_t>(c.last_step() - c.first_step) *
             static_cast<std::uint64_t>(c.batch) * static_cast<std::uint64_t>(c.model.context);
  if (pending) pending->wait();
  if (!c.export_path.empty()) {
    shardkit::io::export_safetensors(eng, c.export_path);
    r.exported = c.export_path;
  }

  // 6. The final parameters (under ZeRO-3 gathered unit by unit: every rank takes part).
  shardkit::stable_hash h;
  for (std::size_t u = 0; u < eng.num_units(); ++u) {
    eng.pre_forward(u);
    for (std::size_t i = 0; i < eng.num_params(); ++i) {
      if (eng.unit_of(i) != u) continue;
      for (auto v : eng.param(i)) {
        h.f32(static_cast<float>(v));
        if (c.compare && printer) r.final_params.push_back(static_cast<float>(v));
      }
    }
    eng.post_forward(u);
  }
  eng.parameters().after_step(false);  // release what the loop above left gathered
  r.params_hash = h.value();
  net->around_model = nullptr;  // they refer to `hooks` and `eng`, which end here
  net->around_block = nullptr;

  // 7. Bytes held by category (the ledger) against the planner's figures for the same model.
  using shardkit::memory_category;
  const auto& mem = eng.memory();
  const auto plan = planned_memory(c, N, unit_numels);
  r.ledger = {{"working_params", mem.current(memory_category::working_params)},
              {"grads", mem.current(memory_category::grads)},
              {"master_params", mem.current(memory_category::master_params)},
              {"optimizer_moments", mem.current(memory_category::optimizer_moments)},
              {"gathered_params (peak)", mem.peak(memory_category::gathered_params)},
              {"grad_buckets (peak)", mem.peak(memory_category::grad_buckets)},
              {"comm_scratch (peak)", mem.peak(memory_category::comm_scratch)}};
  r.planned = {{"working_params", plan.working_params},
               {"grads", plan.grads},
               {"master_params", plan.master_params},
               {"optimizer_moments", plan.optimizer_moments},
               {"gathered_params (peak)", plan.gathered_params},
               {"grad_buckets (peak)", plan.grad_buckets},
               {"comm_scratch (peak)", plan.comm_scratch}};
  r.unit_numels = unit_numels;
  r.gathered_peak = mem.peak(memory_category::gathered_params);
  r.gathered_bound = eng.gathered_bytes_bound();
  r.seconds = seconds_since(start);
  return r;
}

}  // namespace gpt
