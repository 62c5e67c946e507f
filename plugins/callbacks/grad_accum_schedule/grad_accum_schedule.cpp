// Plugin "grad_accum_schedule": Lightning's GradientAccumulationScheduler. Sets the gradient
// accumulation factor at the start of every training epoch from an {epoch: factor} schedule,
// written as two lists: epochs = [0, 4], factors = [1, 2] means "1 from epoch 0, 2 from epoch 4".
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace {

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::IntList("epochs", nullptr,
        "Epochs (0-based, ascending) at which a factor takes effect (required); without 0, epochs before the first use factor 1.").at_least(0),
    ember::key::IntList("factors", nullptr,
        "Accumulation factor from the epoch at the same position in `epochs` on (required, each >= 1).").at_least(1),
    ember::key::Elsewhere("scheduling", "write Lightning's {epoch: factor} table as two lists: epochs = [0, 4] and factors = [8, 4] "
                                        "for {0: 8, 4: 4}"),
};
// clang-format on

std::string list_text(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

class GradAccumSchedule final : public ember::Callback {
 public:
  GradAccumSchedule(ember::IHost& host, const ember::IConfig& cfg) : host_(host) {
    for (const char* k : {"epochs", "factors"})
      if (!cfg.has(k))
        throw ember::ConfigError(std::string("grad_accum_schedule.") + k +
                                 " is required: write the schedule as epochs = [0, 4] and factors = [1, 2] "
                                 "(factor 1 from epoch 0, 2 from epoch 4)");
    const auto epochs = cfg.get_int_list("epochs");
    const auto factors = cfg.get_int_list("factors");
    if (epochs.empty() || epochs.size() != factors.size())
      throw ember::ConfigError("grad_accum_schedule: epochs = " + list_text(epochs) + " (" + cfg.where("epochs") +
                               ") and factors = " + list_text(factors) + " (" + cfg.where("factors") +
                               ") must be non-empty and of the same length: one factor per epoch");
    for (size_t i = 1; i < epochs.size(); ++i)
      if (epochs[i] <= epochs[i - 1])
        throw ember::ConfigError("grad_accum_schedule.epochs = " + list_text(epochs) + " (" + cfg.where("epochs") +
                                 "): epochs must be strictly ascending (" + std::to_string(epochs[i - 1]) + " then " +
                                 std::to_string(epochs[i]) + ")");
    // Lightning: a schedule that does not start at epoch 0 starts with factor 1.
    if (epochs.front() != 0) schedule_.emplace_back(0, 1);
    for (size_t i = 0; i < epochs.size(); ++i) schedule_.emplace_back(epochs[i], factors[i]);
  }

  // The factor in effect at `epoch`.
  int64_t factor_at(int64_t epoch) const {
    int64_t f = 1;
    for (const auto& [e, factor] : schedule_)
      if (epoch >= e) f = factor;
    return f;
  }

  void setup(ember::ITrainer& t) override {
    // Lightning refuses both: the trainer's factor would be silently overridden (only training
    // accumulates; validate/test/predict run setup too).
    if (t.stage() == ember::Stage::fit && ember::trainer_service<ember::ITrainerSettings>(t, "grad_accum_schedule").accumulate_grad_batches() != 1)
      throw ember::ConfigError("trainer.accumulate_grad_batches = " + std::to_string(ember::trainer_service<ember::ITrainerSettings>(t, "grad_accum_schedule").accumulate_grad_batches()) +
                               " and [grad_accum_schedule] both set gradient accumulation: remove "
                               "trainer.accumulate_grad_batches (the schedule's factor for epoch 0 replaces it)");
  }

  void on_train_epoch_start(ember::ITrainer& t) override {
    const int64_t f = factor_at(t.current_epoch());
    if (f != ember::trainer_service<ember::ITrainerSettings>(t, "grad_accum_schedule").accumulate_grad_batches())
      host_.log(ember::LogLevel::info, "grad_accum_schedule: accumulating " + std::to_string(f) +
                                           " batches per optimizer step from epoch " + std::to_string(t.current_epoch()));
    ember::trainer_service<ember::ITrainerSettings>(t, "grad_accum_schedule").set_accumulate_grad_batches(f);
  }

  // The factor follows from the epoch alone, so a resume needs nothing but the loop's epoch;
  // the schedule is saved so a changed schedule is noticed.
  c10::IValue state_dict() const override {
    c10::List<int64_t> epochs, factors;
    for (const auto& [e, f] : schedule_) {
      epochs.push_back(e);
      factors.push_back(f);
    }
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert(std::string("epochs"), epochs);
    d.insert(std::string("factors"), factors);
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    if (!state.isGenericDict()) throw ember::RunError("grad_accum_schedule: malformed state in the checkpoint");
    const auto d = state.toGenericDict();
    const auto epochs = d.at(std::string("epochs")).toIntVector();
    const auto factors = d.at(std::string("factors")).toIntVector();
    std::vector<std::pair<int64_t, int64_t>> saved;
    for (size_t i = 0; i < epochs.size() && i < factors.size(); ++i) saved.emplace_back(epochs[i], factors[i]);
    if (saved != schedule_)
      host_.log(ember::LogLevel::warn, "grad_accum_schedule: the checkpoint was trained with another schedule; "
                                       "this run's schedule applies from the resumed epoch on");
  }

 private:
  ember::IHost& host_;
  std::vector<std::pair<int64_t, int64_t>> schedule_;  // (epoch, factor), ascending, starts at 0
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new GradAccumSchedule(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "grad_accum_schedule", "0.1.0", "Apache-2.0",
             "Changes gradient accumulation by epoch from an {epoch: factor} schedule (Lightning's GradientAccumulationScheduler).",
             EMBER_CONFIG_KEYS(kKeys), make)
