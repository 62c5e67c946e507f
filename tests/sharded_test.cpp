// sharded (ZeRO stages 1-3) on CPU with 2 and 3 ranks on loopback: the same weights as
// single_device with the matching global batch, with uneven shards (no parameter count divides
// by 2 or 3), accumulation and clipping; amp16/bf16 within a tolerance an unsynchronised run
// fails; checkpoints that resume on another world size (and under single_device) exactly; the
// training tricks under stage 3.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <regex>

#include "bn_mlp_run.h"
#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// 72 samples, global batch 24: 1 rank x 24, 2 ranks x 12 and 3 ranks x 8 see the same samples in
// every optimizer step (the loader deals shuffled sample i to rank i % world). The mlp's hidden
// layers are units (gathered one at a time under stage 3); 23 and 17 make every parameter's size
// indivisible by 2 and by 3, so shards are padded.
const std::string kRun = synthetic_mlp_toml({.accelerator = "cpu", .hidden = "[23, 17]", .num_train = 72,
                                             .num_val = 24, .batch_size = 24}) +
                         "[optimizer]\n";
const char* kSgd = "name = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n";
const char* kAdam = "name = \"adam\"\nlr = 0.01\n";

void write_run(const TempDir& dir, const char* optimizer = kSgd) { write_file(dir / "run.toml", kRun + optimizer); }

// single_device with the global batch (24).
void reference(const TempDir& dir, std::vector<std::string> extra = {}, const char* optimizer = kSgd) {
  write_run(dir, optimizer);
  std::vector<std::string> args = {"run.toml"};
  args.insert(args.end(), extra.begin(), extra.end());
  run_engine_ok(dir, args);
}

// sharded with `ranks` ranks of batch 24 / ranks.
ProcessResult sharded(const TempDir& dir, int stage, int ranks, std::vector<std::string> extra = {}, const char* optimizer = kSgd) {
  write_run(dir, optimizer);
  std::vector<std::string> args = {"--plugins", "sharded", "run.toml", "--set", "sharded.timeout=30.0",
                                   "--set", "trainer.devices=" + std::to_string(ranks),
                                   "--set", "sharded.stage=" + std::to_string(stage),
                                   "--set", "data.batch_size=" + std::to_string(24 / ranks)};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args);
}

struct StageRanks {
  int stage, ranks;
};

// Every test here runs CPU ranks, which talk through Open MPI.
class ShardedStages : public ::testing::TestWithParam<StageRanks> {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};
class Sharded : public ::testing::Test {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};
using DistributedBuffers = Sharded;

}  // namespace

TEST_P(ShardedStages, MatchSingleDeviceWithTheGlobalBatch) {
  const auto [stage, ranks] = GetParam();
  TempDir single("sharded"), dir("sharded");
  reference(single);
  // Tiny groups: the parameters outside units are reduce-scattered in several pieces, some of
  // them while backward still runs.
  auto r = sharded(dir, stage, ranks, {"--set", "sharded.bucket_cap_mb=0.0001"});
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(dir)), 1e-5);
  EXPECT_GT(count_in_log(r.err, R"((\d+) reduce-scatters)"), 0) << r.err;
  EXPECT_GT(count_in_log(r.err, R"(\((\d+) started while backward was still running\))"), 0) << r.err;
  if (stage == 3) EXPECT_GT(count_in_log(r.err, R"(\((\d+) prefetched\))"), 0) << r.err;
  // Every rank trains its part: together they hold every element exactly once.
  std::regex part(R"(this rank trains (\d+) of (\d+) elements)");
  int64_t sum = 0, total = 0;
  for (std::sregex_iterator it(r.err.begin(), r.err.end(), part), end; it != end; ++it) {
    sum += std::stoll((*it)[1].str());
    total = std::stoll((*it)[2].str());
  }
  EXPECT_EQ(sum, total) << r.err;
  EXPECT_GT(total, 0);
  EXPECT_FALSE(fs::exists(dir / "runs/run/version_1"));
}

INSTANTIATE_TEST_SUITE_P(Sharded, ShardedStages,
                         ::testing::Values(StageRanks{1, 2}, StageRanks{2, 2}, StageRanks{3, 2}, StageRanks{1, 3}, StageRanks{2, 3},
                                           StageRanks{3, 3}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) + "_ranks" + std::to_string(info.param.ranks);
                         });

// Adam (per-element state in every shard), accumulation (stage 1 talks only on the updating
// micro-batch, stages 2-3 on each) and clipping by global norm (the norm spans the shards).
TEST_F(Sharded, AccumulationAndClippingMatchSingleDevice) {
  const std::vector<std::string> extra = {"--set", "trainer.accumulate_grad_batches=2", "--set", "trainer.gradient_clip_val=0.05"};
  TempDir single("sharded");
  auto ref = extra;
  ref.insert(ref.end(), {"--set", "data.batch_size=12"});
  reference(single, ref, kAdam);
  for (int stage : {1, 3}) {
    TempDir dir("sharded");
    // 2 ranks x 6 x 2 micro-batches = 24 per step, as 12 x 2 on one device.
    auto a = extra;
    a.insert(a.end(), {"--set", "data.batch_size=6"});
    write_run(dir, kAdam);
    std::vector<std::string> args = {"--plugins", "sharded", "run.toml", "--set", "sharded.timeout=30.0", "--set", "trainer.devices=2",
                                     "--set", "sharded.stage=" + std::to_string(stage)};
    args.insert(args.end(), a.begin(), a.end());
    run_engine_ok(dir, args);
    EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(dir)), 1e-5) << "stage " << stage;
  }
}

// A full checkpoint is world-size independent: saved by 2 ranks, resumed by 3 (re-sharded) and
// by single_device, each ends exactly like the uninterrupted single-device run.
TEST_F(Sharded, CheckpointResumesOnAnotherWorldSizeAndUnderSingleDevice) {
  TempDir single("sharded"), three("sharded"), one("sharded");
  reference(single, {}, kAdam);
  const std::vector<std::string> epoch1 = {"--set", "trainer.max_epochs=1"};
  sharded(three, 3, 2, epoch1, kAdam);
  fs::copy_file(last_checkpoint(three), one / "two_ranks.ckpt");
  auto r = sharded(three, 3, 3, {"--resume", "last"}, kAdam);
  EXPECT_NE(r.err.find("re-sharded onto 3"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(three)), 1e-5);
  write_run(one, kAdam);
  auto o = run_engine_ok(one, {"run.toml", "--resume", "two_ranks.ckpt"});
  EXPECT_NE(o.err.find("resumed from"), std::string::npos) << o.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(one)), 1e-5) << o.err;
  // And the other way: single_device's checkpoint resumes under sharding.
  TempDir back("sharded");
  write_run(back, kAdam);
  run_engine_ok(back, {"run.toml", "--set", "trainer.max_epochs=1"});
  sharded(back, 2, 3, {"--resume", "last"}, kAdam);
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(back)), 1e-5);
}

// amp16 and bf16 under stage 3 agree with single_device in the same precision within a tolerance
// that a run without gradient synchronisation (one rank on its half of each batch) exceeds.
TEST_F(Sharded, MixedPrecisionMatchesSingleDeviceWithinTolerance) {
  for (const char* precision : {"16-mixed", "bf16-mixed"}) {
    const std::vector<std::string> mode = {"--set", std::string("trainer.precision=\"") + precision + "\""};
    TempDir single("sharded"), dir("sharded"), alone("sharded");
    reference(single, mode);
    sharded(dir, 3, 2, mode);
    auto lone = mode;
    lone.insert(lone.end(), {"--set", "data.batch_size=12"});
    reference(alone, lone);
    const WeightDifference synced = max_weight_difference(last_checkpoint(single), last_checkpoint(dir));
    const WeightDifference unsynced = max_weight_difference(last_checkpoint(single), last_checkpoint(alone));
    EXPECT_LE(synced, 0.02) << precision;
    EXPECT_GT(unsynced, 0.02) << precision << ": the tolerance would not catch a missing synchronisation";
  }
}

// The training tricks under stage 3 compute what they compute under single_device: swa and ema
// average the shards, a scheduler steps the sharded optimizer, early stopping and top-k
// checkpoints read reduced metrics.
TEST_F(Sharded, TricksUnderStage3MatchSingleDevice) {
  const std::vector<std::string> tricks = {
      "--plugins", "checkpoint,early_stopping,cosine,ema", "--set", "trainer.max_epochs=4", "--set", "checkpoint.save_top_k=2",
      "--set", "checkpoint.monitor=\"val_loss\"", "--set", "early_stopping.monitor=\"val_loss\"", "--set", "early_stopping.patience=5"};
  TempDir single("sharded"), dir("sharded");
  reference(single, tricks);
  auto r = sharded(dir, 3, 2, tricks);
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(dir)), 1e-5);
  int ckpts = 0;
  for (const auto& e : fs::directory_iterator(dir / "runs/run/version_0/checkpoints")) ckpts += e.path().extension() == ".ckpt";
  EXPECT_EQ(ckpts, 3) << "top-2 plus last";
  TempDir swa_single("sharded"), swa_dir("sharded");
  const std::vector<std::string> swa = {"--plugins", "swa", "--set", "trainer.max_epochs=4", "--set", "swa.swa_epoch_start=2",
                                        "--set", "swa.swa_lrs=[0.05]"};
  reference(swa_single, swa);
  sharded(swa_dir, 3, 3, swa);
  EXPECT_LE(max_weight_difference(last_checkpoint(swa_single), last_checkpoint(swa_dir)), 1e-5);
}

// Weight averaging keeps this rank's shards of its average and of the model's own weights, so a
// checkpoint holds each rank's state (callbacks_by_rank) and a resume gives each rank its own: a
// run stopped after epoch 1 and resumed ends bit for bit where the whole run does, in a file and in
// a sharded directory. (Before, every rank took rank 0's shards: a size error with these uneven
// shards, silently wrong weights with even ones.) Another number of ranks is one line.
TEST_F(Sharded, WeightAveragingResumesEveryRanksOwnShards) {
  struct Variant {
    std::string name;
    std::vector<std::string> keys;
  };
  const std::vector<Variant> variants = {
      {"ema, file", {"--plugins", "ema,checkpoint", "--set", "ema.decay=0.9"}},
      {"ema, sharded directory", {"--plugins", "ema,checkpoint", "--set", "ema.decay=0.9", "--set", "sharded.state_dict_type=\"sharded\""}},
      {"swa, file", {"--plugins", "swa,checkpoint", "--set", "swa.swa_epoch_start=1", "--set", "swa.swa_lrs=[0.05]"}},
  };
  for (const auto& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir whole("sharded"), resumed("sharded");
    auto keys = v.keys;
    keys.insert(keys.end(), {"--set", "trainer.max_epochs=3"});
    sharded(whole, 2, 2, keys);
    auto first = v.keys;
    first.insert(first.end(), {"--set", "trainer.max_epochs=2"});
    sharded(resumed, 2, 2, first);
    keys.insert(keys.end(), {"--resume", "last"});
    sharded(resumed, 2, 2, keys);
    expect_identical_weights(last_checkpoint(resumed), last_checkpoint(whole));
  }
  TempDir dir("sharded");
  sharded(dir, 2, 2, {"--plugins", "ema,checkpoint", "--set", "trainer.max_epochs=1"});
  const auto ck = ember::engine::load_checkpoint_file(last_checkpoint(dir));
  EXPECT_EQ(ck.at("callbacks_by_rank").toGenericDict().at("world_size").toInt(), 2);
  EXPECT_EQ(ck.at("callbacks_by_rank").toGenericDict().at("states").toGenericDict().size(), 1u) << "only ema's state differs per rank";
  const auto info = run_engine({"checkpoint", "info", last_checkpoint(dir).string()}, dir.path(), {}, 60);
  EXPECT_NE(info.out.find("callback states per rank (2 ranks; a resume with as many ranks gives each its own): ema\n"), std::string::npos)
      << info.out;
  write_run(dir);
  const auto r = run_engine({"--plugins", "sharded,ema,checkpoint", "run.toml", "--set", "sharded.timeout=30.0", "--set", "trainer.devices=3",
                             "--set", "data.batch_size=8", "--set", "trainer.max_epochs=2", "--resume", "last"},
                            dir.path(), {}, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("callback 'ema' saved a state of its own on each of the 2 ranks that wrote it (its part of the strategy's shards), "
                       "and this run has 3: resume with 2 ranks, or without 'ema'"),
            std::string::npos)
      << r.err;
  // In a sharded directory each rank writes its own state into its part (rank 0 gathers none):
  // meta.ckpt only names it. A background save does the same. `engine checkpoint consolidate`
  // puts every rank's into the file, which resumes exactly too.
  {
    const std::vector<std::string> ema_dir = {"--plugins", "ema,checkpoint", "--set", "ema.decay=0.9",
                                              "--set", "sharded.state_dict_type=\"sharded\"", "--set", "checkpoint.async=true"};
    TempDir whole("sharded"), stopped("sharded"), from_file("sharded");
    auto keys = ema_dir;
    keys.insert(keys.end(), {"--set", "trainer.max_epochs=3"});
    sharded(whole, 2, 2, keys);
    auto first = ema_dir;
    first.insert(first.end(), {"--set", "trainer.max_epochs=2"});
    sharded(stopped, 2, 2, first);
    const fs::path parts = last_checkpoint(stopped);
    ASSERT_TRUE(ember::engine::is_sharded_checkpoint(parts)) << parts;
    const auto meta = ember::engine::read_sharded_meta(parts);
    const auto by_rank = meta.at("callbacks_by_rank").toGenericDict();
    EXPECT_FALSE(by_rank.contains("states")) << "rank 0 gathered the ranks' states";
    ASSERT_TRUE(by_rank.contains("in_parts"));
    EXPECT_EQ(by_rank.at("in_parts").toList().size(), 1u);
    EXPECT_EQ(by_rank.at("in_parts").toList().get(0).toStringRef(), "ema");
    EXPECT_FALSE(meta.at("callbacks").toGenericDict().contains("ema")) << "rank 0's shards of the average are in its part already";
    std::vector<at::Tensor> own;
    for (int64_t k = 0; k < 2; ++k) {
      const auto part = ember::engine::read_sharded_part_file(parts, k);
      ASSERT_TRUE(part.callback_states.isGenericDict()) << "part " << k;
      ASSERT_TRUE(part.callback_states.toGenericDict().contains("ema")) << "part " << k;
      part.callback_states.toGenericDict().at("ema").visit([&](const c10::IValue& v) {
        if (v.isTensor() && v.toTensor().numel() > 1) own.push_back(v.toTensor());
        return false;
      });
    }
    ASSERT_GE(own.size(), 2u);
    EXPECT_FALSE(own.front().equal(own.at(own.size() / 2))) << "both parts hold the same state";
    const auto info = run_engine({"checkpoint", "info", parts.string()}, stopped.path(), {}, 60);
    EXPECT_NE(info.out.find("callback states per rank (2 ranks, each in its part; a resume with as many ranks gives each its own): ema\n"),
              std::string::npos)
        << info.out;
    const fs::path file = from_file / "consolidated.ckpt";
    const auto c = run_engine({"checkpoint", "consolidate", parts.string(), file.string()}, stopped.path(), {}, 120);
    ASSERT_EQ(c.exit_code, 0) << c.err;
    const auto ck = ember::engine::load_checkpoint_file(file);
    EXPECT_EQ(ck.at("callbacks_by_rank").toGenericDict().at("states").toGenericDict().at("ema").toList().size(), 2u);
    EXPECT_FALSE(ck.at("callbacks_by_rank").toGenericDict().contains("in_parts"));
    keys.insert(keys.end(), {"--resume", file.string()});
    sharded(from_file, 2, 2, keys);
    expect_identical_weights(last_checkpoint(from_file), last_checkpoint(whole));
  }
  // A state without tensors that differs per rank (a timer's clock) is not shaped by the ranks:
  // every rank of a run with another number of them takes rank 0's.
  TempDir clock("sharded");
  const std::vector<std::string> timer = {"--plugins", "timer,checkpoint", "--set", "timer.duration=\"00:01:00:00\""};
  auto first = timer;
  first.insert(first.end(), {"--set", "trainer.max_epochs=1"});
  sharded(clock, 2, 2, first);
  EXPECT_TRUE(ember::engine::load_checkpoint_file(last_checkpoint(clock)).at("callbacks_by_rank").toGenericDict().at("states")
                  .toGenericDict().contains("timer"));
  auto more = timer;
  more.insert(more.end(), {"--set", "trainer.max_epochs=2", "--resume", "last"});
  sharded(clock, 2, 3, more);
}

TEST_F(Sharded, BadSettingsAreOneClearLine) {
  TempDir dir("sharded");
  write_run(dir);
  auto r = run_engine({"--plugins", "sharded", "run.toml", "--set", "sharded.stage=4"}, dir.path(), {}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("sharded.stage"), std::string::npos) << r.err;
}

// Batch norm under ddp and sharded: with broadcast_buffers (the default) every rank evaluates with
// rank 0's statistics; without it each rank's statistics drift with its own batches, which this
// probe sees (so the check can fail).
TEST_F(DistributedBuffers, BatchNormStatisticsAgreeAcrossRanks) {
  std::regex line(R"(buffer_probe: rank (\d) epoch (\d+) buffers (\S+))");
  for (const std::string strategy : {"ddp", "sharded"})
    for (const bool broadcast : {true, false}) {
      TempDir dir("buffers");
      write_file(dir / "run.toml", kBnMlpRun);
      auto r = run_engine({"--plugin-path", test_plugin_dir("good").string(), "--plugins", strategy + ",buffer_probe", "run.toml",
                           "--set", "trainer.devices=2", "--set", strategy + ".timeout=30.0", "--set",
                           strategy + ".broadcast_buffers=" + (broadcast ? "true" : "false")},
                          dir.path(), {}, 180);
      ASSERT_EQ(r.exit_code, 0) << r.err;
      std::map<std::string, std::map<std::string, std::string>> by_epoch;  // epoch -> rank -> sum
      for (std::sregex_iterator it(r.err.begin(), r.err.end(), line), end; it != end; ++it) by_epoch[(*it)[2]][(*it)[1]] = (*it)[3];
      ASSERT_EQ(by_epoch.size(), 2u) << r.err;
      bool all_equal = true;
      for (auto& [epoch, ranks] : by_epoch) {
        ASSERT_EQ(ranks.size(), 2u) << r.err;
        all_equal = all_equal && ranks["0"] == ranks["1"];
      }
      EXPECT_EQ(all_equal, broadcast) << strategy << " broadcast_buffers=" << broadcast << "\n" << r.err;
    }
}

// Memory at the step, measured on each rank (memory_probe): sharding the optimizer state (1), the
// gradients (2) and the parameters (3) each lowers what a rank holds; stage 3 holds about 1/N of
// ddp's (padding aside: nothing is gathered at the step).
TEST_F(Sharded, StateMemoryPerRankShrinksWithEachStage) {
  std::regex probe(R"(memory_probe: rank 0 step 2: .* total (\d+) bytes)");
  auto measure = [&](const std::vector<std::string>& strategy) {
    TempDir dir("sharded");
    write_run(dir, kAdam);
    std::vector<std::string> args = {"--plugin-path", test_plugin_dir("good").string(), "run.toml", "--set", "trainer.devices=2",
                                     "--set", "data.batch_size=12", "--set", "trainer.max_epochs=1", "--set", "model.hidden=[64, 64]"};
    args.insert(args.end(), strategy.begin(), strategy.end());
    auto r = run_engine_ok(dir, args);
    std::smatch m;
    EXPECT_TRUE(std::regex_search(r.err, m, probe)) << r.err;
    return m.empty() ? int64_t{0} : std::stoll(m[1].str());
  };
  const int64_t ddp = measure({"--plugins", "ddp,memory_probe", "--set", "ddp.timeout=30.0"});
  std::vector<int64_t> stage(4, 0);
  for (int s = 1; s <= 3; ++s)
    stage[s] = measure({"--plugins", "sharded,memory_probe", "--set", "sharded.timeout=30.0", "--set", "sharded.stage=" + std::to_string(s)});
  EXPECT_GT(ddp, 0);
  EXPECT_LT(stage[1], ddp);
  EXPECT_LT(stage[2], stage[1]);
  EXPECT_LT(stage[3], stage[2]);
  EXPECT_LE(static_cast<double>(stage[3]), 0.5 * static_cast<double>(ddp) * 1.02) << "ddp " << ddp << ", stage 3 " << stage[3];
}

// The checkpoint callback's "best" is found among sharded directories too (it read the directory
// as a file: "skipping unreadable .../last.ckpt: Is a directory", then "no 'best' checkpoint"):
// the default test_after_fit with test_ckpt = "best" tests it, and --resume best continues from it.
TEST_F(Sharded, BestShardedCheckpointIsTestedAndResumed) {
  TempDir dir("sharded");
  const std::vector<std::string> best = {"--set", "sharded.state_dict_type=\"sharded\"", "--set", "trainer.test_after_fit=true",
                                         "--set", "trainer.test_ckpt=\"best\"", "--set", "data.num_test=24"};
  auto r = sharded(dir, 3, 2, best, kAdam);
  EXPECT_EQ(r.err.find("skipping unreadable"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("test_loss"), std::string::npos) << r.out;
  const fs::path folder = dir / "runs/run/version_0/checkpoints";
  bool any_dir = false;
  for (const auto& e : fs::directory_iterator(folder)) any_dir = any_dir || fs::is_directory(e.path());
  EXPECT_TRUE(any_dir) << "the checkpoints are sharded directories";
  auto resumed = run_engine_ok(dir, {"--plugins", "sharded", "run.toml", "--set", "sharded.timeout=30.0", "--set", "trainer.devices=2",
                                     "--set", "sharded.stage=3", "--set", "data.batch_size=12", "--set",
                                     "sharded.state_dict_type=\"sharded\"", "--set", "trainer.max_epochs=3", "--resume", "best"});
  EXPECT_NE(resumed.err.find("resumed from"), std::string::npos) << resumed.err;
}

// state_dict_type = "sharded": a directory of one part per rank, nothing gathered. Saved by 2
// ranks, it resumes on 3 (each rank reading only the parts that hold its shards) and on 1 exactly;
// `engine checkpoint consolidate` makes the single file that single_device resumes from (and with
// --weights-only the weights alone); single_device refuses the directory with one line saying so;
// `engine validate --ckpt DIR` reads the weights alone.
TEST_F(Sharded, ShardedCheckpointDirectoryReshardsAndConsolidates) {
  TempDir single("sharded"), dir("sharded");
  reference(single, {}, kAdam);
  const std::vector<std::string> sharded_ckpt = {"--set", "sharded.state_dict_type=\"sharded\""};
  auto epoch1 = sharded_ckpt;
  epoch1.insert(epoch1.end(), {"--set", "trainer.max_epochs=1"});
  sharded(dir, 3, 2, epoch1, kAdam);
  const fs::path saved = last_checkpoint(dir);
  ASSERT_TRUE(fs::is_directory(saved)) << saved;
  for (const char* f : {"meta.ckpt", "rank0.ckpt", "rank1.ckpt"}) EXPECT_TRUE(fs::is_regular_file(saved / f)) << f;
  EXPECT_FALSE(fs::exists(saved.parent_path() / ".last.ckpt.partial"));
  // Keep the 2-rank directory for the other resumes.
  TempDir keep("sharded");
  fs::create_directories(keep / "two_ranks.ckpt");
  for (const auto& e : fs::directory_iterator(saved)) fs::copy_file(e.path(), keep / "two_ranks.ckpt" / e.path().filename());

  for (int ranks : {3, 1}) {
    TempDir r("sharded");
    write_run(r, kAdam);
    auto out = sharded(r, 2, ranks, {"--resume", (keep / "two_ranks.ckpt").string()}, kAdam);
    EXPECT_NE(out.err.find("resumed from"), std::string::npos) << out.err;
    // The first part lists every part's layout: on 3 ranks, rank 0's shards lie in part 0 alone.
    EXPECT_NE(out.err.find(ranks == 3 ? "read 1 of the 2 parts" : "read 2 of the 2 parts"), std::string::npos) << out.err;
    EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(r)), 1e-5) << ranks << " ranks";
  }
  // single_device cannot read parts: it says what to do.
  TempDir plain("sharded");
  write_run(plain, kAdam);
  auto refused = run_engine({"run.toml", "--resume", (keep / "two_ranks.ckpt").string()}, plain.path(), {}, 60);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find("engine checkpoint consolidate"), std::string::npos) << refused.err;
  // Consolidated, it resumes under single_device exactly.
  auto c = run_engine({"checkpoint", "consolidate", (keep / "two_ranks.ckpt").string(), (keep / "whole.ckpt").string()}, keep.path(), {}, 120);
  ASSERT_EQ(c.exit_code, 0) << c.err;
  auto whole = weights(keep / "whole.ckpt");
  EXPECT_EQ(whole.at("fc1.weight").sizes(), (std::vector<int64_t>{23, 32}));
  TempDir from_whole("sharded");
  write_run(from_whole, kAdam);
  run_engine_ok(from_whole, {"run.toml", "--resume", (keep / "whole.ckpt").string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(from_whole)), 1e-5);
  // The weights alone: --weights-only leaves the optimizer's state unread (only the model's part of
  // each part is read) and writes what save_weights_only writes, the same weights bit for bit.
  c = run_engine({"checkpoint", "consolidate", (keep / "two_ranks.ckpt").string(), (keep / "weights.ckpt").string(), "--weights-only"},
                 keep.path(), {}, 120);
  ASSERT_EQ(c.exit_code, 0) << c.err;
  EXPECT_NE(c.err.find("read the model's part of 2 of the 2 parts"), std::string::npos) << c.err;
  EXPECT_NE(c.err.find("(the model's weights alone)"), std::string::npos) << c.err;
  const auto only = ember::engine::load_checkpoint_file(keep / "weights.ckpt");
  EXPECT_TRUE(only.at("weights_only").toBool());
  for (const char* absent : {"optimizer", "loops", "callbacks"}) EXPECT_FALSE(only.contains(absent)) << absent;
  expect_identical_weights(keep / "weights.ckpt", keep / "whole.ckpt");
  // Evaluating the directory reads the weights alone, and scores what the file scores.
  auto metric = [](const std::string& out, const std::string& name) {
    std::smatch m;
    if (!std::regex_search(out, m, std::regex("(^|\\n)" + name + "\\s+(\\S+)"))) return std::string("nan");
    return m[2].str();
  };
  auto parts = run_engine_ok(plain, {"validate", "--ckpt", (keep / "two_ranks.ckpt").string(), "run.toml", "--plugins", "sharded", "--set",
                                     "trainer.devices=2", "--set", "sharded.timeout=30.0", "--set", "data.batch_size=12"});
  EXPECT_NE(parts.err.find("read the model's part of 1 of the 2 parts"), std::string::npos) << parts.err;
  auto file = run_engine_ok(plain, {"validate", "--ckpt", (keep / "weights.ckpt").string(), "run.toml"});
  EXPECT_NEAR(std::stod(metric(parts.out, "val_loss")), std::stod(metric(file.out, "val_loss")), 1e-6) << parts.out << file.out;
}

// Resumed on the mesh that saved it, each rank reads its own part and no other (the part holds its
// shards, their optimizer state, the optimizer's groups and its buffers), and the run continues
// exactly: with broadcast_buffers = false each rank's batch-norm statistics are its own, so rank
// 1 resuming with rank 0's (what the first part alone held before every part carried its buffers)
// would evaluate with other statistics than the uninterrupted run.
TEST_F(Sharded, ShardedDirectoryOnItsOwnMeshIsReadOncePartPerRank) {
  auto run = [&](const TempDir& dir, std::vector<std::string> extra) {
    write_file(dir / "run.toml", kBnMlpRun);
    std::vector<std::string> args = {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "sharded,buffer_probe", "run.toml",
                                     "--set", "trainer.devices=2", "--set", "sharded.timeout=30.0", "--set", "sharded.stage=3",
                                     "--set", "sharded.broadcast_buffers=false", "--set", "sharded.state_dict_type=\"sharded\"",
                                     "--set", "optimizer.name=\"adam\"", "--set", "optimizer.lr=0.01"};  // (with per-element state)
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = run_engine(args, dir.path(), {}, 180);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.err;
  };
  // rank -> the buffer sum its second epoch evaluated with
  auto second_epoch = [](const std::string& err) {
    std::map<std::string, std::string> by_rank;
    std::regex line(R"(buffer_probe: rank (\d) epoch 1 buffers (\S+))");
    for (std::sregex_iterator it(err.begin(), err.end(), line), end; it != end; ++it) by_rank[(*it)[1]] = (*it)[2];
    return by_rank;
  };
  TempDir whole("sharded"), halves("sharded");
  const auto uninterrupted = second_epoch(run(whole, {}));
  run(halves, {"--set", "trainer.max_epochs=1"});
  ASSERT_TRUE(fs::is_directory(last_checkpoint(halves))) << last_checkpoint(halves);
  const std::string resumed_err = run(halves, {"--resume", "last"});
  EXPECT_NE(resumed_err.find("resumed from"), std::string::npos) << resumed_err;
  std::regex read_line(R"(read (\d+) of the 2 parts of the sharded checkpoint)");
  int lines = 0;
  for (std::sregex_iterator it(resumed_err.begin(), resumed_err.end(), read_line), end; it != end; ++it, ++lines)
    EXPECT_EQ((*it)[1], "1") << resumed_err;
  EXPECT_EQ(lines, 2) << "one line per rank\n" << resumed_err;
  const auto resumed = second_epoch(resumed_err);
  ASSERT_EQ(uninterrupted.size(), 2u);
  EXPECT_NE(uninterrupted.at("0"), uninterrupted.at("1")) << "each rank keeps its own statistics";
  EXPECT_EQ(resumed, uninterrupted) << resumed_err;
  EXPECT_LE(max_weight_difference(last_checkpoint(whole), last_checkpoint(halves)), 1e-6);
}

// A rank killed while a sharded checkpoint is being saved leaves the previous one whole: the job
// fails (bounded by the timeout), and --resume last continues from the epoch before, exactly.
// save_last = "link" with sharded checkpoint directories: last.ckpt links to the directory the
// save kept; a full directory replaces the link (every_n_epochs = 2: no top-k save at epoch 2) and
// a link replaces that real directory (swapped in, then deleted); the resumed runs end with the
// weights of one straight single_device run.
TEST_F(Sharded, SaveLastLinkPointsAtTheSavesDirectory) {
  TempDir single("sharded"), dir("sharded");
  reference(single, {"--set", "trainer.max_epochs=4"});
  auto train = [&](int epochs, bool resume) {
    std::vector<std::string> args = {"--set", "sharded.state_dict_type=\"sharded\"", "--set", "checkpoint.save_last=\"link\"", "--set",
                                     "checkpoint.every_n_epochs=2", "--set", "trainer.max_epochs=" + std::to_string(epochs)};
    if (resume) args.insert(args.end(), {"--resume", "last"});
    sharded(dir, 3, 2, args);
  };
  const fs::path folder = dir / "runs/run/version_0/checkpoints", last = folder / "last.ckpt";
  train(2, false);  // 3 steps an epoch: epoch 1 ends at step 6
  ASSERT_TRUE(fs::is_symlink(last));
  EXPECT_EQ(fs::read_symlink(last), "epoch=1-step=6.ckpt");
  EXPECT_TRUE(ember::engine::is_sharded_checkpoint(last));
  train(3, true);
  EXPECT_FALSE(fs::is_symlink(last));
  EXPECT_TRUE(ember::engine::is_sharded_checkpoint(last));
  EXPECT_TRUE(ember::engine::is_sharded_checkpoint(folder / "epoch=1-step=6.ckpt"));
  train(4, true);
  ASSERT_TRUE(fs::is_symlink(last));
  EXPECT_EQ(fs::read_symlink(last), "epoch=3-step=12.ckpt");
  // The step `--resume last` ranks a folder's checkpoints by, from the directory's meta.ckpt.
  EXPECT_EQ(ember::engine::probe_checkpoint_file(last / "meta.ckpt").global_step, 12);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(folder)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"epoch=3-step=12.ckpt", "last.ckpt"}));  // no swapped-out directory, no temporary link
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last), 1e-5);
}

TEST_F(Sharded, KilledMidSaveKeepsThePreviousCheckpoint) {
  TempDir single("sharded"), dir("sharded");
  reference(single, {}, kAdam);
  write_run(dir, kAdam);
  // Step 6 is the end of epoch 2: rank 1 dies as that checkpoint is being saved.
  auto r = run_engine({"--plugin-path", test_plugin_dir("good").string(), "--plugins", "sharded,chaos", "run.toml", "--set",
                       "sharded.timeout=10.0", "--set", "trainer.devices=2", "--set", "data.batch_size=12", "--set",
                       "sharded.state_dict_type=\"sharded\"", "--set", "chaos.step=6", "--set", "chaos.hook=\"on_save_checkpoint\""},
                      dir.path(), {}, 120);
  EXPECT_NE(r.exit_code, 0) << r.err;
  auto meta_ok = run_engine({"--plugins", "sharded", "run.toml", "--set", "sharded.timeout=30.0", "--set", "trainer.devices=2",
                             "--set", "data.batch_size=12", "--set", "sharded.state_dict_type=\"sharded\"", "--resume", "last"},
                            dir.path(), {}, 180);
  ASSERT_EQ(meta_ok.exit_code, 0) << meta_ok.err;
  EXPECT_NE(meta_ok.err.find("at epoch 0, step 3"), std::string::npos) << meta_ok.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(dir)), 1e-5);
}
