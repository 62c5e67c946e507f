// timer: DD:HH:MM:SS durations (duration.h), and runs that stop at the limit, count time before a
// resume, and take trainer.max_time.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "callback_runs.h"
#include "checkpoint_support.h"
#include <ember/support/duration.h>

using namespace ember::test;
using namespace ember::test::callback_runs;

TEST(TimerDuration, ParsesDaysHoursMinutesSeconds) {
  EXPECT_DOUBLE_EQ(ember::parse_duration("00:12:00:00"), 12 * 3600.0);
  EXPECT_DOUBLE_EQ(ember::parse_duration("01:00:01:02.5"), 86400 + 62.5);
  EXPECT_THROW(ember::parse_duration("12:00:00"), std::invalid_argument);
  EXPECT_THROW(ember::parse_duration("00:x:00:00"), std::invalid_argument);
  EXPECT_THROW(ember::parse_duration("00:00:00:00"), std::invalid_argument);
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
