// Plugin "lr_find": Lightning's LearningRateFinder, the LR range test. At fit start it saves a
// temporary checkpoint, runs `num_training_steps` optimizer steps with the rate rising from
// min_lr to max_lr (stopping early when the loss diverges), restores the checkpoint (weights,
// optimizer, loop, RNG and every plugin's state go back to where they were), writes
// <run_dir>/lr_find.csv and lr_find.png, logs the suggested rate and, with update_attr, trains
// with it.
#include <ember/support/callback_base.h>
#include <ember/support/param_groups.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "plot.h"
#include "sweep.h"

namespace {

// The trainer services this tuner uses (ember/trainer.h).
ember::ITrainerCheckpoints& checkpoints(ember::ITrainer& t) { return ember::trainer_service<ember::ITrainerCheckpoints>(t, "lr_find"); }
ember::ITrainerPasses& passes(ember::ITrainer& t) { return ember::trainer_service<ember::ITrainerPasses>(t, "lr_find"); }

namespace lf = ember_lr_find;
namespace fs = std::filesystem;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Float("min_lr", "1e-8", "Rate of the first trial step.").above(0.0),
    ember::key::Float("max_lr", "1.0", "Rate the sweep rises towards.").above(0.0),
    ember::key::Int("num_training_steps", "100", "Trial optimizer steps (one rate each).").at_least(2),
    ember::key::String("mode", "\"exponential\"",
        "How the rate rises from step to step: geometrically or linearly.").choices("exponential|linear"),
    ember::key::Float("early_stop_threshold", "4.0",
        "Stop the sweep once the smoothed loss exceeds this many times its best value; 0 = never.").at_least(0.0),
    ember::key::Bool("update_attr", "true",
        "Train with the suggested rate (set in every parameter group of the optimizer)."),
    ember::key::Elsewhere("attr_name", "Ember sets the suggested rate in every parameter group of the optimizer (update_attr = true), "
                                       "not in a model attribute; remove the key"),
};
// clang-format on

std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// `lr` is the first group's; the others keep the ratio `ratios` (to the first group's) they had
// before the sweep (optimizer.backbone trains at lr x backbone_lr_scale).
void set_lr(torch::optim::Optimizer& opt, double lr, const std::vector<double>& ratios) {
  for (size_t g = 0; g < opt.param_groups().size(); ++g) opt.param_groups()[g].options().set_lr(lr * ratios.at(g));
}

class LrFind final : public ember::Callback {
 public:
  LrFind(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        min_lr_(cfg.get_float("min_lr")),
        max_lr_(cfg.get_float("max_lr")),
        steps_(cfg.get_int("num_training_steps")),
        mode_(cfg.get_string("mode") == "linear" ? lf::Mode::linear : lf::Mode::exponential),
        threshold_(cfg.get_float("early_stop_threshold")),
        update_attr_(cfg.get_bool("update_attr")) {
    if (!(max_lr_ > min_lr_))
      throw ember::ConfigError("lr_find.max_lr = " + sci(max_lr_) + " (" + cfg.where("max_lr") + ") must be above min_lr = " +
                               sci(min_lr_) + " (" + cfg.where("min_lr") + "): the sweep rises from min_lr to max_lr");
  }

  void on_fit_start(ember::ITrainer& t) override {
    if (done_) {
      // A resumed run: the optimizer state in the checkpoint already carries the rate in use.
      host_.log(ember::LogLevel::info, "lr_find: ran before this resume (suggested " +
                                           (suggestion_ ? sci(*suggestion_) : std::string("none")) + "); not searching again");
      return;
    }
    if (t.world_size() > 1)
      throw ember::RunError("lr_find: runs in single-process training only (each rank would see its own losses and "
                            "could stop the sweep at a different step); find the rate with trainer.devices = 1, then "
                            "set [optimizer] lr");
    if (t.num_batches(ember::Split::train) == 0) throw ember::RunError("lr_find: the run has no training batches");

    ratios_ = ember::support::rates_keeping_ratios(t.optimizer(), 1.0);
    const fs::path tmp = fs::path(t.run_dir()) / (".lr_find." + std::to_string(::getpid()) + ".ckpt");
    checkpoints(t).save_checkpoint(tmp.string());
    std::vector<double> lrs, losses, smoothed;
    try {
      sweep(t, lrs, losses, smoothed);
    } catch (...) {
      restore(t, tmp);
      throw;
    }
    restore(t, tmp);  // also hands this plugin its state from before the sweep: set ours after

    done_ = true;
    const std::optional<size_t> best = lf::suggestion(smoothed);
    if (best) suggestion_ = lrs[*best];
    if (t.is_global_zero()) write_outputs(t, lrs, losses, smoothed, best);
    if (!best) {
      host_.log(ember::LogLevel::warn, "lr_find: no suggestion: only " + std::to_string(lrs.size()) +
                                           " steps ran, too few to compute one (it skips the first 10 and the last); "
                                           "raise num_training_steps or early_stop_threshold, or widen the rate range");
      return;
    }
    host_.log(ember::LogLevel::info, "lr_find: suggested learning rate " + sci(*suggestion_) + " (step " +
                                         std::to_string(*best) + " of " + std::to_string(lrs.size()) + ")");
    if (update_attr_) {
      set_lr(t.optimizer(), *suggestion_, ratios_);
      host_.log(ember::LogLevel::info, "lr_find: learning rate set to " + sci(*suggestion_));
    }
  }

  // {done: bool, suggestion: float or None}
  c10::IValue state_dict() const override {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert(std::string("done"), done_);
    d.insert(std::string("suggestion"), suggestion_ ? c10::IValue(*suggestion_) : c10::IValue());
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    try {
      const auto d = state.toGenericDict();
      done_ = d.at(std::string("done")).toBool();
      const auto s = d.at(std::string("suggestion"));
      suggestion_.reset();
      if (!s.isNone()) suggestion_ = s.toDouble();
    } catch (const c10::Error&) {
      throw ember::RunError("lr_find: malformed state in the checkpoint (expected {done, suggestion})");
    }
  }

 private:
  void sweep(ember::ITrainer& t, std::vector<double>& lrs, std::vector<double>& losses, std::vector<double>& smoothed) {
    lf::Smoother smoother;
    lf::Divergence divergence(threshold_);
    auto& opt = t.optimizer();
    bool stop = false;
    while (!stop && static_cast<int64_t>(lrs.size()) < steps_) {
      // One pass over the training batches per round: the sweep may be longer than an epoch.
      const size_t before = lrs.size();
      passes(t).for_each_batch(ember::Split::train, steps_ - static_cast<int64_t>(lrs.size()), [&](const ember::Batch& batch) {
        const double lr = lf::lr_at(mode_, min_lr_, max_lr_, static_cast<int64_t>(lrs.size()), steps_);
        set_lr(opt, lr, ratios_);
        const double loss = passes(t).run_trial_step(batch).item<double>();
        lrs.push_back(lr);
        losses.push_back(loss);
        smoothed.push_back(smoother.add(loss));
        stop = divergence.add(smoothed.back());
        return !stop;
      });
      if (lrs.size() == before) break;
    }
    if (stop)
      host_.log(ember::LogLevel::info, "lr_find: loss diverged at lr " + sci(lrs.back()) + " (step " +
                                           std::to_string(lrs.size()) + " of " + std::to_string(steps_) + "); sweep stopped");
  }

  void restore(ember::ITrainer& t, const fs::path& tmp) {
    checkpoints(t).load_checkpoint(tmp.string());
    std::error_code ec;
    fs::remove(tmp, ec);
  }

  void write_outputs(ember::ITrainer& t, const std::vector<double>& lrs, const std::vector<double>& losses,
                     const std::vector<double>& smoothed, std::optional<size_t> best) {
    const fs::path dir(t.run_dir());
    const fs::path csv = dir / "lr_find.csv";
    {
      std::ofstream out(csv);
      out << "lr,loss,smoothed_loss\n";
      char line[128];
      for (size_t i = 0; i < lrs.size(); ++i) {
        std::snprintf(line, sizeof line, "%.9g,%.9g,%.9g\n", lrs[i], losses[i], smoothed[i]);
        out << line;
      }
      if (!out) throw ember::RunError("lr_find: cannot write " + csv.string());
    }
#ifdef EMBER_WITH_CAIRO
    lf::PlotData plot{lrs, losses, smoothed, best, mode_ == lf::Mode::exponential,
                      "Learning rate finder (" + std::to_string(lrs.size()) + " steps)"};
    const fs::path png = dir / "lr_find.png";
    try {
      lf::write_plot(png.string(), plot);
    } catch (const std::runtime_error& e) {
      throw ember::RunError(std::string("lr_find: ") + e.what());
    }
    host_.log(ember::LogLevel::info, "lr_find: wrote " + csv.string() + " and " + png.string());
#else
    (void)best;
    host_.log(ember::LogLevel::warn, "lr_find: wrote " + csv.string() + " but no lr_find.png: this build has no cairo "
                                     "(install libcairo2-dev and rebuild for the plot)");
#endif
  }

  ember::IHost& host_;
  double min_lr_, max_lr_;
  int64_t steps_;
  lf::Mode mode_;
  double threshold_;
  bool update_attr_;
  bool done_ = false;
  std::optional<double> suggestion_;
  std::vector<double> ratios_;  // each group's rate over the first's, before the sweep
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new LrFind(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "lr_find", "0.1.0", "Apache-2.0",
             "Learning rate range test at fit start: suggests a rate, plots the curve, can train with it (Lightning's LearningRateFinder).",
             EMBER_CONFIG_KEYS(kKeys), make)
