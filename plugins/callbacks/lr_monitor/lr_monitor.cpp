// Plugin "lr_monitor": Lightning's LearningRateMonitor. Logs the learning rate (and optionally
// momentum and weight decay) of every param group under Lightning's names: "lr-SGD", "lr-Adam",
// or "lr-Adam/pg1", "lr-Adam/pg2" for several groups; "<name>-momentum", "<name>-weight_decay".
//
// It reads the optimizer in on_before_optimizer_step, i.e. after every callback's
// on_train_batch_start and right before the update: the value logged is the one that step used,
// whatever order schedulers and swa were named in. Per step it logs like self.log(on_step=True):
// loggers receive it every trainer.log_every_n_steps steps, at the step's index. Per epoch it logs
// once, at the first optimizer step of the epoch.
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include <ember/support/param_groups.h>

namespace {

using namespace ember::support;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::String("logging_interval", "\"step\"", "Log at every optimizer step (sent every trainer.log_every_n_steps) or once per epoch.").choices("step|epoch"),
    ember::key::Bool("log_momentum", "false", "Also log momentum (beta1 for adam/adamw; 0 for optimizers without momentum) as <name>-momentum."),
    ember::key::Bool("log_weight_decay", "false", "Also log weight decay as <name>-weight_decay."),
    ember::key::String("log_key_prefix", "\"lr-\"", "Prefix of the logged names, before the optimizer's class name."),
};
// clang-format on

class LrMonitor final : public ember::Callback {
 public:
  explicit LrMonitor(const ember::IConfig& cfg)
      : per_epoch_(cfg.get_string("logging_interval") == "epoch"),
        log_momentum_(cfg.get_bool("log_momentum")),
        log_weight_decay_(cfg.get_bool("log_weight_decay")),
        prefix_(cfg.get_string("log_key_prefix")) {}

  void on_train_epoch_start(ember::ITrainer&) override { logged_this_epoch_ = false; }

  void on_before_optimizer_step(ember::ITrainer& t) override {
    if (per_epoch_ && logged_this_epoch_) return;
    logged_this_epoch_ = true;
    for (const auto& [name, value] : stats(t.optimizer())) {
      if (per_epoch_) {
        t.log_metric(name, value);
      } else {
        ember::LogOptions o;
        o.on_step = 1;
        o.on_epoch = 0;
        t.log_tensor(name, at::scalar_tensor(value, at::kDouble), o);
      }
    }
  }

 private:
  std::vector<std::pair<std::string, double>> stats(const torch::optim::Optimizer& opt) const {
    std::vector<std::pair<std::string, double>> out;
    const std::string base = prefix_ + optimizer_name(opt);
    const size_t n = num_groups(opt);
    for (size_t g = 0; g < n; ++g) {
      const std::string name = n > 1 ? base + "/pg" + std::to_string(g + 1) : base;
      out.emplace_back(name, get_lr(opt, g));
      if (log_momentum_) out.emplace_back(name + "-momentum", get_momentum(opt, g).value_or(0.0));
      if (log_weight_decay_) out.emplace_back(name + "-weight_decay", get_weight_decay(opt, g).value_or(0.0));
    }
    return out;
  }

  bool per_epoch_;
  bool log_momentum_;
  bool log_weight_decay_;
  std::string prefix_;
  bool logged_this_epoch_ = false;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new LrMonitor(cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "lr_monitor", "0.1.0", "Apache-2.0",
             "Logs the learning rate (and momentum, weight decay) of every param group (Lightning's LearningRateMonitor).",
             EMBER_CONFIG_KEYS(kKeys), make)
