// Precision handlers on real runs: the loss scaler's skip/backoff/growth sequence with planted
// inf gradients (also under accumulation), unscaling before clipping, exact resume with the
// scaler state, a falling and finite loss for every mode on the CNN, and the dtypes each mode
// promises for parameters, gradients and activations, with the process default dtype left alone.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <ember/support/precision_util.h>

#include "checkpoint/checkpoint_io.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// Regression MLP without dropout on generated data: every step is deterministic.
const char* kMlp = R"(
[trainer]
max_epochs = 1
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
log_every_n_steps = 1
deterministic = true
[model]
name = "mlp"
task = "regression"
input_size = 12
hidden = [16]
num_classes = 3
[data]
name = "synthetic"
task = "regression"
shape = [12]
num_classes = 3
num_train = 256
num_val = 32
num_test = 0
batch_size = 16
shuffle = true
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
)";

struct Run {
  fs::path dir;
  ProcessResult result;
};

Run train(const TempDir& dir, const std::string& name, const std::string& config, std::vector<std::string> sets,
          std::vector<std::string> args = {}) {
  write_file(dir / (name + ".toml"), config);
  std::vector<std::string> cmd = {name + ".toml", "--plugin-path", test_plugin_dir("good").string()};
  for (const auto& s : sets) cmd.insert(cmd.end(), {"--set", s});
  cmd.insert(cmd.end(), args.begin(), args.end());
  auto r = run_engine(cmd, dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return {dir / "runs" / name / "version_0", r};
}

struct BatchLine {
  int64_t batch, step;
  bool stepped, skipped;
  double change;
};

std::vector<BatchLine> poison_trace(const fs::path& p) {
  std::vector<BatchLine> out;
  std::ifstream in(p);
  BatchLine l{};
  while (in >> l.batch >> l.step >> l.stepped >> l.skipped >> l.change) out.push_back(l);
  return out;
}

// metrics.csv column `name` by step, for rows that have it.
std::map<int64_t, double> column(const fs::path& csv, const std::string& name) {
  std::map<int64_t, double> out;
  for (const auto& row : read_csv(csv))
    if (row.count(name) && !row.at(name).empty()) out[std::stoll(row.at("step"))] = std::stod(row.at(name));
  return out;
}

}  // namespace

// The same planted pattern as GradScaler.MatchesPythonGradScalerSkipBackoffGrowth, whose scales
// come from torch.amp.GradScaler itself.
TEST(Precision, Amp16SkipsBacksOffAndGrowsLikeGradScaler) {
  TempDir dir("precision");
  auto run = train(dir, "amp", std::string(kMlp) + "\n[amp16]\ninit_scale = 1024.0\ngrowth_interval = 3\n[grad_poison]\nbatches = [3, 8, 9]\n",
                   {"trainer.max_steps=13", "trainer.max_epochs=-1"}, {"--plugins", "amp16,grad_poison"});
  auto trace = poison_trace(dir / "poison.txt");
  ASSERT_EQ(trace.size(), 13u);
  for (const auto& l : trace) {
    const bool poisoned = l.batch == 3 || l.batch == 8 || l.batch == 9;
    EXPECT_TRUE(l.stepped) << "batch " << l.batch;
    EXPECT_EQ(l.skipped, poisoned) << "batch " << l.batch;
    if (poisoned) EXPECT_EQ(l.change, 0.0) << "a skipped step changed the weights, batch " << l.batch;
    else EXPECT_GT(l.change, 0.0) << "batch " << l.batch;
  }
  const double expected[] = {1024, 1024, 2048, 1024, 1024, 1024, 2048, 2048, 1024, 512, 512, 512, 1024};
  auto scales = column(run.dir / "metrics.csv", "amp_scale");
  auto skipped = column(run.dir / "metrics.csv", "amp_skipped_steps");
  ASSERT_EQ(scales.size(), 13u);
  for (int64_t s = 0; s < 13; ++s) EXPECT_EQ(scales[s], expected[s]) << "scale after step " << s;
  EXPECT_EQ(skipped[2], 0.0);
  EXPECT_EQ(skipped[3], 1.0);
  EXPECT_EQ(skipped[12], 3.0);
}

TEST(Precision, Amp16UnderAccumulationSkipsOnlyTheWindowWithAnInf) {
  TempDir dir("precision");
  // Windows of two micro-batches: batch 2 opens window 1, batch 7 closes window 3.
  auto run = train(dir, "acc", std::string(kMlp) + "\n[amp16]\ninit_scale = 1024.0\ngrowth_interval = 2\n[grad_poison]\nbatches = [2, 7]\n",
                   {"trainer.max_steps=6", "trainer.max_epochs=-1", "trainer.accumulate_grad_batches=2"},
                   {"--plugins", "amp16,grad_poison"});
  auto trace = poison_trace(dir / "poison.txt");
  ASSERT_EQ(trace.size(), 12u);
  for (const auto& l : trace) {
    const int64_t window = l.batch / 2;
    const bool closes = l.batch % 2 == 1;
    EXPECT_EQ(l.stepped, closes) << "batch " << l.batch;
    EXPECT_EQ(l.skipped, closes && (window == 1 || window == 3)) << "batch " << l.batch;
    if (!closes || window == 1 || window == 3) EXPECT_EQ(l.change, 0.0) << "batch " << l.batch;
    else EXPECT_GT(l.change, 0.0) << "batch " << l.batch;
  }
  // finite (tracker 1), inf (x0.5), finite, inf (x0.5), finite, finite (x2)
  auto scales = column(run.dir / "metrics.csv", "amp_scale");
  const double expected[] = {1024, 512, 512, 256, 256, 512};
  ASSERT_EQ(scales.size(), 6u);
  for (int64_t s = 0; s < 6; ++s) EXPECT_EQ(scales[s], expected[s]) << "scale after step " << s;
}

TEST(Precision, Amp16UnscalesBeforeClipping) {
  TempDir dir("precision");
  // Clipped to 1e-3 by value with lr 1, the largest weight change is 1e-3 when clipping sees
  // true gradients; clipping scaled ones (then unscaling) would move weights by 1e-3 / 65536.
  train(dir, "clip", std::string(kMlp) + "\n[grad_poison]\n",
        {"trainer.max_steps=1", "trainer.gradient_clip_val=0.001", "trainer.gradient_clip_algorithm=\"value\"",
         "optimizer.lr=1.0", "optimizer.momentum=0.0", "trainer.precision=\"16-mixed\""},
        {"--plugins", "grad_poison"});
  auto trace = poison_trace(dir / "poison.txt");
  ASSERT_EQ(trace.size(), 1u);
  EXPECT_NEAR(trace[0].change, 1e-3, 1e-6);
}

TEST(Precision, Amp16ResumeIsExactWithTheScalerState) {
  TempDir full("precision"), split("precision");
  const std::string cfg = std::string(kMlp) + "\n[amp16]\ninit_scale = 256.0\ngrowth_interval = 3\n[grad_poison]\nbatches = [5, 20, 21]\n";
  // 16 batches per epoch; the scale changes in both halves.
  auto a = train(full, "run", cfg, {"trainer.max_epochs=3"}, {"--plugins", "amp16,grad_poison"});
  train(split, "run", cfg, {"trainer.max_epochs=1"}, {"--plugins", "amp16,grad_poison"});
  auto b = train(split, "run", cfg, {"trainer.max_epochs=3"}, {"--plugins", "amp16,grad_poison", "--resume", "last"});
  auto ca = ember::engine::load_checkpoint_file(a.dir / "checkpoints/last.ckpt");
  auto cb = ember::engine::load_checkpoint_file(b.dir / "checkpoints/last.ckpt");
  auto wa = ca.at("state_dict").toGenericDict(), wb = cb.at("state_dict").toGenericDict();
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& e : wa) EXPECT_TRUE(at::equal(e.value().toTensor(), wb.at(e.key()).toTensor())) << e.key().toStringRef();
  auto sa = ca.at("plugins").toGenericDict().at("precision").toGenericDict();
  auto sb = cb.at("plugins").toGenericDict().at("precision").toGenericDict();
  for (const char* key : {"scale", "_growth_tracker", "skipped_steps"})
    EXPECT_EQ(sa.at(key), sb.at(key)) << key;
  EXPECT_EQ(sa.at("skipped_steps").toInt(), 3);
  // The scale the resumed half started from was the checkpoint's, not init_scale: without the
  // restore, the resumed run's first scale would be 256.
  auto scales = column(b.dir / "metrics.csv", "amp_scale");
  ASSERT_TRUE(scales.count(16));
  EXPECT_NE(scales[16], 256.0);
}

// ---------------------------------------------------------------------------------------------
// Every mode, on the CNN: a few hundred steps with a finite, falling loss.
class EveryMode : public ::testing::TestWithParam<const char*> {};

TEST_P(EveryMode, TrainsTheCnnWithAFallingFiniteLoss) {
  TempDir dir("precision");
  const char* cfg = R"(
[trainer]
max_epochs = 4
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
log_every_n_steps = 10
[model]
name = "cnn"
image_size = 12
conv1_channels = 4
conv2_channels = 8
hidden = 32
dropout_conv = 0.0
dropout_fc = 0.0
[data]
name = "synthetic"
shape = [1, 12, 12]
noise = 1.0
num_train = 800
num_val = 0
num_test = 0
batch_size = 16
shuffle = true
[optimizer]
name = "sgd"
lr = 0.01
momentum = 0.9
)";
  auto run = train(dir, "cnn", cfg, {std::string("trainer.precision=\"") + GetParam() + "\""});
  auto loss = column(run.dir / "metrics.csv", "train_loss_step");
  ASSERT_GE(loss.size(), 19u) << "200 steps, logged every 10";
  std::vector<double> v;
  for (const auto& [step, l] : loss) {
    EXPECT_TRUE(std::isfinite(l)) << "step " << step;
    v.push_back(l);
  }
  const double first = (v[0] + v[1] + v[2]) / 3, last = (v[v.size() - 1] + v[v.size() - 2] + v[v.size() - 3]) / 3;
  EXPECT_LT(last, 0.5 * first) << GetParam() << ": loss went from " << first << " to " << last;
}

INSTANTIATE_TEST_SUITE_P(Precision, EveryMode, ::testing::Values("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& c : s) if (c == '-') c = '_';
                           return "p" + s;
                         });

// ---------------------------------------------------------------------------------------------
// The dtypes each mode promises.
struct DtypeCase {
  const char* precision;
  const char* param;       // and gradient
  const char* activation;  // what the hidden layer computed in
  const char* input;
};

void PrintTo(const DtypeCase& c, std::ostream* os) { *os << c.precision; }

class ModeDtypes : public ::testing::TestWithParam<DtypeCase> {};

TEST_P(ModeDtypes, ParametersGradientsAndActivations) {
  const auto& c = GetParam();
  TempDir dir("precision");
  const std::string cfg = R"(
[trainer]
max_steps = 2
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[model]
name = "dtype_probe"
[data]
name = "synthetic"
shape = [16]
num_classes = 4
num_train = 64
num_val = 0
num_test = 0
[optimizer]
name = "sgd"
lr = 0.01
)";
  train(dir, "dt", cfg, {std::string("trainer.precision=\"") + c.precision + "\""});
  std::set<std::string> got;
  std::ifstream in(dir / "dtypes.txt");
  for (std::string l; std::getline(in, l);) got.insert(l);
  const std::string p(c.param), a(c.activation), i(c.input);
  std::set<std::string> want = {"input=" + i, "activation=" + a, "param=" + p, "grad=" + p,
                                // Autocast computes losses in float32 (cross-entropy is on its fp32 list).
                                "loss=" + std::string(a == "Half" || a == "BFloat16" ? (p == "Float" ? "Float" : a) : a)};
  EXPECT_EQ(got, want) << c.precision;
}

INSTANTIATE_TEST_SUITE_P(Precision, ModeDtypes,
                         ::testing::Values(DtypeCase{"32-true", "Float", "Float", "Float"},
                                           DtypeCase{"64-true", "Double", "Double", "Double"},
                                           DtypeCase{"16-mixed", "Float", "Half", "Float"},
                                           DtypeCase{"bf16-mixed", "Float", "BFloat16", "Float"},
                                           DtypeCase{"16-true", "Half", "Half", "Half"},
                                           DtypeCase{"bf16-true", "BFloat16", "BFloat16", "BFloat16"}),
                         [](const auto& info) {
                           std::string s = info.param.precision;
                           for (auto& ch : s) if (ch == '-') ch = '_';
                           return "p" + s;
                         });

// ---------------------------------------------------------------------------------------------
// The process's default dtype is never switched: it is one global, and loader threads (or
// anything else) creating tensors while a 16-true / bf16-true / 64-true step runs would get the
// wrong dtype.
TEST(DefaultDtype, UniformPrecisionLeavesTheProcessDefaultAlone) {
  for (const auto dtype : {at::kHalf, at::kBFloat16, at::kDouble}) {
    ember::UniformPrecision precision(c10::toString(dtype), dtype, "");
    precision.forward_begin();
    c10::ScalarType other_thread = at::kByte;
    std::thread([&] { other_thread = at::empty({1}).scalar_type(); }).join();
    const c10::ScalarType this_thread = at::empty({1}).scalar_type();
    precision.forward_end();
    EXPECT_EQ(other_thread, at::kFloat) << c10::toString(dtype);
    EXPECT_EQ(this_thread, at::kFloat) << c10::toString(dtype);
  }
}

class LoaderThreadDtype : public ::testing::TestWithParam<const char*> {};

// Two loader workers sample the default dtype for 10 ms per batch while each step waits 10 ms
// inside forward: with a per-forward switch they saw float16/bfloat16 (and built batches in it).
TEST_P(LoaderThreadDtype, LoaderThreadsSeeFloat32WhileAStepRuns) {
  const std::string precision = GetParam();
  TempDir dir("precision");
  const std::string cfg = R"(
[trainer]
max_steps = 12
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
logger = false
num_sanity_val_steps = 0
limit_val_batches = 0
[model]
name = "dtype_probe"
step_sleep_ms = 10
[data]
name = "default_dtype_data"
num_samples = 96
sample_ms = 10
batch_size = 8
num_workers = 2
[optimizer]
name = "sgd"
lr = 0.01
)";
  auto run = train(dir, "dt", cfg, {"trainer.precision=\"" + precision + "\""});
  ASSERT_EQ(run.result.exit_code, 0) << run.result.err;
  std::set<std::string> loader, model;
  std::ifstream in(dir / "loader_dtypes.txt");
  for (std::string l; std::getline(in, l);) loader.insert(l);
  std::ifstream m(dir / "dtypes.txt");
  for (std::string l; std::getline(m, l);) model.insert(l);
  EXPECT_EQ(loader, (std::set<std::string>{"Float"})) << precision;
  // And the mode itself is intact: parameters, inputs, activations and gradients in its dtype.
  const std::string want = precision == "16-true" ? "Half" : "BFloat16";
  for (const char* what : {"param=", "input=", "activation=", "grad="})
    EXPECT_TRUE(model.count(what + want)) << precision << ": no " << what << want;
}

INSTANTIATE_TEST_SUITE_P(DefaultDtype, LoaderThreadDtype, ::testing::Values("16-true", "bf16-true"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& c : s) if (c == '-') c = '_';
                           return "p" + s;
                         });
