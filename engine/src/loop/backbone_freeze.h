// optimizer.backbone_unfreeze_at_epoch (Lightning's BackboneFinetuning): the backbone's parameters
// are frozen (no gradients, so no update and no optimizer state) for the epochs before that one and
// train from it on, in the param groups the optimizer already has for them (optimizer_factory.h)
// at lr x backbone_lr_scale. Nothing is added to a running optimizer, so checkpoints, schedulers
// and the strategy see the same groups all run, and a resumed run freezes by its epoch alone.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn { class Module; struct BatchNormOptions; }
namespace torch::optim { class Optimizer; }

namespace ember::engine {

class BackboneFreeze {
 public:
  BackboneFreeze() = default;
  // After the strategy built the optimizer. Throws UsageError (`where` names the key) when the
  // optimizer does not train the module's own tensors for these parameters (a sharding strategy,
  // tensor or pipeline parallelism, a precision's master copies): their requires_grad would not
  // decide what trains. Nothing to do when `unfreeze_at` <= 0.
  // With `train_bn`, the parameters of batch-norm layers among them stay trained throughout;
  // without, those layers also keep their running statistics while frozen.
  void setup(torch::nn::Module& module, const torch::optim::Optimizer& optimizer, const std::set<std::string>& names, int64_t unfreeze_at,
             double lr_scale, bool train_bn, const std::string& where, const std::string& strategy);
  bool active() const { return unfreeze_at_ > 0; }
  // At the start of training epoch `epoch`: frozen before unfreeze_at, trained from it on. Returns
  // the line to log when that changed ("" otherwise).
  std::string apply(int64_t epoch);

 private:
  std::vector<at::Tensor> params_;  // frozen in the epochs before unfreeze_at_
  size_t batch_norm_ = 0;           // batch-norm parameters of the backbone trained throughout (train_bn)
  // Without train_bn: the backbone's batch-norm layers and their own momenta, 0 while frozen.
  std::vector<std::pair<torch::nn::BatchNormOptions*, std::optional<double>>> statistics_;
  int64_t unfreeze_at_ = 0;
  double lr_scale_ = 1.0;
  bool frozen_ = false;
};

}  // namespace ember::engine
