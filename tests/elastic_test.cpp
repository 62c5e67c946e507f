// Elastic restarts. Under the real torchrun agent (the torch wheel's `torchrun` in the venv that
// scripts/setup.sh makes): `torchrun --max-restarts=2 --no-python engine ...` with one rank killed
// mid-run; the agent stops the group and starts it again with TORCHELASTIC_RESTART_COUNT=1, the new
// ranks resume by themselves from the last checkpoint and the job ends with exit 0 and exactly the
// weights of an uninterrupted run. And a group that comes back with more ranks
// (trainer.num_nodes = 0: the launcher decides): 3 ranks in torchrun's environment resume a 2-rank
// sharded checkpoint by themselves, resharded.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {
// 240 samples, 8 per rank: 15 steps an epoch on 2 ranks, 10 on 3.
const std::string kSharded = synthetic_mlp_toml({.accelerator = "cpu", .hidden = "[23, 17]", .num_train = 240, .num_val = 24, .batch_size = 8}) +
                             "[optimizer]\nname = \"adam\"\nlr = 0.01\n[checkpoint]\nevery_n_train_steps = 4\n"
                             "[sharded]\nstage = 3\nstate_dict_type = \"sharded\"\ntimeout = 30.0\n";
}  // namespace

// The group a restart brings back with 3 ranks (torchrun --nnodes=2:3 when a node joins) resumes
// the 2-rank job's sharded checkpoint by itself, with trainer.num_nodes = 0 taking the world from
// torchrun's environment: the same weights as the same two phases run by hand (2 ranks to step 8,
// then `--resume last` on 3). Without a launcher, num_nodes = 0 is a one-line error.
TEST(Elastic, GroupRestartedOnMoreRanksResumesTheShardedCheckpoint) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir by_hand("elastic"), restarted("elastic");
  for (const auto* d : {&by_hand, &restarted}) write_file(*d / "run.toml", kSharded);
  const std::vector<std::string> two = {"--plugins", "sharded", "run.toml", "--set", "trainer.devices=2", "--set", "trainer.max_steps=8",
                                        "--set", "trainer.max_epochs=-1"};
  run_engine_ok(by_hand, two);
  run_engine_ok(restarted, two);
  ASSERT_TRUE(fs::is_directory(last_checkpoint(restarted)));
  run_engine_ok(by_hand, {"--plugins", "sharded", "run.toml", "--set", "trainer.devices=3", "--set", "trainer.max_steps=20", "--set",
                          "trainer.max_epochs=-1", "--resume", "last"});
  // What torchrun gives each rank of the new group: 3 nodes of 1 rank, restart 1.
  const std::string port = std::to_string(free_port());
  std::vector<Running> ranks;
  for (int r = 0; r < 3; ++r) {
    std::map<std::string, std::string> env = {{"RANK", std::to_string(r)}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "0"},
                                              {"LOCAL_WORLD_SIZE", "1"}, {"GROUP_RANK", std::to_string(r)}, {"MASTER_ADDR", "127.0.0.1"},
                                              {"MASTER_PORT", port}, {"TORCHELASTIC_RESTART_COUNT", "1"}, {"OMP_NUM_THREADS", "1"}};
    ranks.push_back(start_process({engine_path().string(), "--plugins", "sharded", "run.toml", "--set", "trainer.devices=1", "--set",
                                   "trainer.num_nodes=0", "--set", "trainer.max_steps=20", "--set", "trainer.max_epochs=-1"},
                                  restarted.path(), env));
  }
  std::string logs;
  for (int r = 0; r < 3; ++r) {
    auto res = wait_process(ranks[static_cast<size_t>(r)], 180);
    EXPECT_EQ(res.exit_code, 0) << "rank " << r << ": " << res.err;
    logs += res.err;
  }
  EXPECT_NE(logs.find("restart 1 of this job (TORCHELASTIC_RESTART_COUNT=1): resuming from its last checkpoint"), std::string::npos) << logs;
  EXPECT_NE(logs.find("the checkpoint was written by 2 ranks and is re-sharded onto 3"), std::string::npos) << logs;
  EXPECT_EQ(max_weight_difference(last_checkpoint(by_hand), last_checkpoint(restarted)), 0.0);

  TempDir alone("elastic");
  write_file(alone / "run.toml", kSharded);
  auto r = run_engine({"--plugins", "sharded", "run.toml", "--set", "trainer.num_nodes=0"}, alone.path(), {}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("trainer.num_nodes = 0 takes the number of nodes from the launcher that started the ranks"), std::string::npos) << r.err;
}

#ifdef EMBER_TEST_PYTHON
namespace {
const std::string kCnn = R"(
[trainer]
deterministic = true
accelerator = "cpu"
devices = 2
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
max_epochs = -1
max_steps = 15
[checkpoint]
every_n_train_steps = 1
)" + small_cnn_toml(16, 16);
}  // namespace

TEST(Elastic, TorchrunAgentRestartsTheGroupWhichResumesByItself) {
  EMBER_SKIP_WITHOUT_MPI();
  const fs::path torchrun = fs::path(EMBER_TEST_PYTHON).parent_path() / "torchrun";
  ASSERT_TRUE(fs::exists(torchrun)) << torchrun << " missing: run scripts/setup.sh";
  TempDir full("elastic"), restarted("elastic");
  for (const auto* d : {&full, &restarted}) write_file(*d / "run.toml", kCnn);
  const std::vector<std::string> ddp = {"--plugins", "ddp", "--set", "ddp.timeout=10.0", "run.toml"};
  run_engine_ok(full, ddp);  // Ember's own launcher, no failure
  // The chaos test plugin kills rank 1 (SIGKILL) at step 8 on attempt 0 only.
  std::vector<std::string> argv = {torchrun.string(), "--standalone", "--nproc-per-node=2", "--max-restarts=2", "--monitor-interval=0.2",
                                   "--no-python", engine_path().string(), "--plugin-path", test_plugin_dir("good").string(),
                                   "--plugins", "chaos", "--set", "chaos.rank=1", "--set", "chaos.step=8"};
  argv.insert(argv.end(), ddp.begin(), ddp.end());
  auto r = run_process(argv, restarted.path(), {{"OMP_NUM_THREADS", "1"}}, 300);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("restart 1 of this job (TORCHELASTIC_RESTART_COUNT=1): resuming from its last checkpoint"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("(batch 2 of the epoch)"), std::string::npos) << "resumed mid-epoch after step 8: " << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(full), last_checkpoint(restarted)), 0.0);
}
#endif
