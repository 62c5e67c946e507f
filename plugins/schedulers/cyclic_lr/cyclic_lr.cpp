// Plugin "cyclic_lr": torch.optim.lr_scheduler.CyclicLR (triangular, triangular2, exp_range) with
// optional momentum cycling, stepped after every optimizer step. A callback that writes the
// optimizer's param-group learning rates (see <ember/support/closed_form_scheduler.h> for when).
#include <ember/plugin.h>

#include <ember/support/closed_form_scheduler.h>
#include <ember/support/lr_schedule.h>

namespace {

using namespace ember::support;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Float("base_lr", nullptr, "Lower bound of the cycle; unset = the optimizer's lr at the start of training.").above(0),
    ember::key::Float("max_lr", nullptr, "Upper bound of the cycle (required).").above(0),
    ember::key::Int("step_size_up", "2000", "Optimizer steps from base_lr up to max_lr.").at_least(1),
    ember::key::Int("step_size_down", nullptr, "Optimizer steps from max_lr back down; unset = step_size_up.").at_least(1),
    ember::key::String("mode", "\"triangular\"", "triangular: constant amplitude; triangular2: amplitude halves every cycle; exp_range: amplitude * gamma^step.").choices("triangular|triangular2|exp_range"),
    ember::key::Float("gamma", "1.0", "Amplitude decay per optimizer step for mode exp_range.").above(0),
    ember::key::Bool("cycle_momentum", "true", "Cycle momentum (beta1 for adam/adamw) inversely to the learning rate, like PyTorch; set false for optimizers without momentum."),
    ember::key::Float("base_momentum", "0.8", "Lowest momentum (at max_lr).").at_least(0),
    ember::key::Float("max_momentum", "0.9", "Highest momentum (at base_lr).").at_least(0),
};
// clang-format on

class CyclicLr final : public ClosedFormScheduler {
 public:
  CyclicLr(ember::IHost& host, const ember::IConfig& cfg) : ClosedFormScheduler(host, cfg, Interval::step) {
    p_.max_lr = required_float(cfg, "max_lr", "0.01");
    p_.step_size_up = cfg.get_int("step_size_up");
    p_.step_size_down = cfg.has("step_size_down") ? cfg.get_int("step_size_down") : p_.step_size_up;
    const std::string mode = cfg.get_string("mode");
    p_.mode = mode == "triangular2" ? CyclicMode::triangular2 : mode == "exp_range" ? CyclicMode::exp_range : CyclicMode::triangular;
    p_.gamma = cfg.get_float("gamma");
    cycle_momentum_ = cfg.get_bool("cycle_momentum");
    p_.base_momentum = cfg.get_float("base_momentum");
    p_.max_momentum = cfg.get_float("max_momentum");
    if (cycle_momentum_ && p_.base_momentum > p_.max_momentum)
      config_error(cfg, "base_momentum", "base_momentum = " + std::to_string(p_.base_momentum) + " is above max_momentum = " +
                                             std::to_string(p_.max_momentum), "make base_momentum <= max_momentum");
  }

 protected:
  void prepare(ember::ITrainer&) override {}
  double lr_at(int64_t t, size_t g) const override {
    CyclicParams p = p_;
    p.base_lr = base_lrs()[g];
    p.max_lr = p_.max_lr * ratio(g);  // max_lr is the first group's; the others keep their ratio
    return cyclic_lr(p, t);
  }
  bool cycles_momentum() const override { return cycle_momentum_; }
  double momentum_at(int64_t t, size_t) const override { return cyclic_momentum(p_, t); }

 private:
  CyclicParams p_;
  bool cycle_momentum_ = true;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new CyclicLr(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "cyclic_lr", "0.1.0", "Apache-2.0",
             "Cyclical learning rate per optimizer step (PyTorch's CyclicLR: triangular, triangular2, exp_range).",
             EMBER_CONFIG_KEYS(kKeys), make)
