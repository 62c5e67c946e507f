// The training loop's SDK 1.1 services: what tuners, schedulers, precision handlers and averaging
// callbacks call on ITrainer (trial steps, forward passes, batch iteration, batch size changes).
#include "training_loop.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "log.h"

namespace ember::engine {

// ---------------------------------------------------------------------------------------------
// SDK 1.1: what tuners, schedulers, precision handlers and averaging callbacks need.

void TrainingLoop::log_tensor(std::string_view name, const at::Tensor& value, const LogOptions& options) {
  if (quiet_) return;
  metrics_.log(std::string(name), value.detach(), options, stage_ == Stage::none ? Stage::fit : stage_, 1);
}

void TrainingLoop::set_accumulate_grad_batches(int64_t factor) {
  if (factor < 1) throw RunError("accumulate_grad_batches must be >= 1, got " + std::to_string(factor));
  settings_.accumulate_grad_batches = factor;
}

void TrainingLoop::set_batch_size(int64_t size) {
  if (size < 1) throw RunError("batch size must be >= 1, got " + std::to_string(size));
  train_opts_.batch_size = size;
  if (!eval_batch_size_set_) eval_opts_.batch_size = size;
  build_loaders();
}

int64_t TrainingLoop::num_batches(Split split) const {
  switch (split) {
    case Split::train: return num_train_batches_;
    case Split::val: return num_val_batches_;
    case Split::test: return num_test_batches_;
  }
  return 0;
}

void TrainingLoop::for_each_batch(Split split, int64_t max_batches, const std::function<bool(const Batch&)>& fn) {
  const DataLoader* loader = split == Split::train ? train_loader_.get() : split == Split::val ? val_loader_.get() : test_loader_.get();
  int64_t n = num_batches(split);
  if (max_batches >= 0) n = std::min(n, max_batches);
  if (!loader || n <= 0) return;
  auto& strategy = *plugins_.strategy.object;
  auto& precision = *plugins_.precision.object;
  auto pass = loader->pass(split == Split::train ? epoch_ : 0, 0, n);
  DeviceFeed feed(*pass, strategy, precision, feed_options_);
  Batch batch;
  while (feed.next(batch))
    if (!fn(batch)) break;
}

void TrainingLoop::load_checkpoint(const std::string& path) { restore(path, /*weights_only=*/false, /*announce=*/false); }

void TrainingLoop::run_validation() {
  if (!validation_enabled()) return;
  evaluate(Split::val, Stage::validate, num_val_batches_);
}

}  // namespace ember::engine

