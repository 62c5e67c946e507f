// The engine's IOptimizerFactory: the strategy hands it the tensors it trains (full parameters or
// shards, by parameter name) and gets the run's optimizer over exactly those.
#pragma once
#include <ember/model.h>
#include <ember/strategy.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "config/run_config.h"

namespace ember::engine {

class OptimizerFactory final : public IOptimizerFactory {
 public:
  // `optimizer_section` is the [optimizer] table, used when the model builds no optimizer itself.
  // Built before the strategy sets the model up, while the module is whole: optimizer.no_weight_decay
  // and no_weight_decay_1d are resolved here, over every trained parameter (names and dimensions),
  // so that each rank later sorts its shards, slices or stages by name alone.
  OptimizerFactory(IModel& model, std::string model_name, const Section& optimizer_section);

  // [optimizer]: one param group over `params`, or two when some parameters take no weight decay,
  // and as many again for optimizer.backbone (at lr x backbone_lr_scale), in that order (every
  // group on every rank, even where one is empty, so every rank's optimizer has the same groups).
  // The model's configure_optimizers: its optimizer (built over the module's own parameters) with
  // every parameter replaced by the tensor given for its name, so param groups and their options
  // stay as the model made them.
  std::shared_ptr<torch::optim::Optimizer> build(const std::vector<NamedTensor>& params) override;

  // "weight decay 0.1 on 18 parameters (...); none on 9 (...)" when some parameters take none,
  // else empty: the run logs it once.
  const std::string& weight_decay_summary() const { return summary_; }

  // optimizer.backbone: the names of its parameters (empty when unset), the epoch from which it
  // trains (0: always; -1: never, and then the constructor has frozen it), and a line the run logs
  // once ("optimizer: backbone of 12 parameters ... trains at lr x 0.1, frozen until epoch 2").
  const std::set<std::string>& backbone() const { return backbone_; }
  int64_t backbone_unfreeze_at_epoch() const { return unfreeze_at_; }
  const std::string& backbone_summary() const { return backbone_summary_; }

 private:
  void resolve_backbone();
  void resolve_weight_decay();

  IModel& model_;
  std::string model_name_;
  const Section& section_;
  bool split_ = false;                 // two groups: decayed, then not
  std::set<std::string> no_decay_;     // parameter names of the second group
  std::string summary_;
  std::string where_;                  // the key's place in the config
  std::set<std::string> backbone_;     // parameter names of optimizer.backbone
  double scale_ = 1.0;                 // optimizer.backbone_lr_scale
  int64_t unfreeze_at_ = 0;            // optimizer.backbone_unfreeze_at_epoch
  std::string backbone_summary_;
};

}  // namespace ember::engine
