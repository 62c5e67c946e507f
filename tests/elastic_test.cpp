// Elastic restarts. Under the real torchrun agent (the torch wheel's `torchrun` in the venv that
// scripts/setup.sh makes): `torchrun --max-restarts=2 --no-python engine ...` with one rank killed
// mid-run; the agent stops the group and starts it again with TORCHELASTIC_RESTART_COUNT=1, the new
// ranks resume by themselves from the last checkpoint and the job ends with exit 0 and exactly the
// weights of an uninterrupted run. And a group that comes back with more ranks
// (trainer.num_nodes = 0: the launcher decides): 3 ranks in torchrun's environment resume a 2-rank
// sharded checkpoint by themselves, resharded. And the group torchrun re-forms when a node joins
// (`--nnodes=2:3`, three agents on this machine), which torchrun does not count as a restart: the
// run folder knows the job's id and the three ranks resume the two ranks' checkpoint by themselves.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>
#include <map>
#include <regex>
#include <string>
#include <thread>
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

// torchrun re-forms a group without counting a restart when a node joins or leaves; its job id
// (TORCHELASTIC_RUN_ID, --rdzv-id) in the run folder tells the new group that it already trained.
// Another job id, or torchrun's shared default "none", starts a run of its own.
TEST(Elastic, SameTorchrunJobResumesItsRunFolderAnotherStartsAfresh) {
  TempDir dir("elastic");
  write_file(dir / "run.toml", synthetic_mlp_toml({.accelerator = "cpu", .num_train = 64, .num_val = 16, .batch_size = 8}) +
                                   "[checkpoint]\nevery_n_train_steps = 2\n");
  const std::vector<std::string> steps = {"run.toml", "--set", "trainer.max_epochs=-1", "--set", "trainer.max_steps="};
  auto run = [&](const std::string& job, int max_steps) {
    auto args = steps;
    args.back() += std::to_string(max_steps);
    auto r = run_engine(args, dir.path(), {{"TORCHELASTIC_RUN_ID", job}}, 120);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.err;
  };
  std::string err = run("job-a", 4);
  EXPECT_EQ(err.find("re-formed"), std::string::npos) << err;
  EXPECT_EQ(read_file(dir / "runs/run/version_0/torchrun_job_id"), "job-a");
  err = run("job-a", 8);
  EXPECT_NE(err.find("torchrun re-formed the group of job 'job-a' (a node joined or left, which torchrun does not count as a restart): "
                     "resuming from the last checkpoint of its run folder version_0"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("at epoch 0, step 4 (batch 4 of the epoch)"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(dir / "runs/run/version_1"));
  EXPECT_TRUE(fs::exists(dir / "runs/run/version_0/checkpoints/epoch=0-step=8.ckpt"));
  for (const std::string job : {"job-b", "none"}) {
    err = run(job, 2);
    EXPECT_EQ(err.find("resum"), std::string::npos) << job << ": " << err;
  }
  EXPECT_EQ(read_file(dir / "runs/run/version_1/torchrun_job_id"), "job-b");
  EXPECT_TRUE(fs::exists(dir / "runs/run/version_2/checkpoints/last.ckpt"));
  EXPECT_FALSE(fs::exists(dir / "runs/run/version_2/torchrun_job_id")) << "\"none\" names no job";
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
// A real scale-up under torchrun's agents: three agents on this machine (`--nnodes=2:3`, one rank
// each, c10d rendezvous on the loopback). Two start and train a sharded job (slowly: the sleeper
// plugin holds each step of the 2-rank group); the third joins once a checkpoint exists, the
// agents stop the group (SIGTERM: the ranks save last.ckpt and exit) and start it again on 3
// ranks with TORCHELASTIC_RESTART_COUNT still 0. The new ranks find the job's run folder, resume
// its 2-rank checkpoint resharded, and end as the same two phases run by hand.
// torch 2.11's agents share their rendezvous store with the workers by default, and then a
// joining agent waits for a MASTER_ADDR that only the first round's rank 0 ever wrote (the round
// hangs until its 60 s timeout); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is the documented opt-out.
TEST(Elastic, TorchrunScaleUpReformsTheGroupWhichResumesResharded) {
  EMBER_SKIP_WITHOUT_MPI();
  const fs::path torchrun = fs::path(EMBER_TEST_PYTHON).parent_path() / "torchrun";
  ASSERT_TRUE(fs::exists(torchrun)) << torchrun << " missing: run scripts/setup.sh";
  TempDir shared("elastic"), by_hand("elastic"), a0("elastic"), a1("elastic"), a2("elastic");
  const TempDir* agent_dirs[] = {&a0, &a1, &a2};  // each agent's own output files; one run folder
  const std::string toml = kSharded + "[sleeper]\nseconds = [0.2]\nworld_size = 2\n";
  for (const auto* d : agent_dirs) write_file(*d / "run.toml", toml);
  write_file(by_hand / "run.toml", kSharded);
  const std::string port = std::to_string(free_port());
  auto start_agent = [&](int a) {
    return start_process({torchrun.string(), "--nnodes=2:3", "--nproc-per-node=1", "--max-restarts=1", "--monitor-interval=0.2",
                          "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:" + port, "--rdzv-id=scale-up-test",
                          "--rdzv-conf=last_call_timeout=5,join_timeout=120", "--local-addr=127.0.0.1", "--no-python",
                          engine_path().string(), "--plugin-path", test_plugin_dir("good").string(), "--plugins", "sharded,sleeper",
                          "run.toml", "--set", "trainer.devices=1", "--set", "trainer.num_nodes=0", "--set", "trainer.max_steps=200",
                          "--set", "trainer.max_epochs=-1", "--set", "trainer.default_root_dir=\"" + (shared / "runs").string() + "\""},
                         agent_dirs[a]->path(),
                         {{"OMP_NUM_THREADS", "1"}, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"}});
  };
  std::vector<Running> agents = {start_agent(0), start_agent(1)};
  const fs::path first_save = shared / "runs/run/version_0/checkpoints/epoch=0-step=4.ckpt";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(first_save / "meta.ckpt") && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const bool saved = fs::exists(first_save / "meta.ckpt");
  agents.push_back(start_agent(2));  // joins even if the wait ran out, so every agent ends
  std::string logs;
  for (size_t a = 0; a < agents.size(); ++a) {
    auto r = wait_process(agents[a], 300);
    EXPECT_FALSE(r.timed_out) << "agent " << a;
    EXPECT_EQ(r.exit_code, 0) << "agent " << a << ": " << r.err;
    logs += r.err;
  }
  ASSERT_TRUE(saved) << "the 2-rank group saved no checkpoint within 120 s: " << logs;
  EXPECT_NE(logs.find("torchrun re-formed the group of job 'scale-up-test'"), std::string::npos) << logs;
  EXPECT_NE(logs.find("the checkpoint was written by 2 ranks and is re-sharded onto 3"), std::string::npos) << logs;
  EXPECT_FALSE(fs::exists(shared / "runs/run/version_1")) << "the re-formed group started a run of its own";
  // Where the group was stopped depends on when the third agent came: run the same two phases
  // by hand from that step.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(logs, m, std::regex("resumed from \\S+ at epoch \\d+, step (\\d+)"))) << logs;
  const std::string step = m[1];
  run_engine_ok(by_hand, {"--plugins", "sharded", "run.toml", "--set", "trainer.devices=2", "--set", "trainer.max_steps=" + step, "--set",
                          "trainer.max_epochs=-1"});
  run_engine_ok(by_hand, {"--plugins", "sharded", "run.toml", "--set", "trainer.devices=3", "--set", "trainer.max_steps=200", "--set",
                          "trainer.max_epochs=-1", "--resume", "last"});
  EXPECT_EQ(max_weight_difference(last_checkpoint(by_hand), shared / "runs/run/version_0/checkpoints/last.ckpt"), 0.0) << "stopped at step " << step;
}
#endif
