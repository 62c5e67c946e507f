#include "loop/backbone_freeze.h"

#include <ember/error.h>

#include <c10/util/StringUtil.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/optim/optimizer.h>

#include <unordered_set>

#include "config/run_config.h"

namespace ember::engine {

void BackboneFreeze::setup(torch::nn::Module& module, const torch::optim::Optimizer& optimizer, const std::set<std::string>& names,
                           int64_t unfreeze_at, double lr_scale, bool train_bn, const std::string& where, const std::string& strategy) {
  params_.clear();
  statistics_.clear();
  batch_norm_ = 0;
  unfreeze_at_ = 0;
  frozen_ = false;
  if (unfreeze_at <= 0 || names.empty()) return;
  // Lightning's train_bn: BatchNorm layers (ember's SyncBatchNorm derives from them) keep training.
  std::unordered_set<const void*> batch_norm;
  if (train_bn)
    for (const auto& m : module.modules())
      if (dynamic_cast<torch::nn::BatchNorm1dImpl*>(m.get()) || dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get()) ||
          dynamic_cast<torch::nn::BatchNorm3dImpl*>(m.get()))
        for (const auto& p : m->parameters(/*recurse=*/false)) batch_norm.insert(p.unsafeGetTensorImpl());
  // train_bn = false: the backbone's batch-norm layers also keep their running statistics in the
  // frozen epochs (Lightning sets track_running_stats = False). LibTorch's forward updates them
  // whenever its buffers exist, so their momentum is 0 instead: running x 1 + batch x 0, exactly.
  if (!train_bn)
    for (const auto& m : module.named_modules()) {
      torch::nn::BatchNormOptions* options = nullptr;
      if (auto* b1 = dynamic_cast<torch::nn::BatchNorm1dImpl*>(m.value().get())) options = &b1->options;
      else if (auto* b2 = dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.value().get())) options = &b2->options;
      else if (auto* b3 = dynamic_cast<torch::nn::BatchNorm3dImpl*>(m.value().get())) options = &b3->options;
      if (options == nullptr || !options->track_running_stats()) continue;
      bool in_backbone = true;
      for (const auto& p : m.value()->named_parameters(/*recurse=*/false))
        in_backbone = in_backbone && names.count(m.key().empty() ? p.key() : m.key() + "." + p.key());
      if (in_backbone && !m.value()->parameters(/*recurse=*/false).empty()) statistics_.push_back({options, options->momentum()});
    }
  std::unordered_set<const void*> trained;
  for (const auto& group : optimizer.param_groups())
    for (const auto& t : group.params()) trained.insert(t.unsafeGetTensorImpl());
  for (const auto& p : module.named_parameters()) {
    if (!names.count(p.key())) continue;
    if (!trained.count(p.value().unsafeGetTensorImpl()))
      throw UsageError(where + ": optimizer.backbone_unfreeze_at_epoch = " + std::to_string(unfreeze_at) + ": under strategy '" + strategy +
                       "' the optimizer trains shards or copies of the parameters (e.g. of '" + p.key() +
                       "'), not the module's own, so the backbone cannot be frozen for some epochs and trained after: use single_device "
                       "or ddp (without tensor or pipeline parallelism), or set backbone_unfreeze_at_epoch = -1 (frozen for the whole "
                       "run) or 0");
    if (batch_norm.count(p.value().unsafeGetTensorImpl())) ++batch_norm_;
    else params_.push_back(p.value());
  }
  unfreeze_at_ = unfreeze_at;
  lr_scale_ = lr_scale;
}

std::string BackboneFreeze::apply(int64_t epoch) {
  if (!active()) return "";
  const bool frozen = epoch < unfreeze_at_;
  if (frozen == frozen_) return "";
  frozen_ = frozen;
  for (auto& p : params_) {
    p.set_requires_grad(!frozen);
    if (frozen) p.mutable_grad() = at::Tensor();  // nothing left over for the optimizer to apply
  }
  for (auto& [options, momentum] : statistics_) options->momentum(frozen ? std::optional<double>(0.0) : momentum);
  const std::string what = "the backbone (" + std::to_string(params_.size()) + " parameters)";
  if (frozen)
    return "epoch " + std::to_string(epoch) + ": " + what + " is frozen until epoch " + std::to_string(unfreeze_at_) +
           (batch_norm_ > 0 ? " (its " + std::to_string(batch_norm_) + " batch-norm parameters train on: backbone_train_bn)" : std::string()) +
           (statistics_.empty() ? std::string()
                                : " (its " + std::to_string(statistics_.size()) + " batch-norm layers keep their running statistics)");
  return "epoch " + std::to_string(epoch) + ": " + what + " trains from now on, at lr x " + c10::str(lr_scale_);
}

}  // namespace ember::engine
