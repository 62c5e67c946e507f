// Plugin "early_stopping": Lightning's EarlyStopping. Watches a logged metric and asks the loop
// to stop when it has not improved for `patience` checks, reached a goal, diverged or became
// non-finite. The decision itself lives in criteria.h; this file is the glue (when to check,
// config, state across --resume).
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <string>
#include <vector>

#include "criteria.h"

namespace {

namespace es = ember_early_stopping;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::String("monitor", nullptr,
        "Logged metric to watch (required), e.g. \"val_loss\"."),
    ember::key::String("mode", "\"min\"",
        "Whether the metric should go down (min) or up (max).").choices("min|max"),
    ember::key::Float("min_delta", "0.0",
        "Smallest change that counts as an improvement.").at_least(0.0),
    ember::key::Int("patience", "3",
        "Checks without improvement before stopping (checks, not epochs: with val_check_interval < 1 there are several per epoch).").at_least(0),
    ember::key::Bool("strict", "true",
        "A missing monitored metric is an error (true) or a warning, once (false)."),
    ember::key::Bool("check_finite", "true",
        "Stop when the metric becomes NaN or infinite."),
    ember::key::Float("stopping_threshold", nullptr,
        "Stop as soon as the metric is better than this (a goal reached); unset = off."),
    ember::key::Float("divergence_threshold", nullptr,
        "Stop as soon as the metric is worse than this (training diverged); unset = off."),
    ember::key::Bool("check_on_train_epoch_end", nullptr,
        "Check at the end of each training epoch (true) or after each validation (false); unset = Lightning's choice: at epoch end when validation runs once per epoch at its end or not at all, else after each validation."),
    ember::key::Bool("verbose", "false",
        "Log every check's outcome (improvements too), not only the stop."),
};
// clang-format on

class EarlyStopping final : public ember::Callback {
 public:
  EarlyStopping(ember::IHost& host, const ember::IConfig& cfg) : host_(host), criteria_(read(cfg)) {
    strict_ = cfg.get_bool("strict");
    verbose_ = cfg.get_bool("verbose");
    if (cfg.has("check_on_train_epoch_end")) check_on_train_epoch_end_ = cfg.get_bool("check_on_train_epoch_end");
  }

  bool monitors_metrics() const override { return true; }

  // Where to check, Lightning's rule: at the end of each training epoch when validation runs
  // once per epoch at its end (then train and validation metrics are both there), after each
  // validation when it runs mid-epoch or every few epochs, and at epoch end without validation.
  // check_on_train_epoch_end = true / false forces one of the two.
  void on_train_batch_end(ember::ITrainer& trainer) override { last_train_batch_ = trainer.batch_idx(); }

  void on_train_epoch_end(ember::ITrainer& trainer) override {
    const bool forced = check_on_train_epoch_end_.value_or(false);
    const bool no_validation = !check_on_train_epoch_end_ && trainer.num_batches(ember::Split::val) == 0;
    if (forced || no_validation || deferred_) check(trainer);
    deferred_ = false;
  }

  void on_validation_end(ember::ITrainer& trainer) override {
    if (trainer.sanity_checking() || trainer.stage() != ember::Stage::validate) return;
    if (check_on_train_epoch_end_) {
      if (!*check_on_train_epoch_end_) check(trainer);
      return;
    }
    // The validation at the end of an epoch: check with the epoch's training metrics, right
    // after them (on_train_epoch_end follows).
    if (last_train_batch_ + 1 == trainer.num_training_batches()) deferred_ = true;
    else check(trainer);
  }

  // {monitor, mode, wait_count, stopped_epoch, best_score, patience} (Lightning's keys plus the
  // monitor and mode, which Lightning keeps in the state key).
  c10::IValue state_dict() const override {
    const auto& s = criteria_.state();
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert(std::string("monitor"), criteria_.settings().monitor);
    d.insert(std::string("mode"), std::string(criteria_.settings().mode == es::Mode::min ? "min" : "max"));
    d.insert(std::string("wait_count"), s.wait_count);
    d.insert(std::string("stopped_epoch"), s.stopped_epoch);
    d.insert(std::string("best_score"), s.best_score);
    d.insert(std::string("patience"), criteria_.settings().patience);
    return d;
  }

  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    if (!state.isGenericDict()) throw ember::RunError("early_stopping: malformed state in the checkpoint (not a dict)");
    const auto d = state.toGenericDict();
    auto get = [&](const char* k) -> c10::IValue {
      auto it = d.find(c10::IValue(std::string(k)));
      if (it == d.end()) throw ember::RunError(std::string("early_stopping: malformed state in the checkpoint ('") + k + "' missing)");
      return it->value();
    };
    const std::string monitor = get("monitor").toStringRef();
    const std::string mode = get("mode").toStringRef();
    const std::string my_mode = criteria_.settings().mode == es::Mode::min ? "min" : "max";
    if (monitor != criteria_.settings().monitor || mode != my_mode) {
      // Lightning keys the state by monitor and mode: another setting starts afresh.
      host_.log(ember::LogLevel::warn, "early_stopping: the checkpoint watched " + monitor + " (" + mode + "), this run " +
                                           criteria_.settings().monitor + " (" + my_mode + "); starting without its history");
      return;
    }
    auto& s = criteria_.state();
    s.wait_count = get("wait_count").toInt();
    s.stopped_epoch = get("stopped_epoch").toInt();
    s.best_score = get("best_score").toDouble();
    // patience: the configured value wins, so a resumed run can be given more (or less).
  }

 private:
  static es::Settings read(const ember::IConfig& cfg) {
    if (!cfg.has("monitor") || cfg.get_string("monitor").empty())
      throw ember::ConfigError("early_stopping.monitor is required: name the logged metric to watch, e.g. "
                               "[early_stopping] monitor = \"val_loss\"");
    es::Settings s;
    s.monitor = cfg.get_string("monitor");
    s.mode = cfg.get_string("mode") == "max" ? es::Mode::max : es::Mode::min;
    s.min_delta = cfg.get_float("min_delta");
    s.patience = cfg.get_int("patience");
    s.check_finite = cfg.get_bool("check_finite");
    if (cfg.has("stopping_threshold")) s.stopping_threshold = cfg.get_float("stopping_threshold");
    if (cfg.has("divergence_threshold")) s.divergence_threshold = cfg.get_float("divergence_threshold");
    if (s.stopping_threshold && s.divergence_threshold) {
      const bool ok = s.mode == es::Mode::min ? *s.stopping_threshold < *s.divergence_threshold
                                              : *s.stopping_threshold > *s.divergence_threshold;
      if (!ok)
        throw ember::ConfigError("early_stopping.stopping_threshold (" + cfg.where("stopping_threshold") +
                                 ") must be " + (s.mode == es::Mode::min ? "below" : "above") +
                                 " divergence_threshold (" + cfg.where("divergence_threshold") + ") for mode = \"" +
                                 cfg.get_string("mode") + "\": swap them or check the mode");
    }
    return s;
  }

  void check(ember::ITrainer& trainer) {
    const std::string& m = criteria_.settings().monitor;
    double current = 0;
    if (!trainer.metric(m, &current)) {
      std::string names;
      for (const auto& n : trainer.metric_names()) names += (names.empty() ? "" : ", ") + n;
      const std::string msg = "early_stopping: monitor '" + m + "' is not a logged metric; available: " +
                              (names.empty() ? std::string("(none yet)") : names) +
                              " (set [early_stopping] monitor to one of them" +
                              (strict_ ? ", or strict = false to only warn)" : ")");
      if (strict_) throw ember::RunError(msg);
      if (!warned_) host_.log(ember::LogLevel::warn, msg);
      warned_ = true;
      return;
    }
    const es::Decision d = criteria_.evaluate(current);
    if (d.stop) {
      criteria_.state().stopped_epoch = trainer.current_epoch();
      trainer.request_stop("early_stopping: " + d.reason);
    } else if (verbose_ && !d.reason.empty()) {
      host_.log(ember::LogLevel::info, "early_stopping: " + d.reason);
    } else if (verbose_) {
      host_.log(ember::LogLevel::info, "early_stopping: " + m + " did not improve (" +
                                           std::to_string(criteria_.state().wait_count) + " of " +
                                           std::to_string(criteria_.settings().patience) + ")");
    }
  }

  ember::IHost& host_;
  es::Criteria criteria_;
  bool strict_ = true, verbose_ = false, warned_ = false;
  std::optional<bool> check_on_train_epoch_end_;
  int64_t last_train_batch_ = -1;
  bool deferred_ = false;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new EarlyStopping(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "early_stopping", "0.1.0", "Apache-2.0",
             "Stops training when a monitored metric stops improving (Lightning's EarlyStopping).",
             EMBER_CONFIG_KEYS(kKeys), make)
