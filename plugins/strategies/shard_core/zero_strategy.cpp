// ZeRO data parallel, shared by the `sharded` and `offload` plugins (docs/strategy.md). Multi-process
// like ddp (same launch, rendezvous, timeouts and collectives: sdk/distributed, Ember::distributed), and it
// owns the model's state through strategy contract 2:
//   stage 1  the optimizer state is sharded: each rank steps its 1/N of every parameter; gradients
//            stay whole until the updating micro-batch, then are reduce-scattered;
//   stage 2  + gradients are reduce-scattered on every micro-batch as backward produces them and
//            only this rank's shard is kept;
//   stage 3  + parameters are sharded: a unit's parameters are all-gathered just before its
//            forward (the next unit's prefetched), freed after it, gathered again before its
//            backward and freed once its gradients are reduce-scattered.
// Stages 1 and 2 all-gather the updated shards into the whole parameters after every step.
// Offload (ZeRO-Offload / ZeRO-Infinity's parameter offload): the shards are fp32 masters in host
// memory, each group's reduced gradient is copied to the host as soon as it is ready (a side
// stream on GPUs) and accumulated there in fp32, the optimizer steps on the host (ATen's fused CPU
// kernels), and the device only ever holds compute-dtype weights: all of them (stage 2) or the
// unit that runs (stage 3, offload_params). One rank is world size 1: no collective runs then.
//
// The parts, one job each: shard_table (what this rank holds: parameters, shards, groups),
// parameter_gather (whole parameters from the shards, prefetch and free), gradient_reducer
// (gradients to shards while backward runs, offload's host landing), sharded_state_io (full and
// per-rank checkpoints); Ember::distributed's DeferredParts (this rank's parts taken while the
// model is built) and PipelineState (the model cut into pipeline stages). The class is in
// zero_strategy_impl.h, its set-up in zero_setup.cpp; this file ties the parts to the strategy
// contract while training runs (the step's non-finite vote, clipping across shards, the pipeline
// window, the model's state for checkpoints, the closing statistics).
#include "zero_strategy_impl.h"

#include <ember/error.h>
#include <ember/support/grad_util.h>
#include <ember/support/optimizer_state_tensors.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstring>

namespace ember_shard {

using namespace ember_dist;

void* ZeroStrategy::query_interface(const char* iid) {
  if (std::strcmp(iid, ember::kShardedCheckpointsIid) == 0) return this;
  if (std::strcmp(iid, ember::kShardedModelStateIid) == 0) return static_cast<ember::IShardedModelState*>(this);
  if (std::strcmp(iid, ember::kShardedModelStateSelectiveIid) == 0) return static_cast<ember::IShardedModelStateSelective*>(this);
  if (std::strcmp(iid, ember::kDeviceMeshIid) == 0) return static_cast<ember::IDeviceMesh*>(this);
  if (std::strcmp(iid, ember::kDeferredInitIid) == 0) return static_cast<ember::IDeferredInit*>(this);
  if (std::strcmp(iid, ember::kDeferredInitPlanIid) == 0) return static_cast<ember::IDeferredInitPlan*>(this);
  if (std::strcmp(iid, ember::kPipelineParallelIid) == 0 && mesh_ && mesh_->pipeline_size() > 1)
    return static_cast<ember::IPipelineParallel*>(this);
  return nullptr;
}

void ZeroStrategy::backward(const at::Tensor& loss, ember::IPrecision& precision, bool sync_gradients) {
  // Stage 1 keeps whole gradients until the updating micro-batch; stages 2 and 3 keep only
  // their shard, so every micro-batch reduce-scatters (offload: moves them to the host).
  reducer_.begin(o_.stage >= 2 || sync_gradients);
  try {
    precision.backward(loss);
  } catch (...) {
    reducer_.abandon();
    throw;
  }
  reducer_.end();
  if (sync_gradients) sum_sequence_parallel_gradients();
}

void ZeroStrategy::sum_sequence_parallel_gradients() {
  if (!summed_.empty()) {
    std::vector<at::Tensor> grads;
    for (const auto& p : table_.params)
      if (summed_.count(p.name) && p.shard.grad().defined() && p.shard.grad().numel() > 0) grads.push_back(p.shard.grad());
    // Offload's gradients are on the host: summed through the device (NCCL needs it).
    std::vector<at::Tensor> staged;
    for (const auto& g : grads) staged.push_back(g.device() == comm_.device() ? g : g.to(comm_.device()));
    sum_over_group(mesh_->tensor_parallel(), staged, "sequence-parallel gradients");
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < grads.size(); ++i)
      if (!staged[i].is_same(grads[i])) grads[i].copy_(staged[i]);
  }
}

bool ZeroStrategy::optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) {
  // A rank sees only its shard's gradients: the non-finite vote goes over every rank.
  VotingStep wrapped(step, comm_);
  const bool taken = precision.optimizer_step(wrapped);
  if (taken) ++stats_.steps;
  // Stages 1 and 2 keep whole parameters for the next forward: gather the updated shards
  // (offload: the updated masters, in the compute dtype).
  if (o_.stage < 3 && taken) gather_.gather_all_into_parameters();
  return taken;
}

at::Tensor ZeroStrategy::clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm) {
  auto grads = ember::grads_of(optimizer);
  if (algorithm == ember::ClipAlgorithm::value) return ember::clip_gradients_in_place(grads, max, algorithm);
  if (comm_.world() == 1) return ember::clip_gradients_norm_in_place(grads, max);
  const c10::Device where = grads.empty() ? comm_.device() : grads.front().device();
  auto options = at::TensorOptions().dtype(at::kDouble).device(where);
  at::Tensor sliced = at::zeros({1}, options), replicated = at::zeros({1}, options);
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      if (!t.grad().defined() || t.grad().numel() == 0) continue;
      if (pipeline_ && !pipeline_->counted_in_norm(t)) continue;  // a shared parameter: the first stage counts it
      const bool split = !tensor_parallel_.empty() && tensor_parallel_.count(table_.params[table_.param_of_shard.at(t.unsafeGetTensorImpl())].name);
      (split ? sliced : replicated) += t.grad().detach().to(at::kDouble).pow(2).sum();
    }
  at::Tensor total;
  if (tensor_parallel_.empty()) {
    // The shards of one copy of the model (every rank, or one replica under hybrid sharding).
    total = shard_group_.size > 1 ? sum_over(replicated, *shard_group_.backend, "gradient norm") : replicated;
  } else {
    if (replica_group_.size > 1 || pipeline_) {
      // Hybrid sharding: one replica's ranks (its shards x the tensor-parallel slices), not every
      // rank; pipeline stages: one stage's (the stages are summed below).
      if (shard_group_.size > 1) sliced = sum_over(sliced, *shard_group_.backend, "gradient norm (split parameters, shards)");
      total = sum_over(sliced, *mesh_->tensor_parallel().backend(), "gradient norm (split parameters, slices)");
    } else {
      total = sum_over(sliced, comm_.backend(), "gradient norm (split parameters)");
    }
    if (shard_group_.size > 1) total = total + sum_over(replicated, *shard_group_.backend, "gradient norm (replicated parameters)");
    else total = total + replicated.to(total.device());
  }
  // Pipeline stages: each holds other parameters.
  if (pipeline_) {
    total = total.to(comm_.device()).reshape({1}).contiguous();
    mesh_->pipeline().all_reduce(total, ember::ReduceOp::sum, "gradient norm (stages)");
  }
  total = total.to(where).sqrt();
  auto coef = (max / (total + 1e-6)).clamp_max(1.0);
  for (const auto& g : grads) g.mul_(coef.to(g.scalar_type()));
  return total.reshape({}).to(at::kFloat);
}

at::Tensor ZeroStrategy::reduce(const at::Tensor& value, ember::ReduceOp op) {
  if (op != ember::ReduceOp::sum || data_parallel_size() == world_size()) return comm_.reduce(value, op);
  at::Tensor t = value.detach().to(comm_.device(), /*non_blocking=*/false, /*copy=*/true).contiguous();
  mesh_->data_parallel().all_reduce(t, op, "metric reduction");
  return t.to(value.device());
}

void ZeroStrategy::teardown() {
  if (table_.units) {
    table_.units->set_unit_hooks(nullptr);
    table_.units = nullptr;
  }
  std::string line;
  if (ready_) {  // not after a set-up that failed
    // One rank runs no collective: its gathers are copies from the shards, and a group's
    // gradients are its part as they are.
    const bool alone = comm_.world() == 1;
    line = o_.name + ": stage " + std::to_string(o_.stage) + ", " + std::to_string(table_.groups.size()) + " groups, " +
           std::to_string(stats_.gathers) + (alone ? " weight fetches (" : " all-gathers (") + std::to_string(stats_.prefetched) +
           " prefetched), " + std::to_string(stats_.scatters) + (alone ? " gradient groups (" : " reduce-scatters (") +
           std::to_string(stats_.scatters_early) + (alone ? " ready" : " started") + " while backward was still running)";
    if (o_.offload)
      line += "; " + std::to_string(stats_.host_copies) + " gradient copies to the host (" + std::to_string(stats_.host_copies_early) +
              " while backward was still running, " + describe_bytes(stats_.host_bytes) + "), " + std::to_string(stats_.steps) +
              " host optimizer steps";
  }
  if (pipeline_) line += pipeline_->describe_stats();
  if (mesh_) mesh_->shutdown();
  comm_.teardown(line);
}

c10::IValue ZeroStrategy::state_dict() const {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("world_size", static_cast<int64_t>(comm_.world()));
  d.insert("stage", static_cast<int64_t>(o_.stage));
  return d;
}

void ZeroStrategy::load_state_dict(const c10::IValue& state) {
  if (!state.isGenericDict()) return;
  auto d = state.toGenericDict();
  if (d.contains("world_size") && d.at("world_size").toInt() != comm_.world())
    host_.log(ember::LogLevel::info, o_.name + ": the checkpoint was written by " + std::to_string(d.at("world_size").toInt()) +
                                         " ranks and is re-sharded onto " + std::to_string(comm_.world()) +
                                         "; each rank's share of the data differs from here on");
}

void ZeroStrategy::forward_begin(bool grad_enabled) {
  if (!pipeline_) buffers_.before_forward(*module_, comm_);  // each stage holds other buffers
  forward_grad_ = grad_enabled;
  if (o_.stage == 3)
    for (size_t g = 0; g < table_.groups.size(); ++g)
      if (table_.groups[g].unit < 0) gather_.materialize(g);
}

void ZeroStrategy::zero_grad() {
  for (auto& p : table_.params) {
    if (p.shard.grad().defined()) p.shard.mutable_grad() = at::Tensor();
    if (p.param.grad().defined()) p.param.mutable_grad() = at::Tensor();
  }
}

void ZeroStrategy::before_unit_forward(int64_t unit) {
  const size_t g = table_.group_of_unit(unit);
  if (g == kNone) return;
  gather_.materialize(g);
  if (o_.prefetch) gather_.prefetch_unit(unit + 1);
}

void ZeroStrategy::before_unit_backward(int64_t unit) {
  // The unit after this one has finished its backward (its input is this unit's output): a
  // unit with frozen parameters kept them for it (gradient_reducer.cpp) and lets them go now.
  // In a pipeline window no gradient is reduced before the window ends (pipeline_train_batch),
  // so nothing else lets the finished unit go.
  const size_t done = table_.group_of_unit(unit + 1);
  if (done != kNone && (table_.has_frozen(done) || in_pipeline_window_)) gather_.release(done);
  const size_t g = table_.group_of_unit(unit);
  if (g == kNone) return;
  gather_.materialize(g);
  if (o_.prefetch) gather_.prefetch_unit(unit - 1);
}

at::Tensor ZeroStrategy::sum_over(const at::Tensor& value, c10d::Backend& backend, const std::string& what) {
  comm_.label(what);
  std::vector<at::Tensor> v{value.to(comm_.device())};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  backend.allreduce(v, opts)->wait();
  return v.front();
}

// Pipeline stages under ZeRO: the stage's micro-batches add to whole gradients (stage 3 gathers
// each unit for its forward and again for its backward, and frees it after), and the window's
// gradients are reduce-scattered once, after its last batch: a stage's micro-batch backwards are
// interleaved with other stages' work, so none is the one to overlap the reduction with (stage 2
// thus keeps whole gradients during the window, as stage 1 does; FSDP with pipelines does the same
// with its gradient sync off until the last micro-batch).
at::Tensor ZeroStrategy::pipeline_train_batch(const ember::Batch& batch, ember::IModel&, ember::IStepContext& ctx,
                                              ember::IPrecision& precision, double loss_divisor, bool sync_gradients) {
  at::Tensor loss;
  in_pipeline_window_ = true;
  reducer_.begin(false);
  try {
    loss = pipeline_->runner().train(batch, pipeline_->model(), ctx, [&](const at::Tensor& l) {
      precision.backward(loss_divisor != 1.0 ? l / loss_divisor : l);
    });
    reducer_.end();
    in_pipeline_window_ = false;
    if (sync_gradients) {
      pipeline_->sum_shared_gradients();  // a tied embedding's copies on the first and last stage
      reducer_.begin(true);
      reducer_.end();  // every group reduce-scattered now, in order
      sum_sequence_parallel_gradients();
    }
  } catch (...) {
    in_pipeline_window_ = false;
    reducer_.abandon();
    throw;
  }
  return loss;
}

}  // namespace ember_shard
