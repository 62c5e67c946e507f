// early_stopping: its order of checks tested directly (criteria.h), its behaviour through real engine
// runs, resume included.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "callback_runs.h"
#include "checkpoint_support.h"
#include "criteria.h"

using namespace ember::test;
using namespace ember::test::callback_runs;

namespace {

// Scripted metric "score" (hook_recorder logs scripted_values[epoch] at each epoch end), no
// validation, so early stopping checks at the end of every training epoch.
std::string scripted(const std::string& values, const std::string& early_stopping, int max_epochs = 10,
                     const std::string& monitor = "score") {
  return "plugins = [\"hook_recorder\", \"early_stopping\"]\n" +
         tiny_mlp_toml(max_epochs, "num_train = 32\nnum_val = 0\nbatch_size = 16\n[hook_recorder]\nscripted_values = " + values +
                                       "\n[early_stopping]\n") +
         (monitor.empty() ? std::string() : "monitor = \"" + monitor + "\"\n") + early_stopping;
}

}  // namespace

TEST(EarlyStoppingCriteria, FollowsLightningsOrderOfChecks) {
  namespace es = ember_early_stopping;
  auto stop_index = [](es::Settings s, std::vector<double> values) -> int {
    es::Criteria c(std::move(s));
    for (size_t i = 0; i < values.size(); ++i)
      if (c.evaluate(values[i]).stop) return static_cast<int>(i);
    return -1;
  };
  es::Settings s;
  s.monitor = "m";
  s.patience = 2;
  EXPECT_EQ(stop_index(s, {1.0, 0.9, 0.95, 0.93, 0.5}), 3);  // two checks without improvement
  s.min_delta = 0.1;
  EXPECT_EQ(stop_index(s, {1.0, 0.95, 0.91, 0.5}), 2);  // 0.05 and 0.09 are below min_delta
  s.min_delta = 0.0;
  s.patience = 10;
  s.divergence_threshold = 3.0;
  EXPECT_EQ(stop_index(s, {1.0, 0.8, 5.0}), 2);
  EXPECT_EQ(stop_index(s, {1.0, std::numeric_limits<double>::infinity()}), 1);  // non-finite
  s.check_finite = false;
  s.divergence_threshold.reset();
  EXPECT_EQ(stop_index(s, {1.0, std::numeric_limits<double>::infinity(), 0.5}), -1);
  s.mode = es::Mode::max;
  s.stopping_threshold = 0.85;
  EXPECT_EQ(stop_index(s, {0.1, 0.5, 0.9}), 2);
  // A reset criterion and a restored one differ only by the state.
  es::Criteria c(s);
  c.evaluate(0.5);
  c.evaluate(0.4);
  EXPECT_EQ(c.state().wait_count, 1);
  EXPECT_DOUBLE_EQ(c.state().best_score, 0.5);
}

TEST(EarlyStoppingRun, StopsAtTheExpectedEpoch) {
  TempDir dir("es");
  struct Case {
    const char* name;
    std::string values, settings;
    int64_t stop_epoch;
    const char* reason;
  };
  const std::vector<Case> cases = {
      {"patience", "[1.0, 0.9, 0.95, 0.93, 0.5, 0.4]", "patience = 2\n", 3, "did not improve in the last 2 records"},
      {"min_delta", "[1.0, 0.95, 0.91, 0.5, 0.4]", "patience = 2\nmin_delta = 0.1\n", 2, "did not improve"},
      {"threshold", "[0.1, 0.5, 0.9, 0.95, 0.99]", "mode = \"max\"\nstopping_threshold = 0.85\n", 2, "stopping threshold reached"},
      {"divergence", "[1.0, 0.8, 5.0, 0.5]", "divergence_threshold = 3.0\n", 2, "divergence threshold reached"},
      {"nonfinite", "[1.0, 0.9, inf, 0.5]", "", 2, "is not finite"},
  };
  for (const auto& c : cases) {
    auto r = run(dir, c.name, scripted(c.values, c.settings));
    ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << r.err;
    EXPECT_NE(r.err.find(c.reason), std::string::npos) << c.name << "\n" << r.err;
    const auto last = dir / "runs" / c.name / "version_0/checkpoints/last.ckpt";
    EXPECT_EQ(load(last).at("epoch").toInt(), c.stop_epoch) << c.name;
    EXPECT_EQ(callback_state(last, "early_stopping").at("stopped_epoch").toInt(), c.stop_epoch) << c.name;
    EXPECT_EQ(count(read_file(dir / "hooks.txt"), "on_train_epoch_end"), static_cast<size_t>(c.stop_epoch + 1)) << c.name;
    fs::remove(dir / "hooks.txt");
  }
}

// trainer.min_epochs / min_steps (Lightning's): early stopping asks at epoch 3 (as in the
// patience case above); the loop trains on until the minimum is met, then stops there: at the end
// of the fifth epoch, or after the first step of epoch 4 (2 steps an epoch).
TEST(EarlyStoppingRun, WaitsForMinEpochsAndMinSteps) {
  TempDir dir("es_min");
  const std::string values = "[1.0, 0.9, 0.95, 0.93, 0.5, 0.4, 0.3]";
  struct Case {
    const char* name;
    std::string trainer_keys;
    int64_t last_epoch, last_step;
    size_t epoch_ends;
  };
  for (const Case& c : {Case{"min_epochs", "min_epochs = 5\n", 4, 10, 5}, Case{"min_steps", "min_steps = 9\n", 4, 9, 5},
                        Case{"met_already", "min_epochs = 2\nmin_steps = 4\n", 3, 8, 4}}) {
    std::string toml = scripted(values, "patience = 2\n");
    toml.replace(toml.find("[trainer]\n"), 10, "[trainer]\n" + c.trainer_keys);
    auto r = run(dir, c.name, toml);
    ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << r.err;
    EXPECT_NE(r.err.find("did not improve in the last 2 records"), std::string::npos) << c.name << "\n" << r.err;
    const bool deferred = std::string(c.name) != "met_already";
    EXPECT_EQ(r.err.find("before trainer.min_epochs") != std::string::npos, deferred) << c.name << "\n" << r.err;
    const auto last = dir / "runs" / c.name / "version_0/checkpoints/last.ckpt";
    EXPECT_EQ(load(last).at("epoch").toInt(), c.last_epoch) << c.name;
    EXPECT_EQ(load(last).at("global_step").toInt(), c.last_step) << c.name;
    EXPECT_EQ(count(read_file(dir / "hooks.txt"), "on_train_epoch_end"), c.epoch_ends) << c.name;
    fs::remove(dir / "hooks.txt");
  }
  // A minimum above the maximum is a mistake, not something to ignore.
  std::string toml = scripted(values, "patience = 2\n", 3);
  toml.replace(toml.find("[trainer]\n"), 10, "[trainer]\nmin_epochs = 4\n");
  auto r = run(dir, "bad", toml);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("bad.toml:3:14: trainer.min_epochs = 4 exceeds max_epochs = 3: lower min_epochs or raise max_epochs"),
            std::string::npos) << r.err;
}

TEST(EarlyStoppingRun, WaitCountSurvivesResume) {
  TempDir dir("es");
  const std::string values = "[1.0, 0.9, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0, 1.1, 1.2]";
  // Epochs 0-2: best 0.9 at epoch 1, one check without improvement.
  auto first = run(dir, "es", scripted(values, "patience = 3\n", 3));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const auto last = dir / "runs/es/version_0/checkpoints/last.ckpt";
  auto state = callback_state(last, "early_stopping");
  EXPECT_EQ(state.at("wait_count").toInt(), 1);
  EXPECT_DOUBLE_EQ(state.at("best_score").toDouble(), 0.9);
  // Resumed: epochs 3 and 4 complete the patience of 3 (a fresh state would stop at epoch 6).
  auto second = run(dir, "es", scripted(values, "patience = 3\n", 10), {"--resume", "last"});
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_EQ(load(last).at("epoch").toInt(), 4);
  EXPECT_EQ(callback_state(last, "early_stopping").at("stopped_epoch").toInt(), 4);
}

TEST(EarlyStoppingRun, MissingMetricIsAnErrorListingTheAvailableOnes) {
  TempDir dir("es");
  auto r = run(dir, "es", scripted("[1.0]", "", 10, "scor"));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("monitor 'scor' is not a logged metric; available:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("score"), std::string::npos) << r.err;
  auto lax = run(dir, "lax", scripted("[1.0]", "strict = false\n", 2, "scor"));
  EXPECT_EQ(lax.exit_code, 0) << lax.err;
  EXPECT_EQ(count(lax.err, "monitor 'scor' is not a logged metric"), 1u) << lax.err;  // warned once
  auto missing = run(dir, "none", scripted("[1.0]", "", 10, ""));
  EXPECT_EQ(missing.exit_code, 2) << missing.err;
  EXPECT_NE(missing.err.find("early_stopping.monitor is required"), std::string::npos) << missing.err;
}

TEST(EarlyStoppingRun, ChecksWhereLightningDoes) {
  TempDir dir("es");
  const std::string toml = "plugins = [\"early_stopping\"]\n" +
                           tiny_mlp_toml(2, "num_train = 64\nnum_val = 32\nbatch_size = 16\n[early_stopping]\npatience = 100\nverbose = true\n");
  auto checks = [](const std::string& err) { return count(err, "early_stopping: metric ") + count(err, " did not improve ("); };
  // Validation at each epoch's end: one check per epoch, after the epoch's training metrics.
  auto train_metric = run(dir, "a", toml, {"--set", "early_stopping.monitor=\"train_loss_epoch\""});
  ASSERT_EQ(train_metric.exit_code, 0) << train_metric.err;
  EXPECT_EQ(checks(train_metric.err), 2u) << train_metric.err;
  // Validation twice per epoch: a check after each.
  auto mid = run(dir, "b", toml, {"--set", "early_stopping.monitor=\"val_loss\"", "--set", "trainer.val_check_interval=0.5"});
  ASSERT_EQ(mid.exit_code, 0) << mid.err;
  EXPECT_EQ(checks(mid.err), 4u) << mid.err;
  // Forced to validation end: the epoch's training metric does not exist yet there.
  auto forced = run(dir, "c", toml, {"--set", "early_stopping.monitor=\"train_loss_epoch\"", "--set",
                                     "early_stopping.check_on_train_epoch_end=false"});
  EXPECT_EQ(forced.exit_code, 1) << forced.err;
  EXPECT_NE(forced.err.find("monitor 'train_loss_epoch' is not a logged metric"), std::string::npos) << forced.err;
}
