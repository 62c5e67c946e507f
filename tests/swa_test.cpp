// swa and ema on real runs: the averages equal averages computed by hand from weight snapshots,
// batch-norm statistics are recomputed like torch.optim.swa_utils.update_bn, swa owns the
// learning rate from swa_epoch_start whatever the plugin order, and both resume exactly.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/serialize.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <ember/support/lr_schedule.h>
#include <ember/support/weight_averaging.h>

#include "checkpoint/checkpoint_io.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// 64 samples in batches of 16 (4 per epoch), no dropout, no shuffling: runs repeat exactly and
// the test can rebuild the training batches (see training_inputs).
const char* kRun = R"(
[trainer]
max_epochs = 5
log_every_n_steps = 1
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[data]
name = "synthetic"
shape = [16]
num_classes = 4
num_train = 64
num_val = 32
num_test = 32
batch_size = 16
shuffle = false
[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
)";

const char* kMlp = "\n[model]\nname = \"mlp\"\ninput_size = 16\nhidden = [8]\nnum_classes = 4\n";
const char* kBnMlp = "\n[model]\nname = \"bn_mlp\"\ninput_size = 16\nhidden = 8\nnum_classes = 4\n";

struct Run {
  ProcessResult result;
  fs::path dir;
};

Run train(const TempDir& dir, const std::string& extra, const std::string& plugins, std::vector<std::string> more = {},
          const char* model = kMlp) {
  write_file(dir / "run.toml", std::string(kRun) + model + extra);
  std::vector<std::string> args = {"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", plugins};
  args.insert(args.end(), more.begin(), more.end());
  return Run{run_engine(args, dir.path()), dir / "runs/run/version_0"};
}

using Weights = std::map<std::string, at::Tensor>;

Weights checkpoint_weights(const fs::path& ckpt) {
  auto ck = ember::engine::load_checkpoint_file(ckpt);
  Weights out;
  for (const auto& e : ck.at("state_dict").toGenericDict()) out[e.key().toStringRef()] = e.value().toTensor();
  return out;
}

Weights snapshot(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(in) << "no snapshot " << file;
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Weights out;
  for (const auto& e : torch::pickle_load(bytes).toGenericDict()) out[e.key().toStringRef()] = e.value().toTensor();
  return out;
}

std::map<int64_t, double> column(const fs::path& run_dir, const std::string& name) {
  std::map<int64_t, double> out;
  for (const auto& row : read_csv(run_dir / "metrics.csv")) {
    auto it = row.find(name);
    if (it != row.end() && !it->second.empty()) out[std::stoll(row.at("step"))] = std::stod(it->second);
  }
  return out;
}

void expect_close(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  EXPECT_TRUE(at::allclose(a.to(at::kDouble), b.to(at::kDouble), 1e-5, 1e-6))
      << what << ": max difference " << (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// The synthetic data module's training inputs for seed 0 / trainer.seed 0 (data/synthetic:
// centroids, then per split labels, a permutation and noise, all from one generator).
at::Tensor training_inputs(int64_t n, int64_t features, int64_t classes, double noise) {
  auto splitmix64 = [](uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  };
  at::Generator gen = at::detail::createCPUGenerator(splitmix64(splitmix64(0) ^ 0));
  at::Tensor centroids = at::randn({classes, features}, gen, at::kFloat);
  at::Tensor labels = at::arange(n, at::kLong).remainder(classes);
  labels = labels.index_select(0, at::randperm(n, gen, at::kLong));
  return centroids.index_select(0, labels) + noise * at::randn({n, features}, gen, at::kFloat);
}

}  // namespace

TEST(Swa, AverageEqualsTheMeanOfTheEpochSnapshotsAndSwalrOwnsTheRate) {
  TempDir dir("swa");
  // weight_snapshot is named first: it saves each epoch's weights before swa averages them.
  auto r = train(dir, R"(
[swa]
swa_lrs = [0.05]
swa_epoch_start = 2
annealing_epochs = 2
[weight_snapshot]
dir = "snaps"
)",
                 "weight_snapshot,swa,lr_monitor", {"--set", "trainer.test_after_fit=true", "--set", "trainer.test_ckpt=\"last\""});
  ASSERT_EQ(r.result.exit_code, 0) << r.result.err;
  EXPECT_NE(r.result.err.find("swa: the model now holds the average of 3 epochs"), std::string::npos) << r.result.err;
  const Weights avg = checkpoint_weights(r.dir / "checkpoints/last.ckpt");
  const Weights s2 = snapshot(dir / "snaps/epoch2.pt"), s3 = snapshot(dir / "snaps/epoch3.pt"), s4 = snapshot(dir / "snaps/epoch4.pt");
  for (const auto& [name, w] : s4) {
    expect_close(avg.at(name), (s2.at(name) + s3.at(name) + w) / 3.0, name);
    EXPECT_FALSE(at::allclose(avg.at(name), w)) << name << ": the checkpoint holds the last epoch's own weights";
  }
  // The rate: the optimizer's 0.1 until epoch 2, then SWALR from 0.1 to 0.05 over 2 epochs.
  auto lr = column(r.dir, "lr-SGD");
  ASSERT_EQ(lr.size(), 20u);
  for (const auto& [step, v] : lr) {
    const int64_t epoch = step / 4;
    const double expected = epoch < 2 ? 0.1 : ember::support::swalr(0.1, 0.05, epoch - 2, 2, ember::support::AnnealStrategy::cos);
    EXPECT_NEAR(v, expected, 1e-12) << "step " << step;
  }
  // The final validation ran on the averaged weights (a second val row at the last step), and the
  // test used them.
  int val_rows_at_end = 0;
  for (const auto& row : read_csv(r.dir / "metrics.csv"))
    if (row.at("step") == "19" && !row.at("val_loss").empty()) ++val_rows_at_end;
  EXPECT_EQ(val_rows_at_end, 2) << "the epoch's own validation, then the averaged model's";
  EXPECT_NE(r.result.out.find("test_acc"), std::string::npos) << r.result.out;
}

TEST(Swa, TakesTheRateOverFromCyclicLrInEitherPluginOrder) {
  ember::support::CyclicParams p;
  p.base_lr = 0.01;
  p.max_lr = 0.2;
  p.step_size_up = 3;
  p.step_size_down = 3;
  for (const std::string plugins : {"cyclic_lr,swa,lr_monitor", "swa,lr_monitor,cyclic_lr"}) {
    TempDir dir("swa");
    auto r = train(dir, R"(
[swa]
swa_lrs = [0.02]
swa_epoch_start = 3
annealing_epochs = 1
annealing_strategy = "linear"
[cyclic_lr]
base_lr = 0.01
max_lr = 0.2
step_size_up = 3
cycle_momentum = false
)",
                   plugins);
    ASSERT_EQ(r.result.exit_code, 0) << plugins << ": " << r.result.err;
    auto lr = column(r.dir, "lr-SGD");
    ASSERT_EQ(lr.size(), 20u) << plugins;
    const double lr0 = ember::support::cyclic_lr(p, 12);  // the rate in place when SWA starts (after 12 steps)
    for (const auto& [step, v] : lr) {
      const int64_t epoch = step / 4;
      const double expected = epoch < 3 ? ember::support::cyclic_lr(p, step)
                                        : ember::support::swalr(lr0, 0.02, epoch - 3, 1, ember::support::AnnealStrategy::linear);
      EXPECT_NEAR(v, expected, 1e-12) << plugins << " at step " << step;
    }
  }
}

TEST(Swa, RecomputesBatchNormStatisticsForTheAveragedWeights) {
  TempDir dir("swa");
  auto r = train(dir, "\n[swa]\nswa_lrs = [0.05]\nswa_epoch_start = 1\n", "swa", {"--set", "trainer.max_epochs=3"}, kBnMlp);
  ASSERT_EQ(r.result.exit_code, 0) << r.result.err;
  const Weights w = checkpoint_weights(r.dir / "checkpoints/last.ckpt");
  EXPECT_EQ(w.at("bn.num_batches_tracked").item<int64_t>(), 4);  // one cumulative pass of 4 batches
  // update_bn with momentum None: the running mean is the mean of the 4 batch means, the running
  // variance the mean of the 4 unbiased batch variances, of fc1's output under the averaged weights.
  at::Tensor x = training_inputs(64, 16, 4, 0.5);
  at::Tensor h = at::linear(x, w.at("fc1.weight"), w.at("fc1.bias"));
  at::Tensor mean = at::zeros({8}), var = at::zeros({8});
  for (int64_t b = 0; b < 4; ++b) {
    at::Tensor hb = h.narrow(0, b * 16, 16);
    mean += hb.mean(0) / 4.0;
    var += hb.var(0, /*unbiased=*/true) / 4.0;
  }
  expect_close(w.at("bn.running_mean"), mean, "running_mean");
  expect_close(w.at("bn.running_var"), var, "running_var");
}

TEST(Swa, ResumeIsExactEvenFromTheFinishedRun) {
  // With batch norm: the finished 2-epoch run holds averaged weights and recomputed statistics;
  // the resume must go on from the model's own weights and buffers.
  const std::string extra = R"(
[swa]
swa_lrs = [0.05]
swa_epoch_start = 1
annealing_epochs = 2
)";
  TempDir full("swa"), split("swa");
  auto a = train(full, extra, "swa", {"--set", "trainer.max_epochs=4"}, kBnMlp);
  ASSERT_EQ(a.result.exit_code, 0) << a.result.err;
  auto b = train(split, extra, "swa", {"--set", "trainer.max_epochs=2"}, kBnMlp);
  ASSERT_EQ(b.result.exit_code, 0) << b.result.err;
  auto c = train(split, extra, "swa", {"--set", "trainer.max_epochs=4", "--resume", "last"}, kBnMlp);
  ASSERT_EQ(c.result.exit_code, 0) << c.result.err;
  const Weights wa = checkpoint_weights(a.dir / "checkpoints/last.ckpt"), wc = checkpoint_weights(c.dir / "checkpoints/last.ckpt");
  for (const auto& [k, v] : wa) EXPECT_TRUE(at::equal(v, wc.at(k))) << k << " differs after resume";
}

TEST(Ema, EqualsTheMovingAverageOfTheStepSnapshots) {
  TempDir dir("ema");
  // decay 0.9, step indices 1.. with index % 2 == 0 (Lightning's rule): updates after the steps
  // with index 2, 4 and 6, i.e. global steps 3, 5 and 7.
  auto r = train(dir, R"(
[ema]
decay = 0.9
update_every_n_steps = 2
update_starting_at_step = 1
[weight_snapshot]
dir = "snaps"
every_step = true
)",
                 "weight_snapshot,ema", {"--set", "trainer.max_epochs=2"});
  ASSERT_EQ(r.result.exit_code, 0) << r.result.err;
  Weights ema = snapshot(dir / "snaps/step3.pt");
  for (int s : {5, 7})
    for (auto& [name, t] : ema) t = t + 0.1 * (snapshot(dir / ("snaps/step" + std::to_string(s) + ".pt")).at(name) - t);
  const fs::path last = r.dir / "checkpoints/last.ckpt";
  const Weights saved = checkpoint_weights(last);
  for (const auto& [name, t] : ema) {
    if (!t.is_floating_point()) continue;
    expect_close(saved.at(name), t, name);
  }
  // The model's own weights travel in the plugin's state, for resuming.
  auto ck = ember::engine::load_checkpoint_file(last);
  auto own = ck.at("callbacks").toGenericDict().at("ema").toGenericDict().at("model").toTensorVector();
  const Weights s8 = snapshot(dir / "snaps/step8.pt");
  ASSERT_FALSE(own.empty());
  EXPECT_TRUE(at::equal(own[0], s8.at("fc1.weight")));
}

TEST(Ema, ResumeIsExact) {
  const std::string extra = "\n[ema]\ndecay = 0.8\n";
  TempDir full("ema"), split("ema");
  auto a = train(full, extra, "ema", {"--set", "trainer.max_epochs=4"});
  ASSERT_EQ(a.result.exit_code, 0) << a.result.err;
  auto b = train(split, extra, "ema", {"--set", "trainer.max_epochs=2"});
  ASSERT_EQ(b.result.exit_code, 0) << b.result.err;
  auto c = train(split, extra, "ema", {"--set", "trainer.max_epochs=4", "--resume", "last"});
  ASSERT_EQ(c.result.exit_code, 0) << c.result.err;
  auto own = [](const fs::path& f) {
    return ember::engine::load_checkpoint_file(f).at("callbacks").toGenericDict().at("ema").toGenericDict().at("model").toTensorVector();
  };
  const Weights wa = checkpoint_weights(a.dir / "checkpoints/last.ckpt"), wc = checkpoint_weights(c.dir / "checkpoints/last.ckpt");
  for (const auto& [k, v] : wa) EXPECT_TRUE(at::equal(v, wc.at(k))) << k << " (average) differs after resume";
  auto oa = own(a.dir / "checkpoints/last.ckpt"), oc = own(c.dir / "checkpoints/last.ckpt");
  ASSERT_EQ(oa.size(), oc.size());
  for (size_t i = 0; i < oa.size(); ++i) EXPECT_TRUE(at::equal(oa[i], oc[i])) << "model tensor " << i << " differs after resume";
}

TEST(Swa, BadSettingsAreOneClearLine) {
  TempDir dir("swa");
  auto r = train(dir, "\n[swa]\nswa_epoch_start = 2\n", "swa");
  EXPECT_NE(r.result.exit_code, 0);
  EXPECT_NE(r.result.err.find("[swa] swa_lrs is required"), std::string::npos) << r.result.err;
  TempDir dir2("swa");
  r = train(dir2, "\n[swa]\nswa_lrs = [0.01]\nswa_epoch_start = 1.5\n", "swa");
  EXPECT_NE(r.result.exit_code, 0);
  EXPECT_NE(r.result.err.find("should be an integer >= 1 (an epoch) or a float in (0, 1]"), std::string::npos) << r.result.err;
}
