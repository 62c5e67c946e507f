// The training loop's trainer services (ember/trainer.h: ITrainerSettings, ITrainerPasses,
// ITrainerCheckpoints' load) and log_tensor: what tuners, schedulers, precision handlers and
// averaging callbacks call (trial steps, forward passes, batch iteration, batch size changes).
#include "loop/training_loop.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "common/log.h"
#include "common/sized_struct.h"

namespace ember::engine {

// ---------------------------------------------------------------------------------------------
// The trainer's services: what tuners, schedulers, precision handlers and averaging callbacks need.

void TrainingLoop::log_tensor(std::string_view name, const at::Tensor& value, const LogOptions& options) {
  if (steps_->quiet()) return;
  require_sdk2_fields(options, &LogOptions::batch_size, "LogOptions");
  metrics_.log(std::string(name), value.detach(), options, stage_ == Stage::none ? Stage::fit : stage_, 1);
}

void TrainingLoop::set_accumulate_grad_batches(int64_t factor) {
  if (factor < 1) throw RunError("accumulate_grad_batches must be >= 1, got " + std::to_string(factor));
  settings_.accumulate_grad_batches = factor;
}

void TrainingLoop::set_batch_size(int64_t size) {
  if (size < 1) throw RunError("batch size must be >= 1, got " + std::to_string(size));
  plan_->set_batch_size(size);
}

int64_t TrainingLoop::num_batches(Split split) const { return plan_->num_batches(split); }

void TrainingLoop::for_each_batch(Split split, int64_t max_batches, const std::function<bool(const Batch&)>& fn) {
  const DataLoader* loader = plan_->loader(split);
  int64_t n = num_batches(split);
  if (max_batches >= 0) n = std::min(n, max_batches);
  if (!loader || n <= 0) return;
  auto pass = loader->pass(split == Split::train ? pos_.epoch : 0, 0, n);
  DeviceFeed feed(*pass, *runtime_, feed_options_);
  Batch batch;
  while (feed.next(batch))
    if (!fn(batch)) break;
}

void TrainingLoop::load_checkpoint(const std::string& path) { restore(path, /*weights_only=*/false, /*announce=*/false); }

void TrainingLoop::run_validation() {
  if (!validation_enabled()) return;
  evaluate(Split::val, Stage::validate, plan_->num_batches(Split::val));
}

// ITrainerRecovery (spike_guard): asked for in a hook, done by the loop (train_epoch, roll_back).
void TrainingLoop::skip_batch() {
  if (current_hook_ != Hook::on_train_batch_start)
    throw RunError("skip_batch() was called in " + std::string(hook_name(current_hook_)) + "; it works in on_train_batch_start only");
  skip_requested_ = true;
}

void TrainingLoop::rollback(const std::string& path) {
  if (current_hook_ != Hook::on_train_batch_end)
    throw RunError("rollback() was called in " + std::string(hook_name(current_hook_)) + "; it works in on_train_batch_end only");
  if (path.empty()) throw RunError("rollback() needs the checkpoint to go back to");
  rollback_path_ = path;
}

// Tuner work (SDK 1.1): one training step or forward pass with no hooks and nothing logged.
at::Tensor TrainingLoop::run_trial_step(const Batch& batch, bool* skipped) { return steps_->trial_step(batch, batch_idx_, skipped); }

at::Tensor TrainingLoop::run_forward(const Batch& batch) { return steps_->forward_only(batch, batch_idx_); }

}  // namespace ember::engine

