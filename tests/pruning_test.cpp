// The pruning plugin (Lightning's ModelPruning): its masks against PyTorch's torch.nn.utils.prune
// for every method, pruned weights held at zero while training goes on, exact resume, ddp on two
// CPU ranks, and its one-line errors.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "callback_runs.h"
#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace cr = ember::test::callback_runs;

namespace {

// The mlp (fc1 23x32, fc2 17x23, head 4x17, with biases) on synthetic data: 3 batches per epoch,
// AdamW with weight decay and gradient clipping, so a pruned entry would move back away from zero
// if its gradient or optimizer state were left alone. A checkpoint at every epoch's last step is
// taken before that epoch's pruning (on_train_batch_end comes before on_train_epoch_end).
constexpr const char* kRun = R"(plugins = ["pruning", "checkpoint"]
[trainer]
max_epochs = 4
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
log_every_n_steps = 1
gradient_clip_val = 0.5
[model]
name = "mlp"
input_size = 32
hidden = [23, 17]
num_classes = 4
[data]
name = "synthetic"
shape = [32]
num_classes = 4
num_train = 72
num_val = 24
num_test = 0
batch_size = 24
shuffle = true
[optimizer]
name = "adamw"
lr = 0.01
weight_decay = 0.1
[checkpoint]
every_n_train_steps = 3
save_top_k = -1
[pruning]
epochs = [0, 1, 2]
)";

std::filesystem::path step_checkpoint(const TempDir& dir, int epoch) {
  return dir / ("runs/run/version_0/checkpoints/epoch=" + std::to_string(epoch) + "-step=" + std::to_string(3 * (epoch + 1)) + ".ckpt");
}

ProcessResult train(const TempDir& dir, std::vector<std::string> args) {
  write_file(dir / "run.toml", kRun);
  args.insert(args.begin(), "run.toml");
  return run_engine_ok(dir, args, 300);
}

std::map<std::string, at::Tensor> masks(const std::filesystem::path& ckpt) {
  std::map<std::string, at::Tensor> out;
  for (const auto& e : cr::callback_state(ckpt, "pruning").at("masks").toGenericDict())
    out[e.key().toStringRef()] = e.value().toTensor();
  return out;
}

}  // namespace

// Every method, with fractions and counts, each parameter alone or all together: the masks after
// each of three prunings are the ones PyTorch's own pruning functions compute from the same
// weights and earlier masks (tests/reference/pruning_masks.py), random methods included (the same
// seed, the same generator).
TEST(Pruning, MasksAreTheOnesPyTorchComputes) {
#ifndef EMBER_TEST_PYTHON
  GTEST_SKIP() << "no Python with torch next to this LibTorch";
#else
  struct Variant {
    std::string method, amount, global, dim, norm, seed;
    std::vector<std::string> extra;
  };
  const std::vector<Variant> variants = {
      {"l1_unstructured", "0.3", "true", "0", "2", "0", {}},
      {"l1_unstructured", "0.35", "false", "0", "2", "0", {"--set", "pruning.use_global_unstructured=false"}},
      {"l1_unstructured", "40", "true", "0", "2", "0", {}},
      {"random_unstructured", "0.25", "true", "0", "2", "7", {"--set", "pruning.seed=7"}},
      {"random_unstructured", "0.4", "false", "0", "2", "3", {"--set", "pruning.seed=3", "--set", "pruning.use_global_unstructured=false"}},
      {"ln_structured", "0.2", "false", "0", "2", "0", {"--set", "pruning.pruning_dim=0", "--set", "pruning.pruning_norm=2.0"}},
      {"ln_structured", "3", "false", "1", "inf", "0", {"--set", "pruning.pruning_dim=1", "--set", "pruning.pruning_norm=inf"}},
      {"random_structured", "0.25", "false", "-1", "2", "5", {"--set", "pruning.pruning_dim=-1", "--set", "pruning.seed=5"}},
  };
  for (const auto& v : variants) {
    SCOPED_TRACE(v.method + " amount " + v.amount + (v.global == "true" ? " global" : ""));
    TempDir dir("pruning");
    std::vector<std::string> args = {"--set", "pruning.pruning_fn=\"" + v.method + "\"", "--set", "pruning.amount=" + v.amount};
    if (v.method.find("structured") != std::string::npos && v.method.find("unstructured") == std::string::npos)
      args.insert(args.end(), {"--set", "pruning.use_global_unstructured=false", "--set", "pruning.parameter_names=[\"weight\"]"});
    args.insert(args.end(), v.extra.begin(), v.extra.end());
    const auto r = train(dir, args);
    EXPECT_EQ(cr::count(r.err, "pruning: epoch "), 3u) << r.err;
    std::vector<std::string> py = {EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/pruning_masks.py").string(),
                                   v.method, v.amount, v.global, v.dim, v.norm, v.seed};
    for (int e = 0; e < 4; ++e) py.push_back(step_checkpoint(dir, e).string());
    const auto ref = run_process(py, dir.path(), {}, 300);
    EXPECT_EQ(ref.exit_code, 0) << ref.out << ref.err;
    const size_t compared = v.global == "true" || v.method.find("unstructured") != std::string::npos ? 18 : 9;
    EXPECT_NE(ref.out.find("ok " + std::to_string(compared)), std::string::npos) << ref.out << ref.err;
  }
#endif
}

// After the last pruning (epoch 1) two more epochs train: the pruned entries stay exactly zero
// (AdamW's decay, its moments and clipping included) while the others move, the log and metrics
// say how much is pruned, and a run stopped after epoch 1 and resumed ends bit for bit where the
// whole run does.
TEST(Pruning, PrunedWeightsStayZeroAndAResumeGoesOnExactly) {
  TempDir whole("pruning"), resumed("pruning");
  const std::vector<std::string> keys = {"--set", "pruning.epochs=[0, 1]", "--set", "pruning.amount=0.4"};
  auto r = train(whole, keys);
  EXPECT_NE(r.err.find("pruning: epoch 0: l1_unstructured (global) pruned 496 more of 1,239 entries in 6 parameters: 0 (0.00%) -> 496 "
                       "(40.03%)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("pruning: epoch 1: l1_unstructured (global) pruned 297 more of 1,239 entries in 6 parameters: 496 (40.03%) -> 793 "
                       "(64.00%)"),
            std::string::npos)
      << r.err;
  const auto sparsity = cr::column(whole / "runs/run/version_0", "pruning_sparsity");
  ASSERT_EQ(sparsity.size(), 2u);
  EXPECT_NEAR(sparsity[0], 496.0 / 1239.0, 1e-6);
  EXPECT_NEAR(sparsity[1], 793.0 / 1239.0, 1e-6);

  const auto after_epoch_2 = step_checkpoint(whole, 2), end = step_checkpoint(whole, 3);
  const auto m2 = masks(after_epoch_2), m3 = masks(end);
  const auto w2 = weights(after_epoch_2), w3 = weights(end);
  int64_t pruned = 0;
  double kept_moved = 0.0;
  for (const auto& [name, mask] : m3) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(at::equal(mask, m2.at(name)));
    const at::Tensor gone = mask.logical_not();
    pruned += gone.sum().item<int64_t>();
    EXPECT_EQ(w3.at(name).masked_select(gone).abs().max().item<double>(), 0.0);
    EXPECT_EQ(w2.at(name).masked_select(gone).abs().max().item<double>(), 0.0);
    // Every kept entry is non-zero: the zeros are exactly the pruned ones.
    EXPECT_EQ(w3.at(name).masked_select(mask).eq(0).sum().item<int64_t>(), 0);
    if (mask.any().item<bool>())
      kept_moved = std::max(kept_moved, (w3.at(name) - w2.at(name)).masked_select(mask).abs().max().item<double>());
  }
  EXPECT_EQ(pruned, 793);
  EXPECT_GT(kept_moved, 1e-4) << "the kept weights did not train";

  // Stopped at the end of epoch 1 (its last checkpoint was taken before that epoch's pruning,
  // which the resumed run does), then resumed for epochs 2 and 3.
  train(resumed, {"--set", "pruning.epochs=[0, 1]", "--set", "pruning.amount=0.4", "--set", "trainer.max_epochs=2"});
  r = train(resumed, {"--set", "pruning.epochs=[0, 1]", "--set", "pruning.amount=0.4", "--resume", "last"});
  expect_identical_weights(step_checkpoint(resumed, 3), end);
  expect_identical_weights(last_checkpoint(resumed), last_checkpoint(whole));
  EXPECT_TRUE(at::equal(masks(last_checkpoint(resumed)).at("fc1.weight"), m3.at("fc1.weight")));
}

// final_sparsity (automated gradual pruning): three prunings of all chosen parameters together
// follow the cubic schedule 0.9 x (1 - (1 - j/3)^3), each a fraction of what is left, and end at
// 0.9 of the 1,239 entries; linear, each parameter on its own, reaches 0.6 in even steps.
TEST(Pruning, FinalSparsityIsReachedGradually) {
  TempDir cubic("pruning"), linear("pruning");
  auto r = train(cubic, {"--set", "pruning.final_sparsity=0.9"});
  for (const std::string step : {"0 (0.00%) -> 785 (63.36%); pruning 1 of 3 towards final_sparsity 90.00%",
                                 "785 (63.36%) -> 1,074 (86.68%); pruning 2 of 3 towards final_sparsity 90.00%",
                                 "1,074 (86.68%) -> 1,115 (89.99%); pruning 3 of 3 towards final_sparsity 90.00%"})
    EXPECT_NE(r.err.find(step), std::string::npos) << step << "\n" << r.err;
  int64_t pruned = 0;
  for (const auto& [name, mask] : masks(step_checkpoint(cubic, 3))) pruned += mask.logical_not().sum().item<int64_t>();
  EXPECT_EQ(pruned, 1115);

  r = train(linear, {"--set", "pruning.final_sparsity=0.6", "--set", "pruning.sparsity_schedule=\"linear\"", "--set",
                     "pruning.use_global_unstructured=false"});
  for (const auto& [name, mask] : masks(step_checkpoint(linear, 3))) {
    const double kept = mask.to(at::kDouble).mean().item<double>();
    // Each parameter on its own, within the rounding of its three prunings (half an entry each).
    EXPECT_NEAR(1.0 - kept, 0.6, 1.5 / static_cast<double>(mask.numel()) + 1e-9) << name;
  }
  const auto sparsity = cr::column(linear / "runs/run/version_0", "pruning_sparsity");
  ASSERT_EQ(sparsity.size(), 3u);
  EXPECT_NEAR(sparsity[0], 0.2, 0.01);
  EXPECT_NEAR(sparsity[1], 0.4, 0.01);
}

// use_lottery_ticket_hypothesis: after each pruning the kept weights start again from their values
// at the start of training, which the checkpoint keeps, so a resumed run rewinds to the same ones.
// The start is what a run at lr 1e-30 still holds after an epoch (AdamW's step is far below
// float32's resolution there). Checkpoints are taken at each epoch's end, after its pruning.
TEST(Pruning, LotteryTicketRewindsTheKeptWeightsToTheirStart) {
  std::string run = kRun;
  const std::string steps = "every_n_train_steps = 3\n";
  run.replace(run.find(steps), steps.size(), "every_n_epochs = 1\nsave_on_train_epoch_end = true\n");
  TempDir start("pruning"), lottery("pruning"), resumed("pruning");
  auto go = [&](const TempDir& dir, std::vector<std::string> args) {
    write_file(dir / "run.toml", run);
    args.insert(args.begin(), "run.toml");
    return run_engine_ok(dir, args, 300);
  };
  auto at_end_of = [](const TempDir& dir, int epoch) {
    return dir / ("runs/run/version_0/checkpoints/epoch=" + std::to_string(epoch) + "-step=" + std::to_string(3 * (epoch + 1)) + ".ckpt");
  };
  go(start, {"--set", "optimizer.lr=1e-30", "--set", "trainer.max_epochs=1", "--set", "pruning.epochs=[5]"});
  const auto initial = weights(at_end_of(start, 0));
  const std::vector<std::string> keys = {"--set", "pruning.use_lottery_ticket_hypothesis=true", "--set", "pruning.epochs=[0, 1]",
                                         "--set", "trainer.max_epochs=2"};
  go(lottery, keys);
  const auto kept = cr::callback_state(at_end_of(lottery, 0), "pruning").at("initial").toGenericDict();
  ASSERT_EQ(kept.size(), 6u);
  for (int epoch : {0, 1}) {
    SCOPED_TRACE("epoch " + std::to_string(epoch));
    const auto w = weights(at_end_of(lottery, epoch));
    int64_t pruned = 0;
    for (const auto& [name, mask] : masks(at_end_of(lottery, epoch))) {
      pruned += mask.logical_not().sum().item<int64_t>();
      EXPECT_TRUE(at::equal(w.at(name), initial.at(name) * mask)) << name << " is not its start times its mask";
      EXPECT_TRUE(at::equal(kept.at(name).toTensor(), initial.at(name))) << name;
    }
    EXPECT_EQ(pruned, epoch == 0 ? 620 : 930);
  }
  // Stopped after epoch 0 and resumed: the rewind at epoch 1 takes the start from the checkpoint.
  auto first = keys;
  first.back() = "trainer.max_epochs=1";
  go(resumed, first);
  auto again = keys;
  again.insert(again.end(), {"--resume", "last"});
  go(resumed, again);
  expect_identical_weights(at_end_of(resumed, 1), at_end_of(lottery, 1));
  // A run written without it has no start to rewind to: one line.
  const auto r = run_engine({"run.toml", "--set", "pruning.use_lottery_ticket_hypothesis=true", "--set", "trainer.max_epochs=2", "--resume",
                             "last"},
                            start.path(), {}, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("pruning: use_lottery_ticket_hypothesis rewinds to the weights the run started with, and the checkpoint this run "
                       "resumes was written without them: resume without it, or start the run anew"),
            std::string::npos)
      << r.err;
}

// prune_on_train_epoch_end = false: at the end of each validation of a chosen epoch during fit,
// twice per epoch with val_check_interval = 0.5 (4 batches: validation after 2 and 4), as Lightning's
// on_validation_epoch_end does; never in the sanity check, and not again at the epoch's end.
TEST(Pruning, AtValidationEndWhenAsked) {
  TempDir dir("pruning");
  const auto r = train(dir, {"--set", "pruning.prune_on_train_epoch_end=false", "--set", "pruning.epochs=[1]", "--set",
                             "trainer.val_check_interval=0.5", "--set", "trainer.num_sanity_val_steps=2", "--set", "pruning.amount=0.5", "--set",
                             "data.num_train=96"});
  EXPECT_EQ(cr::count(r.err, "pruning: epoch 1: "), 2u) << r.err;
  EXPECT_EQ(cr::count(r.err, "pruning: epoch "), 2u) << r.err;
  EXPECT_NE(r.err.find("620 (50.04%) -> 930 (75.06%)"), std::string::npos) << r.err;
}

// Mistakes are one line that names the key, where it was set and the fix, before any training
// where they can be known then.
TEST(Pruning, BadSettingsAreOneLineWithTheirPlace) {
  TempDir dir("pruning");
  write_file(dir / "run.toml", kRun);
  auto fails = [&](std::vector<std::string> args, const std::string& line) {
    args.insert(args.begin(), "run.toml");
    const auto r = run_engine(args, dir.path(), {}, 120);
    EXPECT_NE(r.exit_code, 0) << line;
    EXPECT_NE(r.err.find(line), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("pruning: epoch 0"), std::string::npos) << "trained before refusing:\n" << r.err;
  };
  fails({"--set", "pruning.amount=1.5"},
        "[pruning] amount = 1.500000 (--set pruning.amount=1.5) is outside [0, 1]: a float is the fraction of the entries not pruned yet");
  fails({"--set", "pruning.amount=-2"}, "[pruning] amount = -2 (--set pruning.amount=-2) is negative");
  fails({"--set", "pruning.amount=2000"},
        "[pruning] amount = 2000 (--set pruning.amount=2000) is more than the 1239 entries of the chosen parameters together: give a smaller "
        "count or a fraction (a float)");
  fails({"--set", "pruning.pruning_fn=\"ln_structured\""}, "prunes each parameter's channels on its own: set use_global_unstructured = false");
  fails({"--set", "pruning.pruning_fn=\"ln_structured\"", "--set", "pruning.use_global_unstructured=false", "--set", "pruning.pruning_dim=0"},
        "[pruning] pruning_fn = \"ln_structured\" needs pruning_norm: the norm that ranks the channels, e.g. pruning_norm = 2.0");
  fails({"--set", "pruning.pruning_fn=\"random_structured\"", "--set", "pruning.use_global_unstructured=false", "--set", "pruning.pruning_dim=1"},
        "[pruning] pruning_dim = 1 does not fit 'fc1.bias' of shape [23] (structured pruning needs a dimension of a tensor of at least two)");
  fails({"--set", "pruning.pruning_dim=0"}, "[pruning] pruning_dim (--set pruning.pruning_dim=0) applies to structured methods only");
  fails({"--set", "pruning.modules=[\"fc1\", \"encoder\"]"},
        "[pruning] modules (--set pruning.modules=[\"fc1\", \"encoder\"]): 'encoder' names no module of this model; its parameters are "
        "fc1.weight, fc1.bias, fc2.weight");
  fails({"--set", "pruning.parameter_names=[\"kernel\"]"}, "no chosen module has a parameter named 'kernel'");
  fails({"--set", "pruning.amount=0.2", "--set", "pruning.final_sparsity=0.8"},
        "[pruning] amount (--set pruning.amount=0.2) and final_sparsity (--set pruning.final_sparsity=0.8) both say how much to prune: keep one");
  fails({"--set", "pruning.sparsity_schedule=\"linear\""},
        "[pruning] sparsity_schedule (--set pruning.sparsity_schedule=\"linear\") shapes the way to final_sparsity, which is not set");
  fails({"--set", "pruning.final_sparsity=0.8", "--set", "pruning.epochs=[]", "--set", "trainer.max_epochs=-1", "--set", "trainer.max_steps=30"},
        "[pruning] final_sparsity is reached over the prunings of a known number of epochs, and trainer.max_epochs is unlimited: list the "
        "epochs to prune at in epochs");
  fails({"--set", "pruning.make_pruning_permanent=true"}, "the weights always hold their zeros, so there is nothing to make permanent");
  // A count the first prunings can take but a later one cannot ends the run at that pruning, in
  // one line (its checkpoints stay as they were).
  write_file(dir / "run.toml", kRun);
  const auto r = run_engine({"run.toml", "--set", "pruning.amount=3", "--set", "pruning.use_global_unstructured=false", "--set",
                             "pruning.modules=[\"head\"]"},
                            dir.path(), {}, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("[pruning] at the end of epoch 1: 'head.bias': amount = 3 is more than the 1 not pruned yet (amount, --set "
                       "pruning.amount=3)"),
            std::string::npos)
      << r.err;
}

class PruningRanks : public ::testing::Test {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};

// ddp on two CPU ranks (half the batch each) prunes what single_device prunes and ends where it
// does. So does sharded (stages 2 and 3): each rank holds its shards' masks, the entries are ranked
// across the ranks, and a resumed run gives each rank its own masks back (callbacks_by_rank). A
// random method prunes exactly its amount there too; a structured one needs whole tensors.
TEST_F(PruningRanks, DdpAndShardedMatchSingleDeviceAndResumeExactly) {
  TempDir single("pruning"), ddp("pruning");
  train(single, {"--set", "trainer.accelerator=\"cpu\""});
  const std::vector<std::string> ranks = {"--set", "trainer.accelerator=\"cpu\"", "--set", "trainer.devices=2", "--set", "data.batch_size=12"};
  auto args = ranks;
  args.insert(args.end(), {"--plugins", "ddp", "--set", "ddp.timeout=60.0"});
  train(ddp, args);
  EXPECT_LE(max_weight_difference(step_checkpoint(single, 3), step_checkpoint(ddp, 3)), 1e-5);
  const auto ms = masks(step_checkpoint(single, 3)), md = masks(step_checkpoint(ddp, 3));
  ASSERT_EQ(ms.size(), 6u);
  for (const auto& [name, m] : ms) EXPECT_TRUE(at::equal(m, md.at(name))) << name;

  auto sharded = [&](int stage, std::vector<std::string> extra = {}) {
    auto a = ranks;
    a.insert(a.end(), {"--plugins", "sharded", "--set", "sharded.timeout=60.0", "--set", "sharded.stage=" + std::to_string(stage)});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const auto ws = weights(step_checkpoint(single, 3));
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TempDir whole("pruning"), resumed("pruning");
    train(whole, sharded(stage));
    EXPECT_LE(max_weight_difference(step_checkpoint(single, 3), step_checkpoint(whole, 3)), 1e-5);
    // The whole weights a sharded checkpoint holds are zero exactly where single_device pruned.
    const auto w = weights(step_checkpoint(whole, 3));
    for (const auto& [name, m] : ms) EXPECT_TRUE(at::equal(w.at(name).ne(0), m)) << name;
    train(resumed, sharded(stage, {"--set", "trainer.max_epochs=2"}));
    train(resumed, sharded(stage, {"--resume", "last"}));
    expect_identical_weights(step_checkpoint(resumed, 3), step_checkpoint(whole, 3));
  }
  TempDir random("pruning"), structured("pruning");
  auto r = train(random, sharded(2, {"--set", "pruning.pruning_fn=\"random_unstructured\"", "--set", "pruning.amount=0.25"}));
  EXPECT_NE(r.err.find("pruning: epoch 0: random_unstructured (global) pruned 310 more of 1,239 entries in 6 parameters"), std::string::npos)
      << r.err;
  write_file(structured / "run.toml", kRun);
  args = sharded(2, {"--set", "pruning.pruning_fn=\"ln_structured\"", "--set", "pruning.use_global_unstructured=false", "--set",
                     "pruning.pruning_dim=0", "--set", "pruning.pruning_norm=2.0", "--set", "pruning.parameter_names=[\"weight\"]"});
  args.insert(args.begin(), "run.toml");
  r = run_engine(args, structured.path(), {}, 300);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("[pruning] pruning_fn = \"ln_structured\" prunes whole channels, and the strategy trains 'fc1.weight' as shards of "
                       "shape [368], not [23, 32]: use an unstructured method, or single_device or ddp"),
            std::string::npos)
      << r.err;
}
