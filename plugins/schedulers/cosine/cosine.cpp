// Plugin "cosine": cosine annealing (PyTorch's CosineAnnealingLR) after an optional linear warmup
// (PyTorch's LinearLR), per optimizer step or per epoch. The length defaults to the run's
// (Lightning's estimated_stepping_batches, or max_epochs for the epoch interval).
#include <ember/plugin.h>

#include <ember/support/closed_form_scheduler.h>
#include <ember/support/lr_schedule.h>

namespace {

using namespace ember::support;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Float("base_lr", nullptr, "Peak learning rate (after warmup); unset = the optimizer's lr at the start of training.").above(0),
    ember::key::Float("eta_min", "0.0", "Learning rate at the end of the schedule (and after it).").at_least(0),
    ember::key::Int("warmup", "0", "Warmup length in interval units (steps or epochs); 0 = no warmup.").at_least(0),
    ember::key::Float("warmup_start_factor", "0.3333333333333333", "The warmup starts at base_lr * this factor and rises linearly to base_lr (PyTorch LinearLR's start_factor).").above(0).at_most(1),
    ember::key::Int("total", nullptr, "Schedule length in interval units, warmup included; unset = the run's optimizer steps (max_epochs * ceil(batches / accumulate), capped by max_steps) or max_epochs.").at_least(1),
    ember::key::String("interval", "\"step\"", "Advance after every optimizer step or at the end of every epoch.").choices("step|epoch"),
};
// clang-format on

class Cosine final : public ClosedFormScheduler {
 public:
  Cosine(ember::IHost& host, const ember::IConfig& cfg) : ClosedFormScheduler(host, cfg, read_interval(cfg)) {
    p_.eta_min = cfg.get_float("eta_min");
    p_.warmup = cfg.get_int("warmup");
    p_.warmup_start_factor = cfg.get_float("warmup_start_factor");
    if (cfg.has("total")) configured_total_ = cfg.get_int("total");
    if (configured_total_ > 0 && p_.warmup >= configured_total_)
      config_error(cfg, "warmup", "warmup = " + std::to_string(p_.warmup) + " is not shorter than total = " +
                                      std::to_string(configured_total_), "make the warmup shorter than the schedule");
  }

 protected:
  void prepare(ember::ITrainer& t) override {
    if (p_.total <= 0)
      p_.total = configured_total_ > 0 ? configured_total_ : estimated_total(t, interval(), name(), "total");
    if (p_.warmup >= p_.total)
      throw ember::ConfigError("[" + name() + "] warmup = " + std::to_string(p_.warmup) + " is not shorter than the run (" +
                               std::to_string(p_.total) + (interval() == Interval::step ? " steps" : " epochs") +
                               "): shorten the warmup or set total");
  }
  double lr_at(int64_t t, size_t g) const override {
    CosineParams p = p_;
    p.base_lr = base_lrs()[g];
    return cosine_warmup(p, t);
  }
  void save_extra(StateDict& d) const override { d.insert("total", p_.total); }
  void load_extra(const StateReader& r) override { p_.total = r.get_int("total"); }

 private:
  CosineParams p_;
  int64_t configured_total_ = 0;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new Cosine(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "cosine", "0.1.0", "Apache-2.0",
             "Cosine annealing of the learning rate after an optional linear warmup, per step or per epoch.",
             EMBER_CONFIG_KEYS(kKeys), make)
