// simple_profiler on a real run: every phase counted, the table sums to the run.
#include <gtest/gtest.h>

#include "profile_table.h"
#include "observability_support.h"

using namespace ember::test;
namespace fs = std::filesystem;

TEST(SimpleProfiler, TimelineAddsUp) {
  ember_prof::Timeline t;
  t.switch_to("a", 1.0);
  t.switch_to("b", 1.5);
  t.switch_to("a", 2.0);
  t.switch_to("", 4.0);
  EXPECT_DOUBLE_EQ(t.stats().at("a").total, 2.5);
  EXPECT_EQ(t.stats().at("a").count, 2);
  EXPECT_DOUBLE_EQ(t.recorded(), 3.0);
}

TEST(SimpleProfiler, TableCountsEveryPhaseAndSumsToTheRun) {
  TempDir dir("observability");
  write_file(dir / "run.toml", kMlp);
  // A known cost: the sleeper sleeps 30 ms in on_after_backward, after the profiler (named
  // first) started the "after backward" action.
  auto r = engine_ok(dir, {"--plugins", "simple_profiler,sleeper", "--set", "sleeper.hooks=[\"on_after_backward\"]",
                           "--set", "sleeper.seconds=[0.03]", "--set", "trainer.accumulate_grad_batches=2"});
  const fs::path report = dir / "runs/run/version_0/simple_profiler.txt";
  ASSERT_TRUE(fs::exists(report)) << r.err;
  const std::string text = read_file(report);
  EXPECT_NE(r.err.find("simple_profiler (fit)"), std::string::npos) << r.err;  // the table is printed
  auto rows = fit_table(text);
  ASSERT_TRUE(rows.count("Total")) << text;
  // 2 epochs x 6 batches; accumulating 2 batches: 6 optimizer steps, 6 zero_grads; 2 validation
  // epochs of 2 batches (the sanity check's are apart).
  EXPECT_EQ(rows["training_step (forward)"].calls, 12) << text;
  EXPECT_EQ(rows["backward"].calls, 12) << text;
  EXPECT_EQ(rows["optimizer_step (clip, step)"].calls, 6) << text;
  EXPECT_EQ(rows["optimizer_zero_grad"].calls, 6) << text;
  EXPECT_EQ(rows["validation_step"].calls, 4) << text;
  // After each epoch start and batch end, and again after each epoch's validation.
  EXPECT_EQ(rows["data fetch (train)"].calls, 2 + 12 + 2) << text;
  EXPECT_GE(rows["sanity check"].calls, 1) << text;
  // The sleeper's 30 ms after every backward land in "after backward", nowhere else.
  EXPECT_GE(rows["after backward (unscale, hooks)"].mean, 0.03) << text;
  EXPECT_LT(rows["backward"].mean, 0.03) << text;
  // The actions add up to the run: totals and percentages.
  double total = 0, pct = 0;
  for (const auto& [name, row] : rows)
    if (name != "Total") total += row.total, pct += row.pct;
  EXPECT_NEAR(total, rows["Total"].total, 1e-4 * rows["Total"].total + 1e-5) << text;
  EXPECT_NEAR(pct, 100.0, 0.05) << text;
  EXPECT_GT(rows["Total"].total, 12 * 0.03);
  EXPECT_NE(text.find("Profiler overhead:"), std::string::npos) << text;
}

TEST(SimpleProfiler, FailedRunStillGetsItsReport) {
  TempDir dir("observability");
  // The checkpoint callback fails at the first epoch end: its monitor is never logged.
  write_file(dir / "run.toml", std::string(kMlp) + "\n[checkpoint]\nmonitor = \"no_such_metric\"\n");
  auto r = run_engine({"run.toml", "--plugins", "simple_profiler"}, dir.path(), {{"OMP_NUM_THREADS", "1"}});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const fs::path report = dir / "runs/run/version_0/simple_profiler.txt";
  ASSERT_TRUE(fs::exists(report)) << r.err;
  auto rows = fit_table(read_file(report));
  EXPECT_EQ(rows["training_step (forward)"].calls, 6) << read_file(report);  // the first epoch ran
  EXPECT_GT(rows["Total"].total, 0.0);
  EXPECT_NE(r.err.find("simple_profiler (failed run)"), std::string::npos) << r.err;
}
