// Strategy contract 2 (docs/strategy.md): a strategy built against SDK 1.1 (contract 1) still
// trains through the engine's adapter, with single_device's numbers; the model's own optimizer
// keeps its param groups when a strategy rebinds it to what it trains.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {
const char* kRun = R"(
[trainer]
# The test strategy of contract 1 trains on the CPU: single_device must too, for equal weights.
accelerator = "cpu"
max_epochs = 2
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 16
hidden = [12]
num_classes = 3
[data]
name = "synthetic"
shape = [16]
num_classes = 3
num_train = 48
num_val = 12
num_test = 0
batch_size = 8
[optimizer]
name = "adam"
lr = 0.01
)";
}  // namespace

TEST(StrategyContract, Contract1StrategyStillTrainsLikeSingleDevice) {
  TempDir single("contract"), old("contract");
  write_file(single / "run.toml", kRun);
  write_file(old / "run.toml", kRun);
  auto a = run_engine({"run.toml"}, single.path());
  ASSERT_EQ(a.exit_code, 0) << a.err;
  auto b = run_engine({"--plugin-path", test_plugin_dir("good").string(), "--plugins", "contract1_strategy", "run.toml", "--set",
                       "trainer.precision=\"32-true\""},
                      old.path());
  ASSERT_EQ(b.exit_code, 0) << b.err;
  auto wa = weights(single / "runs/run/version_0/checkpoints/last.ckpt");
  auto wb = weights(old / "runs/run/version_0/checkpoints/last.ckpt");
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) EXPECT_TRUE(at::equal(t, wb.at(name))) << name;
  // And it resumes from its own checkpoint (the optimizer state round-trips through the adapter).
  auto c = run_engine({"--plugin-path", test_plugin_dir("good").string(), "--plugins", "contract1_strategy", "run.toml", "--set",
                       "trainer.max_epochs=3", "--resume", "last"},
                      old.path());
  ASSERT_EQ(c.exit_code, 0) << c.err;
}
