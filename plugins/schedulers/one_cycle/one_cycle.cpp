// Plugin "one_cycle": torch.optim.lr_scheduler.OneCycleLR, stepped after every optimizer step.
// total_steps defaults to Lightning's estimated_stepping_batches (see <ember/support/closed_form_scheduler.h>).
#include <ember/plugin.h>

#include <stdexcept>

#include <ember/support/closed_form_scheduler.h>
#include <ember/support/lr_schedule.h>

namespace {

using namespace ember::support;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Float("max_lr", nullptr, "Peak learning rate (required); the cycle starts at max_lr / div_factor.").above(0),
    ember::key::Int("total_steps", nullptr, "Optimizer steps in the cycle; unset = max_epochs * ceil(batches / accumulate_grad_batches), capped by max_steps.").at_least(1),
    ember::key::Float("pct_start", "0.3", "Fraction of the cycle spent increasing the learning rate.").above(0).below(1),
    ember::key::String("anneal_strategy", "\"cos\"", "Cosine or linear annealing between the phases.").choices("cos|linear"),
    ember::key::Bool("cycle_momentum", "true", "Cycle momentum (beta1 for adam/adamw) inversely to the learning rate; set false for optimizers without momentum."),
    ember::key::Float("base_momentum", "0.85", "Lowest momentum (at max_lr).").at_least(0),
    ember::key::Float("max_momentum", "0.95", "Highest momentum (at the start and end).").at_least(0),
    ember::key::Float("div_factor", "25.0", "initial_lr = max_lr / div_factor.").above(0),
    ember::key::Float("final_div_factor", "10000.0", "min_lr = initial_lr / final_div_factor.").above(0),
    ember::key::Bool("three_phase", "false", "Use a third phase that anneals from initial_lr to min_lr (fast.ai's shape) instead of two phases."),
};
// clang-format on

class OneCycle final : public ClosedFormScheduler {
 public:
  OneCycle(ember::IHost& host, const ember::IConfig& cfg) : ClosedFormScheduler(host, cfg, Interval::step) {
    p_.max_lr = required_float(cfg, "max_lr", "0.01");
    if (cfg.has("total_steps")) configured_total_ = cfg.get_int("total_steps");
    p_.pct_start = cfg.get_float("pct_start");
    p_.anneal_strategy = cfg.get_string("anneal_strategy") == "linear" ? Anneal::linear : Anneal::cos;
    cycle_momentum_ = cfg.get_bool("cycle_momentum");
    p_.base_momentum = cfg.get_float("base_momentum");
    p_.max_momentum = cfg.get_float("max_momentum");
    p_.div_factor = cfg.get_float("div_factor");
    p_.final_div_factor = cfg.get_float("final_div_factor");
    p_.three_phase = cfg.get_bool("three_phase");
  }

 protected:
  void prepare(ember::ITrainer& t) override {
    // A resumed run keeps the cycle it started with (PyTorch keeps total_steps in its state too).
    if (p_.total_steps <= 0)
      p_.total_steps = configured_total_ > 0 ? configured_total_ : estimated_total(t, Interval::step, name(), "total_steps");
    // Each phase must span at least one step, or PyTorch's formula divides by zero.
    const double up_end = p_.pct_start * static_cast<double>(p_.total_steps) - 1.0;
    if (up_end <= 0.0 || up_end >= static_cast<double>(p_.total_steps) - 1.0)
      throw ember::ConfigError("[" + name() + "] total_steps = " + std::to_string(p_.total_steps) + " with pct_start = " +
                               std::to_string(p_.pct_start) + " leaves a phase without steps: use more steps or another pct_start");
  }
  // max_lr is the first group's; the others keep the ratio their rates started with.
  double lr_at(int64_t t, size_t g) const override { return at(t).lr * ratio(g); }
  void save_extra(StateDict& d) const override { d.insert("total_steps", p_.total_steps); }
  void load_extra(const StateReader& r) override { p_.total_steps = r.get_int("total_steps"); }
  bool cycles_momentum() const override { return cycle_momentum_; }
  double momentum_at(int64_t t, size_t) const override { return at(t).momentum; }

 private:
  LrMomentum at(int64_t t) const {
    try {
      return one_cycle(p_, t);
    } catch (const std::out_of_range&) {
      // PyTorch raises too ("Tried to step N times"): the cycle was sized for a shorter run.
      throw ember::RunError(name() + ": optimizer step " + std::to_string(t) + " is past the cycle's total_steps = " +
                            std::to_string(p_.total_steps) + "; set [" + name() + "] total_steps to the run's length " +
                            "(a resumed run with a larger max_epochs/max_steps needs it)");
    }
  }

  OneCycleParams p_;
  int64_t configured_total_ = 0;
  bool cycle_momentum_ = true;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new OneCycle(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "one_cycle", "0.1.0", "Apache-2.0",
             "One-cycle learning rate and momentum per optimizer step (PyTorch's OneCycleLR).",
             EMBER_CONFIG_KEYS(kKeys), make)
