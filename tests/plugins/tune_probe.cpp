// Test model for the tuning callbacks (lr_find, batch_size_finder, timer, grad_accum_schedule):
// a quadratic bowl with a planted curvature, optional memory that scales with the batch size, an
// optional planted out-of-memory limit and an optional delay per step.
//
//   loss = 0.5 * curvature * mean_over_batch(||w - x_i * target_scale||^2)
//
// Plain SGD on it converges fastest at lr = 1/curvature and diverges above 2/curvature, so an LR
// range test has a known answer. Inputs come from any data module with float samples of `dim`
// features (synthetic, regression). It also logs, at every training batch start, the learning
// rate the optimizer uses ("probe_lr") and the batch size it sees ("probe_batch").
#include <ember/config.h>
#include <ember/error.h>
#include <ember/model.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("dim", "8", "Parameters (= input features).").at_least(1),
    ember::key::Float("curvature", "1.0", "Curvature a of the bowl: SGD is fastest at lr = 1/a.").above(0.0),
    ember::key::Float("init", "1.0", "Initial value of every parameter."),
    ember::key::Float("target_scale", "0.0", "How much the inputs move the bowl's centre (0: fixed at 0)."),
    ember::key::Int("bytes_per_sample", "0", "Bytes per sample held from forward to backward: a step's peak memory grows by exactly this per sample.").at_least(0),
    ember::key::Int("oom_above", "0", "Throw c10::OutOfMemoryError for batches larger than this (0: never).").at_least(0),
    ember::key::Int("sleep_ms", "0", "Sleep this long in every training step.").at_least(0),
};

// Passes the loss through and keeps `blob` alive from forward until backward, as an activation
// would, without any temporary of its size: a step's peak memory grows by exactly its bytes.
struct HoldUntilBackward : torch::autograd::Function<HoldUntilBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& loss, const at::Tensor& blob) {
    ctx->save_for_backward({blob});
    return loss.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    (void)ctx->get_saved_variables();
    return {grad[0], at::Tensor()};
  }
};

struct Bowl : torch::nn::Module {
  Bowl(int64_t dim, double init) { w = register_parameter("w", torch::full({dim}, init)); }
  at::Tensor w;
};

class TuneProbe final : public ember::IModel {
 public:
  explicit TuneProbe(const ember::IConfig& cfg)
      : a_(cfg.get_float("curvature")),
        scale_(cfg.get_float("target_scale")),
        bytes_(cfg.get_int("bytes_per_sample")),
        oom_above_(cfg.get_int("oom_above")),
        sleep_ms_(cfg.get_int("sleep_ms")),
        net_(std::make_shared<Bowl>(cfg.get_int("dim"), cfg.get_float("init"))) {}

  torch::nn::Module& module() override { return *net_; }

  at::Tensor training_step(const ember::Batch& b, ember::IStepContext& ctx) override {
    if (sleep_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    if (oom_above_ > 0 && b.size > oom_above_)
      TORCH_CHECK_WITH(OutOfMemoryError, false, "tune_probe: planted out-of-memory for batch ", b.size, " > ", oom_above_);
    at::Tensor loss = bowl(b);
    if (bytes_ > 0) {
      // bytes_per_sample per sample on the model's device, written to (so the pages are real) and
      // held for backward.
      at::Tensor blob = torch::empty({b.size * bytes_}, net_->w.options().dtype(torch::kByte)).fill_(1);
      loss = HoldUntilBackward::apply(loss, blob);
    }
    ctx.log("train_loss", loss.detach());
    return loss;
  }
  void validation_step(const ember::Batch& b, ember::IStepContext& ctx) override { ctx.log("val_loss", bowl(b)); }
  void test_step(const ember::Batch& b, ember::IStepContext& ctx) override { ctx.log("test_loss", bowl(b)); }

  void on_hook(ember::Hook hook, ember::ITrainer& t) override {
    if (hook != ember::Hook::on_train_batch_start) return;
    auto& group = t.optimizer().param_groups().at(0);
    t.log_metric("probe_lr", group.options().get_lr());
    t.log_metric("probe_batch", static_cast<double>(t.current_batch().size));
  }

 private:
  at::Tensor bowl(const ember::Batch& b) const {
    at::Tensor x = b[0].flatten(1).to(net_->w.dtype());
    at::Tensor d = net_->w.unsqueeze(0) - x * scale_;
    return 0.5 * a_ * d.pow(2).sum(1).mean();
  }

  double a_, scale_;
  int64_t bytes_, oom_above_, sleep_ms_;
  std::shared_ptr<Bowl> net_;
};

ember::IModel* make(ember::IHost&, const ember::IConfig& cfg) { return new TuneProbe(cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "tune_probe", "0.0.1", "Apache-2.0",
             "Test: quadratic bowl with planted curvature, memory per sample, OOM limit and step delay.",
             EMBER_CONFIG_KEYS(kKeys), make)
