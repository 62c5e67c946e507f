// Interfaces the ENGINE implements and hands to plugins while a run is going on.
// Host-implemented interfaces may grow by appending virtual functions at the end (minor bump);
// a plugin built against minor m only calls what minor m declared. A new service is a new
// interface found through ITrainer::query_interface, not a new method of ITrainer.
#pragma once
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/Device.h>

#include "ember/error.h"
#include "ember/types.h"

namespace torch::nn { class Module; }
namespace torch::optim { class Optimizer; }

namespace ember {

class IConfig;
class IModel;

// Where `self.log(...)` goes: handed to a model's training/validation/test step.
class EMBER_SDK_API IStepContext {
 public:
  virtual ~IStepContext() = default;
  // Records a metric. `value` may live on the device: the engine reads it back only when it logs
  // (every trainer.log_every_n_steps steps, at progress refresh and at epoch end), never per step.
  virtual void log(std::string_view name, const at::Tensor& value, const LogOptions& options = {}) = 0;
  virtual void log(std::string_view name, double value, const LogOptions& options = {}) = 0;
  virtual Stage stage() const = 0;
  virtual int64_t batch_idx() const = 0;
  // SDK 2.7. Hands this batch's predictions to the run's [metrics] table (docs/metrics.md), which
  // computes F1, AUROC, a confusion matrix... over the whole split, exactly, on any number of
  // ranks. `preds`: scores (logits or probabilities) [N, C] for multiclass, [N] for binary,
  // [N, L] for multilabel, values for regression, logits [..., V] for perplexity; `target`: class
  // indices, 0/1 labels or values. Either may stay on the device; the engine detaches them and
  // leaves out the rows a padded evaluation batch repeats. A no-op when the table names nothing
  // for this split, so a model may always call it. (Appended: an IStepContext implemented by a
  // plugin, e.g. a strategy wrapping the model's context, must be built against 2.7 to hand its
  // context to a 2.7 model.)
  virtual void update_metrics(const at::Tensor& preds, const at::Tensor& target) = 0;
};

// The trainer as callbacks, loggers and model hooks see it: a thin view of where the run is.
// What only some plugins need (checkpoints, mid-run settings, tuners' passes, weight averaging)
// lives in the service interfaces below, reached through query_interface (ember::trainer_service),
// so a new engine service is a new interface and this vtable stays as it is.
class EMBER_SDK_API ITrainer {
 public:
  virtual ~ITrainer() = default;

  // Loop position. global_step counts optimizer steps (Lightning's meaning).
  virtual Stage stage() const = 0;
  virtual int64_t current_epoch() const = 0;
  virtual int64_t global_step() const = 0;
  virtual int64_t batch_idx() const = 0;
  virtual int64_t max_epochs() const = 0;      // -1: unlimited
  virtual int64_t max_steps() const = 0;       // -1: unlimited
  virtual int64_t num_training_batches() const = 0;  // per epoch, after limits
  // Batches of a split per epoch after limit_*_batches (0: the split is not run).
  virtual int64_t num_batches(Split split) const = 0;
  virtual bool sanity_checking() const = 0;

  // The last reduced value of a metric ("val_loss", "train_loss_epoch", ...). Returns false
  // when the metric has not been logged yet. Reading never forces a device sync by itself:
  // values here were already read back at the end of a step window or epoch.
  virtual bool metric(std::string_view name, double* value) const = 0;
  virtual std::vector<std::string> metric_names() const = 0;
  // Logs a value from a plugin (learning-rate monitors, timers): reaches loggers at the current
  // step.
  virtual void log_metric(std::string_view name, double value) = 0;
  // Logs a tensor metric from a plugin (a precision handler's loss scale, ...) with self.log's
  // semantics: it may stay on the device until the engine reads it back at a log window.
  virtual void log_tensor(std::string_view name, const at::Tensor& value, const LogOptions& options = {}) = 0;

  // Asks the loop to stop after the current step (early stopping, timers). Rank-consistent.
  virtual void request_stop(std::string_view reason) = 0;
  virtual bool stop_requested() const = 0;

  virtual torch::nn::Module& module() = 0;
  virtual IModel& model() = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;

  // The batch and loss of the current training step (valid inside batch hooks).
  virtual const Batch& current_batch() const = 0;
  virtual at::Tensor current_loss() const = 0;
  // Valid in on_train_batch_end: whether this batch completed an optimizer step (false while
  // gradients are being accumulated), and whether the precision handler then skipped that step
  // (inf/NaN gradients under loss scaling). Schedulers advance only on a step that was taken.
  virtual bool optimizer_stepped() const = 0;
  virtual bool optimizer_step_skipped() const = 0;

  // Distributed position; a single-process run is rank 0 of 1.
  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  virtual bool is_global_zero() const = 0;
  // The device this rank trains on (the strategy's root device): where a plugin puts its own
  // tensors and which device it asks for memory, clocks or peak FLOP/s. Never guess it from a
  // module parameter: a sharding strategy may have freed them, and a model may hold some on the
  // host. Ensures: the same device for the whole run.
  virtual c10::Device root_device() const = 0;

  // Folder of this run (logs, checkpoints): <default_root_dir>/<name>/version_<n>.
  virtual std::string run_dir() const = 0;
  // The whole resolved configuration as TOML (the same text `engine config` prints).
  virtual std::string resolved_config() const = 0;

  // A service interface by id (the k*Iid of the interfaces below), or nullptr when this trainer
  // has none (ember::Fabric's view for loggers has none).
  virtual void* query_interface(const char* iid) = 0;
};

// Service: checkpoints of the running trainer (the checkpoint callback, the tuners).
class EMBER_SDK_API ITrainerCheckpoints {
 public:
  static constexpr const char* kIid = "ember.trainer.Checkpoints/1";
  virtual ~ITrainerCheckpoints() = default;
  // Writes a full checkpoint (weights, optimizer, loop counters, RNG states, every plugin's
  // state_dict, the resolved config and versions) to `path` atomically: a crash or error leaves
  // any earlier file at `path` intact. Collective: every rank calls it; which ranks write depends
  // on the strategy (rank 0 for a file, every rank for a sharded directory).
  virtual void save_checkpoint(const std::string& path, bool weights_only = false) = 0;
  // Restores a checkpoint written by save_checkpoint into the running trainer: weights,
  // optimizer, loop counters, RNG and every plugin's state (tuners return to where they began).
  virtual void load_checkpoint(const std::string& path) = 0;
};

// Service (SDK 2.8): checkpoints written in the background (the checkpoint plugin's `async`).
// save_checkpoint_async takes what save_checkpoint would write, copies it to the host (pinned
// memory for GPU tensors) and returns; a background thread writes it and commits it atomically
// (fsync, then rename: a crash at any point leaves the previous `path` whole) while training goes
// on. The trainer checks the write after every optimizer step (within the stop vote it already
// takes, so no extra collective) and, once they are durable on every rank, calls `committed` on
// every rank at the same step (the place to delete a checkpoint that left the top k). A write
// that failed on any rank stops the run on every rank there, with the reason, like a failed
// synchronous save. At most one write is in flight: a save of either kind, or a load, first
// waits for the one before. The trainer finishes the write in flight when training ends and
// before it tests, predicts or exits. Collective: every rank calls these at the same point.
class EMBER_SDK_API ITrainerAsyncCheckpoints {
 public:
  static constexpr const char* kIid = "ember.trainer.AsyncCheckpoints/1";
  virtual ~ITrainerAsyncCheckpoints() = default;
  // The same state goes to each of `paths` (a top-k file and last.ckpt of one step: one copy of
  // the state, one write in flight).
  virtual void save_checkpoint_async(const std::vector<std::string>& paths, bool weights_only, std::function<void()> committed) = 0;
  // Waits for the write in flight, if any, commits it (running its `committed`), and throws
  // ember::RunError on every rank when it failed on one.
  virtual void finish_checkpoints() = 0;
};

// Service (SDK 2.8): undoing training (spike_guard's rollback). Rank-consistent: every rank calls
// these at the same batch.
class EMBER_SDK_API ITrainerRecovery {
 public:
  static constexpr const char* kIid = "ember.trainer.Recovery/1";
  virtual ~ITrainerRecovery() = default;
  // In on_train_batch_start: this batch and the rest of its accumulation window are not trained
  // on (no forward, backward or optimizer step; the gradients earlier micro-batches of the window
  // accumulated are dropped), and no later hook sees them; the loop goes on with the next batch.
  virtual void skip_batch() = 0;
  // In on_train_batch_end: once the callback that calls it returns (the callbacks after it and the
  // model do not see this batch end), the trainer restores the checkpoint `path` as a resume does
  // (weights, optimizer, loop position, RNG, every callback's state; loggers keep theirs) and
  // training goes on from the position it holds. The epoch's running metrics start again there.
  virtual void rollback(const std::string& path) = 0;
};

// Service: settings a plugin may change while the run goes on.
class EMBER_SDK_API ITrainerSettings {
 public:
  static constexpr const char* kIid = "ember.trainer.Settings/1";
  virtual ~ITrainerSettings() = default;
  // Gradient accumulation factor. The loop reads it right after on_train_epoch_start, so a new
  // value takes effect from that epoch on (Lightning's GradientAccumulationScheduler sets it
  // there).
  virtual int64_t accumulate_grad_batches() const = 0;
  virtual void set_accumulate_grad_batches(int64_t factor) = 0;
  // Training batch size per rank ([data] batch_size). Setting it rebuilds the training loader
  // (and the evaluation loaders when no eval_batch_size is configured); call it outside a
  // training epoch (on_fit_start, tuners).
  virtual int64_t batch_size() const = 0;
  virtual void set_batch_size(int64_t size) = 0;
};

// Service: passes outside the loop's cadence (tuners, weight averaging).
class EMBER_SDK_API ITrainerPasses {
 public:
  static constexpr const char* kIid = "ember.trainer.Passes/1";
  virtual ~ITrainerPasses() = default;
  // A pass over the first `max_batches` batches of a split (-1: all) in the order of the current
  // epoch, each moved to the training device and converted by the precision handler. `fn`
  // returns false to end the pass early. No hooks fire.
  virtual void for_each_batch(Split split, int64_t max_batches, const std::function<bool(const Batch&)>& fn) = 0;
  // One complete optimizer step on `batch` without hooks, callbacks or loggers (what tuners
  // need): zero_grad, forward and loss in the precision's autocast region, backward through the
  // strategy and precision, clipping, optimizer step. Metrics the model logs are dropped.
  // Returns the detached loss; *skipped (if given) tells whether the precision skipped the step.
  virtual at::Tensor run_trial_step(const Batch& batch, bool* skipped = nullptr) = 0;
  // Forward and loss of `batch` under no_grad in the module's current mode (in train mode this
  // updates batch-norm statistics), no hooks; metrics the model logs are dropped.
  virtual at::Tensor run_forward(const Batch& batch) = 0;
  // Runs one validation pass now, outside the configured cadence (e.g. after averaged weights
  // were swapped in at the end of training). Its metrics reach loggers and monitors as usual.
  virtual void run_validation() = 0;
};

// Service: the weights as the strategy holds them (weight averaging: SWA, EMA).
class EMBER_SDK_API ITrainerWeights {
 public:
  static constexpr const char* kIid = "ember.trainer.Weights/1";
  virtual ~ITrainerWeights() = default;
  // The tensors the optimizer trains, one per module parameter, by name, as the strategy holds
  // them (IStrategy::trained_parameters): the parameters themselves for replicating strategies,
  // this rank's 1-D shard of each under a sharding one. Element-wise work on them (weight
  // averaging) is therefore right on every rank. Never read parameter values through module()
  // instead: under a sharding strategy they may not be materialised.
  virtual std::vector<NamedTensor> trained_parameters() = 0;
  // After a caller changed trained_parameters() in place (weights swapped in or out): brings the
  // module's own parameters up to date. Collective: every rank calls it at the same point.
  virtual void parameters_changed() = 0;
};

// Service (SDK 2.1): collectives for plugins whose decision every rank must share (a guard that
// stops the run, say). Collective: every rank calls them at the same point. Identity on one
// process.
class EMBER_SDK_API ITrainerCollectives {
 public:
  static constexpr const char* kIid = "ember.trainer.Collectives/1";
  virtual ~ITrainerCollectives() = default;
  // True on every rank when `flag` is true on any rank.
  virtual bool any_rank(bool flag) = 0;
  // `value` (a scalar or any dense tensor) reduced over the ranks, on every rank.
  virtual at::Tensor reduce(const at::Tensor& value, ReduceOp op) = 0;
};

// The service `Service` of `trainer` (one of the interfaces above). Throws ember::RunError naming
// `who` and the service when this trainer has none (e.g. a callback used under Fabric's logger view).
template <class Service>
Service& trainer_service(ITrainer& trainer, std::string_view who) {
  auto* service = static_cast<Service*>(trainer.query_interface(Service::kIid));
  if (service == nullptr)
    throw RunError(std::string(who) + " needs the trainer service " + Service::kIid + ", which this trainer does not offer");
  return *service;
}

// Extension interface (query_interface(kTrainerAwareIid)) for plugins that are not callbacks
// (precision handlers, strategies, loggers...) but need the trainer while a run goes on, e.g.
// to log metrics. The engine attaches the trainer after setup and detaches it (nullptr) before
// the trainer goes away.
inline constexpr const char* kTrainerAwareIid = "ember.ITrainerAware/1";
class EMBER_SDK_API ITrainerAware {
 public:
  virtual ~ITrainerAware() = default;
  virtual void attach_trainer(ITrainer* trainer) = 0;
};

// One optimizer step, as the engine prepared it. The strategy and the precision handler call
// into it (Lightning's nesting): strategy.optimizer_step -> precision.optimizer_step ->
// closure() -> before_step() -> step(). A strategy may wrap it to add its own part.
class EMBER_SDK_API IOptimizerStep {
 public:
  virtual ~IOptimizerStep() = default;
  // Runs the last micro-batch of the step: forward, loss, on_before_backward, backward (through
  // strategy.backward and precision.backward, with gradient sync), on_after_backward.
  // Returns the (unscaled, detached) loss.
  virtual at::Tensor closure() = 0;
  // Fires on_before_optimizer_step and clips gradients by the trainer's settings. Gradients must
  // be unscaled when this is called.
  virtual void before_step() = 0;
  // Runs the optimizer's update.
  virtual void step() = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;
  // The non-finite vote: a precision handler that skips steps on inf/NaN gradients passes what it
  // found on this rank (a device scalar, non-zero when a gradient it sees is inf/NaN) and uses what
  // comes back. Ensures: the same value on every rank, non-zero when any rank's was, so every rank
  // skips the same steps. A strategy whose ranks hold different gradients (shards) reduces it
  // across ranks in its wrapper of the step (and passes the result on to the step it wraps);
  // the engine's own step returns it as it is. No host sync beyond the collective.
  virtual at::Tensor found_inf_on_any_rank(const at::Tensor& found_inf) = 0;
};

}  // namespace ember
