// ddp on CPU with 2 ranks on loopback (Open MPI behind the c10d adapter): the same weights as
// single_device with the doubled batch, with and without accumulation; failures end the job in
// bounded time and name the rank; torchrun-style and mpirun-started ranks join; resume works.
#include <gtest/gtest.h>

#include <algorithm>

#include <ATen/ATen.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <regex>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// 64 samples: 2 ranks x batch 8 and 1 rank x batch 16 both see 4 batches per epoch, and the
// single-device batch k holds exactly the samples of the two ranks' batch k (the loader deals
// shuffled sample i to rank i % 2).
const std::string kRun = synthetic_mlp_toml({.accelerator = "cpu", .hidden = "[24, 16]", .num_train = 64,
                                             .num_val = 16, .batch_size = 8}) +
                         "[optimizer]\nname = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n";

// The single-device reference: one process, batch 16.
void reference(const TempDir& dir, std::vector<std::string> extra = {}) {
  write_file(dir / "run.toml", kRun);
  std::vector<std::string> args = {"run.toml", "--set", "data.batch_size=16"};
  args.insert(args.end(), extra.begin(), extra.end());
  run_engine_ok(dir, args);
}

// Every ddp test here runs CPU ranks, which talk through Open MPI.
class Ddp : public ::testing::Test {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};

}  // namespace

TEST_F(Ddp, TwoRanksMatchSingleDeviceWithTheDoubledBatch) {
  TempDir single("ddp"), ddp("ddp");
  reference(single);
  write_file(ddp / "run.toml", kRun);
  // Small buckets: several of them, so some must start while backward still runs.
  auto r = run_engine_ok(ddp, {"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2", "--set", "ddp.bucket_cap_mb=0.001"});
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(ddp)), 1e-5);
  // 8 optimizer steps, one gradient sync each; buckets overlapped backward.
  EXPECT_EQ(count_in_log(r.err, R"((\d+) gradient syncs)"), 8) << r.err;
  EXPECT_GT(count_in_log(r.err, R"(in (\d+) buckets)"), 1) << r.err;
  EXPECT_GT(count_in_log(r.err, R"((\d+) started while backward was still running)"), 0) << r.err;
  // Only rank 0 writes: one run folder, one metrics file; metrics were reduced over both ranks.
  EXPECT_FALSE(fs::exists(ddp / "runs/run/version_1"));
  auto rows = read_csv(ddp / "runs/run/version_0/metrics.csv");
  EXPECT_FALSE(rows.empty());
  EXPECT_NE(r.err.find("[rank 1]"), std::string::npos) << "rank 1 logs nothing? " << r.err;
}

TEST_F(Ddp, TwoRanksMatchSingleDeviceWithAccumulation) {
  TempDir single("ddp"), ddp("ddp");
  reference(single, {"--set", "trainer.accumulate_grad_batches=2"});
  write_file(ddp / "run.toml", kRun);
  auto r = run_engine_ok(ddp, {"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2", "--set", "trainer.accumulate_grad_batches=2"});
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(ddp)), 1e-5);
  // 8 micro-batches, 4 optimizer steps: gradients are communicated only on the 4 steps.
  EXPECT_EQ(count_in_log(r.err, R"((\d+) gradient syncs)"), 4) << r.err;
  EXPECT_EQ(count_in_log(r.err, R"((\d+) bucket all-reduces)"), 4) << r.err;
}

// ddp composes with the precision handlers: under autocast the two ranks still end where one
// process with the doubled batch ends (to float16/bfloat16 rounding of the per-batch sums), and
// amp16's loss scaler sees the all-reduced gradients, so every rank takes the same steps.
class DdpPrecision : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};

TEST_P(DdpPrecision, TwoRanksMatchSingleDevice) {
  TempDir single("ddp"), ddp("ddp");
  const std::string prec = std::string("trainer.precision=\"") + GetParam() + "\"";
  reference(single, {"--set", prec});
  write_file(ddp / "run.toml", kRun);
  run_engine_ok(ddp, {"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2", "--set", prec});
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(ddp)), 2e-2);
  if (std::string(GetParam()) == "16-mixed") {
    auto rows = read_csv(ddp / "runs/run/version_0/metrics.csv");
    ASSERT_FALSE(rows.empty());
    EXPECT_EQ(rows.back().count("amp_scale"), 1u);
  }
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpPrecision, ::testing::Values("16-mixed", "bf16-mixed"), [](const auto& info) {
  return std::string(info.param) == "16-mixed" ? "amp16" : "bf16";
});

TEST_F(Ddp, TorchrunStyleEnvironmentJoins) {
  TempDir single("ddp"), ddp("ddp");
  reference(single);
  write_file(ddp / "run.toml", kRun);
  const std::string port = std::to_string(free_port());
  std::vector<Running> ranks;
  for (int r = 0; r < 2; ++r) {
    std::map<std::string, std::string> env = {{"RANK", std::to_string(r)}, {"WORLD_SIZE", "2"},  {"LOCAL_RANK", std::to_string(r)},
                                              {"LOCAL_WORLD_SIZE", "2"},   {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
                                              {"TORCHELASTIC_RESTART_COUNT", "0"}, {"OMP_NUM_THREADS", "1"}};
    ranks.push_back(start_process({engine_path().string(), "--plugins", "ddp", "run.toml", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2"}, ddp.path(), env));
  }
  for (int r = 0; r < 2; ++r) {
    auto res = wait_process(ranks[static_cast<size_t>(r)], 180);
    EXPECT_EQ(res.exit_code, 0) << "rank " << r << ": " << res.err;
  }
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(ddp)), 1e-5);
}

TEST_F(Ddp, MpirunStartedRanksJoin) {
  TempDir single("ddp"), ddp("ddp");
  reference(single);
  write_file(ddp / "run.toml", kRun);
  std::string mpirun;
  for (const char* dir : {"/usr/bin", "/usr/local/bin"})
    if (fs::exists(fs::path(dir) / "mpirun")) mpirun = (fs::path(dir) / "mpirun").string();
  ASSERT_FALSE(mpirun.empty()) << "mpirun not found: install openmpi-bin (scripts/setup.sh)";
  std::vector<std::string> argv = {mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,tcp",
                                   "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"};
  if (getuid() == 0) argv.push_back("--allow-run-as-root");
  for (const auto& a : {engine_path().string(), std::string("--plugins"), std::string("ddp"), std::string("run.toml"), std::string("--set"), std::string("ddp.timeout=20.0"), std::string("--set"),
                        std::string("trainer.devices=2")})
    argv.push_back(a);
  auto r = run_process(argv, ddp.path(), {{"OMP_NUM_THREADS", "1"}}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE((r.out + r.err).find("(mpirun"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(ddp)), 1e-5);
}

TEST_F(Ddp, KilledRankEndsTheJobWithinTheTimeout) {
  TempDir dir("ddp");
  write_file(dir / "run.toml", kRun);
  const auto start = std::chrono::steady_clock::now();
  auto r = run_engine({"--plugins", "ddp,chaos", "--plugin-path", test_plugin_dir("good").string(), "run.toml", "--set", "trainer.devices=2",
                       "--set", "ddp.timeout=10.0", "--set", "chaos.rank=1", "--set", "chaos.step=3"},
                      dir.path(), {}, 120);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("ddp launcher: the job failed: rank 1 (pid"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("killed by signal 9"), std::string::npos) << r.err;
  // The timeout (10 s: long enough that a loaded 2-core machine still joins within it), plus
  // start-up and the kill grace.
  EXPECT_LT(seconds, 10.0 + 25.0) << r.err;
}

// The launcher, not rank 0, hosts the rendezvous store of a job without a fixed port (a port picked
// free and bound later by rank 0 could be taken in between by another process on the machine). So
// the store outlives a dead rank 0, and the rank left waiting for it names it.
TEST_F(Ddp, DeadRankZeroIsNamedThroughTheLaunchersStore) {
  TempDir dir("ddp");
  write_file(dir / "run.toml", kRun);
  auto r = run_engine({"--plugins", "ddp,chaos", "--plugin-path", test_plugin_dir("good").string(), "run.toml", "--set", "trainer.devices=2",
                       "--set", "ddp.timeout=6.0", "--set", "chaos.rank=0", "--set", "chaos.step=3"},
                      dir.path(), {}, 120);
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("ddp launcher: the job failed: rank 0 (pid"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("ddp: rank 1: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank(s) 0 never reached it"), std::string::npos) << r.err;
}

// A peer that never starts: rank 0 of a torchrun-style group of 2 stops within its timeout with
// one line that says which step of the MPI join it waited in (the only clue when a join hangs).
TEST_F(Ddp, MissingPeerIsNamedWithTheJoinStepWithinTheTimeout) {
  TempDir dir("ddp");
  write_file(dir / "run.toml", kRun);
  const std::map<std::string, std::string> env = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"},
                                                  {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(free_port())},
                                                  {"TORCHELASTIC_RESTART_COUNT", "0"}, {"OMP_NUM_THREADS", "1"}};
  const auto start = std::chrono::steady_clock::now();
  auto r = run_engine({"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=5.0", "--set", "trainer.devices=2"}, dir.path(), env, 120);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("ddp: rank 0: joining the MPI group of 2 ranks did not finish within 5 s, stuck in MPI_Comm_accept for rank 1"), std::string::npos) << r.err;
  EXPECT_LT(seconds, 5.0 + 25.0) << r.err;
}

// A join that stalls (rank 1 of the first start waits on purpose, as a stalled Open MPI rendezvous
// would) is not a failed run: nothing was trained, so the launcher starts the ranks again once, not
// counted against trainer.max_restarts (0 here), and the job trains to the end.
TEST_F(Ddp, StalledJoinStartsTheRanksAgainOnce) {
  TempDir dir("ddp");
  write_file(dir / "run.toml", kRun);
  const fs::path marker = dir / "stalled-once";
  const auto start = std::chrono::steady_clock::now();
  auto r = run_engine({"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=5.0", "--set", "trainer.devices=2"}, dir.path(),
                      {{"EMBER_TEST_STALL_MPI_JOIN_ONCE", marker.string()}}, 120);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(marker)) << "the first start's rank 1 stalled";
  // Both ranks wait 5 s: whichever deadline passes first names the stall (rank 1 its own wait, or
  // rank 0 its wait for rank 1), and the launcher stops the other.
  const bool stalled_rank_said = r.err.find("ddp: rank 1: joining the MPI group of 2 ranks did not finish within 5 s, stuck stalled on purpose") !=
                                 std::string::npos;
  const bool waiting_rank_said =
      r.err.find("ddp: rank 0: joining the MPI group of 2 ranks did not finish within 5 s, stuck in MPI_Comm_accept for rank 1") != std::string::npos;
  EXPECT_TRUE(stalled_rank_said || waiting_rank_said) << r.err;
  EXPECT_NE(r.err.find("did not form their MPI group within the timeout"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("restart 1 of"), std::string::npos) << "not a restart of trainer.max_restarts\n" << r.err;
  EXPECT_TRUE(fs::exists(dir / "runs/run/version_0/checkpoints/last.ckpt")) << r.err;
  EXPECT_LT(seconds, 5.0 + 60.0) << r.err;
}

TEST_F(Ddp, HungRankEndsTheJobWithinTheTimeout) {
  TempDir dir("ddp");
  write_file(dir / "run.toml", kRun);
  const auto start = std::chrono::steady_clock::now();
  auto r = run_engine({"--plugins", "ddp,chaos", "--plugin-path", test_plugin_dir("good").string(), "run.toml", "--set", "trainer.devices=2",
                       "--set", "ddp.timeout=4.0", "--set", "chaos.rank=1", "--set", "chaos.step=2", "--set", "chaos.action=\"hang\""},
                      dir.path(), {}, 120);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0) << r.err;
  // Rank 0's watchdog names the rank it waited for; the launcher names the hung one.
  EXPECT_NE(r.err.find("rank(s) 1 never reached it"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("ddp launcher: the job failed: rank(s) 1 (pid"), std::string::npos) << r.err;
  EXPECT_LT(seconds, 4.0 + 25.0) << r.err;
}

TEST_F(Ddp, ResumeMatchesAnUninterruptedRun) {
  TempDir full("ddp"), split("ddp");
  write_file(full / "run.toml", kRun);
  write_file(split / "run.toml", kRun);
  run_engine_ok(full, {"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2", "--set", "trainer.max_epochs=3"});
  run_engine_ok(split, {"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2", "--set", "trainer.max_epochs=1"});
  auto r = run_engine_ok(split, {"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2", "--set", "trainer.max_epochs=3", "--resume", "last"});
  EXPECT_NE(r.err.find("resumed from"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(full), last_checkpoint(split)), 0.0);
  // The strategy's own state (the world size it ran on) is part of the checkpoint.
  auto ck = ember::engine::load_checkpoint_file(last_checkpoint(split));
  EXPECT_EQ(ck.at("plugins").toGenericDict().at("strategy").toGenericDict().at("world_size").toInt(), 2);
  // Resumed on one rank: said out loud.
  auto one = run_engine_ok(split, {"--plugins", "ddp", "run.toml", "--set", "trainer.max_epochs=4", "--resume", "last"});
  EXPECT_NE(one.err.find("written by 2 ranks and is resumed on 1"), std::string::npos) << one.err;
}

TEST_F(Ddp, BadSettingsAreOneClearLine) {
  TempDir dir("ddp");
  write_file(dir / "run.toml", kRun);
  auto r = run_engine({"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2", "--set", "ddp.backend=\"nccl\"",
                       "--set", "trainer.accelerator=\"cpu\""}, dir.path(), {}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("ddp.backend = \"nccl\" needs CUDA devices"), std::string::npos) << r.err;
  auto m = run_engine({"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2", "--set", "trainer.num_nodes=2"}, dir.path(), {}, 60);
  EXPECT_NE(m.exit_code, 0);
  EXPECT_NE(m.err.find("needs the same fixed port on every node"), std::string::npos) << m.err;
}

// Exact evaluation (docs/data.md): 49 validation samples on 3 ranks are 17 + 16 + 16, where
// DistributedSampler's padding would count samples 0 and 1 twice. Under ddp the metrics equal
// single_device's, with a rank's last batch cut short (eval batch 5: 1 sample instead of 1 + 1
// padding) and with a batch of padding only (eval batch 8), which still runs so the ranks take
// the same steps.
TEST_F(Ddp, EvaluationCountsEverySampleOnceOnThreeRanks) {
  TempDir dir("ddp");
  reference(dir);
  const std::string ckpt = last_checkpoint(dir).string();
  auto metric = [](const std::string& out, const std::string& name) {
    std::smatch m;
    if (!std::regex_search(out, m, std::regex("(^|\\n)" + name + "\\s+(\\S+)"))) return std::string("missing");
    return m[2].str();
  };
  for (const std::string bs : {"5", "8"}) {
    const std::vector<std::string> common = {"run.toml", "--set", "data.num_val=49", "--set", "data.eval_batch_size=" + bs};
    std::vector<std::string> one = {"validate", "--ckpt", ckpt}, three = {"validate", "--ckpt", ckpt, "--plugins", "ddp"};
    one.insert(one.end(), common.begin(), common.end());
    three.insert(three.end(), common.begin(), common.end());
    three.insert(three.end(), {"--set", "trainer.devices=3", "--set", "ddp.timeout=20.0"});
    auto a = run_engine_ok(dir, one), b = run_engine_ok(dir, three);
    ASSERT_NE(metric(a.out, "val_acc"), "missing") << a.out;
    EXPECT_EQ(metric(a.out, "val_acc"), metric(b.out, "val_acc")) << "eval batch " << bs << "\n" << a.out << b.out;
    EXPECT_NEAR(std::stod(metric(a.out, "val_loss")), std::stod(metric(b.out, "val_loss")), 1e-5) << "eval batch " << bs;
  }
}

// dp was retired in 2.0 (docs/decisions.md): asking for it is one line pointing to ddp, exit 2.
TEST(Dp, RetiredWithOneLinePointingToDdp) {
  TempDir dir("ddp");
  write_file(dir / "run.toml", kRun);
  auto r = run_engine({"--plugins", "dp", "run.toml"}, dir.path(), {}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("plugin 'dp' was retired in Ember 2.0, as Lightning 2.0 retired DataParallel: use --plugins ddp"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// A parameter no rank uses keeps no gradient under find_unused_parameters: with Adam and weight
// decay, ddp then equals single_device and the unused layer stays at its initial values (a zero
// gradient would let weight decay move it). Without the flag it is one clear error.
TEST_F(Ddp, UnusedParametersKeepNoGradient) {
  const char* kUnused = R"(
[trainer]
# CPU ranks (Open MPI) compared with single_device on the same device, also where a GPU is present.
accelerator = "cpu"
max_epochs = 2
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "unused_branch"
input_size = 16
num_classes = 4
[data]
name = "synthetic"
shape = [16]
num_classes = 4
num_train = 64
num_val = 16
num_test = 0
batch_size = 8
[optimizer]
name = "adam"
lr = 0.05
weight_decay = 0.1
)";
  const std::string good = test_plugin_dir("good").string();
  TempDir single("ddp"), ddp("ddp"), strict("ddp");
  for (const TempDir* d : {&single, &ddp, &strict}) write_file(*d / "run.toml", kUnused);
  auto a = run_engine({"--plugin-path", good, "run.toml", "--set", "data.batch_size=16"}, single.path(), {}, 120);
  ASSERT_EQ(a.exit_code, 0) << a.err;
  auto b = run_engine({"--plugin-path", good, "--plugins", "ddp", "run.toml", "--set", "trainer.devices=2", "--set", "ddp.timeout=20.0",
                       "--set", "ddp.find_unused_parameters=true"},
                      ddp.path(), {}, 180);
  ASSERT_EQ(b.exit_code, 0) << b.err;
  // single_device leaves the spare layer alone (no gradient); a zero gradient under ddp would let
  // Adam's weight decay move it, and this comparison would fail.
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(ddp)), 1e-5);
  auto e = run_engine({"--plugin-path", good, "--plugins", "ddp", "run.toml", "--set", "trainer.devices=2", "--set", "ddp.timeout=10.0"},
                      strict.path(), {}, 120);
  EXPECT_NE(e.exit_code, 0);
  EXPECT_NE(e.err.find("parameter 'spare.weight' got no gradient"), std::string::npos) << e.err;
  EXPECT_NE(e.err.find("ddp.find_unused_parameters = true"), std::string::npos) << e.err;
}

// A stop asked for on one rank only, in the middle of an epoch (a callback's decision), is agreed
// by every rank at the same optimizer step: the job ends cleanly at that step, with no timeout.
TEST_F(Ddp, StopAskedOnOneRankStopsEveryRankAtTheSameStep) {
  TempDir dir("ddp");
  write_file(dir / "run.toml", kRun);
  const auto start = std::chrono::steady_clock::now();
  auto r = run_engine({"--plugin-path", test_plugin_dir("good").string(), "--plugins", "ddp,chaos", "run.toml", "--set",
                       "trainer.devices=2", "--set", "ddp.timeout=60.0", "--set", "chaos.action=\"stop\"", "--set", "chaos.step=1"},
                      dir.path(), {}, 120);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(seconds, 60.0) << "a rank waited for the timeout";
  EXPECT_NE(r.err.find("[rank 1] info stopping: chaos: asked on rank 1 only"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("stopping: another rank asked to stop"), std::string::npos) << r.err;
  // Asked at the start of step 1's batch: that step completes, then both ranks stop.
  auto ck = ember::engine::load_checkpoint_file(last_checkpoint(dir));
  EXPECT_EQ(ck.at("global_step").toInt(), 2);
}

// A checkpoint that rank 0 cannot write (here its folder would have to be inside a file) ends
// every rank promptly with that error, not with a rank waiting for the collective timeout.
TEST_F(Ddp, CheckpointWriteFailureOnRankZeroEndsEveryRankPromptly) {
  TempDir dir("ddp");
  write_file(dir / "run.toml", kRun);
  write_file(dir / "blocker", "a file, not a folder");
  const auto start = std::chrono::steady_clock::now();
  auto r = run_engine({"--plugins", "ddp", "run.toml", "--set", "trainer.devices=2", "--set", "ddp.timeout=60.0", "--set",
                       "checkpoint.dirpath=\"" + (dir / "blocker" / "ckpts").string() + "\""},
                      dir.path(), {}, 120);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_LT(seconds, 50.0) << "a rank waited for the collective timeout:\n" << r.err;
  EXPECT_NE(r.err.find("cannot write checkpoint"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[rank 1] error run failed: rank 0 could not write checkpoint"), std::string::npos) << r.err;
}
