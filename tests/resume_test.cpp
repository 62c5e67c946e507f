// Resume: a run stopped after epoch k (or mid-epoch) and resumed ends with exactly the same
// weights as an uninterrupted run (CPU, deterministic), with dropout, shuffling and Adam state.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {
const std::string kCnn = R"(
[trainer]
deterministic = true
num_sanity_val_steps = 1
enable_progress_bar = false
enable_model_summary = false
[checkpoint]
monitor = "val_loss"
)" + small_cnn_toml();

ProcessResult engine_in(const TempDir& dir, std::vector<std::string> args) {
  auto r = run_engine(args, dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r;
}
}  // namespace

TEST(Resume, AfterEpochKMatchesAnUninterruptedRunExactly) {
  TempDir full("resume"), split("resume");
  write_file(full / "run.toml", kCnn);
  write_file(split / "run.toml", kCnn);
  engine_in(full, {"run.toml", "--set", "trainer.max_epochs=4"});
  engine_in(split, {"run.toml", "--set", "trainer.max_epochs=2"});
  auto r = engine_in(split, {"run.toml", "--set", "trainer.max_epochs=4", "--resume", "last"});
  EXPECT_NE(r.err.find("resumed from"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(split / "runs/run/version_1"));  // continued in its own folder
  expect_identical_weights(full / "runs/run/version_0/checkpoints/last.ckpt", split / "runs/run/version_0/checkpoints/last.ckpt");
  EXPECT_EQ(ember::engine::load_checkpoint_file(split / "runs/run/version_0/checkpoints/last.ckpt").at("global_step").toInt(), 24);
  // metrics.csv continues: rows of every epoch, none duplicated.
  std::map<std::string, int> val_rows_per_epoch;
  for (const auto& row : read_csv(split / "runs/run/version_0/metrics.csv"))
    if (!row.at("val_loss").empty()) ++val_rows_per_epoch[row.at("epoch")];
  EXPECT_EQ(val_rows_per_epoch, (std::map<std::string, int>{{"0", 1}, {"1", 1}, {"2", 1}, {"3", 1}}));
}

TEST(Resume, MidEpochMatchesAnUninterruptedRunExactly) {
  TempDir full("resume"), split("resume");
  write_file(full / "run.toml", kCnn);
  write_file(split / "run.toml", kCnn);
  engine_in(full, {"run.toml", "--set", "trainer.max_steps=15", "--set", "trainer.max_epochs=-1"});
  // Stops at step 8, in the middle of epoch 1 (6 batches per epoch), then goes on to 15.
  engine_in(split, {"run.toml", "--set", "trainer.max_steps=8", "--set", "trainer.max_epochs=-1"});
  auto r = engine_in(split, {"run.toml", "--set", "trainer.max_steps=15", "--set", "trainer.max_epochs=-1", "--resume", "last"});
  EXPECT_NE(r.err.find("(batch 2 of the epoch)"), std::string::npos) << r.err;
  expect_identical_weights(full / "runs/run/version_0/checkpoints/last.ckpt", split / "runs/run/version_0/checkpoints/last.ckpt");
}

// A job its agent restarted resumes by itself from its last checkpoint (issue "Training that heals
// itself"): torchrun's elastic agent sets TORCHELASTIC_RESTART_COUNT, SLURM's requeue
// SLURM_RESTART_COUNT. A run killed (SIGKILL: no graceful save) at step 8, in the middle of epoch
// 1, and started again with the same command line and a restart count of 1 ends with exactly the
// weights of an uninterrupted run. (The agent itself, which restarts the group, is torchrun's or
// SLURM's; here the test restarts the process as it would.)
TEST(Resume, RestartedJobResumesByItselfFromItsLastCheckpoint) {
  for (const char* variable : {"TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"}) {
    TempDir full("resume"), killed("resume");
    write_file(full / "run.toml", kCnn);
    write_file(killed / "run.toml", kCnn);
    const std::vector<std::string> common = {"run.toml", "--set", "trainer.max_steps=15", "--set", "trainer.max_epochs=-1",
                                             "--set", "checkpoint.every_n_train_steps=1", "--set", "checkpoint.save_top_k=-1"};
    engine_in(full, common);
    // The chaos test plugin kills rank 0 at step 8 on attempt 0 only.
    std::vector<std::string> cmd = {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "chaos", "--set", "chaos.rank=0",
                                    "--set", "chaos.step=8"};
    cmd.insert(cmd.end(), common.begin(), common.end());
    auto first = run_engine(cmd, killed.path(), {{variable, "0"}});
    EXPECT_NE(first.exit_code, 0) << variable << ": the first attempt was to be killed";
    auto second = run_engine(cmd, killed.path(), {{variable, "1"}});
    EXPECT_EQ(second.exit_code, 0) << second.err;
    EXPECT_NE(second.err.find(std::string("restart 1 of this job (") + variable + "=1): resuming from its last checkpoint"), std::string::npos)
        << second.err;
    EXPECT_NE(second.err.find("(batch 2 of the epoch)"), std::string::npos) << second.err;
    expect_identical_weights(full / "runs/run/version_0/checkpoints/last.ckpt", killed / "runs/run/version_0/checkpoints/last.ckpt");
  }
  // A count that is not one is a one-line error, not a silent fresh start.
  TempDir dir("resume");
  write_file(dir / "run.toml", kCnn);
  auto bad = run_engine({"run.toml"}, dir.path(), {{"TORCHELASTIC_RESTART_COUNT", "one"}});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("TORCHELASTIC_RESTART_COUNT='one' is not a restart count"), std::string::npos) << bad.err;
}

// trainer.max_restarts: Ember's own launcher starts the group again when a rank dies, and the new
// ranks resume from the last checkpoint by themselves: the job ends with exit 0 and the weights of
// an uninterrupted run. Without restarts the same job fails.
TEST(Resume, MaxRestartsRestartsTheGroupWhichResumesByItself) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir full("resume"), restarted("resume"), failed("resume");
  for (const auto* dir : {&full, &restarted, &failed}) write_file(*dir / "run.toml", kCnn);
  const std::vector<std::string> common = {"run.toml", "--plugins", "ddp", "--set", "ddp.timeout=10.0", "--set", "trainer.devices=2",
                                           "--set", "trainer.accelerator=\"cpu\"", "--set", "data.batch_size=16",
                                           "--set", "trainer.max_steps=15", "--set", "trainer.max_epochs=-1",
                                           "--set", "checkpoint.every_n_train_steps=1", "--set", "checkpoint.save_top_k=-1"};
  engine_in(full, common);
  // The chaos test plugin kills rank 1 at step 8 on attempt 0 only.
  std::vector<std::string> cmd = {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "chaos", "--set", "chaos.rank=1",
                                  "--set", "chaos.step=8"};
  cmd.insert(cmd.end(), common.begin(), common.end());
  auto once = cmd;
  once.insert(once.end(), {"--set", "trainer.max_restarts=1"});
  auto r = run_engine(once, restarted.path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("ddp launcher: restarting the job (1 of trainer.max_restarts = 1); its ranks resume from the last checkpoint"),
            std::string::npos) << r.err;
  EXPECT_NE(r.err.find("restart 1 of this job (EMBER_RESTART_COUNT=1): resuming from its last checkpoint"), std::string::npos) << r.err;
  expect_identical_weights(full / "runs/run/version_0/checkpoints/last.ckpt", restarted / "runs/run/version_0/checkpoints/last.ckpt");
  auto no_restart = run_engine(cmd, failed.path());
  EXPECT_NE(no_restart.exit_code, 0) << no_restart.err;
  EXPECT_EQ(no_restart.err.find("restarting the job"), std::string::npos) << no_restart.err;
}

TEST(Resume, BestAndExplicitPath) {
  TempDir dir("resume");
  write_file(dir / "run.toml", kCnn);
  engine_in(dir, {"run.toml", "--set", "trainer.max_epochs=2"});
  auto best = engine_in(dir, {"run.toml", "--set", "trainer.max_epochs=3", "--resume", "best"});
  EXPECT_NE(best.err.find("epoch="), std::string::npos) << best.err;
  // An explicit file starts a new version folder.
  auto path = (dir / "runs/run/version_0/checkpoints/last.ckpt").string();
  engine_in(dir, {"run.toml", "--set", "trainer.max_epochs=4", "--resume", path});
  EXPECT_TRUE(fs::exists(dir / "runs/run/version_1/checkpoints/last.ckpt"));
}

TEST(Resume, FailedRunNeverCorruptsAnEarlierCheckpoint) {
  TempDir dir("resume");
  write_file(dir / "run.toml", kCnn);
  engine_in(dir, {"run.toml", "--set", "trainer.max_epochs=1"});
  auto last = dir / "runs/run/version_0/checkpoints/last.ckpt";
  auto before = read_file(last);
  // Resuming with an optimizer the state does not fit fails, and leaves the file as it was.
  auto r = run_engine({"run.toml", "--set", "trainer.max_epochs=2", "--set", "optimizer.name=\"sgd\"", "--resume", "last"}, dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("resume with the same [optimizer] settings"), std::string::npos) << r.err;
  EXPECT_EQ(read_file(last), before);
}

TEST(Resume, SigtermStopsGracefullyAndResumeContinues) {
  TempDir dir("resume");
  write_file(dir / "run.toml", kCnn);
  auto running = start_engine({"run.toml", "--set", "trainer.max_epochs=1000"}, dir.path());
  // Wait until training is under way (the first epoch's checkpoint exists), then interrupt.
  const auto ckpt = dir / "runs/run/version_0/checkpoints/last.ckpt";
  for (int i = 0; i < 3000 && !fs::exists(ckpt); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(fs::exists(ckpt)) << "training did not start";
  kill(running.pid, SIGTERM);
  auto r = wait_process(running, 120);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_NE(r.err.find("SIGTERM received"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("continue with --resume last"), std::string::npos) << r.err;
  const int64_t stopped_at = ember::engine::load_checkpoint_file(ckpt).at("global_step").toInt();
  EXPECT_GT(stopped_at, 0);
  auto resumed = run_engine({"run.toml", "--set", "trainer.max_steps=" + std::to_string(stopped_at + 3), "--resume", "last"}, dir.path());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(ember::engine::load_checkpoint_file(ckpt).at("global_step").toInt(), stopped_at + 3);
}

// A signal that reaches one rank only (torchrun's agent stopping its own workers while a node
// joins) stops every rank at the same step, and every rank exits as interrupted (128+signal): a
// rank that exited 0 would tell its launcher the job had finished.
TEST(Resume, SignalOnOneRankStopsEveryRankAsInterrupted) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir dir("resume"), r0("resume"), r1("resume");  // the run folder; each rank's own output files
  const std::string port = std::to_string(free_port());
  std::vector<Running> ranks;
  for (const auto* r : {&r0, &r1}) {
    const std::string rank = r == &r0 ? "0" : "1";
    write_file(*r / "run.toml", synthetic_mlp_toml({.accelerator = "cpu", .num_train = 64, .num_val = 16, .batch_size = 8}) +
                                    "[ddp]\ntimeout = 30.0\n");
    ranks.push_back(start_process({engine_path().string(), "--plugins", "ddp", "run.toml", "--set", "trainer.devices=2", "--set",
                                   "trainer.max_epochs=100000", "--set", "trainer.default_root_dir=\"" + (dir / "runs").string() + "\""},
                                  r->path(), {{"RANK", rank}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", rank}, {"LOCAL_WORLD_SIZE", "2"},
                                   {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}, {"OMP_NUM_THREADS", "1"}}));
  }
  const auto ckpt = dir / "runs/run/version_0/checkpoints/last.ckpt";
  for (int i = 0; i < 6000 && !fs::exists(ckpt); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(fs::exists(ckpt)) << "training did not start";
  kill(ranks[1].pid, SIGTERM);
  std::string err[2];
  for (int r = 1; r >= 0; --r) {
    auto res = wait_process(ranks[static_cast<size_t>(r)], 120);
    EXPECT_EQ(res.exit_code, 128 + SIGTERM) << "rank " << r << ": " << res.err;
    err[r] = res.err;
  }
  EXPECT_NE(err[0].find("SIGTERM received by another rank: finishing this step, saving"), std::string::npos) << err[0];
  EXPECT_NE(err[1].find("SIGTERM received: finishing this step"), std::string::npos) << err[1];
  EXPECT_NE(err[0].find("continue with --resume last"), std::string::npos) << err[0];
}

namespace {
const std::string kSmall = tiny_mlp_toml(2, "num_train = 64\nnum_val = 16\nnum_test = 16\nbatch_size = 16\n");
}  // namespace

TEST(Resume, LastWithoutAnyCheckpointStartsFromScratch) {
  TempDir dir("resume");
  write_file(dir / "run.toml", kSmall);
  // A requeued job always passes --resume last, also before it ever saved.
  auto r = run_engine({"run.toml", "--resume", "last"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("--resume last: no checkpoint to resume from under runs/run; starting from scratch"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("resumed from"), std::string::npos) << r.err;
  EXPECT_EQ(ember::engine::load_checkpoint_file(dir / "runs/run/version_0/checkpoints/last.ckpt").at("global_step").toInt(), 8);
  // `best` still needs something to resume from.
  TempDir empty("resume");
  write_file(empty / "run.toml", kSmall);
  EXPECT_EQ(run_engine({"run.toml", "--resume", "best"}, empty.path()).exit_code, 2);
}

// A command that fails before it writes anything leaves no empty version folder behind: the next
// run is version_0, not version_2. A run that wrote its config keeps its folder.
TEST(Resume, FailedCommandsLeaveNoEmptyRunFolder) {
  TempDir dir("resume");
  write_file(dir / "run.toml", kSmall);
  for (const char* stage : {"validate", "test"}) {
    auto r = run_engine({stage, "--ckpt", "best", "run.toml"}, dir.path());
    ASSERT_NE(r.exit_code, 0) << r.err;
    EXPECT_NE(r.err.find("no 'best' checkpoint"), std::string::npos) << r.err;
  }
  auto g = run_engine({"generate", "--prompt", "a", "run.toml"}, dir.path());
  ASSERT_NE(g.exit_code, 0) << g.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "runs/run/version_0")) << "a failed command left an empty run folder";
  auto trained = run_engine({"run.toml", "--set", "trainer.max_epochs=1"}, dir.path());
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  EXPECT_TRUE(std::filesystem::exists(dir / "runs/run/version_0/config.toml"));
  // A training run that fails after writing its config keeps its folder, to be looked at. Testing
  // "best" after a fit that saved none is an error, never version_0's best tested as this run's.
  auto failed = run_engine({"run.toml", "--set", "trainer.max_epochs=0", "--set", "trainer.test_after_fit=true", "--set",
                            "trainer.test_ckpt=\"best\""}, dir.path());
  ASSERT_NE(failed.exit_code, 0) << failed.err;
  EXPECT_NE(failed.err.find("this run saved no 'best' checkpoint in runs/run/version_1"), std::string::npos) << failed.err;
  EXPECT_EQ(failed.err.find("version_0"), std::string::npos) << failed.err;
  EXPECT_TRUE(std::filesystem::exists(dir / "runs/run/version_1/config.toml")) << failed.err;
  // `engine test --ckpt best` (no fit) still finds the newest earlier run's.
  auto tested = run_engine({"test", "--ckpt", "best", "run.toml"}, dir.path());
  ASSERT_EQ(tested.exit_code, 0) << tested.err;
  EXPECT_NE(tested.err.find("version_0/checkpoints"), std::string::npos) << tested.err;
}

TEST(Resume, LastNeverResolvesToAWeightsOnlyOrForeignFile) {
  // Weights-only checkpoints cannot be resumed: `last` skips them and starts from scratch.
  TempDir weights("resume");
  write_file(weights / "run.toml", kSmall);
  ASSERT_EQ(run_engine({"run.toml", "--set", "checkpoint.save_weights_only=true"}, weights.path()).exit_code, 0);
  auto r = run_engine({"run.toml", "--set", "trainer.max_epochs=3", "--set", "checkpoint.save_weights_only=true", "--resume", "last"},
                      weights.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("last.ckpt: it holds weights only"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("starting from scratch"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(weights / "runs/run/version_1/checkpoints/last.ckpt"));

  // A foreign last.ckpt (another program's file, newest of all): `last` resumes from the newest
  // Ember checkpoint next to it instead.
  TempDir foreign("resume");
  write_file(foreign / "run.toml", kSmall);
  ASSERT_EQ(run_engine({"run.toml"}, foreign.path()).exit_code, 0);
  const fs::path ckdir = foreign / "runs/run/version_0/checkpoints";
  write_file(ckdir / "last.ckpt", "PK\x03\x04 a file some other program wrote");
  auto f = run_engine({"run.toml", "--set", "trainer.max_epochs=3", "--resume", "last"}, foreign.path());
  ASSERT_EQ(f.exit_code, 0) << f.err;
  EXPECT_NE(f.err.find("last.ckpt: not an Ember checkpoint"), std::string::npos) << f.err;
  EXPECT_NE(f.err.find("resumed from runs/run/version_0/checkpoints/epoch=1-step=8.ckpt"), std::string::npos) << f.err;
  EXPECT_FALSE(fs::exists(foreign / "runs/run/version_1"));
  EXPECT_EQ(ember::engine::load_checkpoint_file(ckdir / "last.ckpt").at("global_step").toInt(), 12);
}

// A save writes its top-k file, then last.ckpt (in full, or as a link to that file). A job
// killed between the two leaves last.ckpt one save behind a newer file: `--resume last` takes
// the newer file (a later step, written later), and ends with the weights of one straight run.
// A later step written *before* last.ckpt is a state a rollback went back from: last.ckpt wins.
TEST(Resume, LastTakesTheNewerStateOfASaveCutShort) {
  TempDir straight("resume");
  write_file(straight / "run.toml", kSmall);
  ASSERT_EQ(run_engine({"run.toml", "--set", "trainer.max_epochs=3"}, straight.path()).exit_code, 0);
  for (const bool cut_short : {true, false}) {
    SCOPED_TRACE(cut_short ? "killed before last.ckpt" : "a rollback");
    TempDir dir("resume");
    write_file(dir / "run.toml", kSmall);
    const fs::path ckdir = dir / "runs/run/version_0/checkpoints";
    ASSERT_EQ(run_engine({"run.toml", "--set", "trainer.max_epochs=1"}, dir.path()).exit_code, 0);
    fs::copy_file(ckdir / "last.ckpt", dir / "step4.ckpt");
    ASSERT_EQ(run_engine({"run.toml", "--resume", "last"}, dir.path()).exit_code, 0);
    // The kill: epoch=1-step=8.ckpt is durable, last.ckpt is still step 4's.
    const fs::path newer = ckdir / "epoch=1-step=8.ckpt";
    ASSERT_TRUE(fs::exists(newer));
    EXPECT_EQ(ember::engine::probe_checkpoint_file(newer).global_step, 8);
    fs::copy_file(dir / "step4.ckpt", ckdir / "last.ckpt", fs::copy_options::overwrite_existing);
    fs::last_write_time(ckdir / "last.ckpt", fs::last_write_time(newer) + std::chrono::seconds(cut_short ? -2 : 2));
    auto r = run_engine({"run.toml", "--set", "trainer.max_epochs=3", "--resume", "last"}, dir.path());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    if (cut_short) {
      EXPECT_NE(r.err.find("epoch=1-step=8.ckpt holds step 8 and was written after runs/run/version_0/checkpoints/last.ckpt (step 4)"),
                std::string::npos)
          << r.err;
      EXPECT_NE(r.err.find("resumed from runs/run/version_0/checkpoints/epoch=1-step=8.ckpt"), std::string::npos) << r.err;
      expect_identical_weights(straight / "runs/run/version_0/checkpoints/last.ckpt", ckdir / "last.ckpt");
    } else {
      EXPECT_EQ(r.err.find("was written after"), std::string::npos) << r.err;
      EXPECT_NE(r.err.find("resumed from runs/run/version_0/checkpoints/last.ckpt at epoch 0, step 4"), std::string::npos) << r.err;
    }
    EXPECT_EQ(ember::engine::load_checkpoint_file(ckdir / "last.ckpt").at("global_step").toInt(), 12);
    EXPECT_FALSE(fs::exists(dir / "runs/run/version_1"));
  }
}

TEST(Resume, AFinishedRunIsNotTrainedAgain) {
  TempDir dir("resume");
  write_file(dir / "run.toml", kSmall);
  ASSERT_EQ(run_engine({"run.toml", "--set", "trainer.test_after_fit=true"}, dir.path()).exit_code, 0);
  const fs::path run = dir / "runs/run/version_0";
  const auto metrics = read_file(run / "metrics.csv"), last = read_file(run / "checkpoints/last.ckpt");
  ASSERT_NE(metrics.find("test_loss"), std::string::npos);
  // The job is requeued after it ended: nothing is trained, tested or logged again.
  auto r = run_engine({"run.toml", "--set", "trainer.test_after_fit=true", "--resume", "last"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("already finished (epoch 1, step 8): nothing to do"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("test_loss"), std::string::npos) << r.out;
  EXPECT_EQ(read_file(run / "metrics.csv"), metrics);
  EXPECT_EQ(read_file(run / "checkpoints/last.ckpt"), last);
  EXPECT_FALSE(fs::exists(dir / "runs/run/version_1"));
  // Asked for more epochs, it trains on.
  auto more = run_engine({"run.toml", "--set", "trainer.max_epochs=3", "--resume", "last"}, dir.path());
  ASSERT_EQ(more.exit_code, 0) << more.err;
  EXPECT_EQ(ember::engine::load_checkpoint_file(run / "checkpoints/last.ckpt").at("global_step").toInt(), 12);
}

TEST(Resume, Sigusr1StopsGracefullyLikeSigterm) {
  TempDir dir("resume"), other("resume");
  write_file(dir / "run.toml", kSmall);
  write_file(other / "run.toml", kSmall);
  auto interrupt = [&](const TempDir& where, std::vector<std::string> args) {
    const auto ckpt = where / "runs/run/version_0/checkpoints/last.ckpt";
    args.insert(args.begin(), {"run.toml", "--set", "trainer.max_epochs=100000"});
    auto running = start_engine(args, where.path());
    for (int i = 0; i < 3000 && !fs::exists(ckpt); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_TRUE(fs::exists(ckpt)) << "training did not start";
    kill(running.pid, SIGUSR1);
    return wait_process(running, 120);
  };
  // Slurm's warning before the time limit (sbatch --signal=B:USR1@120): save and exit.
  auto r = interrupt(dir, {});
  EXPECT_EQ(r.exit_code, 128 + SIGUSR1) << r.err;
  EXPECT_NE(r.err.find("SIGUSR1 received"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("continue with --resume last"), std::string::npos) << r.err;
  const auto ckpt = dir / "runs/run/version_0/checkpoints/last.ckpt";
  const int64_t stopped_at = ember::engine::load_checkpoint_file(ckpt).at("global_step").toInt();
  EXPECT_GT(stopped_at, 0);
  auto resumed = run_engine({"run.toml", "--set", "trainer.max_epochs=100000", "--set",
                             "trainer.max_steps=" + std::to_string(stopped_at + 3), "--resume", "last"},
                            dir.path());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(ember::engine::load_checkpoint_file(ckpt).at("global_step").toInt(), stopped_at + 3);
  // Left out of trainer.stop_signals, SIGUSR1 keeps its default action (the process ends at once).
  auto plain = interrupt(other, {"--set", "trainer.stop_signals=[\"SIGINT\", \"SIGTERM\"]"});
  EXPECT_EQ(plain.exit_code, -1) << plain.err;
  EXPECT_EQ(plain.err.find("SIGUSR1 received"), std::string::npos) << plain.err;
  // A name that is no signal is a config error.
  auto bad = run_engine({"run.toml", "--set", "trainer.stop_signals=[\"SIGUSR3\"]"}, dir.path());
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("unknown signal 'SIGUSR3'"), std::string::npos) << bad.err;
}

// A Slurm batch job stopped by SIGUSR1 (sbatch --signal=USR1@120) requeues itself once last.ckpt
// is saved (`scontrol requeue JOB`, Lightning's auto_requeue) and, started again
// (SLURM_RESTART_COUNT=1), resumes by itself. This machine has no Slurm: `scontrol` here is a
// script on PATH that records its arguments. An array task requeues as ARRAYJOB_TASK; an
// interactive job (SLURM_JOB_NAME=bash) and trainer.slurm_requeue = false do not requeue; a
// failing scontrol is a warning and the exit code stays 128+SIGUSR1.
TEST(Resume, SlurmJobStoppedBySigusr1RequeuesItself) {
  TempDir dir("resume");
  write_file(dir / "run.toml", kSmall);
  fs::create_directories(dir / "bin");
  write_file(dir / "bin/scontrol", "#!/bin/sh\necho \"$@\" >> \"$(dirname \"$0\")/calls.txt\"\nexit ${SCONTROL_EXIT:-0}\n");
  fs::permissions(dir / "bin/scontrol", fs::perms::owner_all);
  auto calls = [&] { return fs::exists(dir / "bin/calls.txt") ? read_file(dir / "bin/calls.txt") : std::string(); };
  auto interrupt = [&](const std::string& name, std::map<std::string, std::string> env, std::vector<std::string> extra = {}) {
    env["PATH"] = (dir / "bin").string() + ":" + std::getenv("PATH");
    env["OMP_NUM_THREADS"] = "1";
    std::vector<std::string> argv = {engine_path().string(), "run.toml", "--set", "trainer.max_epochs=100000", "--set",
                                     "trainer.name=\"" + name + "\""};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto ckpt = dir / ("runs/" + name + "/version_0/checkpoints/last.ckpt");
    auto running = start_process(argv, dir.path(), env);
    for (int i = 0; i < 3000 && !fs::exists(ckpt); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_TRUE(fs::exists(ckpt)) << "training did not start";
    kill(running.pid, SIGUSR1);
    return wait_process(running, 120);
  };
  auto r = interrupt("job", {{"SLURM_JOB_ID", "4242"}, {"SLURM_JOB_NAME", "train"}});
  EXPECT_EQ(r.exit_code, 128 + SIGUSR1) << r.err;
  EXPECT_NE(r.err.find("Slurm: scontrol requeue 4242: the job is queued again"), std::string::npos) << r.err;
  EXPECT_EQ(calls(), "requeue 4242\n");
  const auto ckpt = dir / "runs/job/version_0/checkpoints/last.ckpt";
  const int64_t stopped_at = ember::engine::load_checkpoint_file(ckpt).at("global_step").toInt();
  auto again = run_engine({"run.toml", "--set", "trainer.max_epochs=100000", "--set", "trainer.name=\"job\"", "--set",
                           "trainer.max_steps=" + std::to_string(stopped_at + 2)},
                          dir.path(), {{"SLURM_JOB_ID", "4242"}, {"SLURM_RESTART_COUNT", "1"}});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.err.find("resumed from runs/job/version_0/checkpoints/last.ckpt"), std::string::npos) << again.err;
  EXPECT_EQ(ember::engine::load_checkpoint_file(ckpt).at("global_step").toInt(), stopped_at + 2);

  interrupt("array", {{"SLURM_JOB_ID", "5000"}, {"SLURM_ARRAY_JOB_ID", "4999"}, {"SLURM_ARRAY_TASK_ID", "3"}});
  EXPECT_EQ(calls(), "requeue 4242\nrequeue 4999_3\n");
  auto interactive = interrupt("interactive", {{"SLURM_JOB_ID", "6000"}, {"SLURM_JOB_NAME", "bash"}});
  auto off = interrupt("off", {{"SLURM_JOB_ID", "7000"}}, {"--set", "trainer.slurm_requeue=false"});
  for (const auto* p : {&interactive, &off}) {
    EXPECT_EQ(p->exit_code, 128 + SIGUSR1) << p->err;
    EXPECT_NE(p->err.find("continue with --resume last"), std::string::npos) << p->err;
  }
  EXPECT_EQ(calls(), "requeue 4242\nrequeue 4999_3\n");
  auto failed = interrupt("failed", {{"SLURM_JOB_ID", "8000"}, {"SCONTROL_EXIT", "1"}});
  EXPECT_EQ(failed.exit_code, 128 + SIGUSR1) << failed.err;
  EXPECT_NE(failed.err.find("Slurm: scontrol requeue 8000 failed (exit code 1): the job is not requeued"), std::string::npos) << failed.err;
}

// ---------------------------------------------------------------------------------------------
// The training position (batch index, current batch) around validations inside an epoch, and a
// resume from a checkpoint saved between a batch and its validation.
namespace {
struct PositionLine {
  std::string hook;
  int64_t epoch, step, batch_idx, size;
  std::string sum;  // %.17g text: compared exactly
  bool operator==(const PositionLine&) const = default;
};

std::vector<PositionLine> positions(const fs::path& p) {
  std::vector<PositionLine> out;
  std::ifstream in(p);
  PositionLine l;
  while (in >> l.hook >> l.epoch >> l.step >> l.batch_idx >> l.size >> l.sum) out.push_back(l);
  return out;
}

std::vector<std::string> probe_args(std::vector<std::string> args) {
  args.insert(args.end(), {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "position_probe"});
  return args;
}

// metrics.csv column by step, as text (compared exactly).
std::map<int64_t, std::string> by_step(const fs::path& csv, const std::string& name) {
  std::map<int64_t, std::string> out;
  for (const auto& row : read_csv(csv))
    if (row.count(name) && !row.at(name).empty()) out[std::stoll(row.at("step"))] = row.at(name);
  return out;
}
}  // namespace

TEST(Resume, ValidationInsideAnEpochHandsBackTheTrainingPosition) {
  TempDir dir("resume");
  write_file(dir / "run.toml", kCnn);
  // 6 training batches of 32, validated after batches 3 and 6; one validation batch of 20.
  engine_in(dir, probe_args({"run.toml", "--set", "trainer.max_epochs=1", "--set", "trainer.val_check_interval=0.5",
                             "--set", "data.num_val=20"}));
  const auto lines = positions(dir / "position.txt");
  std::vector<PositionLine> batch_ends, epoch_ends, val_ends;
  for (const auto& l : lines)
    (l.hook == "on_train_batch_end" ? batch_ends : l.hook == "on_train_epoch_end" ? epoch_ends : val_ends).push_back(l);
  ASSERT_EQ(batch_ends.size(), 6u);
  ASSERT_EQ(val_ends.size(), 2u);
  ASSERT_EQ(epoch_ends.size(), 1u);
  EXPECT_EQ(val_ends[0].size, 20);  // the validation's own batch while it runs
  // After the epoch's last validation, callbacks see the last training batch again.
  const auto& last = batch_ends.back();
  EXPECT_EQ(epoch_ends[0].batch_idx, 5);
  EXPECT_EQ(epoch_ends[0].size, last.size);
  EXPECT_EQ(epoch_ends[0].sum, last.sum);
}

TEST(Resume, FromAStepCheckpointRunsTheValidationDueAfterIt) {
  TempDir dir("resume");
  write_file(dir / "run.toml", kCnn);
  // Validation after every 3rd batch (steps 3, 6, 9, ...); the checkpoint callback saves at step 9
  // in on_train_batch_end, before that step's validation.
  const std::vector<std::string> common = {"--set", "trainer.max_epochs=-1", "--set", "trainer.max_steps=15",
                                           "--set", "trainer.val_check_interval=0.5",
                                           "--set", "checkpoint.every_n_train_steps=9", "--set", "checkpoint.save_top_k=-1"};
  auto args = probe_args({"run.toml"});
  args.insert(args.end(), common.begin(), common.end());
  engine_in(dir, args);
  const auto step9 = dir / "runs/run/version_0/checkpoints/epoch=1-step=9.ckpt";
  ASSERT_TRUE(fs::exists(step9));
  EXPECT_TRUE(ember::engine::load_checkpoint_file(step9).at("loops").toGenericDict().at("validation_pending").toBool());
  args.insert(args.end(), {"--set", "position_probe.path=\"resumed.txt\"", "--resume", step9.string()});
  auto r = engine_in(dir, args);
  EXPECT_NE(r.err.find("(batch 3 of the epoch)"), std::string::npos) << r.err;
  // The resumed run validates at step 9 first, then sees every position the uninterrupted run saw.
  const auto full = positions(dir / "position.txt");
  const auto resumed = positions(dir / "resumed.txt");
  auto from = std::find_if(full.begin(), full.end(), [](const auto& l) { return l.hook == "on_validation_end" && l.step == 9; });
  ASSERT_NE(from, full.end());
  EXPECT_EQ(std::vector<PositionLine>(from, full.end()), resumed);
  // The same validation rows (metrics.csv logs a validation after optimizer step k at step k - 1,
  // as Lightning does), and the same weights at the end.
  auto tail = [](std::map<int64_t, std::string> m) {
    std::erase_if(m, [](const auto& e) { return e.first < 8; });
    return m;
  };
  const auto v0 = dir / "runs/run/version_0", v1 = dir / "runs/run/version_1";
  EXPECT_EQ(tail(by_step(v0 / "metrics.csv", "val_loss")), tail(by_step(v1 / "metrics.csv", "val_loss")));
  EXPECT_EQ(tail(by_step(v1 / "metrics.csv", "val_loss")).size(), 3u);  // after steps 9, 12, 15
  expect_identical_weights(v0 / "checkpoints/last.ckpt", v1 / "checkpoints/last.ckpt");
}

// trainer.overfit_batches (Lightning's): every epoch trains on the same first batches of the
// training split, in file order although data.shuffle = true, and validates on the first
// validation batches; what it trains on is exactly the unshuffled run's first batches.
TEST(Overfit, TrainsOnTheSameFirstBatchesEveryEpoch) {
  TempDir dir("overfit");
  write_file(dir / "run.toml", kCnn);
  auto batch_sums = [&](const std::string& file, size_t* val_ends) {
    std::vector<std::pair<int64_t, std::string>> out;  // (epoch, sum) per training batch
    *val_ends = 0;
    for (const auto& l : positions(dir / file)) {
      if (l.hook == "on_train_batch_end") out.emplace_back(l.epoch, l.sum);
      if (l.hook == "on_validation_end") ++*val_ends;
    }
    return out;
  };
  auto r = engine_in(dir, probe_args({"run.toml", "--set", "trainer.max_epochs=3", "--set", "trainer.overfit_batches=2",
                                      "--set", "position_probe.path=\"overfit.txt\""}));
  EXPECT_NE(r.err.find("overfit_batches: training and validating on the first 2 batch(es) of each split"), std::string::npos) << r.err;
  size_t val_ends = 0;
  const auto overfit = batch_sums("overfit.txt", &val_ends);
  ASSERT_EQ(overfit.size(), 6u);
  EXPECT_EQ(val_ends, 3u);
  for (size_t i = 2; i < overfit.size(); ++i) EXPECT_EQ(overfit[i].second, overfit[i % 2].second) << "batch " << i;
  // The same two batches as an unshuffled run limited to two batches.
  engine_in(dir, probe_args({"run.toml", "--set", "trainer.max_epochs=1", "--set", "trainer.limit_train_batches=2", "--set",
                             "data.shuffle=false", "--set", "position_probe.path=\"plain.txt\""}));
  const auto plain = batch_sums("plain.txt", &val_ends);
  ASSERT_EQ(plain.size(), 2u);
  EXPECT_EQ(plain[0].second, overfit[0].second);
  EXPECT_EQ(plain[1].second, overfit[1].second);
  // The control: shuffled and limited, the epochs see other batches.
  engine_in(dir, probe_args({"run.toml", "--set", "trainer.max_epochs=2", "--set", "trainer.limit_train_batches=2", "--set",
                             "position_probe.path=\"shuffled.txt\""}));
  const auto shuffled = batch_sums("shuffled.txt", &val_ends);
  ASSERT_EQ(shuffled.size(), 4u);
  EXPECT_NE(shuffled[0].second, shuffled[2].second);
  // A fraction above 1 is refused like the limit_* keys.
  auto bad = run_engine({"run.toml", "--set", "trainer.overfit_batches=1.5"}, dir.path());
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("trainer.overfit_batches: a float is a fraction and must be <= 1.0"), std::string::npos) << bad.err;
}
