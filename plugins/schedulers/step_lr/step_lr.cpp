// Plugin "step_lr": torch.optim.lr_scheduler.StepLR: the rate is multiplied by gamma every
// step_size epochs (or optimizer steps with interval = "step").
#include <ember/plugin.h>

#include <ember/support/closed_form_scheduler.h>
#include <ember/support/lr_schedule.h>

namespace {

using namespace ember::support;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Float("base_lr", nullptr, "Starting learning rate; unset = the optimizer's lr at the start of training.").above(0),
    ember::key::Int("step_size", nullptr, "Decay every this many epochs (or optimizer steps with interval = \"step\"); required.").at_least(1),
    ember::key::Float("gamma", "0.1", "Multiplicative decay factor.").above(0),
    ember::key::String("interval", "\"epoch\"", "Count epochs (Lightning's default interval) or optimizer steps.").choices("step|epoch"),
};
// clang-format on

class StepLr final : public ClosedFormScheduler {
 public:
  StepLr(ember::IHost& host, const ember::IConfig& cfg) : ClosedFormScheduler(host, cfg, read_interval(cfg)) {
    if (!cfg.has("step_size"))
      throw ember::ConfigError("[" + cfg.section() + "] step_size is required: set it, e.g. step_size = 10");
    step_size_ = cfg.get_int("step_size");
    gamma_ = cfg.get_float("gamma");
  }

 protected:
  void prepare(ember::ITrainer&) override {}
  double lr_at(int64_t t, size_t g) const override { return step_lr(base_lrs()[g], step_size_, gamma_, t); }

 private:
  int64_t step_size_ = 1;
  double gamma_ = 0.1;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new StepLr(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "step_lr", "0.1.0", "Apache-2.0",
             "Decays the learning rate by gamma every step_size epochs or steps (PyTorch's StepLR).",
             EMBER_CONFIG_KEYS(kKeys), make)
