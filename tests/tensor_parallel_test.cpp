// The device mesh and tensor parallelism (docs/parallelism.md) on CPU ranks over loopback: the
// transformer split over 2 tensor-parallel ranks, and 2 (data parallel) x 2 (tensor parallel) on 4
// ranks (under ddp, and under sharded: 2D), ends with single_device's weights for the same global batch (AdamW, gradient clipping,
// accumulation 2); checkpoints resume across mesh shapes; mixed precision stays within the
// tolerance the sharded tests use; a mesh that cannot work is one line and nothing starts.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <stdexcept>

#include <ember/support/tensor_parallel.h>

#include "checkpoint_support.h"
#include "mesh_support.h"
#include "support.h"

using namespace ember::test;

namespace {

const std::string kRun = transformer_mesh_toml(2);

ProcessResult single(const TempDir& dir, std::vector<std::string> extra = {}) {
  write_file(dir / "run.toml", kRun);
  std::vector<std::string> args = {"run.toml"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args);
}

// `strategy` (ddp, or sharded: 2D) on `ranks` CPU ranks with tensor_parallel = tp; the
// data-parallel ranks share the global batch.
ProcessResult mesh(const TempDir& dir, int ranks, int tp, std::vector<std::string> extra = {}, const std::string& strategy = "ddp") {
  write_file(dir / "run.toml", kRun);
  std::vector<std::string> args = {"--plugins", strategy, "run.toml", "--set", strategy + ".timeout=60.0",
                                   "--set", "trainer.devices=" + std::to_string(ranks),
                                   "--set", "parallelism.tensor_parallel=" + std::to_string(tp),
                                   "--set", "data.batch_size=" + std::to_string(12 / (ranks / tp))};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args);
}

class TensorParallel : public ::testing::Test {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};

std::vector<std::string> val_acc(const TempDir& dir, int version = 0) { return metric_column(dir, "val_acc", version); }

}  // namespace

// Slicing and joining, in process: a fused q/k/v weight keeps, of each of its three blocks, the
// rank's rows; a row-parallel weight its columns; joining the ranks' slices gives the whole back.
TEST(TensorShards, SliceFusedBlocksAndJoinThemBack) {
  const at::Tensor qkv = at::arange(12 * 2, at::kFloat).view({12, 2});  // 3 blocks of 4 rows
  const ember::TensorShard fused{"qkv", 0, 3};
  const at::Tensor r1 = ember::shard_of(qkv, fused, 1, 2);
  ASSERT_EQ(r1.sizes(), (std::vector<int64_t>{6, 2}));
  // Rank 1 of 2 holds rows 2-3 of each block: 2, 3, 6, 7, 10, 11.
  EXPECT_TRUE(at::equal(r1.select(1, 0), at::tensor({4.f, 6.f, 12.f, 14.f, 20.f, 22.f})));
  EXPECT_TRUE(at::equal(ember::whole_of({ember::shard_of(qkv, fused, 0, 2), r1}, fused), qkv));
  const ember::TensorShard columns{"w", 1, 1};
  const at::Tensor w = at::randn({3, 8});
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < 4; ++r) parts.push_back(ember::shard_of(w, columns, r, 4));
  EXPECT_EQ(parts[2].sizes(), (std::vector<int64_t>{3, 2}));
  EXPECT_TRUE(at::equal(ember::whole_of(parts, columns), w));
  try {
    ember::check_splits(qkv, fused, 3);  // 12 rows in 3 blocks do not split 3 ways each
    ADD_FAILURE() << "no error";
  } catch (const ember::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'qkv' of shape [12, 2] cannot be split 3 ways along dimension 0 in 3 blocks"), std::string::npos)
        << e.what();
  }
}

// One rank of a group, in process: what SplitRegionRandomness reads of a group (its rank and
// size); no collective runs.
struct RankOfGroup final : ember::ITensorParallelGroup {
  int64_t r = 0, n = 1;
  RankOfGroup(int64_t rank, int64_t size) : r(rank), n(size) {}
  int64_t rank() const override { return r; }
  int64_t size() const override { return n; }
  void all_reduce_sum(at::Tensor&) override { throw std::logic_error("no collective in process"); }
  at::Tensor all_gather(const at::Tensor&) override { throw std::logic_error("no collective in process"); }
  at::Tensor reduce_scatter_sum(const at::Tensor&) override { throw std::logic_error("no collective in process"); }
  bool sequence_parallel() const override { return false; }
};

// Megatron's second generator, in process: dropout in a split region draws other masks on the
// two ranks of a group (their heads' masks independent, as one device's would be), while the
// default generator goes on in step on both (replicated activations keep equal masks); the same
// seed draws the same masks (a resumed run does); a group of one is plain dropout, and a region
// that draws nothing leaves the generator alone.
TEST(TensorShards, SplitRegionDropoutDrawsEachRanksOwnMasks) {
  auto draw = [](int64_t rank, int64_t size) {
    at::manual_seed(1234);
    RankOfGroup g(rank, size);
    const at::Tensor x = at::ones({64, 64});
    at::Tensor masked = ember::in_split_region(&g, x.device(), true, [&] { return at::dropout(x, 0.5, true); });
    return std::make_pair(masked, at::rand({8}));  // and the default generator after the region
  };
  const auto [m0, after0] = draw(0, 2);
  const auto [m1, after1] = draw(1, 2);
  EXPECT_FALSE(at::equal(m0, m1));
  EXPECT_TRUE(at::equal(after0, after1));
  EXPECT_TRUE(at::equal(draw(0, 2).first, m0));
  EXPECT_NEAR(m0.ne(0).to(at::kFloat).mean().item<float>(), 0.5, 0.05);
  EXPECT_NEAR(m1.ne(0).to(at::kFloat).mean().item<float>(), 0.5, 0.05);
  at::manual_seed(1234);
  const at::Tensor plain = at::dropout(at::ones({64, 64}), 0.5, true);
  EXPECT_TRUE(at::equal(draw(0, 1).first, plain));
  EXPECT_FALSE(at::equal(m0, plain));
  at::manual_seed(1234);
  RankOfGroup g(0, 2);
  ember::in_split_region(&g, c10::Device(c10::kCPU), false, [] { return at::ones({1}); });
  const at::Tensor untouched = at::rand({8});
  at::manual_seed(1234);
  EXPECT_TRUE(at::equal(untouched, at::rand({8})));
}

TEST_F(TensorParallel, TwoAndFourRanksMatchSingleDevice) {
  TempDir one("tensor_parallel"), tp2("tensor_parallel"), dp2tp2("tensor_parallel");
  single(one);
  auto r = mesh(tp2, 2, 2);
  EXPECT_NE(r.err.find("ddp: device mesh 1 (data parallel) x 2 (tensor parallel)"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(tp2)), 1e-5);
  r = mesh(dp2tp2, 4, 2);
  EXPECT_NE(r.err.find("rank 3 is data-parallel rank 1, tensor-parallel rank 1"), std::string::npos) << r.err;
  // Gradients meet over the 2 data-parallel ranks only: one bucket all-reduce per optimizer step.
  EXPECT_EQ(count_in_log(r.err, R"((\d+) bucket all-reduces)"), 8) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(dp2tp2)), 1e-5);
  // Validation on the mesh gives single_device's values.
  EXPECT_EQ(val_acc(one), val_acc(dp2tp2));
  EXPECT_EQ(val_acc(one).size(), 2u);
}

// 2D: ZeRO shards each rank's tensor-parallel slices over the data-parallel ranks, at every stage,
// and offload keeps those shards' masters, gradients and optimizer state in host memory (with
// offload_params: the parameters too, fetched per unit).
TEST_F(TensorParallel, ShardedOverDataParallelRanksMatchesSingleDevice) {
  TempDir one("tensor_parallel");
  single(one);
  for (int stage : {1, 3}) {
    TempDir dir("tensor_parallel");
    auto r = mesh(dir, 4, 2, {"--set", "sharded.stage=" + std::to_string(stage)}, "sharded");
    EXPECT_NE(r.err.find("sharded: device mesh 2 (data parallel) x 2 (tensor parallel) (sharded over the data-parallel ranks)"),
              std::string::npos)
        << r.err;
    EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(dir)), 1e-5) << "stage " << stage;
    EXPECT_EQ(val_acc(one), val_acc(dir)) << "stage " << stage;
  }
  TempDir offloaded("tensor_parallel");
  auto r = mesh(offloaded, 4, 2, {"--set", "offload.offload_params=true"}, "offload");
  EXPECT_NE(r.err.find("offload: device mesh 2 (data parallel) x 2 (tensor parallel)"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(offloaded)), 1e-5);
}

// Hybrid sharding (FSDP's HYBRID_SHARD, torchtitan's dp_replicate x dp_shard): 2 replicas, each
// sharding the model over 2 ranks; a shard's gradient is reduce-scattered within its replica, then
// averaged over the replicas. Stages 2 and 3 and offload end where single_device does; whole checkpoints move
// between hybrid sharding, plain sharding over all 4 ranks and single_device, sharded directories
// between hybrid and plain sharding.
TEST_F(TensorParallel, HybridShardingMatchesSingleDeviceAndResumesAcrossMeshes) {
  TempDir one("tensor_parallel");
  single(one);
  const std::vector<std::string> hybrid = {"--set", "parallelism.data_parallel_replicate=2"};
  for (int stage : {2, 3}) {
    TempDir dir("tensor_parallel");
    auto args = hybrid;
    args.insert(args.end(), {"--set", "sharded.stage=" + std::to_string(stage)});
    auto r = mesh(dir, 4, 1, args, "sharded");
    EXPECT_NE(r.err.find("sharded: hybrid sharding, device mesh 2 (data parallel, replicas) x 2 (data parallel, shards) x 1 (tensor "
                         "parallel): each of the 2 replicas shards the model over 2 ranks; rank 0 is replica 0, shard 0"),
              std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("rank 3 is replica 1, shard 1"), std::string::npos) << r.err;
    EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(dir)), 1e-5) << "stage " << stage;
    EXPECT_EQ(val_acc(one), val_acc(dir)) << "stage " << stage;
  }
  // 3D: 2 replicas x 2 shards x 2 tensor-parallel slices on 8 ranks.
  TempDir three_d("tensor_parallel");
  auto r3 = mesh(three_d, 8, 2, hybrid, "sharded");
  EXPECT_NE(r3.err.find("device mesh 2 (data parallel, replicas) x 2 (data parallel, shards) x 2 (tensor parallel)"), std::string::npos)
      << r3.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(three_d)), 1e-5);
  // Offload: each replica's shards of masters, gradients and optimizer state on the host (with
  // offload_params: the parameters too, fetched per unit).
  TempDir offloaded("tensor_parallel");
  auto args = hybrid;
  args.insert(args.end(), {"--set", "offload.offload_params=true"});
  auto r = mesh(offloaded, 4, 1, args, "offload");
  EXPECT_NE(r.err.find("offload: hybrid sharding, device mesh 2 (data parallel, replicas) x 2 (data parallel, shards)"), std::string::npos)
      << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(offloaded)), 1e-5);
  // Hybrid -> sharded over 4 ranks; sharded over 4 -> hybrid; hybrid -> single_device.
  TempDir to_flat("tensor_parallel"), to_hybrid("tensor_parallel"), to_single("tensor_parallel");
  auto first_epoch = hybrid;
  first_epoch.insert(first_epoch.end(), {"--set", "trainer.max_epochs=1"});
  mesh(to_flat, 4, 1, first_epoch, "sharded");
  mesh(to_flat, 4, 1, {"--resume", last_checkpoint(to_flat).string()}, "sharded");
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(to_flat, 1)), 1e-5);
  mesh(to_hybrid, 4, 1, {"--set", "trainer.max_epochs=1"}, "sharded");
  auto resumed = hybrid;
  resumed.insert(resumed.end(), {"--resume", last_checkpoint(to_hybrid).string()});
  mesh(to_hybrid, 4, 1, resumed, "sharded");
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(to_hybrid, 1)), 1e-5);
  mesh(to_single, 4, 1, first_epoch, "sharded");
  single(to_single, {"--resume", last_checkpoint(to_single).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(to_single, 1)), 1e-5);

  // Sharded directories: the first replica's ranks save the shards, the second replica's a small
  // part naming whose copy they hold; the directory resumes under hybrid sharding, and under plain
  // sharding over 4 and over 2 ranks.
  TempDir dirs("tensor_parallel");
  auto as_dir = first_epoch;
  as_dir.insert(as_dir.end(), {"--set", "sharded.state_dict_type=\"sharded\""});
  mesh(dirs, 4, 1, as_dir, "sharded");
  const auto saved = last_checkpoint(dirs);
  ASSERT_TRUE(std::filesystem::is_directory(saved));
  EXPECT_GT(std::filesystem::file_size(saved / "rank1.ckpt"), 10 * std::filesystem::file_size(saved / "rank3.ckpt"));
  auto again = hybrid;
  again.insert(again.end(), {"--resume", saved.string()});
  mesh(dirs, 4, 1, again, "sharded");
  mesh(dirs, 4, 1, {"--resume", saved.string()}, "sharded");
  mesh(dirs, 2, 1, {"--resume", saved.string()}, "sharded");
  for (int version : {1, 2, 3}) EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(dirs, version)), 1e-5) << version;
}

// Sequence parallelism: norms, dropout and residuals on each rank's half of the positions; their
// parameters' gradients summed over the tensor-parallel ranks (without that sum the norms would
// train on half their gradient and the weights differ).
TEST_F(TensorParallel, SequenceParallelMatchesSingleDevice) {
  TempDir one("tensor_parallel"), ddp("tensor_parallel"), sharded("tensor_parallel"), odd("tensor_parallel");
  single(one);
  const std::vector<std::string> sp = {"--set", "parallelism.sequence_parallel=true"};
  auto r = mesh(ddp, 4, 2, sp);
  EXPECT_NE(r.err.find("sequence parallel: the gradients of 12 norms and biases are summed over the group"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(ddp)), 1e-5);
  mesh(sharded, 4, 2, sp, "sharded");
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(sharded)), 1e-5);
  // 5 positions do not split over 2 ranks: one line, not a wrong answer.
  write_file(odd / "run.toml", kRun);
  r = run_engine({"run.toml", "--plugins", "ddp", "--set", "ddp.timeout=60.0", "--set", "trainer.devices=2", "--set",
                  "parallelism.tensor_parallel=2", "--set", "parallelism.sequence_parallel=true", "--set", "data.shape=[5, 16]"},
                 odd.path(), {}, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("a sequence of 5 positions cannot be split over tensor_parallel = 2 ranks (parallelism.sequence_parallel)"),
            std::string::npos)
      << r.err;
}

// Dropout under tensor parallelism (0.2 in attention, the hidden columns and the residuals; with
// sequence parallelism too; the transformer, then GPT-2): the split regions draw each rank's masks from the default generators
// the checkpoint keeps, so the second epoch resumed from the first's checkpoint ends with exactly
// the weights of the uninterrupted run; and the dropout does act (the weights differ from a run
// without it).
TEST_F(TensorParallel, DropoutInSplitRegionsResumesExactly) {
  for (bool sp : {false, true}) {
    TempDir whole("tensor_parallel"), resumed("tensor_parallel"), without("tensor_parallel");
    std::vector<std::string> drop = {"--set", "model.dropout=0.2", "--set", std::string("parallelism.sequence_parallel=") + (sp ? "true" : "false")};
    mesh(whole, 2, 2, drop);
    auto first = drop;
    first.insert(first.end(), {"--set", "trainer.max_epochs=1"});
    mesh(resumed, 2, 2, first);
    auto second = drop;
    second.insert(second.end(), {"--resume", last_checkpoint(resumed).string()});
    mesh(resumed, 2, 2, second);
    EXPECT_EQ(max_weight_difference(last_checkpoint(whole), last_checkpoint(resumed, 1)), 0.0) << "sequence_parallel " << sp;
    mesh(without, 2, 2, {"--set", std::string("parallelism.sequence_parallel=") + (sp ? "true" : "false")});
    EXPECT_GT(max_weight_difference(last_checkpoint(whole), last_checkpoint(without)), 1e-4) << "sequence_parallel " << sp;
  }
  // GPT-2 (attention dropout inside scaled_dot_product_attention, residual and embedding dropout
  // on this rank's positions under sequence parallelism), resumed after 6 of its 12 steps.
  TempDir whole("tensor_parallel"), resumed("tensor_parallel");
  auto gpt = [](const TempDir& dir, std::vector<std::string> extra) {
    write_gpt_mesh_run(dir, "gpt2", 2, "vocab_size = 48\ndropout = 0.2\n");
    std::vector<std::string> args = {"--plugins", "ddp", "run.toml", "--set", "ddp.timeout=60.0", "--set", "trainer.devices=2",
                                     "--set", "parallelism.tensor_parallel=2", "--set", "parallelism.sequence_parallel=true"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_engine_ok(dir, args);
  };
  gpt(whole, {});
  gpt(resumed, {"--set", "trainer.max_steps=6"});
  gpt(resumed, {"--resume", last_checkpoint(resumed).string()});
  EXPECT_EQ(max_weight_difference(last_checkpoint(whole), last_checkpoint(resumed, 1)), 0.0) << "gpt2";
}

// A checkpoint holds whole tensors, whatever the mesh that wrote it, and a sharded directory's
// parts load onto any mesh: the second epoch under another mesh ends where the uninterrupted
// single_device run does.
TEST_F(TensorParallel, CheckpointsResumeAcrossMeshShapes) {
  TempDir one("tensor_parallel"), from_tp("tensor_parallel"), to_tp("tensor_parallel");
  single(one);
  // Saved in the background: rank 0 holds only its slices, so the asynchronous save gathers the
  // whole tensors (ddp does not offer IDeviceModelState under a tensor-parallel mesh).
  mesh(from_tp, 2, 2, {"--set", "trainer.max_epochs=1", "--set", "checkpoint.async=true"});
  single(from_tp, {"--resume", last_checkpoint(from_tp).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(from_tp, 1)), 1e-5);
  single(to_tp, {"--set", "trainer.max_epochs=1"});
  mesh(to_tp, 4, 2, {"--resume", last_checkpoint(to_tp).string()});
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(to_tp, 1)), 1e-5);
  // 2 x 2 sharded -> 4 x 1 sharded.
  TempDir reshaped("tensor_parallel");
  mesh(reshaped, 4, 2, {"--set", "trainer.max_epochs=1"}, "sharded");
  mesh(reshaped, 4, 1, {"--resume", last_checkpoint(reshaped).string()}, "sharded");
  EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(reshaped, 1)), 1e-5);
  // The same as a sharded directory under ZeRO-3 (each rank's part of its slices, nothing
  // gathered): 2 x 2 -> 4 x 1, and -> 1 x 4 (another tensor-parallel degree: the elements are
  // matched by their place in the whole tensors).
  TempDir dirs("tensor_parallel");
  mesh(dirs, 4, 2, {"--set", "trainer.max_epochs=1", "--set", "sharded.stage=3", "--set", "sharded.state_dict_type=\"sharded\""}, "sharded");
  const auto saved = last_checkpoint(dirs);
  ASSERT_TRUE(std::filesystem::is_directory(saved)) << saved;
  mesh(dirs, 4, 1, {"--resume", saved.string()}, "sharded");
  mesh(dirs, 4, 4, {"--resume", saved.string()}, "sharded");
  for (int version : {1, 2}) EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(dirs, version)), 1e-5) << version;
}

// Weight averaging under a 2 (data parallel) x 2 (tensor parallel) sharded mesh keeps each rank's
// shards of its tensor-parallel slices, cut for that mesh. Resumed on the same mesh it ends bit for
// bit where the whole run does; on as many ranks with another tensor-parallel degree (whose shards
// may have the same sizes and other elements) it is one line on every rank, before any step.
TEST_F(TensorParallel, WeightAveragingResumesOnItsOwnMeshOnly) {
  const std::vector<std::string> ema = {"--plugins", "ema,checkpoint", "--set", "ema.decay=0.9", "--set", "sharded.stage=3"};
  TempDir whole("tensor_parallel"), stopped("tensor_parallel");
  auto keys = ema;
  keys.insert(keys.end(), {"--set", "trainer.max_epochs=2"});
  mesh(whole, 4, 2, keys, "sharded");
  auto first = ema;
  first.insert(first.end(), {"--set", "trainer.max_epochs=1"});
  mesh(stopped, 4, 2, first, "sharded");
  std::vector<std::string> other = {"--plugins", "sharded,ema,checkpoint", "run.toml", "--set", "sharded.timeout=60.0", "--set",
                                    "trainer.devices=4", "--set", "parallelism.tensor_parallel=1", "--set", "data.batch_size=3",
                                    "--set", "ema.decay=0.9", "--set", "sharded.stage=3", "--set", "trainer.max_epochs=2", "--resume", "last"};
  const auto r = run_engine(other, stopped.path(), {}, 180);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("callback 'ema' saved a state of its own on each of the 4 ranks that wrote it (its part of the strategy's shards), "
                       "cut for another mesh than this run's (its tensor-parallel degree or pipeline stages): resume with the "
                       "[parallelism] that wrote it, or without 'ema'"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("The size of tensor"), std::string::npos) << r.err;
  keys.insert(keys.end(), {"--resume", "last"});
  mesh(stopped, 4, 2, keys, "sharded");
  expect_identical_weights(last_checkpoint(stopped), last_checkpoint(whole));
}

// The gpt language model's plan: GPT-2 (fused c_attn split in three blocks, Conv1D weights) under
// ddp and Llama (grouped-query attention: 4 heads and 2 key/value heads over 2 ranks; an untied
// lm_head) under sharded, each 2 (data parallel) x 2 (tensor parallel), end where single_device
// does. A vocabulary of 48 is split too (vocabulary-parallel embedding, lm_head and cross-entropy);
// one of 47 cannot be, and stays whole. GPT-2 once more with sequence parallelism.
TEST_F(TensorParallel, GptPlanForGpt2AndLlamaMatchesSingleDevice) {
  struct Case {
    std::string flavour, strategy, extra, split;
    bool sequence_parallel = false;
  };
  const std::vector<Case> cases = {
      {"gpt2", "ddp", "vocab_size = 48\n", "plan split 13 of 28 parameters; this rank holds 14752 of their 28032 elements"},
      {"llama", "sharded", "vocab_size = 48\nkv_heads = 2\ntied = false\n",
       "plan split 16 of 21 parameters; this rank holds 17056 of their 33952 elements"},
      {"gpt2", "ddp", "vocab_size = 48\n", "sequence parallel: the gradients of 14 norms and biases are summed over the group", true},
      {"gpt2", "ddp", "vocab_size = 47\n", "plan split 12 of 28 parameters; this rank holds 15488 of their 28000 elements"}};
  for (const auto& c : cases) {
    TempDir one("tensor_parallel"), split("tensor_parallel");
    for (const auto* dir : {&one, &split}) write_gpt_mesh_run(*dir, c.flavour, 2, c.extra);
    run_engine_ok(one, {"run.toml"});
    auto r = run_engine_ok(split, {"--plugins", c.strategy, "run.toml", "--set", c.strategy + ".timeout=60.0", "--set", "trainer.devices=4",
                                   "--set", "parallelism.tensor_parallel=2", "--set", "data.batch_size=4", "--set",
                                   std::string("parallelism.sequence_parallel=") + (c.sequence_parallel ? "true" : "false")});
    EXPECT_NE(r.err.find(c.split), std::string::npos) << r.err;
    EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(split)), 1e-5) << c.flavour << " " << c.extra;
  }
}

// LoRA under tensor parallelism: an adapter follows its layer's split (B keeps this rank's outputs
// on a column-parallel layer, A this rank's inputs on a row-parallel one, the branch joining the
// layer's partial sum; the whole factor's gradient is summed over the group). GPT-2 with every
// linear layer adapted under ddp, Llama's seven under sharded, each 2 (data parallel) x 2 (tensor
// parallel): the adapters end where single_device's do.
TEST_F(TensorParallel, LoraAdaptersFollowTheirLayersSplit) {
  struct Case {
    std::string flavour, strategy, extra, targets;
  };
  const std::vector<Case> cases = {
      {"gpt2", "ddp", "vocab_size = 48\n", "[\"c_attn\", \"attn.c_proj\", \"mlp.c_fc\", \"mlp.c_proj\"]"},
      {"llama", "sharded", "vocab_size = 48\nkv_heads = 2\ntied = false\n",
       "[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"]"}};
  for (const auto& c : cases) {
    TempDir one("tensor_parallel"), split("tensor_parallel");
    for (const auto* dir : {&one, &split}) write_gpt_mesh_run(*dir, c.flavour, 2, c.extra);
    const std::vector<std::string> lora = {"--plugins", "lora", "--set", "lora.target_modules=" + c.targets, "--set", "lora.rank=4"};
    auto args = lora;
    args.push_back("run.toml");
    run_engine_ok(one, args);
    args.insert(args.end(), {"--plugins", c.strategy, "--set", c.strategy + ".timeout=60.0", "--set", "trainer.devices=4", "--set",
                             "parallelism.tensor_parallel=2", "--set", "data.batch_size=4"});
    run_engine_ok(split, args);
    const auto trained_weights = weights(last_checkpoint(split));
    int64_t adapters = 0;
    bool trained = false;
    for (const auto& [name, t] : trained_weights) {
      if (name.find(".lora_") == std::string::npos) continue;
      ++adapters;
      trained |= name.find(".lora_B") != std::string::npos && t.abs().max().item<double>() > 0;
    }
    EXPECT_EQ(adapters, c.flavour == "gpt2" ? 16 : 28) << c.flavour;
    EXPECT_TRUE(trained) << c.flavour;
    EXPECT_LE(max_weight_difference(last_checkpoint(one), last_checkpoint(split)), 1e-5) << c.flavour;
  }
}

TEST_F(TensorParallel, MixedPrecisionMatchesSingleDeviceWithinTolerance) {
  for (const char* precision : {"16-mixed", "bf16-mixed"}) {
    const std::vector<std::string> mode = {"--set", std::string("trainer.precision=\"") + precision + "\""};
    TempDir one("tensor_parallel"), tp2("tensor_parallel"), alone("tensor_parallel");
    single(one, mode);
    mesh(tp2, 2, 2, mode);
    auto half_batch = mode;
    half_batch.insert(half_batch.end(), {"--set", "data.batch_size=6"});
    single(alone, half_batch);
    const WeightDifference split = max_weight_difference(last_checkpoint(one), last_checkpoint(tp2));
    const WeightDifference other = max_weight_difference(last_checkpoint(one), last_checkpoint(alone));
    EXPECT_LE(split, 0.03) << precision;
    EXPECT_GT(other, 0.03) << precision << ": the tolerance would not catch another training";
  }
}

TEST_F(TensorParallel, BadMeshIsOneLineAndNothingStarts) {
  TempDir dir("tensor_parallel");
  write_file(dir / "run.toml", kRun);
  auto expect_line = [&](std::vector<std::string> args, const std::string& line) {
    args.insert(args.begin(), "run.toml");
    auto r = run_engine(args, dir.path(), {}, 120);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(line), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir / "runs/run/version_0/checkpoints/last.ckpt")) << line;
  };
  expect_line({"--plugins", "ddp", "--set", "trainer.devices=4", "--set", "parallelism.tensor_parallel=3"},
              "--set parallelism.tensor_parallel=3: the device mesh does not fit the run: data_parallel_replicate (1) x "
              "tensor_parallel (3) x pipeline_parallel (1) = 3 does not divide trainer.devices (4) x trainer.num_nodes (1) = 4 ranks");
  expect_line({"--plugins", "ddp", "--set", "trainer.devices=4", "--set", "parallelism.data_parallel_shard=3"},
              "x data_parallel_shard (3) = 3, but trainer.devices (4) x trainer.num_nodes (1) = 4 ranks");
  expect_line({"--plugins", "ddp", "--set", "trainer.devices=2", "--set", "parallelism.tensor_parallel=2", "--set", "model.nhead=1"},
              "--set model.nhead=1: [model] nhead = 1 cannot be split over tensor_parallel = 2 ranks");
  expect_line({"--plugins", "single_device", "--set", "parallelism.tensor_parallel=1", "--set", "parallelism.sequence_parallel=true"},
              "parallelism.sequence_parallel = true splits activations over the tensor-parallel ranks, and tensor_parallel = 1");
  expect_line({"--plugins", "single_device", "--set", "trainer.devices=2", "--set", "parallelism.tensor_parallel=2"},
              "parallelism.tensor_parallel = 2 needs a strategy with a device mesh, and strategy 'single_device' has none");
  expect_line({"--plugins", "ddp", "--set", "trainer.devices=2", "--set", "parallelism.sequence_parallel=true"},
              "--set parallelism.sequence_parallel=true: parallelism.sequence_parallel = true splits activations over the "
              "tensor-parallel ranks, and tensor_parallel = 1");
  // A model without a plan.
  write_file(dir / "mlp.toml", synthetic_mlp_toml({.accelerator = "cpu"}));
  auto r = run_engine({"mlp.toml", "--plugins", "ddp", "--set", "trainer.devices=2", "--set", "parallelism.tensor_parallel=2"}, dir.path(), {},
                      120);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("parallelism.tensor_parallel = 2: the model has no tensor-parallel plan"), std::string::npos) << r.err;
}
