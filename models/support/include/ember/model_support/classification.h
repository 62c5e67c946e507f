// Shared by the classifying models (cnn, mlp, resnet, transformer, bert): the cross-entropy step,
// the multi-label step and the metrics they log, so the models log the same names with the same
// options (what callbacks and the progress bar look for).
// Header-only: each plugin .so compiles its own copy, nothing is shared at run time.
#pragma once
#include <cmath>
#include <string>

#include <ATen/Dispatch.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/functional/loss.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/error.h>
#include <ember/trainer.h>
#include <ember/types.h>

namespace ember_models {

// Which step is running; it decides the metric prefix and how the metric is reduced.
enum class Phase { train, val, test };

inline const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::train: return "train";
    case Phase::val: return "val";
    case Phase::test: return "test";
  }
  return "unknown";
}

// The loss is shown per step and as an epoch mean while training (Lightning's on_step + on_epoch,
// which the engine logs as train_loss_step / train_loss_epoch); evaluation losses only per epoch.
inline ember::LogOptions loss_log_options(Phase phase) {
  ember::LogOptions o;
  o.on_step = phase == Phase::train ? 1 : 0;
  o.on_epoch = 1;
  o.prog_bar = phase == Phase::train;
  o.sync_dist = true;  // epoch means over every rank's samples (only reduced at epoch end)
  return o;
}

// Accuracy of a single batch is noisy: only its epoch mean is worth logging. The validation
// accuracy is what a user watches, so it goes on the progress bar.
inline ember::LogOptions accuracy_log_options(Phase phase) {
  ember::LogOptions o;
  o.on_step = 0;
  o.on_epoch = 1;
  o.prog_bar = phase == Phase::val;
  o.sync_dist = true;
  return o;
}

// Every step reads tensors[0] (inputs) and tensors[1] (targets); a clear message beats the
// std::out_of_range that Batch::operator[] would throw.
inline void require_inputs_and_targets(const ember::Batch& batch, const char* model) {
  if (batch.tensors.size() < 2) {
    throw ember::RunError(c10::str(model, ": expected a batch of (inputs, targets), got ",
                                   batch.tensors.size(),
                                   " tensor(s): use a data module that yields inputs and targets"));
  }
}

// Reads a dropout probability. The schema bounds it to [0, 1] (it has no exclusive maximum);
// p = 1 would zero every activation, so it is refused here with the fix.
inline double read_dropout(const ember::IConfig& cfg, const char* key) {
  const double p = cfg.get_float(key);
  if (p >= 1.0) {
    throw ember::ConfigError(c10::str("[", cfg.section(), "] ", key, " = ", p, " (", cfg.where(key),
                                      ") must be below 1, which would drop every activation: use a "
                                      "value in [0, 1), 0 for no dropout"));
  }
  return p;
}

// The share of rows of `logits` [N, C] (on the CPU) whose largest entry sits at the row's label,
// exactly as (logits.argmax(1) == labels).to(kFloat).mean() computes it: the first largest on ties,
// NaN counting as the largest, the mean rounded to float. Counted in a plain loop: for the small
// batches where per-step cost shows, argmax/eq/to/mean (four dispatched ops and allocations) cost
// more than the rest of the step's metric work together (bench/overhead.sh).
inline double cpu_accuracy(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t n = logits.size(0);
  const auto label = labels.accessor<int64_t, 1>();
  int64_t correct = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "cpu_accuracy", [&] {
    const auto rows = logits.accessor<scalar_t, 2>();
    auto is_nan = [](scalar_t v) { return std::isnan(static_cast<double>(v)); };
    for (int64_t i = 0; i < n; ++i) {
      const auto row = rows[i];
      int64_t best = 0;
      for (int64_t j = 1; j < row.size(0) && !is_nan(row[best]); ++j)
        if (is_nan(row[j]) || row[j] > row[best]) best = j;
      correct += best == label[i] ? 1 : 0;
    }
  });
  return static_cast<double>(static_cast<float>(correct) / static_cast<float>(n));
}

// Cross-entropy of `logits` [N, C] against class indices `labels` [N]; logs <phase>_loss and
// <phase>_acc and returns the loss (still attached to the graph when training).
// Logs tensors, never .item(): the values may live on the GPU and the engine reads them back
// only when it actually reports, so a step never waits for the device (on the CPU the accuracy
// is counted on the host: nothing to wait for).
// `label_smoothing` > 0 mixes the one-hot targets with the uniform distribution (PyTorch's
// cross_entropy(label_smoothing=...)).
inline at::Tensor classification_step(const at::Tensor& logits, const at::Tensor& labels,
                                      Phase phase, ember::IStepContext& ctx, const char* model,
                                      double label_smoothing = 0.0) {
  // Shapes and dtypes are host-side metadata: checking them costs no device sync.
  if (labels.dim() != 1 || labels.size(0) != logits.size(0) ||
      !at::isIntegralType(labels.scalar_type(), /*includeBool=*/false)) {
    throw ember::RunError(c10::str(model, ": classification needs int64 labels of shape [", logits.size(0),
                                   "], got ", labels.scalar_type(), " ", labels.sizes(),
                                   ": use a data module whose targets are class indices (float targets need a regression model)"));
  }
  // A label outside the outputs (num_classes below the data's classes) would end the run with
  // LibTorch's "Target 5 is out of bounds.", which names no setting. Checked where it costs
  // nothing, labels on the host; on a GPU it would cost a sync per step (and cannot run inside a
  // CUDA graph's capture), so there LibTorch's device-side assert stands.
  if (labels.is_cpu() && labels.numel() > 0 && logits.dim() == 2) {
    const auto [lowest, highest] = at::aminmax(labels);
    const int64_t lo = lowest.item<int64_t>(), hi = highest.item<int64_t>();
    if (lo < 0 || hi >= logits.size(1))
      throw ember::RunError(c10::str(model, ": the data's label ", lo < 0 ? lo : hi, " is outside the model's ", logits.size(1),
                                     " outputs (classes 0 .. ", logits.size(1) - 1,
                                     "): set [model] num_classes to the number of classes the data has (its set-up line says how many)"));
  }
  // The loss is computed in float32 even when the forward ran in reduced precision: the
  // log-softmax is where half precision loses the most.
  const at::Tensor targets = labels.to(torch::kLong);
  at::Tensor loss = torch::nn::functional::cross_entropy(
      logits.to(torch::kFloat), targets,
      torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(label_smoothing));

  const std::string prefix = phase_name(phase);
  // Detached: a logged value must not keep this step's graph alive until the engine reads it.
  ctx.log(prefix + "_loss", loss.detach(), loss_log_options(phase));
  // A metric, not part of the graph.
  if (logits.is_cpu() && logits.dim() == 2 && logits.size(1) > 0)
    ctx.log(prefix + "_acc", cpu_accuracy(logits, targets), accuracy_log_options(phase));
  else
    ctx.log(prefix + "_acc", (logits.detach().argmax(1) == labels).to(torch::kFloat).mean(), accuracy_log_options(phase));
  // The scores and labels for the run's [metrics] table (F1, AUROC, the confusion matrix...).
  ctx.update_metrics(logits.detach(), targets);
  return loss;
}

// Multi-label classification: binary cross-entropy of `logits` [N, L] against 0/1 `targets`
// [N, L] (any dtype; one independent label per output, as transformers' problem_type =
// "multi_label_classification"); logs <phase>_loss and hands logits and targets to the run's
// [metrics] table (task = "multilabel": F1, AUROC, the confusion matrix per label). `fix`
// ends the message for targets of another shape.
inline at::Tensor multilabel_step(const at::Tensor& logits, const at::Tensor& targets, Phase phase, ember::IStepContext& ctx,
                                  const char* model, const std::string& fix) {
  if (targets.dim() != 2 || targets.size(0) != logits.size(0) || targets.size(1) != logits.size(1))
    throw ember::RunError(c10::str(model, ": multilabel needs 0/1 targets of shape [", logits.size(0), ", ", logits.size(1), "], got ",
                                   targets.scalar_type(), " ", targets.sizes(), ": ", fix));
  // float32 even after a reduced-precision forward, as for cross-entropy.
  at::Tensor loss = torch::nn::functional::binary_cross_entropy_with_logits(logits.to(torch::kFloat),
                                                                             targets.to(logits.device(), torch::kFloat));
  ctx.log(std::string(phase_name(phase)) + "_loss", loss.detach(), loss_log_options(phase));
  ctx.update_metrics(logits.detach(), targets);
  return loss;
}

// The step of an image classifier whose `task` is "classification" or "multilabel" (resnet,
// cnn): multilabel trains `multilabel_step` on image_folder's 0/1 rows; single-label refuses
// those rows in one line (they would otherwise read as a shape error) and trains cross-entropy.
// `section` is the model's config section, named in the fixes.
inline at::Tensor image_classes_step(const at::Tensor& logits, const at::Tensor& targets, bool multilabel, Phase phase, ember::IStepContext& ctx,
                                     const char* model, const std::string& section, double label_smoothing = 0.0) {
  if (multilabel)
    return multilabel_step(logits, targets, phase, ctx, model,
                           "set [data] multilabel = true (a list whose label field holds the classes), and [" + section +
                               "] num_classes to the number of classes");
  if (targets.dim() == 2)
    throw ember::RunError(c10::str(model, ": the targets ", targets.sizes(), " are 0/1 per class (multilabel data): set [", section,
                                   "] task = \"multilabel\""));
  return classification_step(logits, targets, phase, ctx, model, label_smoothing);
}

}  // namespace ember_models
