// Strategy contract 2 (IModelStateStrategy) over a strategy built against SDK 1.0/1.1, which knows
// only IStrategy: the engine builds the optimizer over the module's parameters and calls the old
// IStrategy::setup, then the precision handler's setup (the old order), and keeps the state the
// way a replicating strategy does. This is what keeps older strategy plugins working.
#pragma once
#include <ember/model.h>
#include <ember/precision.h>
#include <ember/replicated_state.h>
#include <ember/strategy.h>

namespace ember::engine {

class Contract1StrategyState final : public IModelStateStrategy {
 public:
  Contract1StrategyState(IStrategy& strategy, IPrecision& precision) : strategy_(strategy), precision_(precision) {}

  void setup_module(IModel& model) override {
    module_ = &model.module();
    state_.set_module(*module_);
  }
  std::shared_ptr<torch::optim::Optimizer> setup_optimizer(IOptimizerFactory& factory) override {
    auto optimizer = factory.build(state_.trained_parameters());
    strategy_.setup(*module_, optimizer);  // may replace the optimizer (contract 1)
    precision_.setup(*module_, strategy_.root_device());
    struct Given final : IOptimizerFactory {
      std::shared_ptr<torch::optim::Optimizer> o;
      std::shared_ptr<torch::optim::Optimizer> build(const std::vector<NamedTensor>&) override { return o; }
    } given;
    given.o = optimizer;
    return state_.build_optimizer(given);
  }
  void forward_begin(bool /*grad_enabled*/) override {}
  void forward_end() override {}
  void zero_grad() override { state_.zero_grad(); }
  std::vector<NamedTensor> trained_parameters() override { return state_.trained_parameters(); }
  void parameters_changed() override {}
  c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only) override {
    return state_.full_model_state(!rank0_only || strategy_.rank() == 0);
  }
  void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) override { state_.load_full_model_state(state); }
  std::string full_optimizer_state(bool rank0_only) override {
    return state_.full_optimizer_state(!rank0_only || strategy_.rank() == 0);
  }
  void load_full_optimizer_state(const std::string& bytes) override { state_.load_full_optimizer_state(bytes); }

 private:
  IStrategy& strategy_;
  IPrecision& precision_;
  torch::nn::Module* module_ = nullptr;
  ReplicatedModelState state_;
};

}  // namespace ember::engine
