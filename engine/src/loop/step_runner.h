// ember::engine::StepRunner: how one training step runs (docs/step.md); the loop decides when
// (loop/cadence.h). A micro-batch is the model's training_step in the runtime's forward region,
// the loss checks, zero_grad at the start of an accumulation window and backward; an optimizer
// step hands the runtime (strategy -> precision handler -> closure) the step below, or replays
// the CUDA graph of trainer.cuda_graph. It is also where a model's self.log goes while a step
// runs: into the metric store, or recorded while a CUDA graph captures the step, or nowhere for
// the tuners' quiet passes.
#pragma once
#include <ember/model.h>
#include <ember/trainer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loop/configured_metrics.h"
#include "loop/metrics.h"
#include "loop/step_graph.h"
#include "loop/trainer_settings.h"
#include "registry/named.h"
#include "runtime/runtime.h"

namespace ember::engine {

class StepRunner {
 public:
  // `call_hook` fires a hook on the callbacks and the model (the loop's order); it is not
  // called while quiet().
  StepRunner(Runtime& runtime, const Named<IModel>& model, MetricStore& metrics, ConfiguredMetrics& configured_metrics,
             const TrainerSettings& settings, std::function<void(Hook)> call_hook);
  ~StepRunner();
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  // What a model's step logs through: self.log(...) reaches the metric store tagged with `stage`;
  // update_metrics(...) the [metrics] table's split of `stage`.
  class Context final : public IStepContext {
   public:
    Context(StepRunner& runner, Stage stage, int64_t batch_idx, int64_t batch_size)
        : runner_(runner), stage_(stage), batch_idx_(batch_idx), batch_size_(batch_size) {}
    void log(std::string_view name, const at::Tensor& value, const LogOptions& options) override;
    void log(std::string_view name, double value, const LogOptions& options) override;
    Stage stage() const override { return stage_; }
    int64_t batch_idx() const override { return batch_idx_; }
    void update_metrics(const at::Tensor& preds, const at::Tensor& target) override;

   private:
    StepRunner& runner_;
    Stage stage_;
    int64_t batch_idx_, batch_size_;
  };
  Context context(Stage stage, int64_t batch_idx, int64_t batch_size) { return Context(*this, stage, batch_idx, batch_size); }

  // Tuner work (trial steps, forward passes): no hooks fire and nothing is logged.
  bool quiet() const { return quiet_; }

  // The accumulation factor of the current optimizer window (the loss is divided by it).
  void set_accumulation(int64_t factor) { accumulation_ = factor; }

  // One micro-batch of a window: forward and loss, zero_grad when `first_in_window`, backward
  // (`sync` = false while gradients accumulate). `hooks` = false: the step's inner hooks are the
  // caller's (a CUDA-graph capture calls them outside the graph, so every replay gets them too).
  // Returns the detached loss.
  at::Tensor micro_batch(const Batch& batch, int64_t batch_idx, bool first_in_window, bool sync, bool hooks = true);
  // The micro-batch that completes a window, as an optimizer step through the runtime: the
  // closure runs micro_batch, or the CUDA graph's capture or replay when one is set. Returns
  // false when the precision handler skipped the step.
  bool optimizer_step(const Batch& batch, int64_t batch_idx, bool first_in_window);
  // ITrainerPasses::run_trial_step: one whole quiet step on `batch` (accumulation 1).
  at::Tensor trial_step(const Batch& batch, int64_t batch_idx, bool* skipped);
  // ITrainerPasses::run_forward: forward and loss under no_grad, quiet.
  at::Tensor forward_only(const Batch& batch, int64_t batch_idx);

  // trainer.cuda_graph (the loop checked what cannot be captured).
  void use_cuda_graph(std::unique_ptr<StepGraph> graph) { graph_ = std::move(graph); }
  const StepGraph* cuda_graph() const { return graph_.get(); }

  // The loss of the last micro-batch (detached).
  const at::Tensor& loss() const { return loss_; }

 private:
  class OptimizerStep;
  at::Tensor pipeline_batch(const Batch& batch, int64_t batch_idx, bool first_in_window, bool sync, bool hooks);
  bool run_optimizer_step(const Batch& batch, int64_t batch_idx, bool first_in_window, std::function<at::Tensor()> closure);
  bool graphed_optimizer_step(const Batch& batch, int64_t batch_idx, bool first_in_window);
  void hook(Hook h) {
    if (!quiet_) call_hook_(h);
  }
  void log_from_step(const std::string& name, const at::Tensor& value, const LogOptions& options, Stage stage, int64_t batch_size);

  Runtime& runtime_;
  const Named<IModel>& model_;
  MetricStore& metrics_;
  ConfiguredMetrics& configured_metrics_;
  const TrainerSettings& settings_;
  std::function<void(Hook)> call_hook_;
  int64_t accumulation_ = 1;
  bool quiet_ = false;
  at::Tensor loss_;
  // trainer.cuda_graph: the graph, the metrics the captured step logs (logged again after every
  // replay from the tensors it refreshed), and what the replays must point back to.
  struct RecordedLog {
    std::string name;
    at::Tensor value;
    LogOptions options;
    Stage stage;
    int64_t batch_size;
  };
  std::unique_ptr<StepGraph> graph_;
  bool recording_logs_ = false;
  bool train_predictions_checked_ = false;  // the first training batch fed the train metrics
  std::vector<RecordedLog> graph_logs_;
  struct RecordedPredictions {
    at::Tensor preds, target;  // the graph's own tensors: each replay refreshes them
  };
  std::vector<RecordedPredictions> graph_predictions_;
  at::Tensor graph_loss_;
  std::vector<std::pair<at::Tensor, at::Tensor>> graph_grads_;  // (parameter, the gradient the graph writes)
};

}  // namespace ember::engine
