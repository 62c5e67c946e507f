// Pipeline parallelism (docs/parallelism.md): the schedules' orders in process (every stage's
// forward and backward of every micro-batch once, no deadlock, the bubble theory predicts), the
// stage balance, and on CPU ranks over loopback the transformer cut into stages under ddp with
// each schedule, with tensor and data parallelism (2 x 2 of each pair), and under sharded and
// offload (ZeRO 1-3 per stage; 3D: 2 x 2 x 2 on 8 ranks), ending with single_device's weights for
// the same global batch (AdamW, gradient clipping, accumulation 2); checkpoints resume across
// pipeline shapes and strategies; a pipeline that cannot work is one line and nothing starts.
#include <gtest/gtest.h>

#include <ember/distributed/pipeline_schedule.h>

#include <map>
#include <set>
#include <tuple>

#include "checkpoint_support.h"
#include "mesh_support.h"
#include "support.h"

using namespace ember::test;
using ember_dist::PipelineScheduleKind;

namespace {

// Four encoder layers (tensor_parallel_test.cpp's run has two): stages of 2, or 4 of 1.
const std::string kRun = transformer_mesh_toml(4);

ProcessResult single(const TempDir& dir, std::vector<std::string> extra = {}) {
  write_file(dir / "run.toml", kRun);
  std::vector<std::string> args = {"run.toml"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args);
}

// `strategy` on `ranks` CPU ranks cut into `pp` pipeline stages (x tp tensor-parallel); the
// data-parallel ranks (replicas under ddp, shards under sharded and offload) share the global batch of 12.
ProcessResult staged(const TempDir& dir, const std::string& strategy, int ranks, int pp, int tp, std::vector<std::string> extra = {}) {
  write_file(dir / "run.toml", kRun);
  std::vector<std::string> args = {"--plugins", strategy, "run.toml", "--set", strategy + ".timeout=120.0",
                                   "--set", "trainer.devices=" + std::to_string(ranks),
                                   "--set", "parallelism.pipeline_parallel=" + std::to_string(pp),
                                   "--set", "parallelism.tensor_parallel=" + std::to_string(tp),
                                   "--set", "data.batch_size=" + std::to_string(12 / (ranks / (pp * tp)))};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args);
}
ProcessResult pipeline(const TempDir& dir, int ranks, int pp, int tp, std::vector<std::string> extra = {}) {
  return staged(dir, "ddp", ranks, pp, tp, std::move(extra));
}

class Pipeline : public ::testing::Test {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};

std::vector<std::string> column(const TempDir& dir, const std::string& name) { return metric_column(dir, name); }

}  // namespace

// Every order runs each stage's forward and backward of each micro-batch exactly once, on the
// rank that holds the stage, and completes when sends are buffered and receives wait.
TEST(PipelineSchedules, EveryOrderRunsEachStepOnceWithoutDeadlock) {
  for (auto kind : {PipelineScheduleKind::gpipe, PipelineScheduleKind::one_f_one_b, PipelineScheduleKind::interleaved_1f1b})
    for (int64_t p : {1, 2, 3, 4})
      for (int64_t m = 1; m <= 9; ++m)
        for (int64_t v : {1, 2, 3}) {
          const bool interleaved = kind == PipelineScheduleKind::interleaved_1f1b;
          if ((v > 1) != interleaved || (interleaved && m % p != 0)) continue;
          const auto schedule = ember_dist::pipeline_schedule(kind, p, m, v);
          const std::string where = std::string(ember_dist::schedule_name(kind)) + " p=" + std::to_string(p) + " m=" +
                                    std::to_string(m) + " v=" + std::to_string(v);
          ASSERT_EQ(static_cast<int64_t>(schedule.size()), p) << where;
          std::set<std::tuple<bool, int64_t, int64_t>> seen;
          for (int64_t r = 0; r < p; ++r)
            for (const auto& a : schedule[static_cast<size_t>(r)]) {
              EXPECT_EQ(a.stage % p, r) << where;
              EXPECT_TRUE(seen.insert({a.backward, a.microbatch, a.stage}).second) << where << ": twice";
            }
          EXPECT_EQ(static_cast<int64_t>(seen.size()), 2 * m * p * v) << where;
          const auto sim = ember_dist::simulate_pipeline(schedule, m, v, 1.0, 1.0);
          EXPECT_FALSE(sim.deadlock) << where;
          if (!interleaved) {
            // Forward and backward of equal cost: the bubble is exactly (p - 1) / (m + p - 1).
            EXPECT_NEAR(sim.bubble, ember_dist::theoretical_bubble(kind, p, m, v), 1e-12) << where;
            // GPipe keeps every micro-batch's activations; 1F1B at most p of them.
            EXPECT_EQ(sim.peak_alive, kind == PipelineScheduleKind::gpipe ? m : std::min(p, m)) << where;
          }
        }
}

// Interleaving shrinks the bubble (a stage per rank and chunk costs 1 / v of the rank's layers).
TEST(PipelineSchedules, InterleavingShrinksTheBubble) {
  const int64_t p = 4, m = 8;
  const auto plain = ember_dist::simulate_pipeline(ember_dist::pipeline_schedule(PipelineScheduleKind::one_f_one_b, p, m, 1), m, 1, 1.0, 2.0);
  for (int64_t v : {2, 4}) {
    const auto inter = ember_dist::simulate_pipeline(ember_dist::pipeline_schedule(PipelineScheduleKind::interleaved_1f1b, p, m, v), m, v,
                                                     1.0 / static_cast<double>(v), 2.0 / static_cast<double>(v));
    ASSERT_FALSE(inter.deadlock);
    EXPECT_LT(inter.bubble, plain.bubble) << "v=" << v;
    EXPECT_NEAR(inter.bubble, ember_dist::theoretical_bubble(PipelineScheduleKind::interleaved_1f1b, p, m, v), 0.02) << "v=" << v;
  }
  EXPECT_NEAR(plain.bubble, 3.0 / 11.0, 1e-12);
}

// The simulator does catch an order that cannot complete: rank 1 waits for micro-batch 1's
// forward, which rank 0 runs only after micro-batch 0's backward, which needs rank 1.
TEST(PipelineSchedules, AnOrderThatWaitsOnItselfDeadlocks) {
  using A = ember_dist::PipelineAction;
  const std::vector<std::vector<A>> bad = {{{false, 0, 0}, {true, 0, 0}, {false, 1, 0}, {true, 1, 0}},
                                           {{false, 1, 1}, {false, 0, 1}, {true, 0, 1}, {true, 1, 1}}};
  EXPECT_TRUE(ember_dist::simulate_pipeline(bad, 2, 1).deadlock);
}

TEST(PipelineSchedules, StagesAreBalancedByWeight) {
  EXPECT_EQ(ember_dist::balance_stages({1, 1, 1, 1}, 2), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(ember_dist::balance_stages({5, 1, 1, 1, 1, 1}, 2), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(ember_dist::balance_stages({1, 1, 1, 1, 4}, 2), (std::vector<int64_t>{4, 1}));
  EXPECT_EQ(ember_dist::balance_stages({2, 2, 2, 2, 2, 2}, 3), (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(ember_dist::balance_stages({7, 7, 7}, 3), (std::vector<int64_t>{1, 1, 1}));
}

// Two ranks as two stages, each schedule (interleaved: two stages per rank, four in all), end
// where single_device ends, and validate as it does.
TEST_F(Pipeline, TwoStagesWithEachScheduleMatchSingleDevice) {
  TempDir one("pipeline");
  single(one);
  struct Case {
    std::vector<std::string> settings;
    std::string stages;
  };
  const std::vector<Case> cases = {
      {{"--set", "parallelism.schedule=\"gpipe\"", "--set", "parallelism.microbatches=4"},
       "pipeline stage 1 of 2 [layer3..layer4]; gpipe over 4 micro-batches"},
      {{"--set", "parallelism.schedule=\"1f1b\"", "--set", "parallelism.microbatches=3"},
       "pipeline stage 1 of 2 [layer3..layer4]; 1f1b over 3 micro-batches"},
      {{"--set", "parallelism.schedule=\"interleaved_1f1b\"", "--set", "parallelism.virtual_stages=2", "--set", "parallelism.microbatches=4"},
       "pipeline stages 1 of 4 [layer2], 3 of 4 [layer4]; interleaved_1f1b over 4 micro-batches"},
  };
  for (const auto& c : cases) {
    TempDir dir("pipeline");
    auto r = pipeline(dir, 2, 2, 1, c.settings);
    EXPECT_NE(r.err.find("ddp: device mesh 2 (pipeline) x 1 (data parallel) x 1 (tensor parallel)"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.stages), std::string::npos) << r.err;
    // 2 epochs of 8 batches, each through the schedule; the time waiting for the other stage is measured.
    EXPECT_NE(r.err.find("; pipeline: 16 training batches, "), std::string::npos) << r.err;
    EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(dir)), 1e-5) << c.stages;
    EXPECT_EQ(column(one, "val_acc"), column(dir, "val_acc")) << c.stages;
    EXPECT_EQ(column(one, "val_acc").size(), 2u);
    // The loss every rank logs is the batch's (the last stage's, sent to the others).
    const auto a = column(one, "train_loss_step"), b = column(dir, "train_loss_step");
    ASSERT_EQ(a.size(), b.size()) << c.stages;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(std::stod(a[i]), std::stod(b[i]), 1e-5) << c.stages << " step " << i;
  }
}

// An epoch's short last batch (90 samples in batches of 12: the last has 6) runs as 6 micro-batches
// where the others run 8, and the run still ends where single_device does.
TEST_F(Pipeline, AShortLastBatchRunsFewerMicroBatches) {
  TempDir one("pipeline"), pp("pipeline");
  single(one, {"--set", "data.num_train=90"});
  pipeline(pp, 2, 2, 1, {"--set", "data.num_train=90", "--set", "parallelism.schedule=\"gpipe\"", "--set", "parallelism.microbatches=8"});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(pp)), 1e-5);
}

// Full activation checkpointing recomputes every unit in backward. The transformer's first unit
// takes the data, which needs no gradient: its layers must train all the same (they did not
// before: the recomputed unit's output left the graph). single_device with it ends where it ends
// without it, and so do 2 stages (stage 0 holds only layers whose first input is the data).
TEST_F(Pipeline, FullActivationCheckpointingTrainsEveryStage) {
  TempDir none("pipeline"), full("pipeline"), pp("pipeline");
  single(none);
  const std::vector<std::string> recompute = {"--set", "trainer.activation_checkpointing=\"full\""};
  auto r = single(full, recompute);
  EXPECT_NE(r.err.find("activation checkpointing: full (4 units recomputed in backward"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(none), last_checkpoint(full)), 1e-6);
  pipeline(pp, 2, 2, 1, recompute);
  EXPECT_LE(max_weight_difference(last_checkpoint(none), last_checkpoint(pp)), 1e-5);
}

// Four ranks: 2 stages x 2 tensor-parallel ranks, and 2 stages x 2 data-parallel ranks.
TEST_F(Pipeline, StagesComposeWithTensorAndDataParallelism) {
  TempDir one("pipeline"), pp_tp("pipeline"), pp_dp("pipeline");
  single(one);
  auto r = pipeline(pp_tp, 4, 2, 2, {"--set", "parallelism.microbatches=2"});
  EXPECT_NE(r.err.find("rank 3 is data-parallel rank 0, tensor-parallel rank 1, pipeline rank 1"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(pp_tp)), 1e-5);
  r = pipeline(pp_dp, 4, 2, 1, {"--set", "parallelism.microbatches=2"});
  EXPECT_NE(r.err.find("ddp: device mesh 2 (pipeline) x 2 (data parallel) x 1 (tensor parallel)"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(pp_dp)), 1e-5);
  EXPECT_EQ(column(one, "val_acc"), column(pp_dp, "val_acc"));
}

// 3D with ZeRO: each stage's parameters sharded over its data-parallel ranks, under each ZeRO
// stage and schedule, with tensor parallelism (2 x 2 x 2 on 8 ranks) and hybrid sharding, and
// offloaded to the host; each ends within 1e-5 of single_device (AdamW, clipping, accumulation 2).
TEST_F(Pipeline, StagesComposeWithShardedAndOffload) {
  TempDir one("pipeline");
  single(one);
  struct Case {
    std::string strategy;
    int ranks, tp;
    std::vector<std::string> settings;
    std::string line;
  };
  const std::vector<Case> cases = {
      {"sharded", 4, 1, {"--set", "parallelism.microbatches=2"},
       "sharded: device mesh 2 (pipeline) x 2 (data parallel) x 1 (tensor parallel) (sharded over the data-parallel ranks); rank 3 is "
       "data-parallel rank 1, tensor-parallel rank 0, pipeline rank 1"},
      {"sharded", 4, 1, {"--set", "sharded.stage=1", "--set", "parallelism.schedule=\"gpipe\"", "--set", "parallelism.microbatches=4"},
       "sharded: pipeline stage 1 of 2 [layer3..layer4]; gpipe over 4 micro-batches"},
      {"sharded", 4, 1,
       {"--set", "sharded.stage=2", "--set", "parallelism.schedule=\"interleaved_1f1b\"", "--set", "parallelism.virtual_stages=2", "--set",
        "parallelism.microbatches=2"},
       "sharded: pipeline stages 1 of 4 [layer2], 3 of 4 [layer4]; interleaved_1f1b over 2 micro-batches"},
      {"offload", 4, 1, {"--set", "offload.offload_params=true", "--set", "parallelism.microbatches=3"},
       "offload: pipeline stage 0 of 2 [layer1..layer2]; 1f1b over 3 micro-batches"},
      {"sharded", 8, 2, {"--set", "parallelism.microbatches=2"},
       "sharded: device mesh 2 (pipeline) x 2 (data parallel) x 2 (tensor parallel) (sharded over the data-parallel ranks); rank 7 is "
       "data-parallel rank 1, tensor-parallel rank 1, pipeline rank 1"},
      {"sharded", 8, 1, {"--set", "parallelism.data_parallel_replicate=2", "--set", "parallelism.microbatches=3"},
       "sharded: hybrid sharding, device mesh 2 (pipeline) x 2 (data parallel, replicas) x 2 (data parallel, shards) x 1 (tensor parallel)"},
  };
  for (const auto& c : cases) {
    TempDir dir("pipeline");
    auto r = staged(dir, c.strategy, c.ranks, 2, c.tp, c.settings);
    EXPECT_NE(r.err.find(c.line), std::string::npos) << r.err;
    // Every stage's gradients were reduce-scattered once a window (8 windows of 2 batches), and
    // the pipeline's own statistics close the run.
    EXPECT_NE(r.err.find("; pipeline: 16 training batches, "), std::string::npos) << r.err;
    EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(dir)), 1e-5) << c.line;
    // (The step loss rank 0 logs is its data-parallel share's, as under ddp; validation is reduced.)
    EXPECT_EQ(column(one, "val_acc"), column(dir, "val_acc")) << c.line;
  }
  // Mixed precision: within the tolerance the sharded tests use.
  const std::vector<std::string> fp16 = {"--set", "trainer.precision=\"16-mixed\""};
  TempDir one16("pipeline"), zero16("pipeline");
  single(one16, fp16);
  staged(zero16, "sharded", 4, 2, 1, fp16);
  EXPECT_LE(max_weight_difference(last_checkpoint(one16), last_checkpoint(zero16)), 0.03);
}

// A checkpoint written by ZeRO stages resumes under single_device, one from single_device on ZeRO
// stages, and one from 2 stages x 2 tensor-parallel ranks under offload's 2 stages x 2 shards.
TEST_F(Pipeline, ShardedStagesCheckpointsResumeAcrossMeshes) {
  TempDir one("pipeline"), from_zero("pipeline"), to_zero("pipeline"), reshaped("pipeline");
  single(one);
  staged(from_zero, "sharded", 4, 2, 1, {"--set", "trainer.max_epochs=1"});
  single(from_zero, {"--resume", last_checkpoint(from_zero).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(from_zero, 1)), 1e-5);
  single(to_zero, {"--set", "trainer.max_epochs=1"});
  staged(to_zero, "sharded", 4, 2, 1, {"--resume", last_checkpoint(to_zero).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(to_zero, 1)), 1e-5);
  staged(reshaped, "sharded", 4, 2, 2, {"--set", "trainer.max_epochs=1"});
  staged(reshaped, "offload", 4, 2, 1, {"--set", "offload.offload_params=true", "--resume", last_checkpoint(reshaped).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(reshaped, 1)), 1e-5);
}

// state_dict_type = "sharded" under a mesh: each rank writes its part of its stages' slices and
// shards, nothing gathered, and the directory resumes under other meshes: 2 stages x 2
// tensor-parallel ranks as 2 stages x 2 shards (slices matched by their place in the whole
// tensors), as plain ZeRO over 2 ranks (the parts keep the optimizer's layout over the whole
// model), and, made one file by `engine checkpoint consolidate`, under single_device; a plain ZeRO
// directory resumes as 2 stages x 2 tensor-parallel ranks. Each ends where the uninterrupted run does.
TEST_F(Pipeline, ShardedDirectoriesResumeAcrossMeshes) {
  TempDir one("pipeline"), dirs("pipeline"), flat("pipeline");
  single(one);
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<std::string> as_dir = {"--set", "sharded.state_dict_type=\"sharded\""};
  staged(dirs, "sharded", 4, 2, 2, with(as_dir, {"--set", "trainer.max_epochs=1"}));
  const auto saved = last_checkpoint(dirs);
  ASSERT_TRUE(std::filesystem::is_directory(saved)) << saved;
  for (int k = 0; k < 4; ++k) EXPECT_TRUE(std::filesystem::exists(saved / ("rank" + std::to_string(k) + ".ckpt"))) << k;
  staged(dirs, "sharded", 4, 2, 1, {"--resume", saved.string()});
  staged(dirs, "sharded", 2, 1, 1, {"--resume", saved.string()});
  run_engine_ok(dirs, {"checkpoint", "consolidate", saved.string(), "whole.ckpt"});
  single(dirs, {"--resume", (dirs / "whole.ckpt").string()});
  for (int version : {1, 2, 3}) EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(dirs, version)), 1e-5) << version;
  staged(flat, "sharded", 2, 1, 1, with(as_dir, {"--set", "trainer.max_epochs=1"}));
  staged(flat, "sharded", 4, 2, 2, {"--resume", last_checkpoint(flat).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(flat, 1)), 1e-5);
}

// The gpt language model cut at its blocks: GPT-2 with its tied embedding (the first stage looks
// tokens up in it, the last multiplies by it: their gradients are summed over the two stages and
// the copy counts once in the norm and the checkpoint), on 2 stages and on 2 stages x 2
// tensor-parallel ranks (a vocabulary-parallel tied embedding), and Llama (untied, grouped-query
// attention) on 2 stages x 2 tensor-parallel ranks, each within 1e-5 of single_device; GPT-2 also
// with model.chunked_loss.
TEST_F(Pipeline, GptCutAtItsBlocksMatchesSingleDevice) {
  struct Case {
    std::string flavour, extra;
    int ranks, tp;
    std::string schedule, strategy = "ddp";
  };
  // The last: GPT-2's tied embedding under ZeRO-3, 2 stages x 2 shards (the copies' whole
  // gradients summed over the stages before they are reduce-scattered).
  // model.chunked_loss: the last stage's loss through ember::linear_cross_entropy (second case);
  // under vocabulary parallelism the vocabulary-parallel cross-entropy instead, which must then
  // equal single_device's chunked loss (third case).
  const std::vector<Case> cases = {{"gpt2", "vocab_size = 48\n", 2, 1, "1f1b"},
                                   {"gpt2", "vocab_size = 48\nchunked_loss = true\n", 2, 1, "1f1b"},
                                   {"gpt2", "vocab_size = 48\nchunked_loss = true\n", 4, 2, "gpipe"},
                                   {"llama", "vocab_size = 48\nkv_heads = 2\ntied = false\n", 4, 2, "1f1b"},
                                   {"gpt2", "vocab_size = 48\n", 4, 1, "1f1b", "sharded"}};
  for (const auto& c : cases) {
    TempDir one("pipeline"), cut("pipeline");
    for (const auto* dir : {&one, &cut}) write_gpt_mesh_run(*dir, c.flavour, 4, c.extra);
    run_engine_ok(one, {"run.toml"});
    const int data_parallel = c.ranks / (2 * c.tp);
    auto r = run_engine_ok(cut, {"--plugins", c.strategy, "run.toml", "--set", c.strategy + ".timeout=60.0", "--set", "trainer.devices=" + std::to_string(c.ranks),
                                 "--set", "parallelism.pipeline_parallel=2", "--set", "parallelism.tensor_parallel=" + std::to_string(c.tp),
                                 "--set", "parallelism.schedule=\"" + c.schedule + "\"", "--set", "parallelism.microbatches=" + std::to_string(4 / data_parallel),
                                 "--set", "data.batch_size=" + std::to_string(8 / data_parallel)});
    const std::string unit = c.flavour == "gpt2" ? "h." : "layers.";
    EXPECT_NE(r.err.find("pipeline stage 1 of 2 [" + unit + "2.." + unit + "3]"), std::string::npos) << r.err;
    EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(cut)), 1e-5) << c.flavour << " tp " << c.tp;
    const auto a = column(one, "val_loss"), b = column(cut, "val_loss");
    ASSERT_GE(a.size(), 2u);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(std::stod(a[i]), std::stod(b[i]), 1e-5) << c.flavour << " tp " << c.tp;
  }
}

// A checkpoint holds the whole model and optimizer whatever the stages: pp = 2 resumes as
// single_device, single_device as pp = 2 x tp = 2, interleaved as gpipe; each ends where the
// uninterrupted run does.
TEST_F(Pipeline, CheckpointsResumeAcrossPipelineShapes) {
  TempDir one("pipeline"), from_pp("pipeline"), to_pp("pipeline"), reshaped("pipeline");
  single(one);
  // Saved in the background: rank 0 holds only the first stage, so the asynchronous save merges
  // the stages' parts (ddp does not offer IDeviceModelState under a pipeline).
  pipeline(from_pp, 2, 2, 1, {"--set", "trainer.max_epochs=1", "--set", "checkpoint.async=true"});
  single(from_pp, {"--resume", last_checkpoint(from_pp).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(from_pp, 1)), 1e-5);
  single(to_pp, {"--set", "trainer.max_epochs=1"});
  pipeline(to_pp, 4, 2, 2, {"--resume", last_checkpoint(to_pp).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(to_pp, 1)), 1e-5);
  pipeline(reshaped, 2, 2, 1,
           {"--set", "trainer.max_epochs=1", "--set", "parallelism.schedule=\"interleaved_1f1b\"", "--set", "parallelism.virtual_stages=2"});
  pipeline(reshaped, 2, 2, 1, {"--set", "parallelism.schedule=\"gpipe\"", "--resume", last_checkpoint(reshaped).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(reshaped, 1)), 1e-5);
}

// 16-mixed scales the last stage's loss; the gradients the other stages receive carry the scale,
// and the non-finite vote goes over every stage.
TEST_F(Pipeline, MixedPrecisionMatchesSingleDeviceWithinTolerance) {
  for (const char* precision : {"16-mixed", "bf16-mixed"}) {
    const std::vector<std::string> mode = {"--set", std::string("trainer.precision=\"") + precision + "\""};
    TempDir one("pipeline"), pp("pipeline");
    single(one, mode);
    pipeline(pp, 2, 2, 1, mode);
    // The tolerance of tensor_parallel_test.cpp's, which another training run exceeds.
    EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(pp)), 0.03) << precision;
  }
}

TEST_F(Pipeline, BadPipelineIsOneLineAndNothingStarts) {
  TempDir dir("pipeline");
  write_file(dir / "run.toml", kRun);
  auto expect_line = [&](std::vector<std::string> args, const std::string& line) {
    args.insert(args.begin(), "run.toml");
    auto r = run_engine(args, dir.path(), {}, 120);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(line), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir / "runs/run/version_0/checkpoints/last.ckpt")) << line;
  };
  const std::vector<std::string> two = {"--plugins", "ddp", "--set", "ddp.timeout=60.0", "--set", "trainer.devices=2", "--set",
                                        "parallelism.pipeline_parallel=2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = two;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  expect_line(with({"--set", "model.num_layers=3", "--set", "parallelism.schedule=\"interleaved_1f1b\"", "--set",
                    "parallelism.virtual_stages=2"}),
              "--set parallelism.pipeline_parallel=2: parallelism.pipeline_parallel = 2 x virtual_stages = 2 = 4 stages, but the model "
              "has 3 units and a stage holds at least one: use at most 3 stages");
  expect_line(with({"--set", "parallelism.schedule=\"interleaved_1f1b\""}),
              "parallelism.virtual_stages = 1 with schedule = \"interleaved_1f1b\": the interleaved schedule needs 2 or more stages per rank");
  expect_line(with({"--set", "parallelism.virtual_stages=2"}), "parallelism.virtual_stages = 2 needs schedule = \"interleaved_1f1b\"");
  expect_line(with({"--set", "parallelism.schedule=\"interleaved_1f1b\"", "--set", "parallelism.virtual_stages=2", "--set",
                    "parallelism.microbatches=3"}),
              "--set parallelism.microbatches=3: parallelism.microbatches = 3 with schedule = \"interleaved_1f1b\" must be a multiple of "
              "pipeline_parallel = 2");
  expect_line(with({"--set", "parallelism.stage_units=[3, 2]"}),
              "--set parallelism.stage_units=[3, 2]: parallelism.stage_units lists 2 stages of 5 units; the run has 2 stages and the "
              "model 4 units");
  expect_line(with({"--set", "parallelism.schedule=\"interleaved_1f1b\"", "--set", "parallelism.virtual_stages=2", "--set", "data.batch_size=1"}),
              "pipeline: a batch of 1 sample cannot feed interleaved_1f1b over 2 ranks, which needs a multiple of 2 micro-batches");
  expect_line({"--plugins", "single_device", "--set", "trainer.devices=2", "--set", "parallelism.pipeline_parallel=2"},
              "parallelism.pipeline_parallel = 2 needs a strategy with a device mesh, and strategy 'single_device' has none");
  expect_line({"--plugins", "ddp", "--set", "trainer.devices=4", "--set", "parallelism.pipeline_parallel=3"},
              "x pipeline_parallel (3) = 3 does not divide trainer.devices (4) x trainer.num_nodes (1) = 4 ranks");
  // A model that cannot be cut.
  write_file(dir / "mlp.toml", synthetic_mlp_toml({.accelerator = "cpu"}));
  auto r = run_engine({"mlp.toml", "--plugins", "ddp", "--set", "ddp.timeout=60.0", "--set", "trainer.devices=2", "--set",
                       "parallelism.pipeline_parallel=2"},
                      dir.path(), {}, 120);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("parallelism.pipeline_parallel = 2: the model cannot be cut into pipeline stages"), std::string::npos) << r.err;
}
