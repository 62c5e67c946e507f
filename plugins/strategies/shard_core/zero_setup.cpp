// The ZeRO strategy's set-up (zero_strategy_impl.h): launch and the device mesh, deferred
// initialisation (the model taken piece by piece as it is built), the pipeline cut and the
// tensor-parallel split, the shards placed on the device or offloaded to the host, and the
// optimizer over them; and the plugins' options.
#include "zero_strategy_impl.h"

#include <ember/error.h>
#include <ember/support/grad_util.h>
#include <ember/support/optimizer_state_tensors.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstring>
#include <ember/support/tensor_parallel.h>

namespace ember_shard {

using namespace ember_dist;
using ember::state_tensors_per_element;

bool ZeroStrategy::begin_deferred_init(c10::ScalarType dtype) {
  if (!o_.deferred_init || (o_.stage < 3 && !o_.offload) || !mesh_) return false;
  deferred_.begin(dtype, shard_group_.rank, shard_group_.size);
  if (mesh_->pipeline_size() > 1 || mesh_->tensor_parallel_size() > 1) deferred_.begin_shapes_pass();
  return true;
}

void ZeroStrategy::plan_from_shapes(ember::IModel& model) {
  if (mesh_->pipeline_size() > 1) {
    if (!pipeline_) pipeline_ = std::make_unique<PipelineState>(*mesh_, ember::PipelineOptions{});  // an engine before SDK 2.6
    pipeline_->cut_shapes(model);  // ConfigError for a model that cannot be cut
  }
  std::vector<ember::TensorShard> slices;
  if (mesh_->tensor_parallel_size() > 1) slices = ember::tensor_parallel_plan_of(model, mesh_->tensor_parallel_size()).parallelize_tensors(mesh_->tensor_parallel());
  deferred_.end_shapes_pass(model, slices, mesh_->tensor_parallel_rank(), mesh_->tensor_parallel_size());
}

bool ZeroStrategy::launch(const ember::LaunchRequest& request, int* exit_code) {
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

void ZeroStrategy::set_pipeline_options(const ember::PipelineOptions& options) {
  const std::string degree = "parallelism.pipeline_parallel = " + std::to_string(mesh_->pipeline_size());
  if (!comm_.device().is_cpu())
    throw ember::ConfigError(options.where_pipeline_parallel + ": " + degree + " on " + comm_.device().str() +
                             ": pipeline stages exchange activations over Open MPI, on CPU ranks only so far (NCCL's paired "
                             "send/receive is not built); set trainer.accelerator = \"cpu\" or pipeline_parallel = 1");
  pipeline_ = std::make_unique<PipelineState>(*mesh_, options);
}

// 2D: the model, whole and equal on every rank (rank 0's weights), keeps each rank's
// tensor-parallel slices; ZeRO then shards those slices over the data-parallel ranks, and whole
// checkpoints are made from (and cut into) slices around the shards' own gathering.
void ZeroStrategy::split_tensor_parallel(ember::IModel& model) {
  const int64_t tp = mesh_->tensor_parallel_size();
  auto* plan = &ember::tensor_parallel_plan_of(model, tp);
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
  return new ZeroStrategy(host, cfg, std::move(options));
}

}  // namespace ember_shard
