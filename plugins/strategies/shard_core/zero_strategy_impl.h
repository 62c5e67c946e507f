// The ZeRO strategy's class: the IStrategy the `sharded` and `offload` plugins make
// (zero_strategy.h's make_zero_strategy), its parts and its state. zero_strategy.cpp holds the
// step, the gradient norm, the checkpoints and the closing statistics; zero_setup.cpp the set-up
// (launch and the device mesh, deferred initialisation, the pipeline cut and the tensor-parallel
// split, placing or offloading the shards, the optimizer).
#pragma once
#include "zero_strategy.h"

#include <ember/deferred_init.h>
#include <ember/model.h>
#include <ember/model_units.h>
#include <ember/pipeline.h>
#include <ember/tensor_parallel.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ember/distributed/deferred_parts.h>
#include <ember/distributed/device_mesh.h>
#include <ember/distributed/pipeline_state.h>

#include "gradient_reducer.h"
#include "host_offload.h"
#include "parameter_gather.h"
#include "shard_table.h"
#include "sharded_state_io.h"
#include "zero_context.h"

namespace ember_shard {

using ember_dist::BufferBroadcast;
using ember_dist::Communicator;
using ember_dist::DeferredParts;
using ember_dist::DeviceMesh;
using ember_dist::PipelineState;
using ember_dist::Subgroup;

class ZeroStrategy final : public ember::IStrategy,
                           public ember::IUnitHooks,
                           public ember::IDeviceMesh,
                           public ember::IDeferredInit,
                           public ember::IDeferredInitPlan,
                           public ember::IPipelineParallel,
                           public ember::IShardedModelState,
                           public ember::IShardedModelStateSelective {
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
  void* query_interface(const char* iid) override;

  // ---- ember::IDeferredInit: the model built piece by piece (docs/parallelism.md) ----
  // Only where a rank holds part of each parameter afterwards: stage 3 keeps its shard on the
  // device, offload its master on the host. Pipeline stages and tensor parallelism: which part of
  // a piece a rank keeps is known once the whole model's shapes are (the stage cut, the plan's
  // splits), so the model is built twice (IDeferredInitPlan below).
  bool begin_deferred_init(c10::ScalarType dtype) override;
  void parameters_initialised(torch::nn::Module& module) override { deferred_.take(module); }
  bool wants_shapes_pass() override { return deferred_.active() && deferred_.in_shapes_pass(); }
  // The shapes build parallelised as setup_module will parallelise the model: cut to this rank's
  // stages (the parameters still in it are the ones the second build keeps parts of) and split
  // by the tensor-parallel plan (its split parameters are kept as this rank's slice).
  void plan_from_shapes(ember::IModel& model) override;

  // ---- processes and the step ----
  bool launch(const ember::LaunchRequest& request, int* exit_code) override;
  // ---- ember::IDeviceMesh (before launch: one rank)
  int64_t data_parallel_rank() const override { return mesh_ ? mesh_->data_parallel_rank() : 0; }
  int64_t data_parallel_size() const override { return mesh_ ? mesh_->data_parallel_size() : 1; }
  int64_t tensor_parallel_rank() const override { return mesh_ ? mesh_->tensor_parallel_rank() : 0; }
  int64_t tensor_parallel_size() const override { return mesh_ ? mesh_->tensor_parallel_size() : 1; }
  // ---- ember::IPipelineParallel (answered when the mesh has pipeline stages): each stage's
  // parameters sharded over its data-parallel ranks (3D with tensor parallelism).
  void set_pipeline_options(const ember::PipelineOptions& options) override;
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

  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool sync_gradients) override;

  // Sequence parallelism: a norm's or bias's gradient is a partial sum on each tensor-parallel
  // rank; the peers hold the same shard of it (same data-parallel rank), so the shards are summed.
  void sum_sequence_parallel_gradients();

  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override;

  // Clipping by norm needs the norm over all shards: the local sum of squares is all-reduced. With
  // tensor parallelism the shards of a split parameter's slices add up over every rank, those of
  // a replicated parameter over the data-parallel ranks only (each tensor-parallel rank holds it).
  at::Tensor clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm) override;

  // A sum (a metric's total) counts each batch once: over the data-parallel ranks, whose
  // tensor-parallel peers and pipeline stages hold the same value; the other reductions go over
  // every rank.
  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp op) override;
  void barrier(const char* name) override { comm_.barrier(name); }
  bool broadcast_flag(bool value) override { return comm_.broadcast_flag(value); }
  at::Tensor broadcast(const at::Tensor& value, int64_t src) override { return comm_.broadcast(value, src); }

  void teardown() override;

  c10::IValue state_dict() const override;
  void load_state_dict(const c10::IValue& state) override;

  // ---- the model's state ----
  void setup_module(ember::IModel& model) override;
  std::shared_ptr<torch::optim::Optimizer> setup_optimizer(ember::IOptimizerFactory& factory) override;

  void forward_begin(bool grad_enabled) override;
  void forward_end() override {
    // Without a backward to come, what no unit holds is freed now; otherwise after backward.
    if (o_.stage == 3 && !forward_grad_) gather_.release_all();
  }

  void zero_grad() override;

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
    const int64_t read = io_.load_sharded_state(*module_, *optimizer_, saved_world, read_part);
    host_.log(ember::LogLevel::info, o_.name + ": read " + std::to_string(read) + " of the " + std::to_string(saved_world) +
                                         " parts of the sharded checkpoint (the others hold nothing this rank needs)");
    parameters_changed();
  }
  // IShardedModelState: the model alone ([model] init_checkpoint of a sharded directory).
  void load_sharded_model_state(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part) override {
    load_sharded_model_state_selective(saved_world, read_part, {});
  }
  // IShardedModelStateSelective: the same with [model] init_exclude's tensors keeping their values,
  // and what a plugin added to the model (LoRA) taken only where the parts hold it.
  void load_sharded_model_state_selective(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part,
                                          const std::function<ember::InitialTensor(const std::string&)>& pick) override {
    int64_t kept = 0;
    const int64_t read = io_.load_sharded_state(*module_, *optimizer_, saved_world, read_part, /*with_optimizer=*/false, pick, &kept);
    host_.log(ember::LogLevel::info, o_.name + ": read the model's part of " + std::to_string(read) + " of the " +
                                         std::to_string(saved_world) + " parts of the sharded checkpoint" +
                                         (kept > 0 ? " (" + std::to_string(kept) + " tensors it lacks keep their own values)" : std::string()));
    parameters_changed();
  }

  // ---- IUnitHooks (stage 3) ----
  void before_unit_forward(int64_t unit) override;
  void after_unit_forward(int64_t unit) override {
    const size_t g = table_.group_of_unit(unit);
    if (g != kNone) gather_.release(g);
  }
  void before_unit_backward(int64_t unit) override;

  // The ranks' verdict on the precision handler's non-finite flag: the maximum over ranks.

 private:
  ZeroContext context() { return ZeroContext{o_, comm_, shard_group_, replica_group_, copies_, budget_, stats_}; }
  // The sum over a group's ranks of a one-element double tensor.
  at::Tensor sum_over(const at::Tensor& value, c10d::Backend& backend, const std::string& what);
  void split_tensor_parallel(ember::IModel& model);
  // The model's plan, or ConfigError when it has none.
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

}  // namespace ember_shard
