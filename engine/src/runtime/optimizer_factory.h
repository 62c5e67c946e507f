// The engine's IOptimizerFactory: the strategy hands it the tensors it trains (full parameters or
// shards, by parameter name) and gets the run's optimizer over exactly those.
#pragma once
#include <ember/model.h>
#include <ember/strategy.h>

#include <memory>
#include <string>
#include <vector>

#include "config/run_config.h"

namespace ember::engine {

class OptimizerFactory final : public IOptimizerFactory {
 public:
  // `optimizer_section` is the [optimizer] table, used when the model builds no optimizer itself.
  OptimizerFactory(IModel& model, std::string model_name, const Section& optimizer_section)
      : model_(model), model_name_(std::move(model_name)), section_(optimizer_section) {}

  // [optimizer]: one param group over `params`. The model's configure_optimizers: its optimizer
  // (built over the module's own parameters) with every parameter replaced by the tensor given
  // for its name, so param groups and their options stay as the model made them.
  std::shared_ptr<torch::optim::Optimizer> build(const std::vector<NamedTensor>& params) override;

 private:
  IModel& model_;
  std::string model_name_;
  const Section& section_;
};

}  // namespace ember::engine
