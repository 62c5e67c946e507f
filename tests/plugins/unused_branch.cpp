// Test model: a linear classifier with a second linear layer ("spare") that its forward never
// uses, for ddp's unused-parameter handling (find_unused_parameters).
#include <ember/config.h>
#include <ember/model.h>
#include <ember/plugin.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <ember/model_support/classification.h>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("input_size", "16", "Features per sample.").at_least(1),
    ember::key::Int("num_classes", "4", "Classes.").at_least(2),
};

struct Net : torch::nn::Module {
  Net(int64_t in, int64_t classes)
      : fc(register_module("fc", torch::nn::Linear(in, classes))), spare(register_module("spare", torch::nn::Linear(in, classes))) {}
  at::Tensor forward(const at::Tensor& x) { return fc(x.flatten(1)); }
  torch::nn::Linear fc;
  torch::nn::Linear spare;  // never used
};

class UnusedBranch final : public ember::IModel {
 public:
  explicit UnusedBranch(const ember::IConfig& cfg) : net_(std::make_shared<Net>(cfg.get_int("input_size"), cfg.get_int("num_classes"))) {}
  torch::nn::Module& module() override { return *net_; }
  at::Tensor training_step(const ember::Batch& b, ember::IStepContext& ctx) override {
    return ember_models::classification_step(net_->forward(b[0]), b[1], ember_models::Phase::train, ctx, "unused_branch");
  }
  void validation_step(const ember::Batch& b, ember::IStepContext& ctx) override {
    ember_models::classification_step(net_->forward(b[0]), b[1], ember_models::Phase::val, ctx, "unused_branch");
  }
  void test_step(const ember::Batch& b, ember::IStepContext& ctx) override {
    ember_models::classification_step(net_->forward(b[0]), b[1], ember_models::Phase::test, ctx, "unused_branch");
  }

 private:
  std::shared_ptr<Net> net_;
};

ember::IModel* make(ember::IHost&, const ember::IConfig& cfg) { return new UnusedBranch(cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "unused_branch", "0.0.1", "Apache-2.0", "Test: a linear model with an unused layer.",
             EMBER_CONFIG_KEYS(kKeys), make)
