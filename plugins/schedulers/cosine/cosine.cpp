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

class Cosine final : public WarmupScheduler {
 public:
  Cosine(ember::IHost& host, const ember::IConfig& cfg) : WarmupScheduler(host, cfg) {
    p_.eta_min = cfg.get_float("eta_min");
    p_.warmup_start_factor = cfg.get_float("warmup_start_factor");
  }

 protected:
  double lr_at(int64_t t, size_t g) const override {
    CosineParams p = p_;
    p.base_lr = base_lrs()[g];
    p.warmup = warmup();
    p.total = total();
    return cosine_warmup(p, t);
  }

 private:
  CosineParams p_;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new Cosine(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "cosine", "0.1.0", "Apache-2.0",
             "Cosine annealing of the learning rate after an optional linear warmup, per step or per epoch.",
             EMBER_CONFIG_KEYS(kKeys), make)
