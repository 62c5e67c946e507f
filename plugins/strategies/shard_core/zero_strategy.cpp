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
// model is built) and PipelineState (the model cut into pipeline stages). This file ties them to
// the strategy contract (set-up, the step's non-finite vote, clipping across shards, the closing
// statistics).
#include "zero_strategy.h"

#include <ember/deferred_init.h>
#include <ember/error.h>
#include <ember/support/grad_util.h>
#include <ember/model.h>
#include <ember/model_units.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include <ember/distributed/device_mesh.h>
#include <ember/distributed/pipeline_state.h>
#include <ember/pipeline.h>
#include <ember/support/tensor_parallel.h>
#include <ember/tensor_parallel.h>

#include <ember/distributed/deferred_parts.h>
#include "gradient_reducer.h"
#include "host_offload.h"
#include <ember/support/optimizer_state_tensors.h>
#include "parameter_gather.h"
#include "shard_table.h"
#include "sharded_state_io.h"
#include "zero_context.h"

namespace ember_shard {
namespace {

using namespace ember_dist;
using ember::state_tensors_per_element;

class ZeroStrategy final : public ember::IStrategy,
                           public ember::IUnitHooks,
                           public ember::IDeviceMesh,
                           public ember::IDeferredInit,
                           public ember::IDeferredInitPlan,
                           public ember::IPipelineParallel {
 public:
  ZeroStrategy(ember::IHost& host, const ember::IConfig& cfg, ZeroOptions o)
      : host_(host),
        comm_(o.name, host, cfg),
        o_(std::move(o)),
        buffers_(o_.broadcast_buffers),
        copies_(c10::Device(c10::kCPU), false),
        budget_(o_),
        gather_(table_, context()),
        reducer_(table_, context(), gather_),
        io_(table_, context()) {}

  // The model may be gone by now (plugins are destroyed in reverse order of their kinds): the
  // unit hooks were taken back in teardown().
  ~ZeroStrategy() override { teardown(); }

  // Checkpoints as one part per rank (sharded_state below), read at any world size. A device
  // mesh: sharded (or offloaded) over the data-parallel ranks x tensor parallel.
  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kShardedCheckpointsIid) == 0) return this;
    if (std::strcmp(iid, ember::kDeviceMeshIid) == 0) return static_cast<ember::IDeviceMesh*>(this);
    if (std::strcmp(iid, ember::kDeferredInitIid) == 0) return static_cast<ember::IDeferredInit*>(this);
    if (std::strcmp(iid, ember::kDeferredInitPlanIid) == 0) return static_cast<ember::IDeferredInitPlan*>(this);
    if (std::strcmp(iid, ember::kPipelineParallelIid) == 0 && mesh_ && mesh_->pipeline_size() > 1)
      return static_cast<ember::IPipelineParallel*>(this);
    return nullptr;
  }

  // ---- ember::IDeferredInit: the model built piece by piece (docs/parallelism.md) ----
  // Only where a rank holds part of each parameter afterwards: stage 3 keeps its shard on the
  // device, offload its master on the host. Pipeline stages and tensor parallelism: which part of
  // a piece a rank keeps is known once the whole model's shapes are (the stage cut, the plan's
  // splits), so the model is built twice (IDeferredInitPlan below).
  bool begin_deferred_init(c10::ScalarType dtype) override {
    if (!o_.deferred_init || (o_.stage < 3 && !o_.offload) || !mesh_) return false;
    deferred_.begin(dtype, shard_group_.rank, shard_group_.size);
    if (mesh_->pipeline_size() > 1 || mesh_->tensor_parallel_size() > 1) deferred_.begin_shapes_pass();
    return true;
  }
  void parameters_initialised(torch::nn::Module& module) override { deferred_.take(module); }
  bool wants_shapes_pass() override { return deferred_.active() && deferred_.in_shapes_pass(); }
  // The shapes build parallelised as setup_module will parallelise the model: cut to this rank's
  // stages (the parameters still in it are the ones the second build keeps parts of) and split
  // by the tensor-parallel plan (its split parameters are kept as this rank's slice).
  void plan_from_shapes(ember::IModel& model) override {
    if (mesh_->pipeline_size() > 1) {
      if (!pipeline_) pipeline_ = std::make_unique<PipelineState>(*mesh_, ember::PipelineOptions{});  // an engine before SDK 2.6
      pipeline_->cut_shapes(model);  // ConfigError for a model that cannot be cut
    }
    std::vector<ember::TensorShard> slices;
    if (mesh_->tensor_parallel_size() > 1) slices = tensor_parallel_plan(model).parallelize_tensors(mesh_->tensor_parallel());
    deferred_.end_shapes_pass(model, slices, mesh_->tensor_parallel_rank(), mesh_->tensor_parallel_size());
  }

  // ---- processes and the step ----
  bool launch(const ember::LaunchRequest& request, int* exit_code) override {
    const bool go_on = comm_.launch(request, exit_code);
    if (!go_on) return false;
    copies_ = HostCopies(comm_.device(), o_.pin_memory);
    mesh_ = std::make_unique<DeviceMesh>(comm_, request);
    auto& shards = mesh_->data_parallel_shard();
    auto& replicas = mesh_->data_parallel_replicate();
    shard_group_ = Subgroup{shards.backend(), static_cast<int>(shards.rank()), static_cast<int>(shards.size())};
    replica_group_ = Subgroup{replicas.backend(), static_cast<int>(replicas.rank()), static_cast<int>(replicas.size())};
    if (replica_group_.size > 1)
      host_.log(ember::LogLevel::info, o_.name + ": hybrid sharding, device mesh " + mesh_->describe() + ": each of the " +
                                           std::to_string(replica_group_.size) + " replicas shards the model over " +
                                           std::to_string(shard_group_.size) + " ranks; rank " + std::to_string(comm_.rank()) +
                                           " is replica " + std::to_string(replica_group_.rank) + ", shard " + std::to_string(shard_group_.rank));
    auto& data = mesh_->data_parallel();
    if (mesh_->tensor_parallel_size() > 1 || mesh_->pipeline_size() > 1)
      host_.log(ember::LogLevel::info, o_.name + ": device mesh " + mesh_->describe() + " (sharded over the data-parallel ranks); rank " +
                                           std::to_string(comm_.rank()) + " is data-parallel rank " + std::to_string(data.rank()) +
                                           ", tensor-parallel rank " + std::to_string(mesh_->tensor_parallel_rank()) +
                                           (mesh_->pipeline_size() > 1 ? ", pipeline rank " + std::to_string(mesh_->pipeline_rank()) : ""));
    return true;
  }
  // ---- ember::IDeviceMesh (before launch: one rank)
  int64_t data_parallel_rank() const override { return mesh_ ? mesh_->data_parallel_rank() : 0; }
  int64_t data_parallel_size() const override { return mesh_ ? mesh_->data_parallel_size() : 1; }
  int64_t tensor_parallel_rank() const override { return mesh_ ? mesh_->tensor_parallel_rank() : 0; }
  int64_t tensor_parallel_size() const override { return mesh_ ? mesh_->tensor_parallel_size() : 1; }
  // ---- ember::IPipelineParallel (answered when the mesh has pipeline stages): each stage's
  // parameters sharded over its data-parallel ranks (3D with tensor parallelism).
  void set_pipeline_options(const ember::PipelineOptions& options) override {
    const std::string degree = "parallelism.pipeline_parallel = " + std::to_string(mesh_->pipeline_size());
    if (!comm_.device().is_cpu())
      throw ember::ConfigError(options.where_pipeline_parallel + ": " + degree + " on " + comm_.device().str() +
                               ": pipeline stages exchange activations over Open MPI, on CPU ranks only so far (NCCL's paired "
                               "send/receive is not built); set trainer.accelerator = \"cpu\" or pipeline_parallel = 1");
    pipeline_ = std::make_unique<PipelineState>(*mesh_, options);
  }
  int64_t pipeline_rank() const override { return mesh_ ? mesh_->pipeline_rank() : 0; }
  int64_t pipeline_size() const override { return mesh_ ? mesh_->pipeline_size() : 1; }
  at::Tensor pipeline_train_batch(const ember::Batch& batch, ember::IModel& model, ember::IStepContext& ctx, ember::IPrecision& precision,
                                  double loss_divisor, bool sync_gradients) override;
  at::Tensor pipeline_evaluate_batch(const ember::Batch& batch, ember::IModel&, ember::IStepContext& ctx) override {
    return pipeline_->runner().evaluate(batch, pipeline_->model(), ctx);
  }

  c10::Device root_device() const override { return comm_.device(); }
  int64_t rank() const override { return comm_.rank(); }
  int64_t world_size() const override { return comm_.world(); }
  int64_t local_rank() const override { return comm_.info().local_rank; }

  ember::Batch batch_to_device(ember::Batch batch) override { return comm_.batch_to_device(std::move(batch)); }

  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool sync_gradients) override {
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

  // Sequence parallelism: a norm's or bias's gradient is a partial sum on each tensor-parallel
  // rank; the peers hold the same shard of it (same data-parallel rank), so the shards are summed.
  void sum_sequence_parallel_gradients() {
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

  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override {
    // A rank sees only its shard's gradients: the non-finite vote goes over every rank.
    VotingStep wrapped(step, comm_);
    const bool taken = precision.optimizer_step(wrapped);
    if (taken) ++stats_.steps;
    // Stages 1 and 2 keep whole parameters for the next forward: gather the updated shards
    // (offload: the updated masters, in the compute dtype).
    if (o_.stage < 3 && taken) gather_.gather_all_into_parameters();
    return taken;
  }

  // Clipping by norm needs the norm over all shards: the local sum of squares is all-reduced. With
  // tensor parallelism the shards of a split parameter's slices add up over every rank, those of
  // a replicated parameter over the data-parallel ranks only (each tensor-parallel rank holds it).
  at::Tensor clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm) override {
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

  // A sum (a metric's total) counts each batch once: over the data-parallel ranks, whose
  // tensor-parallel peers and pipeline stages hold the same value; the other reductions go over
  // every rank.
  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp op) override {
    if (op != ember::ReduceOp::sum || data_parallel_size() == world_size()) return comm_.reduce(value, op);
    at::Tensor t = value.detach().to(comm_.device(), /*non_blocking=*/false, /*copy=*/true).contiguous();
    mesh_->data_parallel().all_reduce(t, op, "metric reduction");
    return t.to(value.device());
  }
  void barrier(const char* name) override { comm_.barrier(name); }
  bool broadcast_flag(bool value) override { return comm_.broadcast_flag(value); }
  at::Tensor broadcast(const at::Tensor& value, int64_t src) override { return comm_.broadcast(value, src); }

  void teardown() override {
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

  c10::IValue state_dict() const override {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("world_size", static_cast<int64_t>(comm_.world()));
    d.insert("stage", static_cast<int64_t>(o_.stage));
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (!state.isGenericDict()) return;
    auto d = state.toGenericDict();
    if (d.contains("world_size") && d.at("world_size").toInt() != comm_.world())
      host_.log(ember::LogLevel::info, o_.name + ": the checkpoint was written by " + std::to_string(d.at("world_size").toInt()) +
                                           " ranks and is re-sharded onto " + std::to_string(comm_.world()) +
                                           "; each rank's share of the data differs from here on");
  }

  // ---- the model's state ----
  void setup_module(ember::IModel& model) override;
  std::shared_ptr<torch::optim::Optimizer> setup_optimizer(ember::IOptimizerFactory& factory) override;

  void forward_begin(bool grad_enabled) override {
    if (!pipeline_) buffers_.before_forward(*module_, comm_);  // each stage holds other buffers
    forward_grad_ = grad_enabled;
    if (o_.stage == 3)
      for (size_t g = 0; g < table_.groups.size(); ++g)
        if (table_.groups[g].unit < 0) gather_.materialize(g);
  }
  void forward_end() override {
    // Without a backward to come, what no unit holds is freed now; otherwise after backward.
    if (o_.stage == 3 && !forward_grad_) gather_.release_all();
  }

  void zero_grad() override {
    for (auto& p : table_.params) {
      if (p.shard.grad().defined()) p.shard.mutable_grad() = at::Tensor();
      if (p.param.grad().defined()) p.param.mutable_grad() = at::Tensor();
    }
  }

  std::vector<ember::NamedTensor> trained_parameters() override {
    std::vector<ember::NamedTensor> out;
    for (const auto& p : table_.params) out.push_back({p.name, p.shard});
    return out;
  }
  void parameters_changed() override {
    if (o_.stage < 3) gather_.gather_all_into_parameters();
    else gather_.release_all();
  }

  // Under pipeline parallelism each stage's whole tensors (gathered from its shards and slices)
  // are merged in the whole model's order.
  c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only) override {
    if (!pipeline_) return io_.full_model_state(*module_, !rank0_only || comm_.rank() == 0);
    const bool part = !rank0_only || (data_parallel_rank() == 0 && tensor_parallel_rank() == 0);
    return pipeline_->merge_model_state(io_.full_model_state(*module_, part), !rank0_only || comm_.rank() == 0, !rank0_only);
  }
  void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) override {
    io_.load_full_model_state(*module_, state);
    parameters_changed();
  }
  std::string full_optimizer_state(bool rank0_only) override {
    if (!pipeline_) return io_.full_optimizer_state(*optimizer_, rank0_only);
    return pipeline_->full_optimizer_state(*optimizer_, !rank0_only || comm_.rank() == 0, !rank0_only,
                                           [this](const at::Tensor& shard, const at::Tensor& field) { return io_.whole_field(shard, field); });
  }
  void load_full_optimizer_state(const std::string& bytes) override {
    if (!pipeline_) return io_.load_full_optimizer_state(*optimizer_, bytes);
    pipeline_->load_full_optimizer_state(*optimizer_, bytes,
                                         [this](const at::Tensor& shard, const at::Tensor& whole) { return io_.part_of_field(shard, whole); });
  }

  // ---- sharded checkpoints ----
  bool sharded_checkpoints() const override { return o_.sharded_checkpoints; }
  c10::IValue sharded_state() override { return io_.sharded_state(*module_, *optimizer_); }
  void load_sharded_state(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part) override {
    io_.load_sharded_state(*module_, *optimizer_, saved_world, read_part);
    parameters_changed();
  }

  // ---- IUnitHooks (stage 3) ----
  void before_unit_forward(int64_t unit) override {
    const size_t g = table_.group_of_unit(unit);
    if (g == kNone) return;
    gather_.materialize(g);
    if (o_.prefetch) gather_.prefetch_unit(unit + 1);
  }
  void after_unit_forward(int64_t unit) override {
    const size_t g = table_.group_of_unit(unit);
    if (g != kNone) gather_.release(g);
  }
  void before_unit_backward(int64_t unit) override {
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

  // The ranks' verdict on the precision handler's non-finite flag: the maximum over ranks.

 private:
  ZeroContext context() { return ZeroContext{o_, comm_, shard_group_, replica_group_, copies_, budget_, stats_}; }
  // The sum over a group's ranks of a one-element double tensor.
  at::Tensor sum_over(const at::Tensor& value, c10d::Backend& backend, const std::string& what) {
    comm_.label(what);
    std::vector<at::Tensor> v{value.to(comm_.device())};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    backend.allreduce(v, opts)->wait();
    return v.front();
  }
  void split_tensor_parallel(ember::IModel& model);
  // The model's plan, or ConfigError when it has none.
  ember::ITensorParallelModel& tensor_parallel_plan(ember::IModel& model);
  void cut_pipeline_stages(ember::IModel& model);
  // Rank 0's whole model (parameters and buffers) to every rank, before it is cut or split.
  void broadcast_whole_model();
  // Rank 0's parameters (those built whole) and buffers to every rank.
  void broadcast_initial_state();
  void place_parameters();
  void offload_parameters();

  ember::IHost& host_;
  Communicator comm_;
  std::unique_ptr<DeviceMesh> mesh_;
  Subgroup shard_group_;    // what the shards are cut over: the data-parallel ranks (of one replica)
  Subgroup replica_group_;  // hybrid sharding: the ranks holding this rank's shard in the other replicas
  std::map<std::string, ember::TensorShard> tensor_parallel_;  // the split parameters, by name
  std::set<std::string> summed_;  // kSummedGradient: gradients summed over the tensor-parallel ranks
  ZeroOptions o_;
  BufferBroadcast buffers_;
  HostCopies copies_;
  HostBudget budget_;
  ZeroStats stats_;
  ShardTable table_;
  ParameterGather gather_;
  GradientReducer reducer_;
  ShardedStateIO io_;
  torch::nn::Module* module_ = nullptr;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  bool forward_grad_ = false, ready_ = false, broadcast_done_ = false, buffers_done_ = false;
  DeferredParts deferred_;  // the model's parts taken while it was built (deferred initialisation)
  std::unique_ptr<PipelineState> pipeline_;  // the model cut into stages (pipeline_parallel > 1)
  bool in_pipeline_window_ = false;
};

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


// 2D: the model, whole and equal on every rank (rank 0's weights), keeps each rank's
// tensor-parallel slices; ZeRO then shards those slices over the data-parallel ranks, and whole
// checkpoints are made from (and cut into) slices around the shards' own gathering.
ember::ITensorParallelModel& ZeroStrategy::tensor_parallel_plan(ember::IModel& model) {
  auto* plan = static_cast<ember::ITensorParallelModel*>(model.query_interface(ember::kTensorParallelModelIid));
  if (!plan)
    throw ember::ConfigError("parallelism.tensor_parallel = " + std::to_string(mesh_->tensor_parallel_size()) +
                             ": the model has no tensor-parallel plan (it does not implement ember::ITensorParallelModel); set "
                             "tensor_parallel = 1, or use a model that has one (transformer; docs/parallelism.md)");
  return *plan;
}

void ZeroStrategy::split_tensor_parallel(ember::IModel& model) {
  const int64_t tp = mesh_->tensor_parallel_size();
  auto* plan = &tensor_parallel_plan(model);
  broadcast_whole_model();
  // Deferred initialisation: the pieces taken as the model was built have no storage (this rank
  // kept its chunk of its slice of each); the plan's ember::keep_shard gives them the slices'
  // shapes, still without storage, before the shards are laid out.
  auto& group = mesh_->tensor_parallel();
  const int64_t whole = parameter_elements(*module_);
  for (auto& s : plan->parallelize_tensors(group)) {
    if (s.dim == ember::kSummedGradient) summed_.insert(s.name);
    else tensor_parallel_.emplace(s.name, s);
  }
  host_.log(ember::LogLevel::info, describe_split(o_.name, tensor_parallel_.size(), summed_.size(), whole, *module_));
  ShardedStateIO::TensorParallelSlicing slicing;
  slicing.to_whole = [this, &group](const std::string& name, const at::Tensor& slice) {
    auto it = tensor_parallel_.find(name);
    if (it == tensor_parallel_.end()) return slice;
    return ember::whole_of(group.all_gather(slice).unbind(0), it->second);
  };
  slicing.to_slice = [this, &group](const std::string& name, const at::Tensor& whole) {
    auto it = tensor_parallel_.find(name);
    if (it == tensor_parallel_.end()) return whole;
    return ember::shard_of(whole, it->second, group.rank(), group.size()).contiguous();
  };
  slicing.splits = tensor_parallel_;
  slicing.rank = group.rank();
  slicing.size = tp;
  io_.set_tensor_parallel(std::move(slicing));
}

void ZeroStrategy::broadcast_whole_model() {
  if (broadcast_done_) return;
  if (o_.offload || deferred_.active()) {
    // Offload keeps the whole model off the device: rank 0's weights (and buffers) travel one
    // tensor at a time (through the device, for NCCL) into the host module. A parameter taken
    // while the model was built has no storage (every rank built the same values: checked at
    // set-up), so it is not sent.
    at::NoGradGuard no_grad;
    int i = 0;
    for (auto& t : module_->parameters()) {
      if (deferred_.taken(t)) {
        ++i;
        continue;
      }
      at::Tensor staged = t.detach().to(comm_.device()).clone();
      comm_.broadcast_from_zero(staged, "initial parameter " + std::to_string(i++));
      t.detach().copy_(staged);
    }
    i = 0;
    for (auto& b : module_->buffers()) {
      at::Tensor staged = b.detach().to(comm_.device()).clone();
      comm_.broadcast_from_zero(staged, "initial buffer " + std::to_string(i++));
      b.detach().copy_(staged);
    }
  } else {
    module_->to(comm_.device());
    comm_.broadcast_module_from_zero(*module_);
  }
  broadcast_done_ = buffers_done_ = true;
}

// 3D: the whole model, equal on every rank, keeps this rank's pipeline stages (then its
// tensor-parallel slices of them); ZeRO shards what is left over the stage's data-parallel ranks.
void ZeroStrategy::cut_pipeline_stages(ember::IModel& model) {
  if (!pipeline_) pipeline_ = std::make_unique<PipelineState>(*mesh_, ember::PipelineOptions{});  // an engine before SDK 2.6
  broadcast_whole_model();  // before the cut: afterwards each stage holds other tensors
  pipeline_->cut(model, o_.name, host_);
  // A sharded checkpoint part keeps the optimizer's layout over the whole model, so it loads on
  // any stage of any mesh.
  io_.set_pipeline({mesh_->pipeline_rank(),
                    [this](torch::optim::Optimizer& optimizer) { return pipeline_->optimizer_over_whole_model(optimizer); },
                    [this](torch::optim::Optimizer& optimizer, const std::string& bytes) {
                      pipeline_->load_full_optimizer_state(optimizer, bytes, [](const at::Tensor&, const at::Tensor& field) { return field; });
                    }});
  if (buffers_.enabled() && !module_->buffers().empty())
    throw ember::ConfigError(o_.where_broadcast_buffers + ": " + o_.name + ".broadcast_buffers = true with pipeline stages: each stage "
                             "holds other buffers, so rank 0's cannot be broadcast; set broadcast_buffers = false");
}

void ZeroStrategy::setup_module(ember::IModel& model) {
  module_ = &model.module();
  std::vector<ember::UnitRange> stages;
  if (mesh_->pipeline_size() > 1) {
    cut_pipeline_stages(model);
    stages = pipeline_->my_stages();
  }
  if (mesh_->tensor_parallel_size() > 1) split_tensor_parallel(model);
  table_.build(*module_, model, o_, pipeline_ ? &stages : nullptr);
  table_.lay_out(shard_group_.rank, shard_group_.size);
  if (deferred_.active()) {
    std::vector<at::Tensor> params;
    for (const auto& p : table_.params) params.push_back(p.param);
    host_.log(ember::LogLevel::info, deferred_.check(params, comm_, o_.name));
  }
  if (o_.offload) offload_parameters();
  else place_parameters();
  deferred_.clear();  // the parts are the shards now
  for (auto& p : table_.params) p.shard.set_requires_grad(p.trainable);
  table_.index_shards();
  reducer_.hook_gradients(o_.name);
  if (o_.stage == 3) {
    gather_.release_all();
    if (table_.units) table_.units->set_unit_hooks(this);
  } else if (o_.offload) {
    gather_.gather_all_into_parameters();  // the compute-dtype weights from the masters
  }
  int64_t total = 0, mine = 0;
  for (const auto& p : table_.params) {
    total += p.numel;
    mine += p.valid;
  }
  std::string where = o_.offload ? "; masters, gradients and optimizer state in " + std::string(copies_.pinned() ? "pinned " : "") +
                                       "host memory (" + describe_bytes(budget_.taken()) + " so far), weights on " + comm_.device().str() +
                                       " in " + std::string(c10::toString(table_.params.front().param.scalar_type())) +
                                       (o_.stage == 3 ? ", one unit at a time" : "")
                                 : "";
  host_.log(ember::LogLevel::info, o_.name + ": stage " + std::to_string(o_.stage) + ", " + std::to_string(table_.params.size()) +
                                       " parameters in " + std::to_string(table_.groups.size()) + " groups (" +
                                       std::to_string(table_.unit_group.size()) + " units declared by the model); this rank trains " +
                                       std::to_string(mine) + " of " + std::to_string(total) + " elements" + where);
}

void ZeroStrategy::broadcast_initial_state() {
  if (comm_.world() == 1) return;
  at::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : table_.params)
    if (!deferred_.holds(p.param)) comm_.broadcast_from_zero(p.param, "initial parameter '" + p.name + "'");
  for (auto& b : module_->buffers()) comm_.broadcast_from_zero(b, "initial buffer " + std::to_string(i++));
}

// Sharded: the module moves to the device whole; stages 1-2 train a view into each parameter (no
// second copy), stage 3 a part of its own (the parameter is freed). A parameter taken while the
// model was built has no storage: it gets one on the device, freed again (stage 3 gathers it).
void ZeroStrategy::place_parameters() {
  for (auto& p : table_.params)
    if (deferred_.holds(p.param) && p.param.device() != comm_.device()) {
      p.param.set_data(at::empty(p.shape, p.param.options().device(comm_.device())));
      free_storage(p.param);
    }
  module_->to(comm_.device());
  // Every rank starts from rank 0's weights and buffers (already, when tensor parallelism split them).
  if (!broadcast_done_) broadcast_initial_state();
  at::NoGradGuard no_grad;
  for (auto& p : table_.params) {
    if (deferred_.holds(p.param)) {
      p.shard = deferred_.hand_over(p.param, p.name).to(comm_.device());
      continue;
    }
    at::Tensor part = ShardTable::my_part(p, p.param.detach(), shard_group_.rank);
    p.shard = o_.stage < 3 ? part : part.clone();
  }
}

// Offload: this rank's part of each parameter becomes an fp32 (fp64 under fp64 precision) master in
// host memory, with an fp32 gradient buffer; the module's parameters are replaced by compute-dtype
// tensors on the device (left empty here: filled from the masters, or freed under stage 3), so the
// whole model never has to fit on the device at once.
void ZeroStrategy::offload_parameters() {
  const c10::Device device = comm_.device();
  auto master_dtype = [](const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; };
  int64_t need = 0;
  for (const auto& p : table_.params) {
    if (!at::isFloatingType(p.param.scalar_type()))
      throw ember::RunError(o_.name + ": parameter '" + p.name + "' is not floating point (" + c10::toString(p.param.scalar_type()) +
                            "); only floating-point parameters can be offloaded");
    const int64_t master = p.valid * static_cast<int64_t>(c10::elementSize(master_dtype(p.param)));
    need += 2 * master;  // master + gradient
  }
  budget_.take(need, "the " + std::to_string(table_.params.size()) + " master weights and their gradients");
  at::NoGradGuard no_grad;
  for (auto& p : table_.params) {
    at::Tensor whole = p.param.detach();
    // Every rank starts from rank 0's weights (through the device: NCCL); a part taken while the
    // model was built is already this rank's.
    if (comm_.world() > 1 && !broadcast_done_ && !deferred_.holds(p.param)) {
      whole = whole.to(device).clone();
      comm_.broadcast_from_zero(whole, "initial parameter '" + p.name + "'");
    }
    const auto mdt = master_dtype(p.param);
    p.shard = copies_.host_zeros(p.valid, mdt, "the master weights of '" + p.name + "'");
    p.shard.copy_(deferred_.holds(p.param) ? deferred_.hand_over(p.param, p.name) : ShardTable::my_part(p, whole, shard_group_.rank));
    p.host_grad = copies_.host_zeros(p.valid, mdt, "the gradient of '" + p.name + "'");
    const auto dtype = o_.compute_dtype.value_or(p.param.scalar_type());
    p.param.set_data(at::empty(p.shape, p.param.options().device(device).dtype(dtype)));
    if (o_.stage == 3) free_storage(p.param);
  }
  for (auto& b : module_->buffers()) b.set_data(b.to(device));
  int i = 0;
  if (!buffers_done_)
    for (auto& b : module_->buffers()) comm_.broadcast_from_zero(b, "initial buffer " + std::to_string(i++));
  // Stage 3 frees parameters: everything gathered starts released.
  for (auto& grp : table_.groups) grp.materialized = o_.stage < 3;
}

std::shared_ptr<torch::optim::Optimizer> ZeroStrategy::setup_optimizer(ember::IOptimizerFactory& factory) {
  std::vector<ember::NamedTensor> named;
  for (const auto& p : table_.params) named.push_back({p.name, p.shard});
  optimizer_ = factory.build(named);
  for (auto& group : optimizer_->param_groups())
    for (auto& t : group.params())
      if (!table_.param_of_shard.count(t.unsafeGetTensorImpl()))
        throw ember::RunError(o_.name + ": the optimizer holds a tensor that is not one of this strategy's shards (a bug)");
  if (pipeline_) pipeline_->set_optimizer(*optimizer_, named);
  if (o_.offload) {
    // The optimizer creates its state on the first step: make sure the host has room for it now.
    int64_t need = 0;
    for (auto& group : optimizer_->param_groups())
      for (auto& t : group.params())
        need += state_tensors_per_element(group) * t.numel() * static_cast<int64_t>(t.element_size());
    budget_.take(need, "the optimizer state");
  }
  ready_ = true;
  return optimizer_;
}

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg, ZeroOptions o) { return new ZeroStrategy(host, cfg, std::move(o)); }

}  // namespace

ZeroOptions read_zero_options(std::string name, const ember::IConfig& cfg) {
  ZeroOptions o;
  o.name = std::move(name);
  o.bucket_cap_bytes = std::max<int64_t>(1, static_cast<int64_t>(cfg.get_float("bucket_cap_mb") * 1024.0 * 1024.0));
  o.prefetch = cfg.get_bool("prefetch");
  o.min_unit_params = cfg.get_int("auto_wrap_min_params");
  o.broadcast_buffers = cfg.get_bool("broadcast_buffers");
  o.sharded_checkpoints = cfg.get_string("state_dict_type") == "sharded";
  o.where_state_dict_type = cfg.where("state_dict_type");
  o.where_broadcast_buffers = cfg.where("broadcast_buffers");
  o.deferred_init = cfg.get_bool("deferred_init");
  return o;
}

ember::IStrategy* make_zero_strategy(ember::IHost& host, const ember::IConfig& cfg, ZeroOptions options) {
  return make(host, cfg, std::move(options));
}

}  // namespace ember_shard
