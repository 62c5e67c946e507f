// [model] init_checkpoint: a run starts from an earlier run's weights with a fresh optimizer and
// position (pretraining then fine-tuning); init_exclude keeps this run's own initial values for a
// changed part (a head for other classes); a resumed run and `--ckpt` take their own checkpoint;
// bad settings are one line with their place.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

std::string mlp_run(int classes) {
  const std::string c = std::to_string(classes);
  return R"([trainer]
max_epochs = 2
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[model]
name = "mlp"
input_size = 16
hidden = [8]
num_classes = )" + c + R"(
[data]
name = "synthetic"
shape = [16]
num_classes = )" + c + R"(
num_train = 64
num_val = 32
num_test = 0
batch_size = 16
[optimizer]
name = "sgd"
lr = 0.1
)";
}

// A run of one epoch whose steps cannot move a float32 weight (lr 1e-30): its last.ckpt holds the
// weights it started from.
ProcessResult start(const TempDir& dir, int classes, std::vector<std::string> extra) {
  write_file(dir / "run.toml", mlp_run(classes));
  std::vector<std::string> args = {"run.toml", "--set", "optimizer.lr=1e-30", "--set", "trainer.max_epochs=1"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args, 240);
}

double part_difference(const fs::path& a, const fs::path& b, const std::string& prefix) {
  auto wa = weights(a), wb = weights(b);
  double worst = -1;
  for (const auto& [name, t] : wa)
    if (name.rfind(prefix, 0) == 0) {
      EXPECT_EQ(t.sizes(), wb.at(name).sizes()) << name;
      worst = std::max(worst, (t - wb.at(name)).abs().max().item<double>());
    }
  EXPECT_GE(worst, 0) << "no tensor named " << prefix << "* in " << a;
  return worst;
}

int64_t global_step(const fs::path& ckpt) { return ember::engine::load_checkpoint_file(ckpt).at("global_step").toInt(); }

}  // namespace

// The weights of the earlier run's last step; the position starts at 0 (4 steps, not 8 + 4).
TEST(InitCheckpoint, StartsFromTheWeightsWithAFreshOptimizerAndPosition) {
  TempDir pretrain("init_ckpt"), finetune("init_ckpt"), fresh("init_ckpt");
  write_file(pretrain / "run.toml", mlp_run(4));
  run_engine_ok(pretrain, {"run.toml"});
  const fs::path from = last_checkpoint(pretrain);
  ASSERT_EQ(global_step(from), 8);
  auto r = start(finetune, 4, {"--set", "model.init_checkpoint=\"" + from.string() + "\""});
  EXPECT_NE(r.err.find("model: weights from " + from.string() + "; the optimizer and the schedule start afresh"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(from, last_checkpoint(finetune)), 1e-12);
  EXPECT_EQ(global_step(last_checkpoint(finetune)), 4);
  start(fresh, 4, {});
  EXPECT_GT(max_weight_difference(from, last_checkpoint(fresh)), 1e-3) << "the key changed nothing";
}

// A head for 3 classes on a 4-class run's body: fc1 from the checkpoint, head as a run without
// init_checkpoint makes it; without init_exclude the head's shape is one line naming the key.
TEST(InitCheckpoint, ExcludedTensorsKeepTheirOwnInitialValues) {
  TempDir pretrain("init_ckpt"), finetune("init_ckpt"), fresh("init_ckpt"), refused("init_ckpt");
  write_file(pretrain / "run.toml", mlp_run(4));
  run_engine_ok(pretrain, {"run.toml"});
  const std::string from = "model.init_checkpoint=\"" + last_checkpoint(pretrain).string() + "\"";
  auto r = start(finetune, 3, {"--set", from, "--set", "model.init_exclude=[\"head\"]"});
  EXPECT_NE(r.err.find("except 2 tensors that keep their initial values here (e.g. 'head."), std::string::npos) << r.err;
  start(fresh, 3, {});
  EXPECT_LE(part_difference(last_checkpoint(pretrain), last_checkpoint(finetune), "fc1."), 1e-12);
  EXPECT_LE(part_difference(last_checkpoint(fresh), last_checkpoint(finetune), "head."), 1e-12);
  EXPECT_GT(part_difference(last_checkpoint(fresh), last_checkpoint(finetune), "fc1."), 1e-3);

  write_file(refused / "run.toml", mlp_run(3));
  auto e = run_engine({"run.toml", "--set", from}, refused.path());
  EXPECT_EQ(e.exit_code, 1) << e.err;
  EXPECT_NE(e.err.find("'head.weight' has shape [4, 8] there and [3, 8] in this model: list what changed (a new head for other classes) in "
                       "[model] init_exclude"),
            std::string::npos)
      << e.err;
}

// A resumed run and `engine validate --ckpt` take their own checkpoint, so a pretraining file
// deleted since is no obstacle; bad settings are one line with their place.
TEST(InitCheckpoint, ResumesTakeTheirOwnStateAndBadSettingsAreOneLine) {
  TempDir pretrain("init_ckpt"), dir("init_ckpt");
  write_file(pretrain / "run.toml", mlp_run(4));
  run_engine_ok(pretrain, {"run.toml"});
  const fs::path copy = dir / "pretrained.ckpt";
  fs::copy_file(last_checkpoint(pretrain), copy);
  const std::string run = mlp_run(4);
  const std::string with_init = run.substr(0, run.find("[data]")) + "init_checkpoint = \"pretrained.ckpt\"\n" + run.substr(run.find("[data]"));
  write_file(dir / "run.toml", with_init);
  run_engine_ok(dir, {"run.toml", "--set", "trainer.max_epochs=1"});
  fs::remove(copy);
  auto resumed = run_engine_ok(dir, {"run.toml", "--resume", "last"});
  EXPECT_EQ(resumed.err.find("model: weights from"), std::string::npos) << resumed.err;
  EXPECT_EQ(global_step(last_checkpoint(dir)), 8);
  run_engine_ok(dir, {"validate", "--ckpt", "last", "run.toml"});

  auto e = run_engine({"run.toml", "--set", "trainer.version=7"}, dir.path());
  EXPECT_EQ(e.exit_code, 2) << e.err;
  EXPECT_NE(e.err.find("run.toml:11:19: model.init_checkpoint = \"pretrained.ckpt\": no such file (give the path of a .ckpt an earlier run "
                       "wrote"),
            std::string::npos)
      << e.err;
  fs::copy_file(last_checkpoint(pretrain), copy);
  e = run_engine({"run.toml", "--set", "trainer.version=8", "--set", "model.init_exclude=[\"classifier\"]"}, dir.path());
  EXPECT_EQ(e.exit_code, 2) << e.err;
  EXPECT_NE(e.err.find("model.init_exclude entry \"classifier\" names no module or tensor of model 'mlp' (e.g. 'fc1.weight')"), std::string::npos)
      << e.err;
  // An empty path is no checkpoint: init_exclude alone is one line.
  e = run_engine({"run.toml", "--set", "trainer.version=9", "--set", "model.init_exclude=[\"head\"]", "--set", "model.init_checkpoint=\"\""},
                 dir.path());
  EXPECT_EQ(e.exit_code, 2) << e.err;
  EXPECT_NE(e.err.find("--set model.init_exclude=[\"head\"]: model.init_exclude is set but model.init_checkpoint is not"), std::string::npos) << e.err;
}

// Sharded stage 3 on 2 CPU ranks: each rank keeps its shards of the whole state it read.
TEST(InitCheckpointRanks, ShardedStage3StartsFromTheWholeWeights) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir pretrain("init_ckpt"), sharded("init_ckpt");
  write_file(pretrain / "run.toml", mlp_run(4));
  run_engine_ok(pretrain, {"run.toml"});
  start(sharded, 4, {"--set", "model.init_checkpoint=\"" + last_checkpoint(pretrain).string() + "\"", "--plugins", "sharded", "--set",
                     "sharded.stage=3", "--set", "sharded.timeout=60.0", "--set", "trainer.devices=2", "--set", "data.batch_size=8"});
  EXPECT_LE(max_weight_difference(last_checkpoint(pretrain), last_checkpoint(sharded)), 1e-12);
}

// A sharded directory under sharded: each rank reads its shards of the weights from the parts (here
// on 3 ranks from a 2-rank directory) and the optimizer stays this run's own, of another kind than
// the directory's: the run ends bit for bit where the same run from the consolidated file does.
// With init_exclude, a head for other classes keeps this run's initial values (the parts hold it in
// another shape) and the body comes from the parts; without it, the head's shape is one line naming
// init_exclude. Under a strategy that cannot read the parts it is one line naming
// `engine checkpoint consolidate`.
TEST(InitCheckpointRanks, ShardedDirectoryStartsLikeItsConsolidatedFile) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir pretrain("init_ckpt"), from_dir("init_ckpt"), from_file("init_ckpt");
  const std::vector<std::string> sharded = {"--plugins", "sharded", "--set", "sharded.stage=3", "--set", "sharded.timeout=60.0",
                                            "--set", "data.batch_size=8"};
  write_file(pretrain / "run.toml", mlp_run(4) + "momentum = 0.9\n");
  auto args = sharded;
  args.insert(args.end(), {"run.toml", "--set", "trainer.devices=2", "--set", "sharded.state_dict_type=\"sharded\""});
  run_engine_ok(pretrain, args, 240);
  const fs::path dir = last_checkpoint(pretrain);
  ASSERT_TRUE(ember::engine::is_sharded_checkpoint(dir)) << dir;
  const fs::path file = from_file / "pretrained.ckpt";
  const auto c = run_engine({"checkpoint", "consolidate", dir.string(), file.string()}, pretrain.path(), {}, 120);
  ASSERT_EQ(c.exit_code, 0) << c.err;
  auto finetune = [&](const TempDir& where, const fs::path& from) {
    write_file(where / "run.toml", mlp_run(4));
    auto a = sharded;
    a.insert(a.end(), {"run.toml", "--set", "trainer.devices=3", "--set", "trainer.max_epochs=1", "--set", "optimizer.name=\"adam\"",
                       "--set", "optimizer.lr=0.01", "--set", "model.init_checkpoint=\"" + from.string() + "\""});
    return run_engine_ok(where, a, 240);
  };
  const auto r = finetune(from_dir, dir);
  EXPECT_NE(r.err.find("read the model's part of"), std::string::npos) << r.err;
  finetune(from_file, file);
  expect_identical_weights(last_checkpoint(from_dir), last_checkpoint(from_file));
  EXPECT_GT(max_weight_difference(last_checkpoint(pretrain), last_checkpoint(from_dir)), 1e-4) << "the fine-tuning trained";

  TempDir single("init_ckpt");
  write_file(single / "run.toml", mlp_run(4));
  auto e = run_engine({"run.toml", "--set", "model.init_checkpoint=\"" + dir.string() + "\""}, single.path(), {}, 120);
  EXPECT_NE(e.exit_code, 0);
  EXPECT_NE(e.err.find("is a sharded checkpoint directory, which strategy 'single_device' cannot start from: start under one that can "
                       "(--plugins sharded or offload), or make one file of it first (engine checkpoint consolidate " + dir.string() +
                       " OUT.ckpt)"),
            std::string::npos)
      << e.err;

  // A 3-class head on the 4-class body, on 3 ranks; steps that cannot move a weight (start()).
  TempDir headed("init_ckpt"), fresh("init_ckpt"), refused("init_ckpt");
  auto on_three = sharded;
  on_three.insert(on_three.end(), {"--set", "trainer.devices=3"});
  auto with_init = on_three;
  with_init.insert(with_init.end(), {"--set", "model.init_checkpoint=\"" + dir.string() + "\""});
  auto excluding = with_init;
  excluding.insert(excluding.end(), {"--set", "model.init_exclude=[\"head\"]"});
  const auto h = start(headed, 3, excluding);
  EXPECT_NE(h.err.find("except 2 tensors that keep their initial values here (e.g. 'head."), std::string::npos) << h.err;
  start(fresh, 3, on_three);
  EXPECT_LE(part_difference(file, last_checkpoint(headed), "fc1."), 1e-12);
  EXPECT_LE(part_difference(last_checkpoint(fresh), last_checkpoint(headed), "head."), 1e-12);
  EXPECT_GT(part_difference(last_checkpoint(fresh), last_checkpoint(headed), "fc1."), 1e-3);
  write_file(refused / "run.toml", mlp_run(3));
  with_init.push_back("run.toml");
  e = run_engine(with_init, refused.path(), {}, 240);
  EXPECT_EQ(e.exit_code, 1) << e.err;
  EXPECT_NE(e.err.find("checkpoint " + dir.string() + ": 'head.weight' has shape [4, 8] but the model's is [3, 8] (was it saved from a "
                       "model with other settings?); list what this model has anew (a head for other classes) in [model] init_exclude"),
            std::string::npos)
      << e.err;
}
