// Plugin "linear_lr": a linear warmup, then a linear decay to base_lr * end_factor at the end of
// the run, per optimizer step or per epoch: transformers' get_linear_schedule_with_warmup (the
// schedule its Trainer and most BERT fine-tuning recipes use) with the default factors, PyTorch's
// SequentialLR of two LinearLRs with others. The length defaults to the run's (Lightning's
// estimated_stepping_batches, or max_epochs for the epoch interval).
#include <ember/plugin.h>

#include <ember/support/closed_form_scheduler.h>
#include <ember/support/lr_schedule.h>

namespace {

using namespace ember::support;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Float("base_lr", nullptr, "Peak learning rate (after warmup); unset = the optimizer's lr at the start of training.").above(0),
    ember::key::Int("warmup", "0", "Warmup length in interval units (steps or epochs); 0 = the decay starts at once (transformers' warmup_steps).").at_least(0),
    ember::key::Float("warmup_start_factor", "0.0", "The warmup starts at base_lr * this factor (transformers: 0, so the first step's rate is 0).").at_least(0).at_most(1),
    ember::key::Float("end_factor", "0.0", "The rate at the end of the schedule (and after it) is base_lr * this factor (transformers: 0).").at_least(0).at_most(1),
    ember::key::Int("total", nullptr, "Schedule length in interval units, warmup included; unset = the run's optimizer steps (max_epochs * ceil(batches / accumulate), capped by max_steps) or max_epochs.").at_least(1),
    ember::key::String("interval", "\"step\"", "Advance after every optimizer step or at the end of every epoch.").choices("step|epoch"),
};
// clang-format on

class LinearLr final : public WarmupScheduler {
 public:
  LinearLr(ember::IHost& host, const ember::IConfig& cfg) : WarmupScheduler(host, cfg) {
    p_.warmup_start_factor = cfg.get_float("warmup_start_factor");
    p_.end_factor = cfg.get_float("end_factor");
  }

 protected:
  double lr_at(int64_t t, size_t g) const override {
    LinearParams p = p_;
    p.base_lr = base_lrs()[g];
    p.warmup = warmup();
    p.total = total();
    return linear_warmup_decay(p, t);
  }

 private:
  LinearParams p_;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new LinearLr(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "linear_lr", "0.1.0", "Apache-2.0",
             "Linear warmup then linear decay of the learning rate (transformers' default schedule), per step or per epoch.",
             EMBER_CONFIG_KEYS(kKeys), make)
