// Loop semantics, checked on real runs of the engine: gradient accumulation, clipping, limits,
// max_steps, validation cadence, stop requests and Lightning's hook order.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <fstream>
#include <sstream>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// Regression on generated data with an MLP without dropout: every step is deterministic.
const char* kRegression = R"(
[trainer]
max_epochs = 1
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[model]
name = "mlp"
task = "regression"
input_size = 12
hidden = [16]
num_classes = 3
[data]
name = "synthetic"
task = "regression"
shape = [12]
num_classes = 3
num_train = 256
num_val = 32
num_test = 32
shuffle = false
[optimizer]
name = "sgd"
lr = 0.05
)";

int64_t global_step(const fs::path& ckpt) { return ember::engine::load_checkpoint_file(ckpt).at("global_step").toInt(); }

fs::path train(const TempDir& dir, const std::string& name, std::vector<std::string> sets, const std::string& extra = "",
               std::vector<std::string> args = {}) {
  write_file(dir / (name + ".toml"), std::string(kRegression) + extra);
  std::vector<std::string> cmd = {name + ".toml"};
  for (const auto& s : sets) cmd.insert(cmd.end(), {"--set", s});
  cmd.insert(cmd.end(), args.begin(), args.end());
  auto r = run_engine(cmd, dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return dir / "runs" / name / "version_0";
}

std::vector<std::string> lines(const fs::path& p) {
  std::vector<std::string> out;
  std::ifstream in(p);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

}  // namespace

TEST(Loop, AccumulatingKBatchesOfNEqualsOneBatchOfKN) {
  TempDir dir("loop");
  // Two optimizer steps each: 4 micro-batches of 8 per step, versus one batch of 32 per step.
  auto acc = train(dir, "acc", {"data.batch_size=8", "trainer.accumulate_grad_batches=4", "trainer.limit_train_batches=8"});
  auto big = train(dir, "big", {"data.batch_size=32", "trainer.limit_train_batches=2"});
  EXPECT_EQ(global_step(acc / "checkpoints/last.ckpt"), 2);
  EXPECT_EQ(global_step(big / "checkpoints/last.ckpt"), 2);
  auto a = weights(acc / "checkpoints/last.ckpt"), b = weights(big / "checkpoints/last.ckpt");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(at::allclose(t, b.at(name), 1e-5, 1e-6)) << name;
  // And it really trained: the weights differ from a run with a different batch.
  auto small = train(dir, "small", {"data.batch_size=8", "trainer.limit_train_batches=2"});
  EXPECT_FALSE(at::allclose(weights(small / "checkpoints/last.ckpt").at("head.weight"), b.at("head.weight")));
}

TEST(Loop, GradientClippingByNormAndByValue) {
  TempDir dir("loop");
  // lr so small that float32 weights do not move: the initial weights.
  auto init = weights(train(dir, "init", {"trainer.max_steps=1", "optimizer.lr=1e-30"}) / "checkpoints/last.ckpt");
  auto delta = [&](const fs::path& run) {
    std::vector<at::Tensor> d;
    for (const auto& [name, t] : weights(run / "checkpoints/last.ckpt")) d.push_back((t - init.at(name)).flatten());
    return at::cat(d);
  };
  // SGD with lr 1: the update is minus the clipped gradient.
  auto by_norm = delta(train(dir, "norm", {"trainer.max_steps=1", "optimizer.lr=1.0", "trainer.gradient_clip_val=0.01"}));
  EXPECT_NEAR(by_norm.norm().item<double>(), 0.01, 1e-4);
  auto by_value = delta(train(dir, "value", {"trainer.max_steps=1", "optimizer.lr=1.0", "trainer.gradient_clip_val=0.001",
                                             "trainer.gradient_clip_algorithm=\"value\""}));
  EXPECT_NEAR(by_value.abs().max().item<double>(), 0.001, 1e-6);
  auto unclipped = delta(train(dir, "free", {"trainer.max_steps=1", "optimizer.lr=1.0"}));
  EXPECT_GT(unclipped.norm().item<double>(), 0.1);  // clipping was actually active above
}

TEST(Loop, LimitsMaxStepsAndValidationCadence) {
  TempDir dir("loop");
  std::string recorder = "\n[hook_recorder]\npath = \"hooks.txt\"\n";
  auto good = test_plugin_dir("good").string();
  auto run = train(dir, "limits",
                   {"trainer.max_epochs=2", "trainer.limit_train_batches=6", "trainer.val_check_interval=2",
                    "trainer.limit_val_batches=3", "data.batch_size=8"},
                   recorder, {"--plugin-path", good, "--plugins", "hook_recorder"});
  EXPECT_EQ(global_step(run / "checkpoints/last.ckpt"), 12);
  auto hooks = lines(dir / "hooks.txt");
  EXPECT_EQ(std::count(hooks.begin(), hooks.end(), "on_validation_start"), 6);  // 3 per epoch
  EXPECT_EQ(std::count(hooks.begin(), hooks.end(), "on_validation_batch_start"), 18);
  EXPECT_EQ(std::count(hooks.begin(), hooks.end(), "on_train_batch_start"), 12);

  auto stepped = train(dir, "steps", {"trainer.max_steps=5", "trainer.max_epochs=-1", "data.batch_size=8"});
  EXPECT_EQ(global_step(stepped / "checkpoints/last.ckpt"), 5);

  fs::remove(dir / "hooks.txt");
  auto no_val = train(dir, "noval", {"trainer.limit_val_batches=0", "trainer.limit_train_batches=0.25"}, recorder,
                      {"--plugin-path", good, "--plugins", "hook_recorder"});
  hooks = lines(dir / "hooks.txt");
  EXPECT_EQ(std::count(hooks.begin(), hooks.end(), "on_validation_start"), 0);
  EXPECT_EQ(std::count(hooks.begin(), hooks.end(), "on_train_batch_start"), 2);  // 8 batches of 32, a quarter
  for (const auto& row : read_csv(no_val / "metrics.csv")) EXPECT_EQ(row.count("val_loss"), 0u);
}

TEST(Loop, StopRequestEndsTheRunAfterTheEpoch) {
  TempDir dir("loop");
  auto run = train(dir, "stop", {"trainer.max_epochs=5", "data.batch_size=64"}, "\n[hook_recorder]\nstop_at_epoch = 1\n",
                   {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "hook_recorder"});
  EXPECT_EQ(global_step(run / "checkpoints/last.ckpt"), 8);  // two epochs of 4 batches
}

TEST(Loop, HookOrderFollowsLightning) {
  TempDir dir("loop");
  train(dir, "hooks",
        {"trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=1",
         "trainer.enable_checkpointing=false", "trainer.accumulate_grad_batches=2"},
        "\n[hook_recorder]\n", {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "hook_recorder"});
  std::vector<std::string> val = {"on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
                                  "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end"};
  std::vector<std::string> expected = {"setup", "on_fit_start", "on_sanity_check_start"};
  expected.insert(expected.end(), val.begin(), val.end());
  expected.insert(expected.end(), {"on_sanity_check_end", "on_train_start", "on_train_epoch_start",
                                   // micro-batch 1 of 2: no optimizer step
                                   "on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
                                   "on_train_batch_end",
                                   // micro-batch 2: gradients kept, then the step
                                   "on_train_batch_start", "on_before_backward", "on_after_backward",
                                   "on_before_optimizer_step", "on_train_batch_end"});
  expected.insert(expected.end(), val.begin(), val.end());
  expected.insert(expected.end(), {"on_train_epoch_end", "on_train_end", "on_fit_end", "teardown"});
  EXPECT_EQ(lines(dir / "hooks.txt"), expected);
}

TEST(Loop, FailedRunCallsOnException) {
  TempDir dir("loop");
  write_file(dir / "fail.toml", std::string(kRegression) + "\n[checkpoint]\nmonitor = \"no_such_metric\"\n[hook_recorder]\n");
  auto r = run_engine({"fail.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", "hook_recorder"}, dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  auto hooks = lines(dir / "hooks.txt");
  ASSERT_FALSE(hooks.empty());
  EXPECT_EQ(hooks.back(), "on_exception");
}

TEST(Loop, StrategyPrecisionAndHooksNestAsDocumented) {
  TempDir dir("loop");
  // docs/step.md: the precision handler runs the loop's closure inside its optimizer step, and
  // clipping hooks come after the closure's backward.
  train(dir, "nest",
        {"trainer.limit_train_batches=2", "trainer.limit_val_batches=0", "trainer.enable_checkpointing=false",
         "trainer.accumulate_grad_batches=2", "trainer.max_epochs=1"},
        "\n[hook_recorder]\n[traced_precision]\n",
        {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "hook_recorder,traced_precision"});
  auto all = lines(dir / "hooks.txt");
  auto first = std::find(all.begin(), all.end(), "on_train_batch_start");
  auto last = std::find(all.rbegin(), all.rend(), "on_train_batch_end").base();
  ASSERT_TRUE(first != all.end() && last != all.begin());
  std::vector<std::string> step(first, last);
  EXPECT_EQ(step, (std::vector<std::string>{
                      "on_train_batch_start", "precision.forward_begin", "precision.forward_end", "on_before_zero_grad",
                      "on_before_backward", "precision.backward", "on_after_backward", "on_train_batch_end",
                      "on_train_batch_start", "precision.optimizer_step", "precision.forward_begin",
                      "precision.forward_end", "on_before_backward", "precision.backward", "on_after_backward",
                      "on_before_optimizer_step", "precision.step", "on_train_batch_end"}));
}

// The runtime (engine/src/runtime/runtime.h) checks that some plugin ran the step's closure: a
// precision handler that steps without it would train nothing, silently. One line, exit 1,
// naming both plugins; nothing is written as if the step had happened.
TEST(Loop, RuntimeRefusesAStepWhoseClosureNeverRan) {
  TempDir dir("loop");
  write_file(dir / "skip.toml", std::string(kRegression) + "\n[traced_precision]\nskip_closure = true\n");
  auto r = run_engine({"skip.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", "traced_precision", "--set",
                       "trainer.enable_checkpointing=false"},
                      dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("strategy 'single_device' / precision 'traced_precision' did not run the step's closure (a plugin bug)"),
            std::string::npos)
      << r.err;
  // The same handler that runs its closure trains.
  write_file(dir / "run.toml", std::string(kRegression) + "\n[traced_precision]\n");
  auto ok = run_engine({"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", "traced_precision", "--set",
                        "trainer.enable_checkpointing=false"},
                       dir.path());
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}
