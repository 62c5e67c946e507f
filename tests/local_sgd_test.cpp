// examples/local_sgd_strategy: a strategy built out of tree against the installed SDK and its
// distributed runtime (Ember::distributed), installed next to the engine and trained with the
// installed engine on 2 CPU ranks over loopback. With sync_every = 1 and plain SGD it must take
// ddp's steps; with sync_every = 3 a run resumed from its checkpoint must end where an
// uninterrupted run ends.
#include <gtest/gtest.h>

#include <cstdlib>
#include <mutex>

#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// 64 samples, 2 ranks x batch 8: 4 steps an epoch. Plain SGD (no optimizer state), so local SGD's
// resume, which restarts every rank from the saved average, is exact.
const std::string kRun = synthetic_mlp_toml({.accelerator = "cpu", .hidden = "[24, 16]", .num_train = 64,
                                             .num_val = 16, .batch_size = 8}) +
                         "[optimizer]\nname = \"sgd\"\nlr = 0.1\n";

struct Installed {
  fs::path prefix, engine;
  std::string error;  // why the example could not be built ("" when it was)
};

// Builds and installs the example once per test process. CTest runs each test in a process of its
// own, two at a time, so each test gets a folder of its own (16 MB, replaced by the next run).
const Installed& installed() {
  static Installed result;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    const fs::path work = fs::path(EMBER_TEST_TMP) / ("local-sgd-" + test);
    const fs::path build = engine_path().parent_path().parent_path();
    // Run from a folder of its own (run_process keeps the output there), not the source tree.
    const fs::path cwd = work.string() + "-log";
    fs::create_directories(cwd);
    auto r = run_process({"/bin/bash", (source_dir() / "tests/build_example.sh").string(), build.string(), work.string(), "local_sgd_strategy"},
                         cwd, {{"TORCH_DIR", EMBER_TEST_TORCH_DIR}, {"CMAKE_PREFIX_PATH", EMBER_TEST_DEPS_PREFIX_PATH}}, 900);
    if (r.exit_code != 0) result.error = "build_example.sh failed (exit " + std::to_string(r.exit_code) + "):\n" + r.out + r.err;
    result.prefix = work / "prefix";
    result.engine = result.prefix / "bin/engine";
  });
  return result;
}

// The installed engine, which finds local_sgd (and ddp) in <prefix>/lib/ember/plugins.
ProcessResult run_installed(const TempDir& dir, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {installed().engine.string()};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = run_process(argv, dir.path(), {{"OMP_NUM_THREADS", "1"}}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r;
}

class LocalSgd : public ::testing::Test {
 protected:
  void SetUp() override {
    EMBER_SKIP_WITHOUT_MPI();
    ASSERT_EQ(installed().error, "");
  }
};

}  // namespace

TEST_F(LocalSgd, OutOfTreeStrategyWithSyncEveryStepTakesDdpsSteps) {
  TempDir ddp("local_sgd"), local("local_sgd");
  write_file(ddp / "run.toml", kRun);
  write_file(local / "run.toml", kRun);
  run_installed(ddp, {"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=30.0", "--set", "trainer.devices=2"});
  auto r = run_installed(local, {"--plugins", "local_sgd", "run.toml", "--set", "local_sgd.timeout=30.0", "--set", "trainer.devices=2",
                                 "--set", "local_sgd.sync_every=1"});
  // The strategy came from the installed plugin folder, and averaged after every step.
  EXPECT_NE(r.err.find("local_sgd: 8 parameter averages every 1 steps"), std::string::npos) << r.err;
  // Averaging parameters after each plain SGD step is averaging the gradients first: the same
  // weights up to float rounding.
  EXPECT_LE(max_weight_difference(last_checkpoint(ddp), last_checkpoint(local)), 1e-5);
}

TEST_F(LocalSgd, OutOfTreeStrategyResumesFromItsCheckpoint) {
  TempDir full("local_sgd"), split("local_sgd");
  write_file(full / "run.toml", kRun);
  write_file(split / "run.toml", kRun);
  const std::vector<std::string> common = {"--plugins", "local_sgd", "run.toml", "--set", "local_sgd.timeout=30.0",
                                           "--set", "trainer.devices=2", "--set", "local_sgd.sync_every=3"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), common.begin(), common.end());
    return extra;
  };
  run_installed(full, with({"--set", "trainer.max_epochs=3"}));
  run_installed(split, with({"--set", "trainer.max_epochs=1"}));
  auto r = run_installed(split, with({"--set", "trainer.max_epochs=3", "--resume", "last"}));
  EXPECT_NE(r.err.find("resumed from"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(full), last_checkpoint(split)), 0.0);
  // Local SGD does not take ddp's steps when the ranks go 3 steps alone.
  TempDir ddp("local_sgd");
  write_file(ddp / "run.toml", kRun);
  run_installed(ddp, {"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=30.0", "--set", "trainer.devices=2", "--set",
                      "trainer.max_epochs=3"});
  EXPECT_GT(max_weight_difference(last_checkpoint(ddp), last_checkpoint(full)), 1e-4);
}
