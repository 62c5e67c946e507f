// The fit / validate / test loops (Lightning's semantics and hook order; docs/hooks.md) and the
// ITrainer view plugins see.
#pragma once
#include <ember/callback.h>
#include <ember/data.h>
#include <ember/host.h>
#include <ember/logger.h>
#include <ember/model.h>
#include <ember/model_adapters.h>
#include <ember/model_units.h>
#include <ember/precision.h>
#include <ember/strategy.h>
#include <ember/trainer.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/run_config.h"
#include "data/data_loader.h"
#include "data/device_feed.h"
#include "loop/backbone_freeze.h"
#include "loop/cadence.h"
#include "loop/configured_metrics.h"
#include "loop/data_plan.h"
#include "loop/generation.h"
#include "loop/metrics.h"
#include "loop/progress.h"
#include "loop/rank_states.h"
#include "loop/step_runner.h"
#include "loop/training_state.h"
#include "registry/named.h"
#include "runtime/runtime.h"

namespace ember::engine {

// The plugins a loop runs besides the runtime's strategy and precision handler.
struct RunPlugins {
  Named<IModel> model;
  Named<IDataModule> data;
  std::vector<Named<ICallback>> callbacks;
  std::vector<Named<ILogger>> loggers;
};

// Resolves "best"/"last" for `run_dir` through the callbacks that store checkpoints
// (ICheckpointLocator); "" when none has one.
std::string locate_checkpoint(const std::vector<Named<ICallback>>& callbacks, const std::string& alias,
                              const std::string& run_dir);
// Every file they would answer `alias` with, most preferred first (ICheckpointCandidates; a
// locator without it gives its one answer).
std::vector<std::string> checkpoint_candidates(const std::vector<Named<ICallback>>& callbacks, const std::string& alias,
                                               const std::string& run_dir);

// The loop is the trainer plugins see: ITrainer and its services (ember/trainer.h).
class TrainingLoop final : public ITrainer,
                           public ITrainerCheckpoints,
                           public ITrainerAsyncCheckpoints,
                           public ITrainerRecovery,
                           public ITrainerSettings,
                           public ITrainerPasses,
                           public ITrainerWeights,
                           public ITrainerCollectives {
 public:
  // `runtime` is launched and has its precision handler; the loop sets it up (setup()) and ends
  // it (finalize()).
  TrainingLoop(IHost& host, const ResolvedConfig& config, std::unique_ptr<Runtime> runtime, RunPlugins plugins,
               std::filesystem::path run_dir);
  ~TrainingLoop() override;

  // Builds loaders and the optimizer, places the model; call once before fit/test.
  void setup();
  // Restores a checkpoint written by save_checkpoint (weights, optimizer, loops, RNG, plugin states).
  void restore(const std::filesystem::path& checkpoint, bool weights_only);
  // [model] init_checkpoint, when set: the model's weights from that file (init_exclude keeps
  // this run's own), logged; before fit, in place of a resume. Throws UsageError for a missing
  // file or an init_exclude entry that names nothing, RunError for a state that does not fit.
  void load_init_checkpoint();
  void fit();
  // Runs the test split; returns the test metrics.
  std::vector<std::pair<std::string, double>> test() { return evaluate_split(Split::test); }
  // Runs the validation split on its own (Lightning's trainer.validate); returns the val metrics.
  std::vector<std::pair<std::string, double>> validate() { return evaluate_split(Split::val); }
  const std::vector<Named<ICallback>>& callbacks() const { return plugins_.callbacks; }
  // Lightning's trainer.predict: the model's predictions for every sample of `split` (up to
  // limit_predict_batches), written to `csv` atomically (id, prediction, then one column per
  // class probability or output). One process only. No per-batch hooks (the SDK has no
  // on_predict_* hooks); RunSession wraps it in begin_stage/end_stage. Returns the rows written.
  int64_t predict(Split split, const std::filesystem::path& csv);
  // `engine generate`: the prompt and the tokens sampled after it, streamed to `out` as they are
  // decoded (one process; the model needs ICausalLanguageModel, the data ITokenizer). Returns
  // the text generated after the prompt.
  std::string generate(const GenerationOptions& options, std::ostream& out);
  // The model and tokenizer `generate` uses, or the one-line error it would throw (more than one
  // process, a model that cannot generate, data without a tokenizer): called before a checkpoint
  // is loaded for it.
  LanguageModelPair check_can_generate();
  // Lightning's trainer.validate/test/predict around their run: begin_stage calls the setup hooks
  // with stage() = `stage` (before the checkpoint is restored, as Lightning does), end_stage the
  // teardown hooks (after a successful run; a failure gets on_exception instead).
  void begin_stage(Stage stage);
  void end_stage();
  // Resolves "best"/"last" through the callbacks that store checkpoints ("" when none has one).
  std::string locate_checkpoint(const std::string& alias) const;
  void finalize(const std::string& status);
  // Tells callbacks and the model that the run failed (on_exception); never throws.
  void notify_exception();
  // Writes the single-file checkpoint of the state restored from sharded directory `dir`: its
  // meta.ckpt with the whole model and optimizer state, and the callback states its parts hold; or,
  // `weights_only` (restored so), a weights-only file: the header and the whole model state.
  void write_consolidated(const std::string& path, const std::filesystem::path& dir, bool weights_only);
  // Starts the loggers (after restore, so they know the step a resumed run continues from).
  void setup_loggers(bool resuming);
  // True when fit() would train nothing more: the position (a restored one included) already
  // meets max_epochs or max_steps, as the loop in fit() decides.
  bool fit_done() const { return cadence_.fit_done(pos_); }
  // The stop signal the ranks agreed to stop for (the one any rank received), 0 if none: every
  // rank of an interrupted job exits as interrupted, not only the ones the signal reached.
  int agreed_stop_signal() const { return agreed_stop_signal_; }

  // ITrainer
  Stage stage() const override { return stage_; }
  int64_t current_epoch() const override { return pos_.epoch; }
  int64_t global_step() const override { return pos_.global_step; }
  int64_t batch_idx() const override { return batch_idx_; }
  int64_t max_epochs() const override { return settings_.max_epochs; }
  int64_t max_steps() const override { return settings_.max_steps; }
  int64_t num_training_batches() const override { return plan_->num_batches(Split::train); }
  bool sanity_checking() const override { return stage_ == Stage::sanity_check; }
  bool metric(std::string_view name, double* value) const override;
  std::vector<std::string> metric_names() const override { return metrics_.names(); }
  void request_stop(std::string_view reason) override;
  // True from a callback's request on, also while it waits for trainer.min_epochs/min_steps
  // (Lightning's should_stop); the loop itself ends on stop_requested_.
  bool stop_requested() const override { return stop_requested_ || !deferred_stop_.empty(); }
  torch::nn::Module& module() override { return plugins_.model.object->module(); }
  IModel& model() override { return *plugins_.model.object; }
  torch::optim::Optimizer& optimizer() override { return runtime_->optimizer(); }
  const Batch& current_batch() const override { return current_batch_; }
  at::Tensor current_loss() const override { return steps_->loss(); }
  int64_t rank() const override { return runtime_->rank(); }
  int64_t world_size() const override { return runtime_->world_size(); }
  bool is_global_zero() const override { return rank() == 0; }
  std::string run_dir() const override { return run_dir_.string(); }
  std::string resolved_config() const override { return config_.to_toml(); }
  void log_metric(std::string_view name, double value) override;
  void log_tensor(std::string_view name, const at::Tensor& value, const LogOptions& options) override;
  bool optimizer_stepped() const override { return step_taken_; }
  bool optimizer_step_skipped() const override { return step_skipped_; }
  int64_t num_batches(Split split) const override;
  c10::Device root_device() const override { return runtime_->root_device(); }
  void* query_interface(const char* iid) override;
  // ITrainerCheckpoints
  void save_checkpoint(const std::string& path, bool weights_only) override;
  void load_checkpoint(const std::string& path) override;
  // ITrainerAsyncCheckpoints
  void save_checkpoint_async(const std::vector<std::string>& paths, bool weights_only, std::function<void()> committed) override;
  void finish_checkpoints() override;
  // ITrainerRecovery
  void skip_batch() override;
  void rollback(const std::string& path) override;
  // ITrainerSettings
  int64_t accumulate_grad_batches() const override { return settings_.accumulate_grad_batches; }
  void set_accumulate_grad_batches(int64_t factor) override;
  int64_t batch_size() const override { return plan_->batch_size(); }
  void set_batch_size(int64_t size) override;
  // ITrainerPasses
  void for_each_batch(Split split, int64_t max_batches, const std::function<bool(const Batch&)>& fn) override;
  at::Tensor run_trial_step(const Batch& batch, bool* skipped) override;
  at::Tensor run_forward(const Batch& batch) override;
  void run_validation() override;
  // ITrainerWeights
  std::vector<NamedTensor> trained_parameters() override { return runtime_->state().trained_parameters(); }
  void parameters_changed() override { runtime_->state().parameters_changed(); }
  // ITrainerCollectives (SDK 2.1)
  bool any_rank(bool flag) override { return runtime_->any_rank(flag); }
  at::Tensor reduce(const at::Tensor& value, ReduceOp op) override { return runtime_->reduce(value, op); }

  const MetricStore& metrics() const { return metrics_; }
  Runtime& runtime() { return *runtime_; }

 private:
  void call_hook(Hook hook);
  void train_epoch();
  // The ranks' agreement after an optimizer step: stop signals, a stop asked on one rank, the
  // commit of a background checkpoint write.
  void agree_after_step();
  // A validation pass inside fit (its cadence, a resumed pending one, the one at max_steps).
  void validate_during_fit();
  void evaluate(Split split, Stage stage, int64_t max_batches);
  std::vector<std::pair<std::string, double>> evaluate_split(Split split);
  std::string no_batches_error(Split split) const;
  void setup_cuda_graph();
  void omit_frozen_from_checkpoints(IModel& model);
  void apply_activation_checkpointing(IModel& model);
  void add_configured_metrics(Split split, std::vector<std::pair<std::string, double>>& values, bool ran_batches);
  void publish(const std::vector<std::pair<std::string, double>>& values);
  // Ends the loop after the current step: the engine's own stops (signals, another rank's stop)
  // and a callback's once trainer.min_epochs/min_steps are met.
  void stop(std::string_view reason);
  // A deferred callback stop takes effect once the minimum is met.
  void stop_if_minimum_trained(bool epoch_done);
  void place_data(const Section& data);
  void attach_plugins(ITrainer* trainer);
  void restore(const std::filesystem::path& checkpoint, bool weights_only, bool announce, bool loggers_too = true);
  void roll_back();
  bool validation_enabled() const;
  c10::IValue plugin_states() const;
  c10::impl::GenericDict checkpoint_meta(bool weights_only) const;
  // Throws when a plugin saves during on_exception a state that cannot resume exactly.
  void check_saving_after_failure() const;
  void gather_rank_states(bool weights_only);
  void forget_rank_states();
  int64_t shard_layout();  // RankCollectives::layout of this rank
  c10::IValue own_rank_states() const;  // rank_states_.own, None when empty
  // Throws when the data's class names are not the ones `ck` was trained on, in their order.
  void check_class_names(const c10::impl::GenericDict& ck, const std::string& where) const;

  IHost& host_;
  const ResolvedConfig& config_;
  // Before the plugins: the strategy outlives the model it placed.
  std::unique_ptr<Runtime> runtime_;
  RunPlugins plugins_;
  std::filesystem::path run_dir_;
  TrainerSettings settings_;
  Cadence cadence_{settings_};  // when to step, validate, log and stop (pure rules over settings_ and pos_)
  std::unique_ptr<DataPlan> plan_;  // the loaders (made in setup())
  FeedOptions feed_options_;
  MetricStore metrics_;
  ConfiguredMetrics configured_metrics_;  // the [metrics] table
  Progress progress_;

  Stage stage_ = Stage::none;
  TrainingState pos_;              // the loop's position (what checkpoints keep)
  int64_t batch_idx_ = 0;          // the batch the current stage is at
  int64_t resume_batch_ = 0;       // batches of pos_.epoch to skip after a mid-epoch resume
  bool stop_requested_ = false;
  int agreed_stop_signal_ = 0;
  std::string deferred_stop_;  // a callback's stop request waiting for trainer.min_epochs/min_steps
  bool fitting_ = false;       // inside fit(), validation included
  Batch current_batch_;
  bool step_taken_ = false, step_skipped_ = false;  // of the current training batch
  Hook current_hook_ = Hook::count_;                 // the hook being dispatched (count_: none)
  // ITrainerRecovery: a skip asked for in on_train_batch_start and the rest of its window; a
  // rollback asked for in on_train_batch_end, done once that hook was dispatched.
  bool skip_requested_ = false, skipping_window_ = false, rolled_back_ = false;
  // Whether the weights, optimizer and position agree now, so a checkpoint taken here resumes
  // exactly where the run was: false from the moment an optimizer update begins until the
  // position counts its batch, and inside an accumulation window (its gradients are not in a
  // checkpoint). A save during on_exception is refused when false, or with several ranks
  // (failing_: the others may be stuck in a collective).
  bool resumable_ = true, failing_ = false;
  // During a save under a strategy that trains shards (loop/rank_states.h): the callback states
  // that differ between ranks (record: for checkpoint_meta on rank 0; own: this rank's, for its
  // part of a sharded directory), and every callback's state as the comparison took it, so
  // checkpoint_meta does not ask for (copy) them again. Empty otherwise.
  RankStates rank_states_;
  std::vector<std::pair<std::string, c10::IValue>> taken_states_;
  int64_t batches_skipped_ = 0;
  std::string rollback_path_;
  bool attached_ = false;
  BackboneFreeze backbone_freeze_;  // optimizer.backbone_unfreeze_at_epoch
  // The tensors plugins added to the model (IModelTransform: LoRA's adapters), by name, and which
  // plugins added them: a pretraining run's checkpoint does not hold them, so init_checkpoint
  // takes them from it only where it does.
  std::vector<std::string> added_by_transforms_, transforming_plugins_;
  // How a step runs (micro-batches, the optimizer step, the CUDA graph, a step's logging); last:
  // it refers to the runtime, the model, the metric stores and the settings above.
  std::unique_ptr<StepRunner> steps_;
};

}  // namespace ember::engine
