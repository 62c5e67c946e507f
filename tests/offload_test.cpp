// offload (ZeRO-Offload) on CPU: fp32 masters, gradients and optimizer state in host tensors of
// their own, the step with the fused CPU kernels over them, the compute-dtype weights copied back.
// On this machine device and host are both the CPU, so what is checked is the arithmetic and the
// bookkeeping: the same weights as single_device (with and without offload_params, accumulation,
// clipping, amp16 and bf16), exact resume in both directions between offload and single_device,
// fp32 masters in the checkpoint when the device weights are bf16, the start-up memory check, and
// 2 ranks each offloading its shard.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <regex>

#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// 72 samples, global batch 24 (1 rank x 24, 2 ranks x 12: the same samples per step). The mlp's
// hidden layers are units (fetched one at a time with offload_params); 23 and 17 make uneven
// shards with 2 ranks.
const std::string kRun =
    synthetic_mlp_toml({.hidden = "[23, 17]", .num_train = 72, .num_val = 24, .batch_size = 24}) + "[optimizer]\n";
const char* kAdamW = "name = \"adamw\"\nlr = 0.01\nweight_decay = 0.01\n";
const char* kSgd = "name = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n";

void write_run(const TempDir& dir, const char* optimizer = kAdamW) { write_file(dir / "run.toml", kRun + optimizer); }

ProcessResult single(const TempDir& dir, std::vector<std::string> extra = {}, const char* optimizer = kAdamW) {
  write_run(dir, optimizer);
  std::vector<std::string> args = {"run.toml"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args);
}

ProcessResult offload(const TempDir& dir, bool params, std::vector<std::string> extra = {}, const char* optimizer = kAdamW) {
  write_run(dir, optimizer);
  std::vector<std::string> args = {"--plugins", "offload", "run.toml", "--set", "offload.timeout=30.0",
                                   "--set", std::string("offload.offload_params=") + (params ? "true" : "false")};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args);
}

class OffloadModes : public ::testing::TestWithParam<bool> {};

}  // namespace

// fp32: the same weights as single_device to 1e-6. Tiny groups, so gradients of the layers that
// finish first reach the host while backward still runs; with offload_params every unit is
// fetched (and the next one prefetched) for its forward and again for its backward.
TEST_P(OffloadModes, MatchesSingleDevice) {
  const bool params = GetParam();
  for (const char* optimizer : {kAdamW, kSgd}) {
    TempDir ref("offload"), dir("offload");
    single(ref, {}, optimizer);
    auto r = offload(dir, params, {"--set", "offload.bucket_cap_mb=0.0001"}, optimizer);
    EXPECT_LE(max_weight_difference(last_checkpoint(ref), last_checkpoint(dir)), 1e-6) << optimizer;
    // "pinned host memory" where the device is a GPU.
    EXPECT_TRUE(std::regex_search(r.err, std::regex("masters, gradients and optimizer state in (pinned )?host memory"))) << r.err;
    EXPECT_EQ(count_in_log(r.err, R"((\d+) host optimizer steps)"), 6) << r.err;
    EXPECT_GT(count_in_log(r.err, R"(\((\d+) while backward was still running)"), 0) << r.err;
    if (params) {
      EXPECT_NE(r.err.find("one unit at a time"), std::string::npos) << r.err;
      EXPECT_GT(count_in_log(r.err, R"(\((\d+) prefetched\))"), 0) << r.err;
    }
  }
}

// Accumulation happens on the host in fp32 (every micro-batch's gradients are added into the host
// buffers); clipping by norm reads the host gradients.
TEST_P(OffloadModes, AccumulationAndClippingMatchSingleDevice) {
  const bool params = GetParam();
  const std::vector<std::string> extra = {"--set", "trainer.accumulate_grad_batches=2", "--set", "trainer.gradient_clip_val=0.05",
                                          "--set", "data.batch_size=12"};
  TempDir ref("offload"), dir("offload");
  single(ref, extra);
  auto r = offload(dir, params, extra);
  EXPECT_LE(max_weight_difference(last_checkpoint(ref), last_checkpoint(dir)), 1e-6);
  // 6 micro-batches per epoch, 3 steps: every micro-batch's gradients went to the host.
  EXPECT_EQ(count_in_log(r.err, R"((\d+) host optimizer steps)"), 6) << r.err;
}

INSTANTIATE_TEST_SUITE_P(Offload, OffloadModes, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "offload_params" : "masters_only"; });

// amp16 (loss scaling: the host gradients are unscaled, a non-finite step skipped) and bf16-mixed
// keep fp32 device weights: the same arithmetic as single_device. With compute_dtype = bf16 the
// device weights are bf16 and the masters fp32: within a tolerance that a run on other data
// (a broken step) exceeds.
// On the CPU, where both sides run the same kernels on the same data (tests/gpu_paths.sh trains
// offload under 16-bit on a GPU).
TEST(Offload, MixedPrecisionMatchesSingleDevice) {
  for (const char* precision : {"16-mixed", "bf16-mixed"}) {
    const std::vector<std::string> mode = {"--set", std::string("trainer.precision=\"") + precision + "\"", "--set",
                                           "trainer.accelerator=\"cpu\""};
    TempDir ref("offload"), dir("offload");
    single(ref, mode);
    offload(dir, true, mode);
    EXPECT_LE(max_weight_difference(last_checkpoint(ref), last_checkpoint(dir)), 1e-6) << precision;
  }
  const std::vector<std::string> bf16 = {"--set", "trainer.precision=\"bf16-mixed\"", "--set", "trainer.accelerator=\"cpu\""};
  TempDir ref("offload"), dir("offload"), other("offload");
  single(ref, bf16);
  auto args = bf16;
  args.insert(args.end(), {"--set", "offload.compute_dtype=\"bf16\""});
  auto r = offload(dir, false, args);
  EXPECT_NE(r.err.find("weights on cpu in BFloat16"), std::string::npos) << r.err;
  auto lone = bf16;
  lone.insert(lone.end(), {"--set", "data.batch_size=12"});
  single(other, lone);
  const double close = max_weight_difference(last_checkpoint(ref), last_checkpoint(dir));
  const double broken = max_weight_difference(last_checkpoint(ref), last_checkpoint(other));
  EXPECT_LE(close, 0.02);
  EXPECT_GT(broken, 0.02) << "the tolerance would not catch a wrong step";
  // The checkpoint holds the fp32 masters, not the bf16 device weights.
  auto w = weights(last_checkpoint(dir)).at("fc1.weight");
  EXPECT_EQ(w.scalar_type(), at::kFloat);
  EXPECT_GT((w - w.to(at::kBFloat16).to(at::kFloat)).abs().max().item<double>(), 0.0) << "masters were rounded to bf16";
}

// A checkpoint holds the fp32 masters and the optimizer state as single_device writes them:
// offload resumes its own exactly, single_device resumes offload's, and offload resumes
// single_device's, each ending where the uninterrupted run ends.
TEST(Offload, ResumeIsExactAndCrossesStrategies) {
  TempDir ref("offload");
  single(ref);
  const std::vector<std::string> epoch1 = {"--set", "trainer.max_epochs=1"};
  TempDir dir("offload"), to_single("offload"), from_single("offload");
  offload(dir, true, epoch1);
  fs::copy_file(last_checkpoint(dir), to_single / "offload.ckpt");
  auto r = offload(dir, true, {"--resume", "last"});
  EXPECT_NE(r.err.find("resumed from"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(ref), last_checkpoint(dir)), 1e-6);

  auto s = single(to_single, {"--resume", "offload.ckpt"});
  EXPECT_NE(s.err.find("resumed from"), std::string::npos) << s.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(ref), last_checkpoint(to_single)), 1e-6);

  single(from_single, epoch1);
  offload(from_single, false, {"--resume", "last"});
  EXPECT_LE(max_weight_difference(last_checkpoint(ref), last_checkpoint(from_single)), 1e-6);
}

// The start-up check: with a cap below what the masters and gradients need, or below what the
// optimizer state then needs, the run stops before training with one line giving both numbers.
TEST(Offload, NotEnoughHostMemoryIsOneLineAtStartUp) {
  // mlp 32-23-17-4: 1239 parameters -> 4956 bytes of fp32 masters + 4956 of gradients; AdamW's
  // state another 9912.
  struct Case {
    const char* cap_mb;
    const char* what;
    const char* need;
  };
  for (const Case c : {Case{"0.001", "the 6 master weights and their gradients", "(9912 bytes) needed"},
                       Case{"0.014", "the optimizer state", "(9912 bytes) needed"}}) {
    TempDir dir("offload");
    write_run(dir);
    // The figures are the CPU's: on a GPU the pinned staging copy of the device weights counts too.
    auto r = run_engine({"--plugins", "offload", "run.toml", "--set", std::string("offload.max_host_memory_mb=") + c.cap_mb, "--set",
                         "trainer.accelerator=\"cpu\""}, dir.path(),
                        {}, 60);
    EXPECT_NE(r.exit_code, 0) << r.err;
    EXPECT_NE(r.err.find(std::string("not enough host memory for ") + c.what), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.need), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("bytes) available (the cap offload.max_host_memory_mb"), std::string::npos) << r.err;
    // One line: the error, no statistics of a run that never started.
    EXPECT_EQ(r.err.find("host optimizer steps"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir / "runs/run/version_0/checkpoints/last.ckpt"));
  }
  // A cap that fits trains.
  TempDir ok("offload");
  offload(ok, false, {"--set", "offload.max_host_memory_mb=0.02", "--set", "trainer.accelerator=\"cpu\""});
}

// Two ranks: each offloads its half of every parameter (ZeRO-Offload's layout); gradients are
// reduce-scattered, then the rank's part goes to its host. Same weights as single_device with the
// global batch, with and without offload_params.
TEST(Offload, TwoRanksEachOffloadTheirShard) {
  EMBER_SKIP_WITHOUT_MPI();
  // CPU ranks, and single_device on the CPU too, also where a GPU is present.
  TempDir ref("offload");
  single(ref, {"--set", "trainer.accelerator=\"cpu\""});
  for (bool params : {false, true}) {
    TempDir dir("offload");
    auto r = offload(dir, params, {"--set", "trainer.devices=2", "--set", "data.batch_size=12", "--set", "offload.bucket_cap_mb=0.0001",
                                   "--set", "trainer.accelerator=\"cpu\""});
    EXPECT_LE(max_weight_difference(last_checkpoint(ref), last_checkpoint(dir)), 1e-5) << "offload_params " << params;
    std::regex part(R"(this rank trains (\d+) of (\d+) elements)");
    int64_t sum = 0, total = 0, ranks = 0;
    for (std::sregex_iterator it(r.err.begin(), r.err.end(), part), end; it != end; ++it) {
      sum += std::stoll((*it)[1].str());
      total = std::stoll((*it)[2].str());
      ++ranks;
    }
    EXPECT_EQ(ranks, 2) << r.err;
    EXPECT_EQ(sum, total) << r.err;
  }
}

// offload.state_dict_type = "sharded": two ranks each write their part of the fp32 masters and the
// optimizer state into a checkpoint folder. The parts joined independently of the strategy hold
// single_device's weights; the folder resumes on 2 ranks and, re-sharded, on 1 rank, each ending
// where the uninterrupted run ends; `engine checkpoint consolidate` makes the single file.
TEST(Offload, ShardedCheckpointsResumeOnAnyNumberOfRanks) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir ref("offload"), ref1("offload");
  single(ref, {"--set", "trainer.accelerator=\"cpu\""});
  single(ref1, {"--set", "trainer.accelerator=\"cpu\"", "--set", "trainer.max_epochs=1"});
  const std::vector<std::string> two = {"--set", "trainer.devices=2", "--set", "data.batch_size=12", "--set", "trainer.accelerator=\"cpu\"",
                                        "--set", "offload.state_dict_type=\"sharded\""};
  auto with = [&](std::vector<std::string> extra) {
    auto v = two;
    v.insert(v.end(), extra.begin(), extra.end());
    return v;
  };
  TempDir dir("offload"), one("offload");
  offload(dir, true, with({"--set", "trainer.max_epochs=1"}));
  const auto ckpt = last_checkpoint(dir);
  ASSERT_TRUE(fs::is_directory(ckpt)) << "state_dict_type = \"sharded\" writes a folder: " << ckpt;
  EXPECT_LE(max_weight_difference(last_checkpoint(ref1), ckpt), 1e-5);
  fs::copy(ckpt, one / "epoch1", fs::copy_options::recursive);

  auto r = offload(dir, true, with({"--resume", "last"}));
  EXPECT_NE(r.err.find("resumed from"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(ref), last_checkpoint(dir)), 1e-5);

  // One rank (batch 24) continues the two ranks' folder.
  r = offload(one, true, {"--set", "trainer.accelerator=\"cpu\"", "--set", "offload.state_dict_type=\"sharded\"", "--resume",
                           (one / "epoch1").string()});
  EXPECT_NE(r.err.find("resumed from"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(ref), last_checkpoint(one)), 1e-5);

  run_engine_ok(dir, {"checkpoint", "consolidate", last_checkpoint(dir).string(), "whole.ckpt"});
  EXPECT_LE(max_weight_difference(last_checkpoint(ref), dir / "whole.ckpt"), 1e-5);
}
