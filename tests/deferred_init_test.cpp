// Deferred initialisation (ember/deferred_init.h) on CPU ranks over loopback: under sharded stage 3
// and offload every rank builds the model one piece at a time and keeps only its shard. Checked:
// the initial weights are single_device's and training ends where single_device ends; a rank's
// host memory peak while the model is built and set up is half the model plus one layer (and the
// whole model without deferral, so the measure sees it), and a quarter of it plus one layer on 2
// pipeline stages x 2 shards (built once for the shapes first), and half of it plus one layer on
// ddp's 2 stages and on ddp's 2 tensor-parallel ranks; a dtype-changing precision (64-true)
// under offload; ranks whose model initialisation differs are stopped in one line, and train with
// deferral off.
#include <gtest/gtest.h>

#include <functional>
#include <regex>
#include <string>
#include <vector>

#include "checkpoint_support.h"
#include "mesh_support.h"
#include "support.h"

using namespace ember::test;

namespace {

class DeferredInit : public ::testing::Test {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};

// Every match of `pattern`'s first group, as numbers (one per rank for a per-rank line).
std::vector<double> all_in_log(const std::string& text, const std::string& pattern) {
  std::vector<double> out;
  std::regex re(pattern);
  for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) out.push_back(std::stod((*it)[1].str()));
  return out;
}

// The transformer mesh run (4 layers) under sharded stage 3 on `ranks` ranks with the same
// global batch (12), or under single_device with ranks = 0.
ProcessResult transformer_run(const TempDir& dir, int ranks, std::vector<std::string> extra = {}) {
  write_file(dir / "run.toml", transformer_mesh_toml(4));
  std::vector<std::string> args = {"run.toml"};
  if (ranks > 0)
    args = {"--plugins", "sharded", "run.toml", "--set", "sharded.timeout=60.0", "--set", "trainer.devices=" + std::to_string(ranks),
            "--set", "data.batch_size=" + std::to_string(12 / ranks)};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args);
}

// Each rank's "this rank kept K of their N elements": the K add up to N.
void expect_every_element_kept_once(const ProcessResult& r, size_t ranks) {
  const auto kept = all_in_log(r.err, R"(this rank kept (\d+) of their \d+ elements)");
  const auto whole = all_in_log(r.err, R"(this rank kept \d+ of their (\d+) elements)");
  ASSERT_EQ(kept.size(), ranks) << r.err;
  double sum = 0;
  for (double k : kept) sum += k;
  EXPECT_EQ(sum, whole.front()) << r.err;
  EXPECT_GT(whole.front(), 0);
}

// 16 encoder layers of width 512 (feed-forward 2048): 3,152,384 parameters each, 12.6 MB in
// float32; 202 MB in all. One optimizer step, no checkpoint: the set-up is what is measured.
std::string big_transformer_toml(int num_train, int batch_size) {
  return R"([trainer]
accelerator = "cpu"
max_steps = 1
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
[model]
name = "transformer"
d_model = 512
nhead = 4
dim_feedforward = 2048
num_layers = 16
dropout = 0.0
num_classes = 4
[data]
name = "synthetic"
shape = [2, 512]
num_classes = 4
num_train = )" + std::to_string(num_train) + R"(
num_val = 4
num_test = 0
batch_size = )" + std::to_string(batch_size) + R"(
[optimizer]
name = "sgd"
lr = 0.01
)";
}
constexpr double kBigLayerElements = 3 * 512 * 512 + 3 * 512 + 512 * 512 + 512 + 2 * 512 * 2048 + 2048 + 512 + 4 * 512;

// Under tensor parallelism the tensor-parallel ranks each hold a slice model ("this rank holds H
// of their N elements" after the plan; H is the same on every rank): its shards, over the
// data-parallel ranks, add up to H, so the ranks' kept elements add up to tp x H.
void expect_every_slice_element_kept_once(const ProcessResult& r, size_t ranks, int tp) {
  const auto kept = all_in_log(r.err, R"(this rank kept (\d+) of their \d+ elements)");
  const auto held = all_in_log(r.err, R"(tensor-parallel plan split \d+ of \d+ parameters; this rank holds (\d+) of their)");
  ASSERT_EQ(kept.size(), ranks) << r.err;
  ASSERT_EQ(held.size(), ranks) << r.err;
  double sum = 0;
  for (double k : kept) sum += k;
  EXPECT_EQ(sum, tp * held.front()) << r.err;
  EXPECT_GT(held.front(), 0);
}

// The 16-layer model's set-up peaks (big_transformer_toml) with `args` (engine arguments before
// run.toml), deferred and built whole (`whole_switch` turns deferral off): on each of `ranks`
// ranks the deferred peak is within the rank's share (`share_mb` of the deferred run and the
// model's MB) + one layer + a fixed 24 MB, and built whole at least the whole model (so the
// measure sees it). Returns both runs for further checks.
std::pair<ProcessResult, ProcessResult> expect_setup_peaks(const std::vector<std::string>& args, const std::string& toml, size_t ranks,
                                                           const std::string& whole_switch,
                                                           const std::function<double(const ProcessResult&, double)>& share_mb) {
  auto peaks = [&](const TempDir& dir, std::vector<std::string> extra) {
    write_file(dir / "run.toml", toml);
    std::vector<std::string> a = args;
    a.push_back("run.toml");
    a.insert(a.end(), extra.begin(), extra.end());
    auto run = run_engine_ok(dir, a);
    return std::make_pair(all_in_log(run.err, R"(model set-up: host memory peak \+([0-9.]+) MB)"), run);
  };
  TempDir deferred_dir("deferred"), whole_dir("deferred");
  const auto [deferred, rd] = peaks(deferred_dir, {});
  const auto [whole, rw] = peaks(whole_dir, {"--set", whole_switch});
  EXPECT_EQ(deferred.size(), ranks) << rd.err;
  EXPECT_EQ(whole.size(), ranks) << rw.err;
  const auto model = all_in_log(rd.err, R"(this rank kept \d+ of their (\d+) elements)");
  EXPECT_FALSE(model.empty()) << rd.err;
  if (model.empty()) return {rd, rw};
  const double mb = 1024.0 * 1024.0, model_mb = model.front() * 4 / mb, layer_mb = kBigLayerElements * 4 / mb;
  const double bound = share_mb(rd, model_mb) + layer_mb + 24.0;
  for (double p : deferred) EXPECT_LE(p, bound) << "model " << model_mb << " MB, layer " << layer_mb << " MB\n" << rd.err;
  for (double p : whole) EXPECT_GE(p, model_mb) << rw.err;
  return {rd, rw};
}

// Deferred initialisation over 2 tensor-parallel ranks (`mesh`: engine arguments before run.toml,
// `ranks` in all, `shards` data-parallel ranks sharding each slice, 1 for ddp): the plan, run on
// the shapes build, says which parameters are split, and each rank keeps its part of its slice of
// those as the model is built. single_device's initial weights (the runs train at a learning rate
// of 1e-30); every slice element kept by one rank; a host peak at set-up within the rank's part
// of its slice model (which holds the norms, biases and head whole) plus one layer, and the whole
// model when built whole. `small` and `big_batch`: the batch arguments of the two models' runs.
void expect_tensor_parallel_deferral(const std::vector<std::string>& mesh, size_t ranks, int shards, const std::string& whole_switch,
                                     const std::vector<std::string>& small, int big_batch) {
  TempDir single_init("deferred"), split_init("deferred");
  transformer_run(single_init, 0, {"--set", "optimizer.lr=1e-30"});
  write_file(split_init / "run.toml", transformer_mesh_toml(4));
  std::vector<std::string> args = mesh;
  for (const char* a : {"run.toml", "--set", "optimizer.lr=1e-30"}) args.push_back(a);
  args.insert(args.end(), small.begin(), small.end());
  auto r = run_engine_ok(split_init, args);
  EXPECT_NE(r.err.find("deferred initialisation: the model was built once for its shapes"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(single_init), last_checkpoint(split_init)), 1e-20);
  expect_every_slice_element_kept_once(r, ranks, 2);
  const auto [rd, rw] = expect_setup_peaks(mesh, big_transformer_toml(16, big_batch), ranks, whole_switch,
                                           [shards](const ProcessResult& run, double) {
                                             const auto slice = all_in_log(run.err, R"(this rank holds (\d+) of their \d+ elements)");
                                             EXPECT_FALSE(slice.empty()) << run.err;
                                             return slice.empty() ? 0.0 : slice.front() * 4 / (1024.0 * 1024.0) / shards;
                                           });
  expect_every_slice_element_kept_once(rd, ranks, 2);
}

}  // namespace

TEST_F(DeferredInit, ShardedRanksStartFromSingleDeviceWeightsAndTrainTheSame) {
  // A learning rate of 1e-30 moves no weight by more than 1e-29: the checkpoints hold the initial
  // weights (a wrong cut, offset or draw order differs by ~1e-2).
  TempDir single_init("deferred"), sharded_init("deferred");
  transformer_run(single_init, 0, {"--set", "optimizer.lr=1e-30"});
  auto r = transformer_run(sharded_init, 2, {"--set", "optimizer.lr=1e-30"});
  EXPECT_LE(max_weight_difference(last_checkpoint(single_init), last_checkpoint(sharded_init)), 1e-20);
  EXPECT_EQ(all_in_log(r.err, R"(deferred initialisation: (\d+) of \d+ parameters taken as the model was built)").size(), 2u) << r.err;
  expect_every_element_kept_once(r, 2);

  // AdamW, clipping by norm, accumulation 2, two epochs: single_device's weights on 3 ranks.
  TempDir single("deferred"), sharded("deferred");
  transformer_run(single, 0);
  auto r3 = transformer_run(sharded, 3);
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(sharded)), 1e-5);
  expect_every_element_kept_once(r3, 3);
}

TEST_F(DeferredInit, HostPeakAtSetupIsTheShardAndOneLayer) {
  // Half the model, one layer being built, and a fixed allowance for what else the set-up takes.
  const auto [r, rw] = expect_setup_peaks({"--plugins", "sharded", "--set", "sharded.timeout=60.0", "--set", "trainer.devices=2"},
                                          big_transformer_toml(8, 2), 2, "sharded.deferred_init=false",
                                          [](const ProcessResult&, double model_mb) { return model_mb / 2; });
  EXPECT_EQ(rw.err.find("deferred initialisation:"), std::string::npos) << rw.err;
}

// Pipeline stages x ZeRO-3 (2 x 2 on 4 ranks): the model is built once for its shapes, then again
// with each rank keeping its shard of its own stage's pieces only. The initial weights are
// single_device's, every element is kept by exactly one rank, and a rank's host peak at set-up is
// a quarter of the model plus one layer (the whole model when built whole).
TEST_F(DeferredInit, PipelineStagesKeepTheirShardOfTheirStagesOnly) {
  const std::vector<std::string> mesh = {"--set", "trainer.devices=4", "--set", "parallelism.pipeline_parallel=2", "--set",
                                         "parallelism.microbatches=2", "--set", "data.batch_size=6"};
  TempDir single_init("deferred"), staged_init("deferred");
  transformer_run(single_init, 0, {"--set", "optimizer.lr=1e-30"});
  write_file(staged_init / "run.toml", transformer_mesh_toml(4));
  std::vector<std::string> args = {"--plugins", "sharded", "run.toml", "--set", "sharded.timeout=60.0", "--set", "optimizer.lr=1e-30"};
  for (const auto& a : mesh) args.push_back(a);
  auto r = run_engine_ok(staged_init, args);
  EXPECT_NE(r.err.find("deferred initialisation: the model was built once for its shapes; built again, each rank keeps only its part"),
            std::string::npos)
      << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(single_init), last_checkpoint(staged_init)), 1e-20);
  expect_every_element_kept_once(r, 4);

  // 16 layers of width 512 (202 MB), as above, on 2 stages x 2 shards.
  const auto [rd, rw] = expect_setup_peaks({"--plugins", "sharded", "--set", "sharded.timeout=60.0", "--set", "trainer.devices=4", "--set",
                                            "parallelism.pipeline_parallel=2", "--set", "data.batch_size=2"},
                                           big_transformer_toml(16, 2), 4, "sharded.deferred_init=false",
                                           [](const ProcessResult&, double model_mb) { return model_mb / 4; });
  expect_every_element_kept_once(rd, 4);
}

// 2D: 2 shards x 2 tensor-parallel ranks. The plan, run on the shapes build, says which
// parameters are split; each rank keeps its ZeRO chunk of its slice of those as the model is built.
// single_device's initial weights; every element kept by one rank; a quarter of the model plus
// one layer at set-up.
TEST_F(DeferredInit, TensorParallelRanksKeepTheirShardOfTheirSlices) {
  // A rank keeps half its slice model (2 shards): about a quarter of the model.
  expect_tensor_parallel_deferral({"--plugins", "sharded", "--set", "sharded.timeout=60.0", "--set", "trainer.devices=4", "--set",
                                   "parallelism.tensor_parallel=2"},
                                  4, 2, "sharded.deferred_init=false", {"--set", "data.batch_size=6"}, 2);
}

// ddp's stages (2 ranks, each a stage): the same shapes build, each rank keeping its stage's
// parameters whole. single_device's initial weights, and a host peak of half the model plus one
// layer (the whole model when built whole).
TEST_F(DeferredInit, DdpStagesKeepTheirStagesOnly) {
  const std::vector<std::string> mesh = {"--plugins", "ddp", "--set", "ddp.timeout=60.0", "--set", "trainer.devices=2",
                                         "--set", "parallelism.pipeline_parallel=2", "--set", "parallelism.microbatches=2"};
  TempDir single_init("deferred"), staged_init("deferred");
  transformer_run(single_init, 0, {"--set", "optimizer.lr=1e-30"});
  write_file(staged_init / "run.toml", transformer_mesh_toml(4));
  std::vector<std::string> args = mesh;
  for (const char* a : {"run.toml", "--set", "optimizer.lr=1e-30"}) args.push_back(a);
  auto r = run_engine_ok(staged_init, args);
  EXPECT_NE(r.err.find("deferred initialisation: the model was built once for its shapes"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(single_init), last_checkpoint(staged_init)), 1e-20);
  expect_every_element_kept_once(r, 2);

  expect_setup_peaks(mesh, big_transformer_toml(16, 4), 2, "ddp.deferred_init=false",
                     [](const ProcessResult&, double model_mb) { return model_mb / 2; });
}

// ddp over 2 tensor-parallel ranks: the plan, run on the shapes build, says which parameters are
// split; each rank keeps its slice of those (and the others whole) as the model is built.
// single_device's initial weights, every slice element kept by one rank, and a host peak of the
// slice model plus one layer at set-up (the whole model when built whole).
TEST_F(DeferredInit, DdpTensorParallelRanksKeepTheirSlicesOnly) {
  expect_tensor_parallel_deferral({"--plugins", "ddp", "--set", "ddp.timeout=60.0", "--set", "trainer.devices=2", "--set",
                                   "parallelism.tensor_parallel=2"},
                                  2, 1, "ddp.deferred_init=false", {}, 4);
}

TEST_F(DeferredInit, OffloadTakesThePiecesInThePrecisionsDtype) {
  // 64-true converts the parameters to float64: the pieces are kept in float64 as they are built,
  // and the offloaded masters (float64) train bit for bit as they do when the model is built
  // whole, and as single_device does (offload's host step is 9e-9 away in float64 either way).
  TempDir single("deferred"), deferred("deferred"), whole("deferred");
  transformer_run(single, 0, {"--set", "trainer.precision=\"64-true\""});
  auto offload = [](const TempDir& dir, bool defer) {
    write_file(dir / "run.toml", transformer_mesh_toml(4));
    return run_engine_ok(dir, {"--plugins", "offload", "run.toml", "--set", "offload.timeout=60.0", "--set", "trainer.devices=2", "--set",
                               "data.batch_size=6", "--set", "offload.offload_params=true", "--set", "trainer.precision=\"64-true\"",
                               "--set", std::string("offload.deferred_init=") + (defer ? "true" : "false")});
  };
  auto r = offload(deferred, true);
  offload(whole, false);
  expect_every_element_kept_once(r, 2);
  expect_identical_weights(last_checkpoint(whole), last_checkpoint(deferred));
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(deferred)), 1e-5);
}

TEST_F(DeferredInit, RanksThatBuildDifferentValuesStopInOneLine) {
  const std::string run = R"([trainer]
accelerator = "cpu"
max_epochs = 1
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "bn_mlp"
input_size = 16
hidden = 8
num_classes = 4
rank_dependent_init = true
[data]
name = "synthetic"
shape = [16]
num_classes = 4
num_train = 32
num_val = 8
num_test = 0
batch_size = 8
[optimizer]
name = "sgd"
lr = 0.1
)";
  TempDir dir("deferred");
  write_file(dir / "run.toml", run);
  const std::vector<std::string> args = {"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", "sharded",
                                         "--set", "sharded.timeout=60.0", "--set", "trainer.devices=2"};
  auto r = run_engine(args, dir.path());
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.err.find("deferred initialisation: the ranks built different initial values"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("sharded.deferred_init = false"), std::string::npos) << r.err;
  // Built whole, every rank takes rank 0's values: the same model trains.
  auto args_whole = args;
  args_whole.insert(args_whole.end(), {"--set", "sharded.deferred_init=false"});
  TempDir whole("deferred");
  write_file(whole / "run.toml", run);
  auto ok = run_engine(args_whole, whole.path());
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}
