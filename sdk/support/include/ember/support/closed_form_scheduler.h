// The common part of the closed-form scheduler plugins (cyclic_lr, one_cycle, cosine, linear_lr,
// step_lr):
// when the learning rate is written, the position counter, base learning rates and the
// state_dict. A subclass only says what the rate (and momentum) is at position t.
//
// Position t is the number of optimizer steps taken so far (interval "step") or the epoch index
// (interval "epoch"); the rate f(t) is in the optimizer before the step/epoch t runs:
//   on_train_start        step interval: writes f(count), so the first step already uses it
//   on_train_batch_end    step interval: only when the batch completed an optimizer step that the
//                         precision handler did not skip (inf/NaN gradients); then count += 1
//                         and f(count) is written for the next step
//   on_train_epoch_start  epoch interval: writes f(current_epoch)
//   on_train_epoch_end    epoch interval: writes f(current_epoch + 1) (PyTorch's epoch-end step)
// The count and the base rates are the state_dict, so a resumed run continues the schedule
// exactly (the epoch interval needs no count: the epoch index is part of the loop's state).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/trainer.h>

#include <torch/optim/optimizer.h>

#include <ember/support/param_groups.h>
#include <ember/support/plugin_state.h>

namespace ember::support {

enum class Interval { step, epoch };

[[noreturn]] inline void config_error(const ember::IConfig& cfg, const std::string& key, const std::string& problem,
                                      const std::string& fix) {
  throw ember::ConfigError("[" + cfg.section() + "] " + key + " (" + cfg.where(key) + "): " + problem + "; " + fix);
}

inline Interval read_interval(const ember::IConfig& cfg) {
  return cfg.get_string("interval") == "epoch" ? Interval::epoch : Interval::step;
}

// A required key the schema gives no default.
inline double required_float(const ember::IConfig& cfg, const std::string& key, const std::string& example) {
  if (!cfg.has(key))
    throw ember::ConfigError("[" + cfg.section() + "] " + key + " is required: set it, e.g. " + key + " = " + example);
  return cfg.get_float(key);
}

// Optimizer steps (interval step) or epochs (interval epoch) of the whole run, as Lightning's
// trainer.estimated_stepping_batches counts them: ceil(batches / accumulate) per epoch, times
// max_epochs, capped by max_steps.
inline int64_t estimated_total(ember::ITrainer& t, Interval interval, const std::string& section,
                               const std::string& key) {
  if (interval == Interval::epoch) {
    if (t.max_epochs() < 0)
      throw ember::ConfigError("[" + section + "] " + key + " is unset and trainer.max_epochs is unlimited: set " +
                               section + "." + key + " (epochs) or trainer.max_epochs");
    return t.max_epochs();
  }
  const int64_t accum = std::max<int64_t>(1, ember::trainer_service<ember::ITrainerSettings>(t, "a scheduler").accumulate_grad_batches());
  const int64_t per_epoch = (t.num_training_batches() + accum - 1) / accum;
  if (t.max_epochs() < 0 && t.max_steps() < 0)
    throw ember::ConfigError("[" + section + "] " + key + " is unset and neither trainer.max_epochs nor trainer.max_steps " +
                             "limits the run: set " + section + "." + key + " (optimizer steps)");
  int64_t total = t.max_epochs() >= 0 ? per_epoch * std::max<int64_t>(t.max_epochs(), 1) : t.max_steps();
  if (t.max_steps() >= 0) total = std::min(total, t.max_steps());
  return total;
}

class ClosedFormScheduler : public ember::Callback {
 public:
  ClosedFormScheduler(ember::IHost& host, const ember::IConfig& cfg, Interval interval)
      : host_(host), name_(cfg.section()), interval_(interval) {
    if (cfg.has("base_lr")) cfg_base_lr_ = cfg.get_float("base_lr");
  }

  void on_train_start(ember::ITrainer& t) override {
    auto& opt = t.optimizer();
    if (base_lrs_.empty()) {
      // The optimizer's rate at the start of the first fit ([optimizer] lr), unless configured:
      // then it is the first group's, and the others keep their ratio to it.
      base_lrs_ = cfg_base_lr_ ? rates_keeping_ratios(opt, *cfg_base_lr_) : get_lrs(opt);
    } else if (base_lrs_.size() != num_groups(opt)) {
      throw ember::RunError(name_ + ": the checkpoint has " + std::to_string(base_lrs_.size()) +
                            " param groups, the optimizer " + std::to_string(num_groups(opt)) +
                            "; resume with the same model and optimizer");
    }
    if (cycles_momentum()) {
      for (size_t g = 0; g < num_groups(opt); ++g)
        if (!get_momentum(opt, g))
          throw ember::ConfigError("[" + name_ + "] cycle_momentum = true, but the optimizer " + optimizer_name(opt) +
                                   " has no momentum (only sgd, rmsprop and adam/adamw's beta1): set " + name_ +
                                   ".cycle_momentum = false");
    }
    prepare(t);
    if (interval_ == Interval::step) apply(t, count_);
  }

  void on_train_epoch_start(ember::ITrainer& t) override {
    if (interval_ == Interval::epoch) apply(t, t.current_epoch());
  }

  void on_train_batch_end(ember::ITrainer& t) override {
    if (interval_ != Interval::step || !t.optimizer_stepped() || t.optimizer_step_skipped()) return;
    ++count_;
    apply(t, count_);
  }

  void on_train_epoch_end(ember::ITrainer& t) override {
    if (interval_ == Interval::epoch) apply(t, t.current_epoch() + 1);
  }

  c10::IValue state_dict() const override {
    auto d = new_state();
    d.insert("base_lrs", double_list(base_lrs_));
    d.insert("step_count", count_);
    save_extra(d);
    return d;
  }

  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    StateReader r(state, name_);
    base_lrs_ = r.get_doubles("base_lrs");
    count_ = r.get_int("step_count");
    load_extra(r);
  }

 protected:
  // Called at on_train_start, once base_lrs() are known: resolve totals, check settings.
  virtual void prepare(ember::ITrainer& t) = 0;
  virtual double lr_at(int64_t t, size_t group) const = 0;
  // Group g's base rate over group 0's: what a rate configured for the whole optimizer (max_lr) is
  // multiplied by for group g.
  double ratio(size_t g) const { return base_lrs_.empty() || base_lrs_[0] <= 0 ? 1.0 : base_lrs_.at(g) / base_lrs_[0]; }
  virtual bool cycles_momentum() const { return false; }
  virtual double momentum_at(int64_t /*t*/, size_t /*group*/) const { return 0.0; }
  // Settings resolved at the first fit that a resumed run must keep (e.g. the cycle length).
  virtual void save_extra(StateDict&) const {}
  virtual void load_extra(const StateReader&) {}

  const std::vector<double>& base_lrs() const { return base_lrs_; }
  Interval interval() const { return interval_; }
  const std::string& name() const { return name_; }
  ember::IHost& host() { return host_; }

 private:
  void apply(ember::ITrainer& t, int64_t pos) {
    auto& opt = t.optimizer();
    for (size_t g = 0; g < num_groups(opt); ++g) {
      set_lr(opt, g, lr_at(pos, g));
      if (cycles_momentum()) set_momentum(opt, g, momentum_at(pos, g));
    }
  }

  ember::IHost& host_;
  std::string name_;
  Interval interval_;
  std::optional<double> cfg_base_lr_;
  std::vector<double> base_lrs_;
  int64_t count_ = 0;
};

// A schedule with a warmup inside a length (cosine, linear_lr): the keys `warmup` and `total`
// (unset = the run's length, estimated_total), checked against each other, the length resolved
// when training first starts and kept across a resume.
class WarmupScheduler : public ClosedFormScheduler {
 public:
  WarmupScheduler(ember::IHost& host, const ember::IConfig& cfg) : ClosedFormScheduler(host, cfg, read_interval(cfg)) {
    warmup_ = cfg.get_int("warmup");
    if (cfg.has("total")) configured_total_ = cfg.get_int("total");
    if (configured_total_ > 0 && warmup_ >= configured_total_)
      config_error(cfg, "warmup", "warmup = " + std::to_string(warmup_) + " is not shorter than total = " + std::to_string(configured_total_),
                   "make the warmup shorter than the schedule");
  }

 protected:
  int64_t warmup() const { return warmup_; }
  int64_t total() const { return total_; }
  void prepare(ember::ITrainer& t) override {
    if (total_ <= 0) total_ = configured_total_ > 0 ? configured_total_ : estimated_total(t, interval(), name(), "total");
    if (warmup_ >= total_)
      throw ember::ConfigError("[" + name() + "] warmup = " + std::to_string(warmup_) + " is not shorter than the run (" + std::to_string(total_) +
                               (interval() == Interval::step ? " steps" : " epochs") + "): shorten the warmup or set total");
  }
  void save_extra(StateDict& d) const override { d.insert("total", total_); }
  void load_extra(const StateReader& r) override { total_ = r.get_int("total"); }

 private:
  int64_t warmup_ = 0, configured_total_ = 0, total_ = 0;
};

}  // namespace ember::support
