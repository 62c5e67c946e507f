// Plugins of different issues together: a scheduler does not advance on a step the loss scaler
// skipped, and the training-trick callbacks run unchanged under other precisions and under ddp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>

#include "checkpoint/checkpoint_io.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

const char* kMlp = R"(
[trainer]
max_epochs = 3
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
log_every_n_steps = 1
[model]
name = "mlp"
input_size = 16
hidden = [16]
num_classes = 4
[data]
name = "synthetic"
shape = [16]
num_classes = 4
num_train = 64
num_val = 16
num_test = 0
batch_size = 8
shuffle = true
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
)";

std::map<int64_t, double> column(const fs::path& csv, const std::string& name) {
  std::map<int64_t, double> out;
  for (const auto& row : read_csv(csv))
    if (row.count(name) && !row.at(name).empty()) out[std::stoll(row.at("step"))] = std::stod(row.at(name));
  return out;
}

}  // namespace

TEST(Composition, SchedulerHoldsItsPositionOnAStepTheLossScalerSkipped) {
  TempDir dir("composition");
  write_file(dir / "run.toml", std::string(kMlp) +
                                   "\n[cyclic_lr]\nbase_lr = 0.01\nmax_lr = 0.05\nstep_size_up = 4\ncycle_momentum = false\n"
                                   "[grad_poison]\nbatches = [2]\n");
  auto r = run_engine({"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins",
                       "amp16,cyclic_lr,lr_monitor,grad_poison", "--set", "trainer.max_steps=6"},
                      dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lr = column(dir / "runs/run/version_0/metrics.csv", "lr-SGD");
  auto skipped = column(dir / "runs/run/version_0/metrics.csv", "amp_skipped_steps");
  ASSERT_EQ(lr.size(), 6u);
  EXPECT_EQ(skipped[2], 1.0);
  // Triangular, 4 steps up: position p gives 0.01 + 0.04 * p / 4. Steps 0..5 took positions
  // 0, 1, 2, 2 (step 2 was skipped, so the position did not advance), 3, 4.
  const int64_t position[] = {0, 1, 2, 2, 3, 4};
  for (int64_t s = 0; s < 6; ++s) EXPECT_NEAR(lr[s], 0.01 + 0.04 * std::min<int64_t>(position[s], 4) / 4.0, 1e-9) << "step " << s;
}

// The same plugin set on every combination: it must train to the end, with the averaged weights
// in last.ckpt, whatever the strategy and precision.
class TricksEverywhere : public ::testing::TestWithParam<std::tuple<const char*, const char*>> {};

TEST_P(TricksEverywhere, SwaCyclicEarlyStoppingAndLrMonitorRunToTheEnd) {
  const auto [strategy, precision] = GetParam();
  if (std::string(strategy) == "ddp") EMBER_SKIP_WITHOUT_MPI();
  TempDir dir("composition");
  write_file(dir / "run.toml", std::string(kMlp) +
                                   "\n[swa]\nswa_lrs = [0.02]\nswa_epoch_start = 1\nannealing_epochs = 1\n"
                                   "[cyclic_lr]\nbase_lr = 0.01\nmax_lr = 0.05\nstep_size_up = 4\ncycle_momentum = false\n"
                                   "[early_stopping]\nmonitor = \"val_loss\"\npatience = 5\n");
  std::vector<std::string> args = {"run.toml", "--plugins", std::string(strategy) + ",swa,cyclic_lr,early_stopping,lr_monitor",
                                   "--set", std::string("trainer.precision=\"") + precision + "\""};
  if (std::string(strategy) == "ddp") args.insert(args.end(), {"--set", "trainer.devices=2", "--set", "ddp.timeout=30.0", "--set", "trainer.accelerator=\"cpu\""});
  auto r = run_engine(args, dir.path(), {}, 240);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto ck = ember::engine::load_checkpoint_file(dir / "runs/run/version_0/checkpoints/last.ckpt");
  const int64_t per_epoch = std::string(strategy) == "ddp" ? 4 : 8;
  EXPECT_EQ(ck.at("global_step").toInt(), 3 * per_epoch);
  auto swa_state = ck.at("callbacks").toGenericDict().at("swa").toGenericDict();
  EXPECT_GT(swa_state.size(), 0u);
  for (const auto& e : ck.at("state_dict").toGenericDict())
    EXPECT_TRUE(at::isfinite(e.value().toTensor().to(at::kFloat)).all().item<bool>()) << e.key().toStringRef();
  EXPECT_FALSE(column(dir / "runs/run/version_0/metrics.csv", "lr-SGD").empty());
}

INSTANTIATE_TEST_SUITE_P(Composition, TricksEverywhere,
                         ::testing::Values(std::tuple{"single_device", "16-mixed"}, std::tuple{"single_device", "bf16-true"},
                                           std::tuple{"ddp", "32-true"}, std::tuple{"ddp", "bf16-mixed"}),
                         [](const auto& info) {
                           std::string s = std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
                           for (auto& c : s) if (c == '-') c = '_';
                           return s;
                         });
