// ddp: multi-process data parallel on LibTorch's c10d. One rank per device; gradients are
// all-reduced in buckets while backward runs (grad_buckets.h); ranks come from the local
// launcher (trainer.devices = N), torchrun, mpirun or srun, and talk through NCCL on GPUs or
// Open MPI on CPUs (sdk/distributed: Ember::distributed, docs/decisions.md). With
// [parallelism] tensor_parallel = T > 1 the ranks form a device mesh (data parallel x tensor
// parallel): the model's own plan splits its layers over T consecutive ranks, which see the same
// batch, and gradients are averaged over the data-parallel ranks only. With pipeline_parallel =
// P > 1 the model is also cut into P stages (or P x virtual_stages) at its units, and ddp owns
// the micro-batch window: each batch runs through the stages on the schedule (ember/distributed/pipeline_state.h;
// docs/parallelism.md).
#include <ember/error.h>
#include <ember/plugin.h>
#include <ember/support/replicating_strategy.h>
#include <ember/strategy.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <ember/distributed/communicator.h>
#include <ember/deferred_init.h>
#include <ember/distributed/deferred_parts.h>
#include <ember/distributed/device_mesh.h>
#include <ember/distributed/pipeline_state.h>
#include <ember/model.h>
#include <ember/pipeline.h>
#include <ember/tensor_parallel.h>
#include <ember/support/grad_util.h>
#include <ember/support/tensor_parallel.h>

#include <algorithm>
#include <cstring>

#include "grad_buckets.h"
#include "tensor_parallel_state.h"

namespace {

using namespace ember_dist;
using ember_ddp::GradBuckets;
using ember_ddp::TensorParallelState;

constexpr EmberConfigKey kKeys[] = {
    EMBER_DIST_CONFIG_KEYS,
    ember::key::Float("bucket_cap_mb", "25.0",
                      "Gradients are all-reduced in buckets of about this many megabytes, each starting as soon as its gradients are ready.")
        .above(0.0),
    ember::key::Bool("find_unused_parameters", "false",
                     "PyTorch DDP's flag: a parameter that no rank used in a step keeps no gradient (so the optimizer and "
                     "weight decay leave it alone), at the cost of reading a small mask back each step; false: a parameter "
                     "without a gradient is an error naming it."),
    ember::key::Bool("deferred_init", "true",
                     "Under pipeline stages or tensor parallelism: take the model piece by piece as it is built (built once for "
                     "its shapes first) and keep only this rank's stages and its slices of split parameters, so no rank holds the "
                     "whole model (ember/deferred_init.h). Every rank builds "
                     "the same values from the seed (checked once at set-up) instead of taking rank 0's."),
    ember::key::Bool("broadcast_buffers", "true",
                     "Every rank takes rank 0's buffers (batch-norm statistics) before each forward in training mode, and once before "
                     "evaluating after one (PyTorch DDP's broadcast_buffers), so all ranks evaluate with the same statistics."),
};

class Ddp final : public ember::ReplicatingStrategy,
                  public ember::IDeviceMesh,
                  public ember::IPipelineParallel,
                  public ember::IDeferredInit,
                  public ember::IDeferredInitPlan {
 public:
  Ddp(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        comm_("ddp", host, cfg),
        bucket_cap_bytes_(static_cast<int64_t>(cfg.get_float("bucket_cap_mb") * 1024.0 * 1024.0)),
        find_unused_(cfg.get_bool("find_unused_parameters")),
        deferred_init_(cfg.get_bool("deferred_init")),
        buffers_(cfg.get_bool("broadcast_buffers")),
        where_broadcast_buffers_(cfg.where("broadcast_buffers")) {
    if (bucket_cap_bytes_ < 1) bucket_cap_bytes_ = 1;
  }

  ~Ddp() override { teardown(); }

  bool launch(const ember::LaunchRequest& request, int* exit_code) override {
    if (!comm_.launch(request, exit_code)) return false;
    mesh_ = std::make_unique<DeviceMesh>(comm_, request);
    if (mesh_->tensor_parallel_size() > 1 || mesh_->pipeline_size() > 1)
      host_.log(ember::LogLevel::info, "ddp: device mesh " + mesh_->describe() + "; rank " + std::to_string(comm_.rank()) +
                                           " is data-parallel rank " + std::to_string(mesh_->data_parallel_rank()) +
                                           ", tensor-parallel rank " + std::to_string(mesh_->tensor_parallel_rank()) +
                                           (mesh_->pipeline_size() > 1 ? ", pipeline rank " + std::to_string(mesh_->pipeline_rank()) : ""));
    return true;
  }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kDeviceMeshIid) == 0) return static_cast<ember::IDeviceMesh*>(this);
    if (std::strcmp(iid, ember::kDeferredInitIid) == 0) return static_cast<ember::IDeferredInit*>(this);
    if (std::strcmp(iid, ember::kDeferredInitPlanIid) == 0) return static_cast<ember::IDeferredInitPlan*>(this);
    if (std::strcmp(iid, ember::kPipelineParallelIid) == 0 && mesh_ && mesh_->pipeline_size() > 1)
      return static_cast<ember::IPipelineParallel*>(this);
    // Rank 0's module is the whole model unless a tensor- or pipeline-parallel mesh cut it.
    if (std::strcmp(iid, ember::kDeviceModelStateIid) == 0)
      return tensor_parallel_ || pipeline_ ? nullptr : static_cast<ember::IDeviceModelState*>(this);
    return ember::ReplicatingStrategy::query_interface(iid);
  }
  // ---- ember::IDeviceMesh (before launch: one rank)
  int64_t data_parallel_rank() const override { return mesh_ ? mesh_->data_parallel_rank() : 0; }
  int64_t data_parallel_size() const override { return mesh_ ? mesh_->data_parallel_size() : 1; }
  int64_t tensor_parallel_rank() const override { return mesh_ ? mesh_->tensor_parallel_rank() : 0; }
  int64_t tensor_parallel_size() const override { return mesh_ ? mesh_->tensor_parallel_size() : 1; }

  // ---- ember::IDeferredInit, IDeferredInitPlan: under pipeline stages or tensor parallelism a
  // rank keeps its stages' parameters whole and its slices of the split ones as the model is
  // built (built once for its shapes first, to know which); elsewhere every rank holds the whole
  // model anyway.
  bool begin_deferred_init(c10::ScalarType dtype) override {
    if (!deferred_init_ || !mesh_ || (mesh_->pipeline_size() == 1 && mesh_->tensor_parallel_size() == 1)) return false;
    deferred_.begin(dtype, /*rank=*/0, /*world=*/1, /*in_place=*/true);
    deferred_.begin_shapes_pass();
    return true;
  }
  void parameters_initialised(torch::nn::Module& module) override { deferred_.take(module); }
  bool wants_shapes_pass() override { return deferred_.active() && deferred_.in_shapes_pass(); }
  // The shapes build parallelised as setup_module will parallelise the model: cut to this rank's
  // stages, split by the plan.
  void plan_from_shapes(ember::IModel& model) override {
    if (mesh_->pipeline_size() > 1) {
      if (!pipeline_) pipeline_ = std::make_unique<ember_dist::PipelineState>(*mesh_, ember::PipelineOptions{});  // an engine before SDK 2.6
      pipeline_->cut_shapes(model);
    }
    std::vector<ember::TensorShard> slices;
    if (mesh_->tensor_parallel_size() > 1) slices = ember::tensor_parallel_plan_of(model, mesh_->tensor_parallel_size()).parallelize_tensors(mesh_->tensor_parallel());
    deferred_.end_shapes_pass(model, slices, mesh_->tensor_parallel_rank(), mesh_->tensor_parallel_size());
  }

  // ---- ember::IPipelineParallel (answered when the mesh has pipeline stages)
  void set_pipeline_options(const ember::PipelineOptions& options) override {
    if (!comm_.device().is_cpu())
      throw ember::ConfigError(options.where_pipeline_parallel + ": parallelism.pipeline_parallel = " + std::to_string(mesh_->pipeline_size()) +
                               " on " + comm_.device().str() +
                               ": pipeline stages exchange activations over Open MPI, on CPU ranks only so far (NCCL's paired "
                               "send/receive is not built); set trainer.accelerator = \"cpu\" or pipeline_parallel = 1");
    pipeline_ = std::make_unique<ember_dist::PipelineState>(*mesh_, options);
  }
  int64_t pipeline_rank() const override { return mesh_ ? mesh_->pipeline_rank() : 0; }
  int64_t pipeline_size() const override { return mesh_ ? mesh_->pipeline_size() : 1; }
  at::Tensor pipeline_train_batch(const ember::Batch& batch, ember::IModel&, ember::IStepContext& ctx, ember::IPrecision& precision,
                                  double loss_divisor, bool sync_gradients) override {
    // Gradients accumulate over the micro-batches; they meet over the data-parallel ranks once,
    // after the last backward of the window (every parameter's gradient is final only then).
    buckets_->begin(false);
    at::Tensor loss;
    try {
      loss = pipeline_->runner().train(batch, pipeline_->model(), ctx, [&](const at::Tensor& l) {
        precision.backward(loss_divisor != 1.0 ? l / loss_divisor : l);
      });
      if (sync_gradients) {
        pipeline_->sum_shared_gradients();
        buckets_->begin(true);
        buckets_->finish();
        if (tensor_parallel_) tensor_parallel_->sum_partial_gradients();
      }
    } catch (...) {
      buckets_->abandon();
      throw;
    }
    return loss;
  }
  at::Tensor pipeline_evaluate_batch(const ember::Batch& batch, ember::IModel&, ember::IStepContext& ctx) override {
    return pipeline_->runner().evaluate(batch, pipeline_->model(), ctx);
  }

  c10::Device root_device() const override { return comm_.device(); }
  int64_t rank() const override { return comm_.rank(); }
  int64_t world_size() const override { return comm_.world(); }
  int64_t local_rank() const override { return comm_.info().local_rank; }

  void setup_module(ember::IModel& model) override {
    auto& module = model.module();
    if (deferred_.active()) place_deferred(module);
    else place_module(module);
    if (pipeline_size() > 1) {
      // An engine before SDK 2.6 never set the options: the defaults.
      if (!pipeline_) pipeline_ = std::make_unique<ember_dist::PipelineState>(*mesh_, ember::PipelineOptions{});
      pipeline_->cut(model, "ddp", host_);
      if (buffers_.enabled() && !module.buffers().empty())
        throw ember::ConfigError(where_broadcast_buffers_ + ": ddp.broadcast_buffers = true with pipeline stages: each stage holds "
                                 "other buffers, so rank 0's cannot be broadcast; set broadcast_buffers = false");
    }
    if (tensor_parallel_size() > 1) {
      auto& plan = ember::tensor_parallel_plan_of(model, tensor_parallel_size());
      // Every rank holds rank 0's whole weights now (or, deferred, the slices it kept as the model
      // was built, without storage until handed over below); each keeps its slices.
      const int64_t whole = ember_dist::parameter_elements(module);
      tensor_parallel_ = std::make_unique<TensorParallelState>(mesh_->tensor_parallel(), module,
                                                               plan.parallelize_tensors(mesh_->tensor_parallel()));
      host_.log(ember::LogLevel::info, ember_dist::describe_split("ddp", tensor_parallel_->sliced(), tensor_parallel_->summed(), whole, module));
    }
    if (deferred_.active()) hand_over_slices(module);
    state_.set_module(module);
    // Gradients meet over the data-parallel ranks; tensor-parallel ranks already agree on the
    // replicated ones and hold different slices of the rest.
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (auto& p : module.named_parameters())
      if (p.value().requires_grad()) {
        params.push_back(p.value());
        names.push_back(p.key());
      }
    auto& data = mesh_->data_parallel();
    buckets_ = std::make_unique<GradBuckets>(params, names, bucket_cap_bytes_, data.backend(), static_cast<int>(data.size()), find_unused_,
                                             [this](std::string l) { comm_.label(std::move(l)); });
  }

  void place_module(torch::nn::Module& module) override {
    module.to(comm_.device());
    comm_.broadcast_module_from_zero(module);  // every rank starts from rank 0's weights and buffers
  }

  // Deferred initialisation: every rank built the same values (checked here) and kept its stages'
  // parameters; what no piece handed over, and the buffers, come from rank 0 as usual. Before the
  // cut, while every rank's module still names the same tensors.
  void place_deferred(torch::nn::Module& module) {
    std::vector<at::Tensor> params;
    for (const auto& p : module.parameters()) params.push_back(p);
    host_.log(ember::LogLevel::info, deferred_.check(params, comm_, "ddp"));
    at::NoGradGuard no_grad;
    for (auto& p : module.named_parameters()) {
      at::Tensor t = p.value();
      if (deferred_.holds(t)) {
        if (has_storage(t)) t.set_data(t.to(comm_.device()));  // kept whole, in place, as it was built
        // else a tensor-parallel slice, kept apart: handed over once the plan has run
      } else if (!deferred_.taken(t)) {
        t.set_data(t.to(comm_.device()));
        comm_.broadcast_from_zero(t, "initial parameter '" + p.key() + "'");
      }  // else another stage's, without storage: the cut drops it
    }
    for (auto& b : module.named_buffers()) {
      b.value().set_data(b.value().to(comm_.device()));
      comm_.broadcast_from_zero(b.value(), "initial buffer '" + b.key() + "'");
    }
  }
  // The slices kept as the model was built go into their parameters, which the plan gave the
  // slices' shapes (without storage); then nothing is kept any more.
  void hand_over_slices(torch::nn::Module& module) {
    at::NoGradGuard no_grad;
    for (auto& p : module.named_parameters()) {
      at::Tensor t = p.value();
      if (!deferred_.holds(t) || has_storage(t)) continue;
      at::Tensor slice = deferred_.hand_over(t, p.key());
      if (slice.numel() != t.numel())
        throw ember::RunError("ddp: deferred initialisation kept " + std::to_string(slice.numel()) + " elements of '" + p.key() +
                              "', whose slice has " + std::to_string(t.numel()) + " (a strategy bug)");
      t.set_data(slice.view(t.sizes()).to(comm_.device()));
    }
    deferred_.clear();
  }
  static bool has_storage(const at::Tensor& t) { return t.numel() == 0 || t.storage().data_ptr().get() != nullptr; }

  void forward_begin(bool /*grad_enabled*/) override {
    if (!pipeline_) buffers_.before_forward(state_.module(), comm_);
  }

  std::shared_ptr<torch::optim::Optimizer> setup_optimizer(ember::IOptimizerFactory& factory) override {
    auto optimizer = ember::ReplicatingStrategy::setup_optimizer(factory);
    if (pipeline_) pipeline_->set_optimizer(*optimizer, trained_parameters());
    return optimizer;
  }

  ember::Batch batch_to_device(ember::Batch batch) override { return comm_.batch_to_device(std::move(batch)); }

  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool sync_gradients) override {
    buckets_->begin(sync_gradients);
    try {
      precision.backward(loss);
    } catch (...) {
      buckets_->abandon();
      throw;
    }
    if (sync_gradients) {
      buckets_->finish();
      if (tensor_parallel_) tensor_parallel_->sum_partial_gradients();
    }
  }

  // Tensor-parallel slices and pipeline stages hold different gradients: a loss scaler's
  // non-finite vote goes over every rank, so all skip a step or none does.
  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override {
    if (data_parallel_size() == world_size()) return precision.optimizer_step(step);
    VotingStep voting(step, comm_);
    return precision.optimizer_step(voting);
  }

  // Clipping: ReplicatingStrategy's (gradients are identical on every rank after the sync), or,
  // with tensor parallelism, over the whole model's gradients.
  at::Tensor clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm) override {
    std::function<at::Tensor(const at::Tensor&)> across;
    if (pipeline_) across = [this](const at::Tensor& squared) { return pipeline_->sum_over_stages(squared); };
    std::function<bool(const at::Tensor&)> counted;
    if (pipeline_) counted = [this](const at::Tensor& p) { return pipeline_->counted_in_norm(p); };
    if (tensor_parallel_) return tensor_parallel_->clip_gradients(optimizer, max, algorithm, across, counted);
    if (pipeline_ && algorithm == ember::ClipAlgorithm::norm) {
      // torch's clip_grad_norm_ over the whole model: every stage's squared norm summed, a
      // shared parameter's counted once.
      const auto grads = ember::grads_of(optimizer);
      std::vector<at::Tensor> mine;
      for (auto& group : optimizer.param_groups())
        for (auto& p : group.params())
          if (p.grad().defined() && counted(p)) mine.push_back(p.grad());
      at::Tensor squared = mine.empty() ? at::zeros({}, at::kFloat) : at::stack(at::_foreach_norm(mine, 2)).to(at::kFloat).pow(2).sum();
      at::Tensor total = across(squared).sqrt();
      auto coef = (max / (total + 1e-6)).clamp_max(1.0);
      for (const auto& g : grads) g.mul_(coef.to(g.device()).to(g.scalar_type()));
      return total;
    }
    return ember::ReplicatingStrategy::clip_gradients(optimizer, max, algorithm);
  }

  // Checkpoints hold whole tensors: a tensor-parallel run gathers its slices (and cuts them on load).
  c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only) override {
    if (pipeline_) {
      // Each stage's part (whole over its tensor-parallel ranks), merged in the whole model's order.
      const bool part = !rank0_only || (data_parallel_rank() == 0 && tensor_parallel_rank() == 0);
      auto mine = tensor_parallel_ ? tensor_parallel_->full_model_state(part) : state_.full_model_state(part);
      return pipeline_->merge_model_state(mine, !rank0_only || rank() == 0, !rank0_only);
    }
    if (tensor_parallel_) return tensor_parallel_->full_model_state(!rank0_only || rank() == 0);
    return ember::ReplicatingStrategy::full_model_state(rank0_only);
  }
  void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) override {
    if (tensor_parallel_) return tensor_parallel_->load_full_model_state(state);
    ember::ReplicatingStrategy::load_full_model_state(state);
  }
  std::string full_optimizer_state(bool rank0_only) override {
    if (pipeline_)
      return pipeline_->full_optimizer_state(*state_.optimizer(), !rank0_only || rank() == 0, !rank0_only,
                                             [this](const at::Tensor& p, const at::Tensor& field) {
                                               return tensor_parallel_ ? tensor_parallel_->whole_state(p, field) : field;
                                             });
    if (tensor_parallel_) return tensor_parallel_->full_optimizer_state(*state_.optimizer(), !rank0_only || rank() == 0);
    return ember::ReplicatingStrategy::full_optimizer_state(rank0_only);
  }
  void load_full_optimizer_state(const std::string& bytes) override {
    if (pipeline_)
      return pipeline_->load_full_optimizer_state(*state_.optimizer(), bytes, [this](const at::Tensor& p, const at::Tensor& field) {
        return tensor_parallel_ ? tensor_parallel_->part_of_state(p, field) : field;
      });
    if (tensor_parallel_) return tensor_parallel_->load_full_optimizer_state(*state_.optimizer(), bytes);
    ember::ReplicatingStrategy::load_full_optimizer_state(bytes);
  }

  // A sum (a metric's total) counts each batch once: over the data-parallel ranks, whose
  // tensor-parallel peers and pipeline stages hold the same value. Means, maxima and minima are the same either way
  // and go over every rank (the stop votes).
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
    std::string stats;
    if (buckets_) {
      const auto& s = buckets_->stats();
      stats = "ddp: " + std::to_string(s.syncs) + " gradient syncs, " + std::to_string(s.all_reduces) + " bucket all-reduces in " +
              std::to_string(s.buckets) + " buckets, " + std::to_string(s.started_early) + " started while backward was still running";
    }
    if (pipeline_) stats += pipeline_->describe_stats();
    if (mesh_) mesh_->shutdown();
    comm_.teardown(stats);
  }

  // What a checkpoint records: the world size, so a resume on another number of ranks says that
  // the data order changes from there on.
  c10::IValue state_dict() const override {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("world_size", static_cast<int64_t>(comm_.world()));
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (!state.isGenericDict()) return;
    auto d = state.toGenericDict();
    if (!d.contains("world_size")) return;
    const int64_t saved = d.at("world_size").toInt();
    if (saved != comm_.world())
      host_.log(ember::LogLevel::warn, "ddp: the checkpoint was written by " + std::to_string(saved) + " ranks and is resumed on " +
                                           std::to_string(comm_.world()) + ": each rank's share of the data differs from here on");
  }

 private:
  ember::IHost& host_;
  Communicator comm_;
  int64_t bucket_cap_bytes_;
  bool find_unused_;
  bool deferred_init_;
  ember_dist::DeferredParts deferred_;  // this rank's stages' parameters, taken as the model was built
  BufferBroadcast buffers_;
  std::string where_broadcast_buffers_;
  std::unique_ptr<DeviceMesh> mesh_;
  std::unique_ptr<ember_dist::PipelineState> pipeline_;
  std::unique_ptr<TensorParallelState> tensor_parallel_;
  std::unique_ptr<GradBuckets> buckets_;
};

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) { return new Ddp(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "ddp", "0.1.0", "Apache-2.0",
             "Multi-process data parallel: one rank per device, bucketed gradient all-reduce overlapping backward; x tensor parallel "
             "x pipeline stages on a [parallelism] mesh (" EMBER_DIST_BACKENDS ").",
             EMBER_CONFIG_KEYS(kKeys), make)
