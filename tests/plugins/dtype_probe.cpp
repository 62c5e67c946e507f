// Test model: a two-layer MLP that writes, once, the dtypes a precision mode produced: the input
// it was given, the hidden activation (what autocast decides), the loss, the parameters (in the
// first training step) and the gradients (in on_before_optimizer_step). One "key=value" per line.
// `step_sleep_ms` keeps each step inside forward a while (DefaultDtype tests: what loader threads
// see while a step runs).
#include <ember/config.h>
#include <ember/model.h>
#include <ember/plugin.h>

#include <c10/core/ScalarType.h>
#include <torch/nn.h>

#include <chrono>
#include <fstream>
#include <set>
#include <string>
#include <thread>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("path", "\"dtypes.txt\"", "File the dtypes are written to."),
    ember::key::Int("input_size", "16", "Features per sample.").at_least(1),
    ember::key::Int("num_classes", "4", "Classes.").at_least(2),
    ember::key::Int("step_sleep_ms", "0", "Milliseconds each training step waits inside forward.").at_least(0),
};

struct Net : torch::nn::Module {
  Net(int64_t in, int64_t classes) {
    fc1 = register_module("fc1", torch::nn::Linear(in, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, classes));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

class DtypeProbe final : public ember::IModel {
 public:
  explicit DtypeProbe(const ember::IConfig& cfg)
      : path_(cfg.get_string("path")),
        net_(std::make_shared<Net>(cfg.get_int("input_size"), cfg.get_int("num_classes"))),
        sleep_(cfg.get_int("step_sleep_ms")) {}
  torch::nn::Module& module() override { return *net_; }
  at::Tensor training_step(const ember::Batch& batch, ember::IStepContext& ctx) override {
    at::Tensor x = batch[0].flatten(1);
    at::Tensor hidden = torch::relu(net_->fc1(x));
    if (sleep_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_));
    at::Tensor logits = net_->fc2(hidden);
    at::Tensor loss = torch::nn::functional::cross_entropy(logits, batch[1]);
    record("input", x.scalar_type());
    record("activation", hidden.scalar_type());
    record("loss", loss.scalar_type());
    for (const auto& p : net_->parameters()) record("param", p.scalar_type());
    ctx.log("train_loss", loss.detach(), {});
    return loss;
  }
  void validation_step(const ember::Batch&, ember::IStepContext&) override {}
  void test_step(const ember::Batch&, ember::IStepContext&) override {}
  void on_hook(ember::Hook hook, ember::ITrainer&) override {
    if (hook != ember::Hook::on_before_optimizer_step) return;
    for (const auto& p : net_->parameters())
      if (p.grad().defined()) record("grad", p.grad().scalar_type());
  }

 private:
  void record(const std::string& what, c10::ScalarType t) {
    const std::string line = what + "=" + c10::toString(t);
    if (!seen_.insert(line).second) return;
    std::ofstream(path_, std::ios::app) << line << "\n";
  }
  std::string path_;
  std::shared_ptr<Net> net_;
  int64_t sleep_;
  std::set<std::string> seen_;
};

ember::IModel* make(ember::IHost&, const ember::IConfig& cfg) { return new DtypeProbe(cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "dtype_probe", "0.0.1", "Apache-2.0", "Test: records the dtypes a precision mode produces.",
             EMBER_CONFIG_KEYS(kKeys), make)
