// Plugin "reduce_on_plateau": torch.optim.lr_scheduler.ReduceLROnPlateau, stepped at the end of
// every training epoch with a logged metric (Lightning's `monitor`), after that epoch's
// validation.
//
// It is deliberately NOT a monitoring callback (monitors_metrics() = false): monitoring callbacks
// run after it in on_train_epoch_end, so the checkpoint written at an epoch end already holds this
// epoch's decision (learning rates, patience counters) and a resumed run continues exactly.
// Validation metrics and the training epoch metrics (<name>_epoch) are published before
// on_train_epoch_end; a metric that a callback logs in its own on_train_epoch_end is seen when
// that callback is named before this one.
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <ember/support/lr_schedule.h>
#include <ember/support/param_groups.h>
#include <ember/support/plugin_state.h>

namespace {

using namespace ember::support;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::String("monitor", "\"val_loss\"", "Logged metric to watch (e.g. val_loss, val_acc, train_loss_epoch)."),
    ember::key::String("mode", "\"min\"", "Reduce when the metric stops decreasing (min) or increasing (max).").choices("min|max"),
    ember::key::Float("factor", "0.1", "new_lr = lr * factor; must be below 1.").above(0).below(1),
    ember::key::Int("patience", "10", "Epochs without improvement that are tolerated before reducing.").at_least(0),
    ember::key::Float("threshold", "0.0001", "Least change that counts as an improvement.").at_least(0),
    ember::key::String("threshold_mode", "\"rel\"", "rel: best * (1 -/+ threshold); abs: best -/+ threshold.").choices("rel|abs"),
    ember::key::Int("cooldown", "0", "Epochs to wait after a reduction before counting bad epochs again.").at_least(0),
    ember::key::FloatList("min_lr", "[0.0]", "Lower bound of the learning rate: one value for all param groups, or one per group.").at_least(0),
    ember::key::Float("eps", "1e-08", "A reduction smaller than this is not applied.").at_least(0),
    ember::key::Float("base_lr", nullptr, "Starting learning rate; unset = the optimizer's lr at the start of training.").above(0),
    ember::key::Bool("strict", "true", "A missing monitor is an error (Lightning's strict); false: warn once and skip that epoch."),
};
// clang-format on

class ReduceOnPlateau final : public ember::Callback {
 public:
  ReduceOnPlateau(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host), name_(cfg.section()), monitor_(cfg.get_string("monitor")), strict_(cfg.get_bool("strict")) {
    if (monitor_.empty())
      throw ember::ConfigError("[" + name_ + "] monitor (" + cfg.where("monitor") + ") is empty: name a logged metric, e.g. monitor = \"val_loss\"");
    p_.mode_max = cfg.get_string("mode") == "max";
    p_.factor = cfg.get_float("factor");
    p_.patience = cfg.get_int("patience");
    p_.threshold = cfg.get_float("threshold");
    p_.threshold_abs = cfg.get_string("threshold_mode") == "abs";
    p_.cooldown = cfg.get_int("cooldown");
    p_.min_lrs = cfg.get_float_list("min_lr");
    if (p_.min_lrs.empty())
      throw ember::ConfigError("[" + name_ + "] min_lr (" + cfg.where("min_lr") + ") is empty: give one value, e.g. min_lr = [0.0]");
    p_.eps = cfg.get_float("eps");
    if (cfg.has("base_lr")) base_lr_ = cfg.get_float("base_lr");
    state_ = PlateauState::initial(p_);
  }

  void on_train_start(ember::ITrainer& t) override {
    auto& opt = t.optimizer();
    if (p_.min_lrs.size() != 1 && p_.min_lrs.size() != num_groups(opt))
      throw ember::ConfigError("[" + name_ + "] min_lr has " + std::to_string(p_.min_lrs.size()) + " values but the optimizer has " +
                               std::to_string(num_groups(opt)) + " param groups: give one value, or one per group");
    if (lrs_.empty()) {
      lrs_ = base_lr_ ? rates_keeping_ratios(opt, *base_lr_) : get_lrs(opt);  // base_lr is the first group's
    } else if (lrs_.size() != num_groups(opt)) {
      throw ember::RunError(name_ + ": the checkpoint has " + std::to_string(lrs_.size()) + " param groups, the optimizer " +
                            std::to_string(num_groups(opt)) + "; resume with the same model and optimizer");
    }
    write(t);
  }

  void on_train_epoch_end(ember::ITrainer& t) override {
    double value = 0;
    if (!t.metric(monitor_, &value)) {
      std::string names;
      for (const auto& n : t.metric_names()) names += (names.empty() ? "" : ", ") + n;
      const std::string msg = name_ + ": monitor '" + monitor_ + "' was not logged (available: " +
                              (names.empty() ? std::string("none") : names) + ")";
      if (strict_) throw ember::RunError(msg + "; set [" + name_ + "] monitor to one of them, or strict = false to skip such epochs");
      if (!warned_) host_.log(ember::LogLevel::warn, msg + "; skipping this epoch's step (strict = false)");
      warned_ = true;
      return;
    }
    const std::vector<double> before = lrs_;
    if (plateau_step(p_, state_, value, lrs_)) {
      char line[160];
      std::snprintf(line, sizeof line, "%s: '%s' did not improve for %lld epochs: lr %.6g -> %.6g", name_.c_str(),
                    monitor_.c_str(), static_cast<long long>(p_.patience + 1), before.front(), lrs_.front());
      host_.log(ember::LogLevel::info, line);
    }
    write(t);
  }

  c10::IValue state_dict() const override {
    auto d = new_state();
    d.insert("lrs", double_list(lrs_));
    d.insert("best", state_.best);
    d.insert("num_bad_epochs", state_.num_bad_epochs);
    d.insert("cooldown_counter", state_.cooldown_counter);
    d.insert("last_epoch", state_.last_epoch);
    d.insert("monitor", monitor_);
    return d;
  }

  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    StateReader r(state, name_);
    lrs_ = r.get_doubles("lrs");
    state_.best = r.get_double("best");
    state_.num_bad_epochs = r.get_int("num_bad_epochs");
    state_.cooldown_counter = r.get_int("cooldown_counter");
    state_.last_epoch = r.get_int("last_epoch");
    const std::string saved_monitor = r.get_string("monitor");
    if (saved_monitor != monitor_)
      host_.log(ember::LogLevel::warn, name_ + ": the checkpoint watched '" + saved_monitor + "', this run watches '" + monitor_ +
                                           "': the best value so far is kept as it was");
  }

 private:
  void write(ember::ITrainer& t) {
    auto& opt = t.optimizer();
    for (size_t g = 0; g < num_groups(opt); ++g) set_lr(opt, g, lrs_[g]);
  }

  ember::IHost& host_;
  std::string name_;
  std::string monitor_;
  bool strict_;
  PlateauParams p_;
  PlateauState state_;
  std::optional<double> base_lr_;
  std::vector<double> lrs_;
  bool warned_ = false;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new ReduceOnPlateau(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "reduce_on_plateau", "0.1.0", "Apache-2.0",
             "Reduces the learning rate when a logged metric stops improving (PyTorch's ReduceLROnPlateau).",
             EMBER_CONFIG_KEYS(kKeys), make)
