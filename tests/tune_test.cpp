// Training-trick callbacks: early_stopping, lr_find, batch_size_finder, grad_accum_schedule,
// timer and model_summary. Their pure logic is tested directly (the plugin folders' headers);
// their behaviour through real engine runs, resume included.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "checkpoint/checkpoint_io.h"
#include "criteria.h"
#include "duration.h"
#include "search.h"
#include "checkpoint_support.h"
#include "support.h"
#include "sweep.h"
#include "table.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

c10::impl::GenericDict load(const fs::path& ckpt) { return ember::engine::load_checkpoint_file(ckpt); }

c10::impl::GenericDict callback_state(const fs::path& ckpt, const std::string& name) {
  return load(ckpt).at("callbacks").toGenericDict().at(name).toGenericDict();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

// Runs `engine <name>.toml` with the test plugins; returns the result.
ProcessResult run(const TempDir& dir, const std::string& name, const std::string& toml, std::vector<std::string> extra = {}) {
  write_file(dir / (name + ".toml"), toml);
  std::vector<std::string> args = {name + ".toml", "--plugin-path", test_plugin_dir("good").string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine(args, dir.path());
}

// The values of one metrics.csv column, in row order (rows that have it).
std::vector<double> column(const fs::path& run_dir, const std::string& name) {
  std::vector<double> out;
  for (const auto& row : read_csv(run_dir / "metrics.csv")) {
    auto it = row.find(name);
    if (it != row.end() && !it->second.empty()) out.push_back(std::stod(it->second));
  }
  return out;
}

// Scripted metric "score" (hook_recorder logs scripted_values[epoch] at each epoch end), no
// validation, so early stopping checks at the end of every training epoch.
std::string scripted(const std::string& values, const std::string& early_stopping, int max_epochs = 10,
                     const std::string& monitor = "score") {
  return "plugins = [\"hook_recorder\", \"early_stopping\"]\n[trainer]\nmax_epochs = " + std::to_string(max_epochs) + R"(
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [4]
[data]
name = "synthetic"
shape = [8]
num_train = 32
num_val = 0
batch_size = 16
[hook_recorder]
scripted_values = )" + values + "\n[early_stopping]\n" +
         (monitor.empty() ? std::string() : "monitor = \"" + monitor + "\"\n") + early_stopping;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// early_stopping

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
  const std::string toml = R"(
plugins = ["early_stopping"]
[trainer]
max_epochs = 2
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [4]
[data]
name = "synthetic"
shape = [8]
num_train = 64
num_val = 32
batch_size = 16
[early_stopping]
patience = 100
verbose = true
)";
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

// ---------------------------------------------------------------------------------------------
// timer and grad_accum_schedule

TEST(TimerDuration, ParsesDaysHoursMinutesSeconds) {
  EXPECT_DOUBLE_EQ(ember_timer::parse_duration("00:12:00:00"), 12 * 3600.0);
  EXPECT_DOUBLE_EQ(ember_timer::parse_duration("01:00:01:02.5"), 86400 + 62.5);
  EXPECT_THROW(ember_timer::parse_duration("12:00:00"), std::invalid_argument);
  EXPECT_THROW(ember_timer::parse_duration("00:x:00:00"), std::invalid_argument);
  EXPECT_THROW(ember_timer::parse_duration("00:00:00:00"), std::invalid_argument);
}

TEST(TimerRun, StopsAfterTheDurationAndCountsTimeBeforeAResume) {
  TempDir dir("timer");
  const std::string toml = R"(
plugins = ["timer"]
[trainer]
max_epochs = 50
limit_train_batches = 4
enable_progress_bar = false
[model]
name = "tune_probe"
dim = 4
sleep_ms = 100
[data]
name = "synthetic"
task = "regression"
shape = [4]
num_classes = 4
num_train = 32
num_val = 0
batch_size = 8
[timer]
duration = "00:00:00:01"
)";
  auto r = run(dir, "t", toml);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("timer: time limit 00:00:00:01 reached"), std::string::npos) << r.err;
  const auto last = dir / "runs/t/version_0/checkpoints/last.ckpt";
  const int64_t steps = load(last).at("global_step").toInt();
  // Each step sleeps 0.1 s, so 1 s has passed after 10 steps at the latest (slower steps stop
  // it sooner); 50 epochs x 4 steps would be the end without the timer.
  EXPECT_GE(steps, 1);
  EXPECT_LE(steps, 10);
  const double elapsed = callback_state(last, "timer").at("time_elapsed").toGenericDict().at("train").toDouble();
  EXPECT_GE(elapsed, 1.0);
  // The resumed run already has its second: it stops after its first step.
  auto again = run(dir, "t", toml, {"--resume", "last"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(load(last).at("global_step").toInt(), steps + 1);
  EXPECT_GE(callback_state(last, "timer").at("time_elapsed").toGenericDict().at("train").toDouble(), elapsed + 0.1);
}

TEST(TimerRun, TrainerMaxTimeAddsTheTimer) {
  TempDir dir("timer");
  const std::string toml = R"(
[trainer]
max_epochs = 50
max_time = "00:00:00:01"
limit_train_batches = 4
enable_progress_bar = false
enable_model_summary = false
[model]
name = "tune_probe"
dim = 4
sleep_ms = 100
[data]
name = "synthetic"
task = "regression"
shape = [4]
num_classes = 4
num_train = 32
num_val = 0
batch_size = 8
)";
  auto r = run(dir, "t", toml);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("timer: time limit 00:00:00:01 reached"), std::string::npos) << r.err;
  EXPECT_LE(load(dir / "runs/t/version_0/checkpoints/last.ckpt").at("global_step").toInt(), 10);
  // The same limit twice is fine (a resolved config names both); two different ones are not.
  auto same = run(dir, "same", toml + "[timer]\nduration = \"00:00:00:01\"\n", {"--plugins", "timer"});
  EXPECT_EQ(same.exit_code, 0) << same.err;
  auto clash = run(dir, "clash", toml + "[timer]\nduration = \"00:01:00:00\"\n", {"--plugins", "timer"});
  EXPECT_EQ(clash.exit_code, 2) << clash.err;
  EXPECT_NE(clash.err.find("both set the time limit"), std::string::npos) << clash.err;
  auto bad = run(dir, "bad", toml, {"--set", "trainer.max_time=\"90\""});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("expected DD:HH:MM:SS"), std::string::npos) << bad.err;
}

namespace {
const char* kAccum = R"(
plugins = ["grad_accum_schedule"]
[trainer]
max_epochs = 4
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [4]
[data]
name = "synthetic"
shape = [8]
num_train = 128
num_val = 0
batch_size = 16
[checkpoint]
save_top_k = -1
[grad_accum_schedule]
epochs = [0, 2]
factors = [1, 4]
)";

std::set<std::string> checkpoint_files(const fs::path& run_dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(run_dir / "checkpoints")) out.insert(e.path().filename());
  return out;
}
}  // namespace

TEST(GradAccumScheduleRun, OptimizerStepsPerEpochFollowTheSchedule) {
  TempDir dir("accum");
  // 8 batches per epoch: 8 steps in epochs 0 and 1, then 2 with factor 4.
  auto r = run(dir, "a", kAccum);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(checkpoint_files(dir / "runs/a/version_0"),
            (std::set<std::string>{"epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "epoch=2-step=18.ckpt",
                                   "epoch=3-step=20.ckpt", "last.ckpt"}));
  // Stopped in the middle of epoch 2 (after one 4-batch step), resumed: the factor is back.
  auto part = run(dir, "b", kAccum, {"--set", "trainer.max_steps=17"});
  ASSERT_EQ(part.exit_code, 0) << part.err;
  EXPECT_EQ(load(dir / "runs/b/version_0/checkpoints/last.ckpt").at("global_step").toInt(), 17);
  auto rest = run(dir, "b", kAccum, {"--resume", "last"});
  ASSERT_EQ(rest.exit_code, 0) << rest.err;
  EXPECT_EQ(load(dir / "runs/b/version_0/checkpoints/last.ckpt").at("global_step").toInt(), 20);
  EXPECT_TRUE(checkpoint_files(dir / "runs/b/version_0").count("epoch=2-step=18.ckpt")) << rest.err;
}

TEST(GradAccumScheduleRun, RefusesBadSchedulesAndATrainerFactor) {
  TempDir dir("accum");
  auto both = run(dir, "a", kAccum, {"--set", "trainer.accumulate_grad_batches=2"});
  EXPECT_EQ(both.exit_code, 2) << both.err;
  EXPECT_NE(both.err.find("both set gradient accumulation"), std::string::npos) << both.err;
  auto order = run(dir, "b", kAccum, {"--set", "grad_accum_schedule.epochs=[3, 1]"});
  EXPECT_EQ(order.exit_code, 2) << order.err;
  EXPECT_NE(order.err.find("strictly ascending"), std::string::npos) << order.err;
  auto len = run(dir, "c", kAccum, {"--set", "grad_accum_schedule.factors=[1]"});
  EXPECT_EQ(len.exit_code, 2) << len.err;
  EXPECT_NE(len.err.find("same length"), std::string::npos) << len.err;
}

// ---------------------------------------------------------------------------------------------
// model_summary

TEST(ModelSummaryTable, HumanReadableCountsAsLightning) {
  namespace ms = ember_model_summary;
  EXPECT_EQ(ms::human_count(0), "0  ");
  EXPECT_EQ(ms::human_count(320), "320  ");
  EXPECT_EQ(ms::human_count(18496), "18.5 K");
  EXPECT_EQ(ms::human_count(401536), "401 K");
  EXPECT_EQ(ms::human_count(1290), "1.3 K");
  EXPECT_EQ(ms::human_count(2500000), "2.5 M");
  EXPECT_EQ(ms::short_type("torch::nn::Conv2dImpl"), "Conv2d");
}

TEST(ModelSummaryRun, ListsTheCnnLayersOnce) {
  TempDir dir("summary");
  const std::string toml = R"(
[trainer]
max_steps = 1
enable_progress_bar = false
[model]
name = "cnn"
[data]
name = "synthetic"
shape = [1, 28, 28]
num_train = 16
num_val = 0
batch_size = 8
)";
  auto r = run(dir, "s", toml);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // conv1: 1*32*9 + 32; conv2: 32*64*9 + 64; fc1: 64*7*7*128 + 128; fc2: 128*10 + 10.
  for (const char* row : {"| conv1        | Conv2d  | 320    | train", "| conv2        | Conv2d  | 18.5 K | train",
                          "| dropout_conv | Dropout | 0      | train", "| fc1          | Linear  | 401 K  | train",
                          "| fc2          | Linear  | 1.3 K  | train"})
    EXPECT_NE(r.err.find(row), std::string::npos) << row << "\n" << r.err;
  EXPECT_NE(r.err.find("421 K     Trainable params"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("0         Non-trainable params"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("421 K     Total params"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("1.687     Total estimated model params size (MB)"), std::string::npos) << r.err;
  EXPECT_EQ(count(r.err, "Total params"), 1u) << r.err;  // the engine prints no summary of its own
  auto off = run(dir, "off", toml, {"--set", "trainer.enable_model_summary=false"});
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_EQ(count(off.err, "Total params"), 0u) << off.err;
  auto none = run(dir, "zero", toml, {"--set", "model_summary.max_depth=0"});
  ASSERT_EQ(none.exit_code, 0) << none.err;
  EXPECT_EQ(count(none.err, "Total params"), 0u) << none.err;
}

// ---------------------------------------------------------------------------------------------
// lr_find

TEST(LrFindSweep, ScheduleSmoothingAndSuggestion) {
  namespace lf = ember_lr_find;
  EXPECT_DOUBLE_EQ(lf::lr_at(lf::Mode::exponential, 1e-8, 1.0, 0, 100), 1e-8);
  EXPECT_NEAR(lf::lr_at(lf::Mode::exponential, 1e-8, 1.0, 50, 100), 1e-4, 1e-12);
  EXPECT_NEAR(lf::lr_at(lf::Mode::linear, 1e-3, 1.0 + 1e-3, 25, 100), 0.25 + 1e-3, 1e-12);
  lf::Smoother s;
  EXPECT_NEAR(s.add(2.0), 2.0, 1e-12);  // bias correction: a constant stays constant
  EXPECT_NEAR(s.add(2.0), 2.0, 1e-12);
  lf::Divergence d(4.0);
  EXPECT_FALSE(d.add(1.0));
  EXPECT_FALSE(d.add(0.5));
  EXPECT_FALSE(d.add(1.9));
  EXPECT_TRUE(d.add(2.1));
  // Steepest descent, after skipping the first 10 and the last point.
  std::vector<double> curve;
  for (int i = 0; i < 40; ++i) curve.push_back(-std::tanh((i - 20) / 3.0));
  EXPECT_EQ(lf::suggestion(curve), 20u);
  curve[5] = -100;  // before skip_begin: ignored
  curve[22] = std::nan("");  // non-finite values drop out
  EXPECT_EQ(lf::suggestion(curve), 21u);
  EXPECT_FALSE(lf::suggestion(std::vector<double>(11, 1.0)).has_value());
}

namespace {
std::string lr_find_toml(double curvature, const std::string& extra = "") {
  return R"(
plugins = ["lr_find"]
[trainer]
max_epochs = 1
limit_train_batches = 2
enable_progress_bar = false
enable_model_summary = false
log_every_n_steps = 1
[model]
name = "tune_probe"
dim = 4
curvature = )" + std::to_string(curvature) + R"(
[data]
name = "synthetic"
task = "regression"
shape = [4]
num_classes = 4
num_train = 64
num_val = 0
batch_size = 8
[optimizer]
name = "sgd"
lr = 0.001
)" + extra;
}

double logged_suggestion(const std::string& err) {
  std::smatch m;
  const std::regex re("lr_find: suggested learning rate ([0-9.eE+-]+)");
  if (!std::regex_search(err, m, re)) return NAN;
  return std::stod(m[1]);
}

// Width and height from a PNG's IHDR chunk; 0x0 when the file is no PNG.
std::pair<uint32_t, uint32_t> png_size(const fs::path& p) {
  const std::string b = read_file(p);
  if (b.size() < 24 || b.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0 || b.compare(12, 4, "IHDR") != 0) return {0, 0};
  auto be32 = [&](size_t o) {
    return (uint32_t(uint8_t(b[o])) << 24) | (uint32_t(uint8_t(b[o + 1])) << 16) | (uint32_t(uint8_t(b[o + 2])) << 8) | uint8_t(b[o + 3]);
  };
  return {be32(16), be32(20)};
}
}  // namespace

TEST(LrFindRun, FindsThePlantedRateAndTrainsWithIt) {
  TempDir dir("lrfind");
  // SGD on a bowl of curvature a converges fastest at lr = 1/a and diverges above 2/a; the
  // steepest descent of the loss over the sweep lies a few times below 1/a. Two curvatures ten
  // times apart must give suggestions in the same band, ten times apart.
  double found[2] = {0, 0};
  const double curvature[2] = {1.0, 10.0};
  for (int k = 0; k < 2; ++k) {
    const std::string name = "a" + std::to_string(k);
    // The second sweep goes up to 10, far beyond 2/a = 0.2: the loss blows up and the sweep stops.
    auto r = run(dir, name, lr_find_toml(curvature[k], k == 0 ? "" : "[lr_find]\nmax_lr = 10.0\n"));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const fs::path run_dir = dir / "runs" / name / "version_0";
    found[k] = logged_suggestion(r.err);
    EXPECT_GT(found[k] * curvature[k], 0.1) << r.err;
    EXPECT_LT(found[k] * curvature[k], 1.0) << r.err;
    const auto rows = read_csv(run_dir / "lr_find.csv");
    if (k == 0) EXPECT_EQ(rows.size(), 100u);  // max_lr = 1 < 2/a: no divergence
    else EXPECT_LT(rows.size(), 100u);         // diverged: stopped early
    ASSERT_GE(rows.size(), 12u);
    EXPECT_DOUBLE_EQ(std::stod(rows.front().at("lr")), 1e-8);
    if (EMBER_TEST_WITH_CAIRO) {
      EXPECT_EQ(png_size(run_dir / "lr_find.png"), (std::pair<uint32_t, uint32_t>{900, 600}));
    } else {  // a build without cairo writes the CSV and says why there is no plot
      EXPECT_FALSE(fs::exists(run_dir / "lr_find.png"));
      EXPECT_NE(r.err.find("no lr_find.png: this build has no cairo"), std::string::npos) << r.err;
    }
    // The training that follows uses the suggestion (the model logs its optimizer's rate).
    const double suggestion = callback_state(run_dir / "checkpoints/last.ckpt", "lr_find").at("suggestion").toDouble();
    EXPECT_NEAR(suggestion, found[k], found[k] * 1e-3);
    const auto lrs = column(run_dir, "probe_lr");
    ASSERT_FALSE(lrs.empty()) << r.err;
    for (double lr : lrs) EXPECT_NEAR(lr, suggestion, suggestion * 1e-6);
  }
  EXPECT_GT(found[0] / found[1], 5.0);
  EXPECT_LT(found[0] / found[1], 20.0);
}

TEST(LrFindRun, TrialStepsLeaveNoTraceAndResumeDoesNotSearchAgain) {
  TempDir dir("lrfind");
  // An MLP with dropout on shuffled data: the run after the sweep must be the run without it
  // (weights, optimizer moments, RNG and loop position restored).
  const std::string base = R"(
[trainer]
max_steps = 3
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [16]
dropout = 0.3
[data]
name = "synthetic"
shape = [8]
num_train = 64
num_val = 0
batch_size = 8
)";
  auto plain = run(dir, "plain", base);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  auto swept = run(dir, "swept", base + "[lr_find]\nupdate_attr = false\nnum_training_steps = 20\nearly_stop_threshold = 0\n",
                   {"--plugins", "lr_find"});
  ASSERT_EQ(swept.exit_code, 0) << swept.err;
  ASSERT_NE(swept.err.find("lr_find: suggested learning rate"), std::string::npos) << swept.err;
  auto a = weights(dir / "runs/plain/version_0/checkpoints/last.ckpt");
  auto b = weights(dir / "runs/swept/version_0/checkpoints/last.ckpt");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
  EXPECT_EQ(load(dir / "runs/swept/version_0/checkpoints/last.ckpt").at("global_step").toInt(), 3);
  for (const auto& e : fs::directory_iterator(dir / "runs/swept/version_0"))  // the temporary checkpoint is gone
    EXPECT_EQ(e.path().filename().string().find(".lr_find"), std::string::npos) << e.path();

  // Resume: the suggestion is in the state; no second sweep, the rate in use stays.
  auto first = run(dir, "res", lr_find_toml(1.0));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const fs::path run_dir = dir / "runs/res/version_0";
  const double suggestion = callback_state(run_dir / "checkpoints/last.ckpt", "lr_find").at("suggestion").toDouble();
  const auto csv_before = read_file(run_dir / "lr_find.csv");
  auto second = run(dir, "res", lr_find_toml(1.0), {"--resume", "last", "--set", "trainer.max_epochs=2"});
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_NE(second.err.find("not searching again"), std::string::npos) << second.err;
  EXPECT_EQ(second.err.find("lr_find: suggested learning rate"), std::string::npos) << second.err;
  EXPECT_EQ(read_file(run_dir / "lr_find.csv"), csv_before);
  const auto lrs = column(run_dir, "probe_lr");
  ASSERT_GE(lrs.size(), 4u);
  EXPECT_NEAR(lrs.back(), suggestion, suggestion * 1e-6);
  EXPECT_DOUBLE_EQ(callback_state(run_dir / "checkpoints/last.ckpt", "lr_find").at("suggestion").toDouble(), suggestion);
}

// ---------------------------------------------------------------------------------------------
// batch_size_finder

TEST(BatchSizeSearch, PowerAndBinsearchFindAPlantedLimit) {
  namespace bs = ember_batch_size;
  auto limit = [](int64_t max) {
    return [max](int64_t n) { return n <= max ? bs::Outcome::fits : bs::Outcome::too_big; };
  };
  bs::Settings s;
  EXPECT_EQ(bs::search(s, limit(37)).size, 32);
  EXPECT_EQ(bs::search(s, limit(1)).size, 1);
  EXPECT_EQ(bs::search(s, limit(0)).size, 0);
  s.max_val = 20;
  EXPECT_EQ(bs::search(s, limit(100)).size, 20);
  s = {};
  s.mode = bs::Mode::binsearch;
  s.margin = 0;
  for (int64_t max : {1, 2, 3, 37, 64, 100, 1000}) EXPECT_EQ(bs::search(s, limit(max)).size, max) << max;
  s.margin = 0.05;
  EXPECT_EQ(bs::search(s, limit(100)).size, 95);
  s.margin = 0;
  s.init_val = 64;
  EXPECT_EQ(bs::search(s, limit(5)).size, 5);
  // The data's own size is a limit like memory.
  auto data = [](int64_t n) { return n <= 48 ? bs::Outcome::fits : bs::Outcome::data_limit; };
  s.init_val = 2;
  EXPECT_EQ(bs::search(s, data).size, 48);
}

namespace {
std::string bsf_toml(const std::string& model_extra, const std::string& finder) {
  return R"(
plugins = ["batch_size_finder"]
[trainer]
# The planted limits are CPU memory budgets.
accelerator = "cpu"
max_steps = 2
enable_progress_bar = false
enable_model_summary = false
log_every_n_steps = 1
[model]
name = "tune_probe"
dim = 4
)" + model_extra + R"(
[data]
name = "synthetic"
task = "regression"
shape = [4]
num_classes = 4
num_train = 256
num_val = 0
batch_size = 4
[optimizer]
name = "sgd"
lr = 0.01
[batch_size_finder]
)" + finder;
}

int64_t found_size(const fs::path& run_dir) {
  return callback_state(run_dir / "checkpoints/last.ckpt", "batch_size_finder").at("batch_size").toInt();
}
}  // namespace

TEST(BatchSizeFinderRun, CpuMemoryBudgetAdmitsThePlantedSize) {
  TempDir dir("bsf");
  // tune_probe holds 1 MiB per sample from forward to backward and allocates nothing else of
  // that size: a step's peak is 1 MiB per sample plus a few KB. A budget of 37.5 MiB admits
  // exactly 37.
  const std::string model = "bytes_per_sample = 1048576\n";
  const std::string budget = "memory_budget_mb = " + std::to_string((37 * 1048576 + 524288) / 1e6) + "\n";
  struct Case {
    const char* name;
    std::string finder;
    int64_t expected;
  };
  for (const auto& c : std::vector<Case>{{"power", budget, 32},
                                         {"bin", budget + "mode = \"binsearch\"\nmargin = 0.0\n", 37},
                                         {"margin", budget + "mode = \"binsearch\"\n", 35}}) {
    auto r = run(dir, c.name, bsf_toml(model, c.finder));
    ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << r.err;
    const fs::path run_dir = dir / "runs" / c.name / "version_0";
    EXPECT_EQ(found_size(run_dir), c.expected) << c.name << "\n" << r.err;
    const auto sizes = column(run_dir, "probe_batch");  // the batches training then used
    ASSERT_EQ(sizes.size(), 2u) << c.name;
    for (double s : sizes) EXPECT_EQ(s, static_cast<double>(c.expected)) << c.name;
    EXPECT_EQ(load(run_dir / "checkpoints/last.ckpt").at("global_step").toInt(), 2) << c.name;  // trials not counted
  }
}

TEST(BatchSizeFinderRun, OutOfMemoryEndsTheSearchAndResumeReusesTheSize) {
  TempDir dir("bsf");
  // The model throws c10::OutOfMemoryError above 40 samples, as CUDA's allocator would.
  auto power = run(dir, "power", bsf_toml("oom_above = 40\n", ""));
  ASSERT_EQ(power.exit_code, 0) << power.err;
  EXPECT_NE(power.err.find("batch size 64: out of memory"), std::string::npos) << power.err;
  EXPECT_EQ(found_size(dir / "runs/power/version_0"), 32);
  auto bin = run(dir, "bin", bsf_toml("oom_above = 40\n", "mode = \"binsearch\"\nmargin = 0.0\n"));
  ASSERT_EQ(bin.exit_code, 0) << bin.err;
  const fs::path run_dir = dir / "runs/bin/version_0";
  EXPECT_EQ(found_size(run_dir), 40);
  // Resumed: the size is reapplied without searching.
  auto again = run(dir, "bin", bsf_toml("oom_above = 40\n", "mode = \"binsearch\"\nmargin = 0.0\n"),
                   {"--resume", "last", "--set", "trainer.max_steps=4"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.err.find("using batch size 40 found before this resume"), std::string::npos) << again.err;
  EXPECT_EQ(again.err.find("out of memory"), std::string::npos) << again.err;
  const auto sizes = column(run_dir, "probe_batch");
  ASSERT_EQ(sizes.size(), 4u);
  for (double s : sizes) EXPECT_EQ(s, 40.0);
  EXPECT_EQ(found_size(run_dir), 40);
  // Nothing fits: a clear error.
  auto none = run(dir, "none", bsf_toml("bytes_per_sample = 1048576\n", "memory_budget_mb = 1.0\n"));
  EXPECT_EQ(none.exit_code, 1) << none.err;
  EXPECT_NE(none.err.find("not even batch size 1 fits"), std::string::npos) << none.err;
}
