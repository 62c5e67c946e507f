#include "runtime/runtime.h"

#include <ember/config.h>
#include <ember/grad_util.h>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include "common/log.h"
#include "runtime/contract1_strategy_state.h"

namespace ember::engine {

Runtime::Runtime(Named<IStrategy> strategy) : strategy_(std::move(strategy)) {
  if (!strategy_.object) throw RunError("the run has no strategy object (an engine bug)");
}

Runtime::~Runtime() = default;

LaunchRequest Runtime::launch_request(const IConfig& trainer, std::vector<std::string> argv) {
  LaunchRequest request;
  request.argv = std::move(argv);
  request.devices = trainer.get_int("devices");
  request.num_nodes = trainer.get_int("num_nodes");
  request.accelerator = trainer.get_string("accelerator");
  return request;
}

bool Runtime::launch(const LaunchRequest& request, int* exit_code) {
  if (launched_) return true;
  if (!strategy_.object->launch(request, exit_code)) return false;
  launched_ = true;
  log::set_rank(static_cast<int>(strategy_.object->rank()));
  return true;
}

void Runtime::set_precision(Named<IPrecision> precision) {
  if (!launched_) throw RunError("Runtime::set_precision before launch (an engine bug)");
  if (precision_.object) throw RunError("Runtime::set_precision called twice (an engine bug)");
  precision_ = std::move(precision);
}

std::shared_ptr<torch::optim::Optimizer> Runtime::setup(IModel& model, IOptimizerFactory& factory) {
  if (!precision_.object) throw RunError("Runtime::setup before set_precision (an engine bug)");
  if (state_) throw RunError("Runtime::setup called twice (an engine bug)");
  auto& strategy = *strategy_.object;
  auto* state = static_cast<IModelStateStrategy*>(strategy.query_interface(kModelStateStrategyIid));
  if (state != nullptr) {
    precision_.object->setup(model.module(), strategy.root_device());
  } else {
    // Contract 1: the adapter builds the optimizer, calls IStrategy::setup, then the precision's.
    contract1_ = std::make_unique<Contract1StrategyState>(strategy, *precision_.object);
    state = contract1_.get();
  }
  state->setup_module(model);
  auto optimizer = state->setup_optimizer(factory);
  if (!optimizer) throw RunError("strategy '" + strategy_.name + "' built no optimizer (a plugin bug)");
  state_ = state;
  optimizer_ = std::move(optimizer);
  unscaler_ = static_cast<IGradientUnscaler*>(precision_.object->query_interface(kGradientUnscalerIid));
  norm_clip_ = contract1_ ? nullptr : static_cast<IGradientNormClip*>(strategy.query_interface(kGradientNormClipIid));
  return optimizer_;
}

Batch Runtime::to_device(Batch batch) {
  return precision_.object->convert_input(strategy_.object->batch_to_device(std::move(batch)));
}

Runtime::ForwardRegion Runtime::forward(bool grad_enabled) {
  state_->forward_begin(grad_enabled);
  try {
    precision_.object->forward_begin();
  } catch (...) {
    state_->forward_end();
    throw;
  }
  return ForwardRegion(this);
}

Runtime::ForwardRegion::~ForwardRegion() {
  if (!rt_) return;
  rt_->precision_.object->forward_end();
  rt_->state_->forward_end();
}

void Runtime::zero_grad() { state_->zero_grad(); }

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
  } checked(step);
  const bool stepped = strategy_.object->optimizer_step(checked, *precision_.object);
  if (!checked.ran)
    throw RunError("strategy '" + strategy_.name + "' / precision '" + precision_.name + "' did not run the step's closure (a plugin bug)");
  return stepped;
}

void Runtime::clip_gradients(double max, ClipAlgorithm algorithm) {
  strategy_.object->clip_gradients(*optimizer_, max, algorithm);
}

at::Tensor Runtime::unscale_and_clip_gradients(double max, ClipAlgorithm algorithm) {
  // Lightning's order: unscale, then clip what the step will use.
  if (unscaler_) unscaler_->unscale_gradients(*optimizer_);
  if (algorithm == ClipAlgorithm::value) {
    strategy_.object->clip_gradients(*optimizer_, max, algorithm);
    return {};
  }
  if (norm_clip_) return norm_clip_->clip_gradients_norm(*optimizer_, max);
  // Without the extension the strategy's ranks hold whole gradients: their norm is the total.
  at::Tensor total = total_gradient_norm(grads_of(*optimizer_));
  strategy_.object->clip_gradients(*optimizer_, max, algorithm);
  return total;
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
    if (!value.defined()) throw RunError("broadcast: the tensor is undefined");
    return value;
  }
  auto* caster = static_cast<ITensorBroadcast*>(strategy_.object->query_interface(kTensorBroadcastIid));
  if (caster == nullptr)
    throw RunError("strategy '" + strategy_.name + "' has no tensor broadcast (" + kTensorBroadcastIid +
                   "); use all_reduce, or a strategy that has it (ddp, sharded, offload)");
  return caster->broadcast(value, src);
}

IShardedCheckpoint* Runtime::sharded_checkpoint() const {
  if (contract1_) return nullptr;
  return static_cast<IShardedCheckpoint*>(strategy_.object->query_interface(kShardedCheckpointIid));
}

void Runtime::save_full(bool with_model, bool with_optimizer, const FullStateWriter& write, const std::string& what) {
  // Every rank takes part in the gathers; only rank 0 writes.
  c10::Dict<std::string, at::Tensor> model_state;
  if (with_model) model_state = state_->full_model_state(/*rank0_only=*/true);
  const std::string optimizer_state = with_optimizer ? state_->full_optimizer_state(/*rank0_only=*/true) : std::string();
  std::exception_ptr error;
  if (rank() == 0) {
    try {
      write(model_state, optimizer_state);
    } catch (...) {
      error = std::current_exception();
    }
  }
  // Rank 0's failure (read-only folder, full disk) ends every rank now, with that reason on rank 0,
  // instead of leaving the others to time out in the next collective.
  if (any_rank(error != nullptr) && !error)
    throw RunError("rank 0 could not write " + what + " (its log says why); stopping with it");
  if (error) std::rethrow_exception(error);
}

void Runtime::teardown() {
  if (torn_down_ || !launched_) return;
  torn_down_ = true;
  try {
    strategy_.object->teardown();
  } catch (const std::exception& e) {
    log::warn("strategy '" + strategy_.name + "' teardown failed: " + std::string(e.what()));
  }
}

}  // namespace ember::engine
