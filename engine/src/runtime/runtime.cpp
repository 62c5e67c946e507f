#include "runtime/runtime.h"

#include <ember/config.h>
#include <ember/tensor_parallel.h>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include "common/log.h"

namespace ember::engine {

Runtime::Runtime(Named<IStrategy> strategy) : strategy_(std::move(strategy)) {
  if (!strategy_.object) throw RunError("the run has no strategy object (an engine bug)");
}

Runtime::~Runtime() = default;

LaunchRequest Runtime::launch_request(const IConfig& trainer, const IConfig& parallelism, std::vector<std::string> argv) {
  LaunchRequest request;
  request.argv = std::move(argv);
  request.devices = trainer.get_int("devices");
  request.num_nodes = trainer.get_int("num_nodes");
  request.accelerator = trainer.get_string("accelerator");
  if (request.accelerator == "gpu") request.accelerator = "cuda";  // Lightning's name for it; strategies see cuda
  request.max_restarts = trainer.get_int("max_restarts");
  request.data_parallel_replicate = parallelism.get_int("data_parallel_replicate");
  request.tensor_parallel = parallelism.get_int("tensor_parallel");
  request.pipeline_parallel = parallelism.get_int("pipeline_parallel");
  request.sequence_parallel = parallelism.get_bool("sequence_parallel");
  if (request.sequence_parallel && request.tensor_parallel == 1)
    throw ConfigError(parallelism.where("sequence_parallel") +
                      ": parallelism.sequence_parallel = true splits activations over the tensor-parallel ranks, and tensor_parallel = 1 "
                      "(set tensor_parallel > 1, or sequence_parallel = false)");
  const int64_t shard = parallelism.get_int("data_parallel_shard");
  if (request.num_nodes == 0) {
    // Elastic: the launcher (torchrun --nnodes=MIN:MAX) decides how many ranks there are, and the
    // data-parallel dimension takes whatever the other degrees leave (the strategy's mesh checks
    // the product once the ranks are known).
    if (shard != -1)
      throw ConfigError(parallelism.where("data_parallel_shard") + ": parallelism.data_parallel_shard = " + std::to_string(shard) +
                        " fixes the number of ranks, and trainer.num_nodes = 0 (" + trainer.where("num_nodes") +
                        ") lets the launcher choose it: set data_parallel_shard = -1 (the ranks left over)");
    request.data_parallel_shard = -1;
    return request;
  }
  const int64_t ranks = request.devices * request.num_nodes;
  const int64_t fixed = request.data_parallel_replicate * request.tensor_parallel * request.pipeline_parallel;
  const std::string product = "data_parallel_replicate (" + std::to_string(request.data_parallel_replicate) + ") x tensor_parallel (" +
                              std::to_string(request.tensor_parallel) + ") x pipeline_parallel (" +
                              std::to_string(request.pipeline_parallel) + ")";
  const std::string run = "trainer.devices (" + std::to_string(request.devices) + ") x trainer.num_nodes (" +
                          std::to_string(request.num_nodes) + ") = " + std::to_string(ranks) + " ranks";
  // Name the key the user set (the first that is not the default) for the file:line.
  std::string where;
  for (const char* k : {"tensor_parallel", "pipeline_parallel", "data_parallel_replicate", "data_parallel_shard"})
    if (where.empty() && parallelism.where(k) != "default") where = parallelism.where(k);
  if (where.empty()) where = trainer.where("devices");
  if (shard == -1) {
    if (ranks % fixed != 0)
      throw ConfigError(where + ": the device mesh does not fit the run: " + product + " = " + std::to_string(fixed) +
                        " does not divide " + run + " (make the product of the [parallelism] degrees divide the ranks)");
    request.data_parallel_shard = ranks / fixed;
  } else {
    if (shard == 0)
      throw ConfigError(parallelism.where("data_parallel_shard") + ": parallelism.data_parallel_shard = 0: use -1 (the ranks left over) or a count");
    if (fixed * shard != ranks)
      throw ConfigError(where + ": the device mesh does not fit the run: " + product + " x data_parallel_shard (" + std::to_string(shard) +
                        ") = " + std::to_string(fixed * shard) + ", but " + run +
                        " (make the product equal the ranks, or set data_parallel_shard = -1)");
    request.data_parallel_shard = shard;
  }
  return request;
}

PipelineOptions Runtime::pipeline_options(const IConfig& parallelism) {
  PipelineOptions o;
  o.schedule = parallelism.get_string("schedule");
  o.microbatches = parallelism.get_int("microbatches");
  o.virtual_stages = parallelism.get_int("virtual_stages");
  o.stage_units = parallelism.get_int_list("stage_units");
  o.where_pipeline_parallel = parallelism.where("pipeline_parallel");
  o.where_schedule = parallelism.where("schedule");
  o.where_microbatches = parallelism.where("microbatches");
  o.where_virtual_stages = parallelism.where("virtual_stages");
  o.where_stage_units = parallelism.where("stage_units");
  return o;
}

bool Runtime::launch(const LaunchRequest& request, int* exit_code, const PipelineOptions& pipeline) {
  if (launched_) return true;
  // A strategy without a device mesh would ignore the degrees and train something else.
  if ((request.tensor_parallel > 1 || request.pipeline_parallel > 1) && !strategy_.object->query_interface(kDeviceMeshIid))
    throw ConfigError(std::string(request.tensor_parallel > 1 ? "parallelism.tensor_parallel = " + std::to_string(request.tensor_parallel)
                                                              : "parallelism.pipeline_parallel = " + std::to_string(request.pipeline_parallel)) +
                      " needs a strategy with a device mesh, and strategy '" + strategy_.name +
                      "' has none (use --plugins ddp, or set the degree to 1; docs/parallelism.md)");
  if (!strategy_.object->launch(request, exit_code)) return false;
  launched_ = true;
  log::set_rank(static_cast<int>(strategy_.object->rank()));
  if (request.pipeline_parallel > 1) {
    // Asked after launch: a strategy answers once its mesh has stages.
    pipeline_ = static_cast<IPipelineParallel*>(strategy_.object->query_interface(kPipelineParallelIid));
    if (!pipeline_)
      throw ConfigError(pipeline.where_pipeline_parallel + ": parallelism.pipeline_parallel = " + std::to_string(request.pipeline_parallel) +
                        " needs a strategy that builds pipeline stages, and strategy '" + strategy_.name +
                        "' does not (use --plugins ddp, or set pipeline_parallel = 1; docs/parallelism.md)");
    pipeline_->set_pipeline_options(pipeline);
  }
  return true;
}

at::Tensor Runtime::pipeline_train_batch(const Batch& batch, IModel& model, IStepContext& ctx, double loss_divisor, bool sync_gradients) {
  return pipeline_->pipeline_train_batch(batch, model, ctx, *precision_.object, loss_divisor, sync_gradients);
}

at::Tensor Runtime::pipeline_evaluate_batch(const Batch& batch, IModel& model, IStepContext& ctx) {
  return pipeline_->pipeline_evaluate_batch(batch, model, ctx);
}

int64_t Runtime::data_parallel_rank() const {
  if (auto* mesh = static_cast<IDeviceMesh*>(strategy_.object->query_interface(kDeviceMeshIid))) return mesh->data_parallel_rank();
  return rank();
}

int64_t Runtime::data_parallel_size() const {
  if (auto* mesh = static_cast<IDeviceMesh*>(strategy_.object->query_interface(kDeviceMeshIid))) return mesh->data_parallel_size();
  return world_size();
}

void Runtime::set_precision(Named<IPrecision> precision) {
  if (!launched_) throw RunError("Runtime::set_precision before launch (an engine bug)");
  if (precision_.object) throw RunError("Runtime::set_precision called twice (an engine bug)");
  precision_ = std::move(precision);
}

std::shared_ptr<torch::optim::Optimizer> Runtime::setup(IModel& model, IOptimizerFactory& factory) {
  if (!precision_.object) throw RunError("Runtime::setup before set_precision (an engine bug)");
  if (optimizer_) throw RunError("Runtime::setup called twice (an engine bug)");
  auto& strategy = *strategy_.object;
  // Its tensors' names, whole (before a strategy splits it into stages): what a checkpoint may hold.
  model_tensors_.clear();
  for (const auto& p : model.module().named_parameters()) model_tensors_.insert(p.key());
  for (const auto& b : model.module().named_buffers()) model_tensors_.insert(b.key());
  precision_.object->setup(model.module(), strategy.root_device());
  strategy.setup_module(model);
  auto optimizer = strategy.setup_optimizer(factory);
  if (!optimizer) throw RunError("strategy '" + strategy_.name + "' built no optimizer (a plugin bug)");
  optimizer_ = std::move(optimizer);
  unscaler_ = static_cast<IGradientUnscaler*>(precision_.object->query_interface(kGradientUnscalerIid));
  sharded_ = strategy.query_interface(kShardedCheckpointsIid) != nullptr;
  return optimizer_;
}

Batch Runtime::to_device(Batch batch) {
  return precision_.object->convert_input(strategy_.object->batch_to_device(std::move(batch)));
}

Runtime::ForwardRegion Runtime::forward(bool grad_enabled) {
  strategy_.object->forward_begin(grad_enabled);
  try {
    precision_.object->forward_begin();
  } catch (...) {
    strategy_.object->forward_end();
    throw;
  }
  return ForwardRegion(this);
}

Runtime::ForwardRegion::~ForwardRegion() {
  if (!rt_) return;
  rt_->precision_.object->forward_end();
  rt_->strategy_.object->forward_end();
}

void Runtime::zero_grad() { strategy_.object->zero_grad(); }

void Runtime::backward(const at::Tensor& loss, bool sync_gradients) {
  strategy_.object->backward(loss, *precision_.object, sync_gradients);
}

bool Runtime::optimizer_step(IOptimizerStep& step) {
  // The closure is where forward and backward run (or, under Fabric, where the program's loss is
  // handed over); a plugin that skips it would silently train nothing.
  struct Checked final : IOptimizerStep {
    IOptimizerStep& inner;
    bool ran = false;
    explicit Checked(IOptimizerStep& s) : inner(s) {}
    at::Tensor closure() override {
      ran = true;
      return inner.closure();
    }
    void before_step() override { inner.before_step(); }
    void step() override { inner.step(); }
    torch::optim::Optimizer& optimizer() override { return inner.optimizer(); }
    at::Tensor found_inf_on_any_rank(const at::Tensor& found_inf) override { return inner.found_inf_on_any_rank(found_inf); }
  } checked(step);
  const bool stepped = strategy_.object->optimizer_step(checked, *precision_.object);
  if (!checked.ran)
    throw RunError("strategy '" + strategy_.name + "' / precision '" + precision_.name + "' did not run the step's closure (a plugin bug)");
  return stepped;
}

void Runtime::clip_gradients(double max, ClipAlgorithm algorithm) {
  (void)strategy_.object->clip_gradients(*optimizer_, max, algorithm);
}

at::Tensor Runtime::unscale_and_clip_gradients(double max, ClipAlgorithm algorithm) {
  // Lightning's order: unscale, then clip what the step will use.
  if (unscaler_) unscaler_->unscale_gradients(*optimizer_);
  return strategy_.object->clip_gradients(*optimizer_, max, algorithm);
}

at::Tensor Runtime::reduce(const at::Tensor& value, ReduceOp op) { return strategy_.object->reduce(value, op); }

bool Runtime::any_rank(bool flag) {
  if (world_size() <= 1) return flag;
  return strategy_.object->reduce(at::scalar_tensor(flag ? 1.0 : 0.0, at::kDouble), ReduceOp::max).item<double>() > 0;
}

void Runtime::barrier(const char* name) { strategy_.object->barrier(name); }

bool Runtime::broadcast_flag(bool value) { return strategy_.object->broadcast_flag(value); }

at::Tensor Runtime::broadcast(const at::Tensor& value, int64_t src) {
  if (world_size() == 1) {
    if (!value.defined()) throw RunError("the tensor to broadcast is undefined");
    return value;
  }
  return strategy_.object->broadcast(value, src);
}

void Runtime::teardown() {
  abandon_background_save();
  if (torn_down_ || !launched_) return;
  torn_down_ = true;
  try {
    strategy_.object->teardown();
  } catch (const std::exception& e) {
    log::warn("strategy '" + strategy_.name + "' teardown failed: " + std::string(e.what()));
  }
}

}  // namespace ember::engine
