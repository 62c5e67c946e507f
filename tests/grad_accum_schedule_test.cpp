// grad_accum_schedule: optimizer steps per epoch follow the schedule; bad schedules are one line.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "callback_runs.h"
#include "checkpoint_support.h"

using namespace ember::test;
using namespace ember::test::callback_runs;

namespace {
const std::string kAccum = "plugins = [\"grad_accum_schedule\"]\n" +
                          tiny_mlp_toml(4, "num_train = 128\nnum_val = 0\nbatch_size = 16\n[checkpoint]\nsave_top_k = -1\n"
                                           "[grad_accum_schedule]\nepochs = [0, 2]\nfactors = [1, 4]\n");

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
