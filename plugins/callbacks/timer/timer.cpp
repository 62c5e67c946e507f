// Plugin "timer": Lightning's Timer. Stops training once the time spent in it reaches
// `duration`, checked after every step or every epoch. Time spent before a --resume counts.
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>

#include <ember/support/duration.h>

namespace {

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::String("duration", nullptr,
        "Training time limit as \"DD:HH:MM:SS\" (required), e.g. \"00:12:00:00\" for 12 hours; seconds may have a fraction."),
    ember::key::String("interval", "\"step\"",
        "Check after every optimizer step or every epoch.").choices("step|epoch"),
    ember::key::Bool("verbose", "true",
        "Log the elapsed time when the limit is reached."),
};
// clang-format on

using Clock = std::chrono::steady_clock;

std::string hms(double seconds) {
  const auto s = static_cast<long long>(seconds);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%02lld:%02lld:%02lld:%02lld", s / 86400, (s / 3600) % 24, (s / 60) % 60, s % 60);
  return buf;
}

class Timer final : public ember::Callback {
 public:
  Timer(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host), per_step_(cfg.get_string("interval") == "step"), verbose_(cfg.get_bool("verbose")) {
    if (!cfg.has("duration"))
      throw ember::ConfigError("timer.duration is required: give the time limit as \"DD:HH:MM:SS\", e.g. "
                               "[timer] duration = \"00:12:00:00\"");
    text_ = cfg.get_string("duration");
    try {
      duration_ = ember::parse_duration(text_);
    } catch (const std::invalid_argument& e) {
      throw ember::ConfigError("timer.duration = \"" + text_ + "\" (" + cfg.where("duration") + "): " + e.what() +
                               "; write it as \"DD:HH:MM:SS\", e.g. \"00:01:30:00\" for 90 minutes");
    }
  }

  void on_train_start(ember::ITrainer&) override { start_ = Clock::now(); }
  void on_train_end(ember::ITrainer&) override {
    if (start_) offset_ = elapsed();
    start_.reset();
  }
  void on_train_batch_end(ember::ITrainer& t) override {
    if (per_step_ && t.optimizer_stepped()) check(t);
  }
  void on_train_epoch_end(ember::ITrainer& t) override {
    if (!per_step_) check(t);
  }

  // Seconds of training so far, this run's and the runs before a resume.
  double elapsed() const {
    if (!start_) return offset_;
    return offset_ + std::chrono::duration<double>(Clock::now() - *start_).count();
  }

  // {time_elapsed: {train: seconds}} as Lightning's Timer.state_dict.
  c10::IValue state_dict() const override {
    c10::impl::GenericDict stages(c10::StringType::get(), c10::AnyType::get());
    stages.insert(std::string("train"), elapsed());
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert(std::string("time_elapsed"), stages);
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    try {
      const auto stages = state.toGenericDict().at(std::string("time_elapsed")).toGenericDict();
      offset_ = stages.at(std::string("train")).toDouble();
    } catch (const c10::Error&) {
      throw ember::RunError("timer: malformed state in the checkpoint (expected {time_elapsed: {train: seconds}})");
    }
    if (start_) start_ = Clock::now();  // restored mid-training: the saved time replaces ours
  }

 private:
  void check(ember::ITrainer& t) {
    if (t.stop_requested()) return;
    const double e = elapsed();
    if (e < duration_) return;
    if (verbose_) host_.log(ember::LogLevel::info, "timer: time limit " + text_ + " reached after " + hms(e) + " of training");
    t.request_stop("timer: time limit " + text_ + " reached");
  }

  ember::IHost& host_;
  bool per_step_, verbose_;
  std::string text_;
  double duration_ = 0;
  double offset_ = 0;
  std::optional<Clock::time_point> start_;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new Timer(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "timer", "0.1.0", "Apache-2.0",
             "Stops training after a wall-clock duration, counting time before a resume (Lightning's Timer).",
             EMBER_CONFIG_KEYS(kKeys), make)
