// Test model: linear -> batch norm -> relu -> linear, for the batch-norm recompute of swa, the
// buffers of the sharded strategies and sync_batchnorm. Classification with the shared
// cross-entropy step.
#include <ember/config.h>
#include <ember/model.h>
#include <ember/plugin.h>

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/module.h>

#include <ember/deferred_init.h>
#include <ember/support/sync_batch_norm.h>
#include <ember/trainer.h>
#include <ember/model_support/classification.h>

#include <unistd.h>

#include <cstring>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("input_size", "16", "Features per sample.").at_least(1),
    ember::key::Int("hidden", "8", "Width of the hidden layer.").at_least(1),
    ember::key::Int("num_classes", "4", "Classes.").at_least(2),
    ember::key::Bool("rank_dependent_init", "false",
                     "Add a number that differs between processes to fc1's initial weights (what deferred initialisation must catch)."),
    ember::key::Bool("sync_batchnorm", "false", "The batch norm normalises over every data-parallel rank's batch."),
};

struct Net : torch::nn::Module {
  Net(int64_t in, int64_t hidden, int64_t classes)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        bn(register_module("bn", ember::SyncBatchNorm1d(hidden))),
        head(register_module("head", torch::nn::Linear(hidden, classes))) {}
  at::Tensor forward(const at::Tensor& x) { return head(torch::relu(bn(fc1(x.flatten(1))))); }
  torch::nn::Linear fc1;
  ember::SyncBatchNorm1d bn;
  torch::nn::Linear head;
};

class BnMlp final : public ember::IModel, public ember::ITrainerAware {
 public:
  // The whole net is one piece for deferred initialisation (handed over once it is built).
  BnMlp(ember::IHost& host, const ember::IConfig& cfg)
      : net_(std::make_shared<Net>(cfg.get_int("input_size"), cfg.get_int("hidden"), cfg.get_int("num_classes"))),
        sync_batchnorm_(cfg.get_bool("sync_batchnorm"), "bn_mlp") {
    if (cfg.get_bool("rank_dependent_init")) {
      torch::NoGradGuard no_grad;
      net_->fc1->weight.add_(static_cast<double>(::getpid() % 997) * 1e-3);
    }
    ember::parameters_initialised(host, *net_);
  }
  torch::nn::Module& module() override { return *net_; }
  void* query_interface(const char* iid) override {
    return iid != nullptr && std::strcmp(iid, ember::kTrainerAwareIid) == 0 ? static_cast<ember::ITrainerAware*>(this) : nullptr;
  }
  void attach_trainer(ember::ITrainer* trainer) override {
    sync_batchnorm_.attach(*net_, trainer);
  }
  at::Tensor training_step(const ember::Batch& b, ember::IStepContext& ctx) override {
    return ember_models::classification_step(net_->forward(b[0]), b[1], ember_models::Phase::train, ctx, "bn_mlp");
  }
  void validation_step(const ember::Batch& b, ember::IStepContext& ctx) override {
    ember_models::classification_step(net_->forward(b[0]), b[1], ember_models::Phase::val, ctx, "bn_mlp");
  }
  void test_step(const ember::Batch& b, ember::IStepContext& ctx) override {
    ember_models::classification_step(net_->forward(b[0]), b[1], ember_models::Phase::test, ctx, "bn_mlp");
  }

 private:
  std::shared_ptr<Net> net_;
  ember::SyncBatchNormSetting sync_batchnorm_;
};

ember::IModel* make(ember::IHost& host, const ember::IConfig& cfg) { return new BnMlp(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "bn_mlp", "0.0.1", "Apache-2.0", "Test: an MLP with one batch-norm layer.",
             EMBER_CONFIG_KEYS(kKeys), make)
