#include "loop/step_runner.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "common/sized_struct.h"

namespace ember::engine {

namespace {
// Sets a value for the lifetime of a scope and restores the old one (exceptions included).
template <class T>
struct ValueScope {
  T& ref;
  T old;
  ValueScope(T& r, T value) : ref(r), old(r) { ref = value; }
  ~ValueScope() { ref = old; }
};
}  // namespace

// The optimizer step the strategy and precision handler drive (docs/step.md).
class StepRunner::OptimizerStep final : public IOptimizerStep {
 public:
  OptimizerStep(StepRunner& r, const Batch& batch, int64_t batch_idx, bool first_in_window)
      : r_(r), batch_(batch), batch_idx_(batch_idx), first_(first_in_window) {}
  at::Tensor closure() override {
    if (run_closure) return run_closure();
    return r_.micro_batch(batch_, batch_idx_, first_, /*sync=*/true);
  }
  std::function<at::Tensor()> run_closure;  // set: the closure runs this instead (a CUDA graph's capture or replay)
  void before_step() override {
    r_.hook(Hook::on_before_optimizer_step);
    if (r_.settings_.gradient_clip_val > 0)
      r_.runtime_.clip_gradients(r_.settings_.gradient_clip_val, r_.settings_.gradient_clip_algorithm);
  }
  void step() override { r_.runtime_.optimizer().step(); }
  torch::optim::Optimizer& optimizer() override { return r_.runtime_.optimizer(); }
  // The strategy's wrapper reduces it when its ranks' gradients differ; here it is this rank's.
  at::Tensor found_inf_on_any_rank(const at::Tensor& found_inf) override { return found_inf; }

 private:
  StepRunner& r_;
  const Batch& batch_;
  int64_t batch_idx_;
  bool first_;
};

StepRunner::StepRunner(Runtime& runtime, const Named<IModel>& model, MetricStore& metrics, ConfiguredMetrics& configured_metrics,
                       const TrainerSettings& settings, std::function<void(Hook)> call_hook)
    : runtime_(runtime), model_(model), metrics_(metrics), configured_metrics_(configured_metrics), settings_(settings),
      call_hook_(std::move(call_hook)) {}

StepRunner::~StepRunner() = default;

void StepRunner::Context::log(std::string_view name, const at::Tensor& value, const LogOptions& options) {
  if (runner_.quiet_) return;
  require_sdk2_fields(options, &LogOptions::batch_size, "LogOptions");
  runner_.log_from_step(std::string(name), value, options, stage_, batch_size_);
}

void StepRunner::Context::log(std::string_view name, double value, const LogOptions& options) {
  if (runner_.quiet_) return;
  require_sdk2_fields(options, &LogOptions::batch_size, "LogOptions");
  if (runner_.recording_logs_) runner_.log_from_step(std::string(name), at::scalar_tensor(value, at::kDouble), options, stage_, batch_size_);
  else runner_.metrics_.log(std::string(name), value, options, stage_, batch_size_);
}

void StepRunner::Context::update_metrics(const at::Tensor& preds, const at::Tensor& target) {
  // A batch of padding only (exact evaluation) holds no sample that counts; predict and the
  // tuners' quiet passes compute no metrics.
  if (runner_.quiet_ || batch_size_ == 0 || stage_ == Stage::predict || stage_ == Stage::none) return;
  const Split split = stage_ == Stage::fit ? Split::train : stage_ == Stage::test ? Split::test : Split::val;
  if (!runner_.configured_metrics_.active(split)) return;
  if (!preds.defined() || !target.defined()) throw RunError("update_metrics: predictions and targets must be defined tensors");
  if (runner_.recording_logs_) {
    // Inside a CUDA-graph capture: folded in after every replay, from the tensors it refreshed.
    runner_.graph_predictions_.push_back({preds.detach(), target.detach()});
    return;
  }
  runner_.configured_metrics_.update(split, preds.detach(), target.detach());
}

void StepRunner::log_from_step(const std::string& name, const at::Tensor& value, const LogOptions& options, Stage stage,
                               int64_t batch_size) {
  if (!recording_logs_) {
    metrics_.log(name, value, options, stage, batch_size);
    return;
  }
  // Inside a capture nothing may run on the host's behalf (the metric store's sums are device
  // work): the value's tensor is kept, and logged after every replay has refreshed it.
  MetricStore::require_scalar(name, value);
  graph_logs_.push_back({name, value.detach(), options, stage, batch_size});
}

at::Tensor StepRunner::micro_batch(const Batch& batch, int64_t batch_idx, bool first_in_window, bool sync, bool hooks) {
  if (runtime_.pipeline()) return pipeline_batch(batch, batch_idx, first_in_window, sync, hooks);
  at::Tensor loss;
  {
    Context ctx(*this, Stage::fit, batch_idx, batch.size);
    auto region = runtime_.forward(/*grad_enabled=*/true);
    loss = model_.object->training_step(batch, ctx);
  }
  // Train metrics the model does not feed fail at the first batch, not after an epoch.
  if (!train_predictions_checked_ && !quiet_ && !recording_logs_ && batch.size > 0) {
    train_predictions_checked_ = true;
    configured_metrics_.require_predictions(Split::train);
  }
  if (!loss.defined() || loss.numel() != 1)
    throw RunError("model '" + model_.name + "': training_step must return a scalar loss");
  if (!loss.requires_grad())
    throw RunError("model '" + model_.name + "': the loss does not require grad (was it computed under no_grad, or detached?)");
  if (first_in_window) {
    if (hooks) hook(Hook::on_before_zero_grad);
    runtime_.zero_grad();
  }
  loss_ = loss.detach();
  at::Tensor to_backward = accumulation_ > 1 ? loss / static_cast<double>(accumulation_) : loss;
  if (hooks) hook(Hook::on_before_backward);
  runtime_.backward(to_backward, sync);
  if (hooks) hook(Hook::on_after_backward);
  return loss_;
}

// Under pipeline parallelism the strategy owns the window's micro-batches: forward and backward
// of each run on its schedule, so zero_grad and the backward hooks come before the whole batch.
at::Tensor StepRunner::pipeline_batch(const Batch& batch, int64_t batch_idx, bool first_in_window, bool sync, bool hooks) {
  if (first_in_window) {
    if (hooks) hook(Hook::on_before_zero_grad);
    runtime_.zero_grad();
  }
  if (hooks) hook(Hook::on_before_backward);
  at::Tensor loss;
  {
    Context ctx(*this, Stage::fit, batch_idx, batch.size);
    auto region = runtime_.forward(/*grad_enabled=*/true);
    loss = runtime_.pipeline_train_batch(batch, *model_.object, ctx, static_cast<double>(accumulation_), sync);
  }
  if (hooks) hook(Hook::on_after_backward);
  loss_ = loss.detach();
  return loss_;
}

bool StepRunner::optimizer_step(const Batch& batch, int64_t batch_idx, bool first_in_window) {
  if (graph_) return graphed_optimizer_step(batch, batch_idx, first_in_window);
  return run_optimizer_step(batch, batch_idx, first_in_window, nullptr);
}

bool StepRunner::run_optimizer_step(const Batch& batch, int64_t batch_idx, bool first_in_window, std::function<at::Tensor()> closure) {
  OptimizerStep step(*this, batch, batch_idx, first_in_window);
  step.run_closure = std::move(closure);
  return runtime_.optimizer_step(step);
}

// The closure (forward, loss, zero_grad, backward) is what the graph holds; the optimizer step,
// clipping, the loss scaler's decision and the hooks around them run as usual after it, so
// schedulers that change momentum or betas every step keep working.
bool StepRunner::graphed_optimizer_step(const Batch& current, int64_t batch_idx, bool first_in_window) {
  if (accumulation_ > 1)
    throw RunError("trainer.cuda_graph: gradient accumulation (" + std::to_string(accumulation_) +
                   " batches, set by a callback) cannot be captured: drop the accumulation schedule or cuda_graph");
  const StepGraph::Mode mode = graph_->mode_for(current);
  if (mode == StepGraph::Mode::eager) {
    graph_->count_eager();
    return run_optimizer_step(current, batch_idx, first_in_window, nullptr);
  }
  graph_->load(current);
  const Batch& batch = graph_->batch();
  return run_optimizer_step(batch, batch_idx, first_in_window, [&, mode] {
    hook(Hook::on_before_zero_grad);
    hook(Hook::on_before_backward);
    if (mode == StepGraph::Mode::capture) {
      graph_logs_.clear();
      graph_predictions_.clear();
      recording_logs_ = true;
      try {
        graph_->capture([&] { micro_batch(batch, batch_idx, first_in_window, /*sync=*/true, /*hooks=*/false); });
      } catch (...) {
        recording_logs_ = false;
        throw;
      }
      recording_logs_ = false;
      graph_loss_ = loss_;
      graph_grads_.clear();
      for (auto& group : runtime_.optimizer().param_groups())
        for (auto& p : group.params())
          if (p.grad().defined()) graph_grads_.emplace_back(p, p.grad());
    }
    graph_->replay();
    // An eager step in between (a smaller last batch) left its own gradients and loss: the
    // optimizer must read the ones the graph writes.
    for (auto& [p, g] : graph_grads_) p.mutable_grad() = g;
    loss_ = graph_loss_;
    for (const auto& r : graph_logs_) metrics_.log(r.name, r.value, r.options, r.stage, r.batch_size);
    for (const auto& r : graph_predictions_) configured_metrics_.update(Split::train, r.preds, r.target);
    hook(Hook::on_after_backward);
    return loss_;
  });
}

at::Tensor StepRunner::trial_step(const Batch& batch, int64_t batch_idx, bool* skipped) {
  ValueScope<bool> quiet(quiet_, true);
  ValueScope<int64_t> accumulation(accumulation_, 1);
  model_.object->module().train();
  const bool stepped = run_optimizer_step(batch, batch_idx, /*first_in_window=*/true, nullptr);
  if (skipped) *skipped = !stepped;
  return loss_;
}

at::Tensor StepRunner::forward_only(const Batch& batch, int64_t batch_idx) {
  ValueScope<bool> quiet(quiet_, true);
  torch::NoGradGuard no_grad;
  Context ctx(*this, Stage::fit, batch_idx, batch.size);
  auto region = runtime_.forward(/*grad_enabled=*/false);
  at::Tensor loss = runtime_.pipeline() ? runtime_.pipeline_evaluate_batch(batch, *model_.object, ctx) : model_.object->training_step(batch, ctx);
  return loss.defined() ? loss.detach() : loss;
}

}  // namespace ember::engine
