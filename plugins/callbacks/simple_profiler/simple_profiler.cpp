// Plugin "simple_profiler": Lightning's SimpleProfiler. Reports, per action, the number of calls,
// the mean and total duration and the share of the run, as a table logged at the end (rank 0)
// and written to <run_dir>/<filename> (other ranks: <stem>-rank<r><ext>).
//
// It is a callback, not a plugin of the reserved EMBER_KIND_PROFILER kind: the loop's phases are
// delimited by hooks the engine already fires (on_train_batch_start, on_before_backward, ...), so
// timing from one hook to the next measures them without any change to the engine or the SDK.
// Every moment between `setup` and `teardown` (and between on_test_start and on_test_end) belongs
// to exactly one action, so the actions add up to the total. The price: an action includes the
// hooks of the callbacks that run after this one at its start (name simple_profiler first to
// keep them out), and "data fetch" is everything between one batch's end and the next batch's
// start (loading, transfer to the device, logging, the progress bar).
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "profile_table.h"

namespace {

namespace fs = std::filesystem;
using ember::Hook;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::String("filename", "\"simple_profiler.txt\"", "Report file in the run folder."),
    ember::key::Bool("print", "true", "Also log the table at the end (rank 0)."),
};
// clang-format on

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class SimpleProfiler final : public ember::Callback {
 public:
  SimpleProfiler(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host), filename_(cfg.get_string("filename")), print_(cfg.get_bool("print")) {
    if (filename_.empty() || filename_.find('/') != std::string::npos || filename_ == "." || filename_ == "..")
      throw ember::ConfigError(cfg.section() + ".filename (" + cfg.where("filename") + "): '" + filename_ +
                               "' is not a plain file name; give a name like \"simple_profiler.txt\"");
  }

  void on_hook(Hook hook, ember::ITrainer& t) override {
    // The fit report spans setup(fit)..teardown(fit); validate/test/predict's own setup and
    // teardown (Lightning's setup(stage)) do not open or close it.
    if ((hook == Hook::setup || hook == Hook::teardown) && t.stage() != ember::Stage::fit) return;
    const double t0 = now();
    ++hook_calls_;
    ++hook_counts_[ember::hook_name(hook)];
    Session& s = hook == Hook::on_test_start || (test_open_ && hook != Hook::teardown) ? test_ : fit_;
    const std::string next = action_after(hook, t, s);
    s.timeline.switch_to(next, t0);
    if (hook == Hook::setup) fit_.start = t0;
    if (hook == Hook::on_test_start) {
      test_open_ = true;
      test_.start = t0;
    }
    // A failed run still gets its report, up to the failure.
    const bool failed = hook == Hook::on_exception && !reported_failure_;
    if (failed) {
      reported_failure_ = true;
      if (test_open_) test_.end = t0, test_open_ = false;
      else if (fit_.end < 0) fit_.end = t0;
    }
    const bool finished = hook == Hook::teardown || hook == Hook::on_test_end || failed;
    if (hook == Hook::teardown) fit_.end = t0;
    if (hook == Hook::on_test_end) {
      test_.end = t0;
      test_open_ = false;
    }
    overhead_ += now() - t0;
    if (finished)
      report(t, !print_ ? "" : failed ? "failed run" : hook == Hook::teardown ? "fit" : "test");
  }

 private:
  struct Session {
    ember_prof::Timeline timeline;
    double start = -1, end = -1;
    std::string before_validation;  // the action a validation pass interrupted
  };

  // The action that runs from this hook until the next one.
  static std::string action_after(Hook hook, ember::ITrainer& t, Session& s) {
    const bool sanity = t.sanity_checking();
    switch (hook) {
      case Hook::setup: return "setup hooks";
      case Hook::on_fit_start: return "on_fit_start";
      case Hook::on_sanity_check_start: return "sanity check";
      case Hook::on_sanity_check_end: return "on_sanity_check_end";
      case Hook::on_train_start: return "on_train_start";
      case Hook::on_train_epoch_start: return "data fetch (train)";
      case Hook::on_train_batch_start: return "training_step (forward)";
      case Hook::on_before_zero_grad: return "optimizer_zero_grad";
      case Hook::on_before_backward: return "backward";
      case Hook::on_after_backward: return "after backward (unscale, hooks)";
      case Hook::on_before_optimizer_step: return "optimizer_step (clip, step)";
      case Hook::on_train_batch_end: return "data fetch (train)";
      case Hook::on_train_epoch_end: return "train epoch end (hooks, checkpoint)";
      case Hook::on_save_checkpoint: return "save_checkpoint (to the next hook)";
      case Hook::on_validation_start:
        s.before_validation = s.timeline.current();
        return sanity ? "sanity check" : "validation start";
      case Hook::on_validation_epoch_start: return sanity ? "sanity check" : "data fetch (validation)";
      case Hook::on_validation_batch_start: return sanity ? "sanity check" : "validation_step";
      case Hook::on_validation_batch_end: return sanity ? "sanity check" : "data fetch (validation)";
      case Hook::on_validation_epoch_end: return sanity ? "sanity check" : "validation epoch end (reduce, log)";
      case Hook::on_validation_end:
        return s.before_validation.empty() ? std::string("after validation") : s.before_validation;
      case Hook::on_train_end: return "on_train_end";
      case Hook::on_fit_end: return "on_fit_end";
      case Hook::on_test_start: return "test start";
      case Hook::on_test_epoch_start: return "data fetch (test)";
      case Hook::on_test_batch_start: return "test_step";
      case Hook::on_test_batch_end: return "data fetch (test)";
      case Hook::on_test_epoch_end: return "test epoch end (reduce, log)";
      case Hook::on_load_checkpoint: return "load_checkpoint";
      case Hook::on_exception: return "";
      case Hook::teardown:
      case Hook::on_test_end: return "";
      default: return s.timeline.current();
    }
  }

  std::string render() const {
    std::string out;
    auto section = [&](const char* name, const Session& s) {
      if (s.start < 0 || s.end < 0) return;
      out += ember_prof::table(std::string("Profiler report: ") + name, s.timeline.stats(), s.end - s.start);
      char line[256];
      std::snprintf(line, sizeof(line), "actions sum to %.6f s of %.6f s\n\n", s.timeline.recorded(), s.end - s.start);
      out += line;
    };
    section("fit", fit_);
    section("test", test_);
    char line[512];
    const double run = (fit_.end > fit_.start ? fit_.end - fit_.start : 0) + (test_.end > test_.start ? test_.end - test_.start : 0);
    std::snprintf(line, sizeof(line),
                  "Profiler overhead: %.6f s in %lld hook calls (%.2f us per call, %.4f%% of the profiled time)\n",
                  overhead_, static_cast<long long>(hook_calls_), hook_calls_ ? 1e6 * overhead_ / static_cast<double>(hook_calls_) : 0.0,
                  run > 0 ? 100.0 * overhead_ / run : 0.0);
    out += line;
    out += "Hook calls:";
    for (const auto& [name, n] : hook_counts_) out += " " + name + "=" + std::to_string(n);
    out += "\n";
    return out;
  }

  void report(ember::ITrainer& t, const std::string& print_stage) {
    const std::string text = render();
    fs::path file = fs::path(t.run_dir()) / filename_;
    if (t.rank() != 0) {
      const fs::path f(filename_);
      file = fs::path(t.run_dir()) / (f.stem().string() + "-rank" + std::to_string(t.rank()) + f.extension().string());
    }
    try {
      fs::create_directories(file.parent_path());
      std::ofstream out(file, std::ios::trunc);
      out << text;
      if (!out) throw std::runtime_error("write failed");
    } catch (const std::exception& e) {
      throw ember::RunError("simple_profiler: cannot write " + file.string() + ": " + e.what());
    }
    if (!print_stage.empty() && t.is_global_zero())
      host_.log(ember::LogLevel::info, "simple_profiler (" + print_stage + "), also in " + file.string() + ":\n" + text);
  }

  ember::IHost& host_;
  const std::string filename_;
  const bool print_;
  Session fit_, test_;
  bool test_open_ = false, reported_failure_ = false;
  double overhead_ = 0;
  int64_t hook_calls_ = 0;
  std::map<std::string, int64_t> hook_counts_;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new SimpleProfiler(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "simple_profiler", "0.1.0", "Apache-2.0",
             "Lightning's SimpleProfiler: count, mean, total and share of each phase of the loop (hook to hook).",
             EMBER_CONFIG_KEYS(kKeys), make)
