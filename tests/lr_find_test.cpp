// lr_find: the sweep's schedule, smoothing and suggestion (sweep.h), and runs that find a planted
// rate, leave no trace of their trial steps and do not search again on resume.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "callback_runs.h"
#include "checkpoint_support.h"
#include "sweep.h"

using namespace ember::test;
using namespace ember::test::callback_runs;

TEST(LrFindSweep, ScheduleSmoothingAndSuggestion) {
  namespace lf = ember_lr_find;
  EXPECT_DOUBLE_EQ(lf::lr_at(lf::Mode::exponential, 1e-8, 1.0, 0, 100), 1e-8);
  EXPECT_NEAR(lf::lr_at(lf::Mode::exponential, 1e-8, 1.0, 50, 100), 1e-4, 1e-12);
  EXPECT_NEAR(lf::lr_at(lf::Mode::linear, 1e-3, 1.0 + 1e-3, 25, 100), 0.25 + 1e-3, 1e-12);
  lf::Smoother s;
  EXPECT_NEAR(s.add(2.0), 2.0, 1e-12);  // bias correction: a constant stays constant
  EXPECT_NEAR(s.add(2.0), 2.0, 1e-12);
  lf::Divergence d(4.0);
  EXPECT_FALSE(d.add(1.0));
  EXPECT_FALSE(d.add(0.5));
  EXPECT_FALSE(d.add(1.9));
  EXPECT_TRUE(d.add(2.1));
  // Steepest descent, after skipping the first 10 and the last point.
  std::vector<double> curve;
  for (int i = 0; i < 40; ++i) curve.push_back(-std::tanh((i - 20) / 3.0));
  EXPECT_EQ(lf::suggestion(curve), 20u);
  curve[5] = -100;  // before skip_begin: ignored
  curve[22] = std::nan("");  // non-finite values drop out
  EXPECT_EQ(lf::suggestion(curve), 21u);
  EXPECT_FALSE(lf::suggestion(std::vector<double>(11, 1.0)).has_value());
}

namespace {
std::string lr_find_toml(double curvature, const std::string& extra = "") {
  return R"(
plugins = ["lr_find"]
[trainer]
max_epochs = 1
limit_train_batches = 2
enable_progress_bar = false
enable_model_summary = false
log_every_n_steps = 1
[model]
name = "tune_probe"
dim = 4
curvature = )" + std::to_string(curvature) + R"(
[data]
name = "synthetic"
task = "regression"
shape = [4]
num_classes = 4
num_train = 64
num_val = 0
batch_size = 8
[optimizer]
name = "sgd"
lr = 0.001
)" + extra;
}

double logged_suggestion(const std::string& err) {
  std::smatch m;
  const std::regex re("lr_find: suggested learning rate ([0-9.eE+-]+)");
  if (!std::regex_search(err, m, re)) return NAN;
  return std::stod(m[1]);
}

// Width and height from a PNG's IHDR chunk; 0x0 when the file is no PNG.
std::pair<uint32_t, uint32_t> png_size(const fs::path& p) {
  const std::string b = read_file(p);
  if (b.size() < 24 || b.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0 || b.compare(12, 4, "IHDR") != 0) return {0, 0};
  auto be32 = [&](size_t o) {
    return (uint32_t(uint8_t(b[o])) << 24) | (uint32_t(uint8_t(b[o + 1])) << 16) | (uint32_t(uint8_t(b[o + 2])) << 8) | uint8_t(b[o + 3]);
  };
  return {be32(16), be32(20)};
}
}  // namespace

TEST(LrFindRun, FindsThePlantedRateAndTrainsWithIt) {
  TempDir dir("lrfind");
  // SGD on a bowl of curvature a converges fastest at lr = 1/a and diverges above 2/a; the
  // steepest descent of the loss over the sweep lies a few times below 1/a. Two curvatures ten
  // times apart must give suggestions in the same band, ten times apart.
  double found[2] = {0, 0};
  const double curvature[2] = {1.0, 10.0};
  for (int k = 0; k < 2; ++k) {
    const std::string name = "a" + std::to_string(k);
    // The second sweep goes up to 10, far beyond 2/a = 0.2: the loss blows up and the sweep stops.
    auto r = run(dir, name, lr_find_toml(curvature[k], k == 0 ? "" : "[lr_find]\nmax_lr = 10.0\n"));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const fs::path run_dir = dir / "runs" / name / "version_0";
    found[k] = logged_suggestion(r.err);
    EXPECT_GT(found[k] * curvature[k], 0.1) << r.err;
    EXPECT_LT(found[k] * curvature[k], 1.0) << r.err;
    const auto rows = read_csv(run_dir / "lr_find.csv");
    if (k == 0) EXPECT_EQ(rows.size(), 100u);  // max_lr = 1 < 2/a: no divergence
    else EXPECT_LT(rows.size(), 100u);         // diverged: stopped early
    ASSERT_GE(rows.size(), 12u);
    EXPECT_DOUBLE_EQ(std::stod(rows.front().at("lr")), 1e-8);
    if (EMBER_TEST_WITH_CAIRO) {
      EXPECT_EQ(png_size(run_dir / "lr_find.png"), (std::pair<uint32_t, uint32_t>{900, 600}));
    } else {  // a build without cairo writes the CSV and says why there is no plot
      EXPECT_FALSE(fs::exists(run_dir / "lr_find.png"));
      EXPECT_NE(r.err.find("no lr_find.png: this build has no cairo"), std::string::npos) << r.err;
    }
    // The training that follows uses the suggestion (the model logs its optimizer's rate).
    const double suggestion = callback_state(run_dir / "checkpoints/last.ckpt", "lr_find").at("suggestion").toDouble();
    EXPECT_NEAR(suggestion, found[k], found[k] * 1e-3);
    const auto lrs = column(run_dir, "probe_lr");
    ASSERT_FALSE(lrs.empty()) << r.err;
    for (double lr : lrs) EXPECT_NEAR(lr, suggestion, suggestion * 1e-6);
  }
  EXPECT_GT(found[0] / found[1], 5.0);
  EXPECT_LT(found[0] / found[1], 20.0);
}

TEST(LrFindRun, TrialStepsLeaveNoTraceAndResumeDoesNotSearchAgain) {
  TempDir dir("lrfind");
  // An MLP with dropout on shuffled data: the run after the sweep must be the run without it
  // (weights, optimizer moments, RNG and loop position restored).
  const std::string base = R"(
[trainer]
max_steps = 3
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [16]
dropout = 0.3
[data]
name = "synthetic"
shape = [8]
num_train = 64
num_val = 0
batch_size = 8
)";
  auto plain = run(dir, "plain", base);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  auto swept = run(dir, "swept", base + "[lr_find]\nupdate_attr = false\nnum_training_steps = 20\nearly_stop_threshold = 0\n",
                   {"--plugins", "lr_find"});
  ASSERT_EQ(swept.exit_code, 0) << swept.err;
  ASSERT_NE(swept.err.find("lr_find: suggested learning rate"), std::string::npos) << swept.err;
  auto a = weights(dir / "runs/plain/version_0/checkpoints/last.ckpt");
  auto b = weights(dir / "runs/swept/version_0/checkpoints/last.ckpt");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
  EXPECT_EQ(load(dir / "runs/swept/version_0/checkpoints/last.ckpt").at("global_step").toInt(), 3);
  for (const auto& e : fs::directory_iterator(dir / "runs/swept/version_0"))  // the temporary checkpoint is gone
    EXPECT_EQ(e.path().filename().string().find(".lr_find"), std::string::npos) << e.path();

  // Resume: the suggestion is in the state; no second sweep, the rate in use stays.
  auto first = run(dir, "res", lr_find_toml(1.0));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const fs::path run_dir = dir / "runs/res/version_0";
  const double suggestion = callback_state(run_dir / "checkpoints/last.ckpt", "lr_find").at("suggestion").toDouble();
  const auto csv_before = read_file(run_dir / "lr_find.csv");
  auto second = run(dir, "res", lr_find_toml(1.0), {"--resume", "last", "--set", "trainer.max_epochs=2"});
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_NE(second.err.find("not searching again"), std::string::npos) << second.err;
  EXPECT_EQ(second.err.find("lr_find: suggested learning rate"), std::string::npos) << second.err;
  EXPECT_EQ(read_file(run_dir / "lr_find.csv"), csv_before);
  const auto lrs = column(run_dir, "probe_lr");
  ASSERT_GE(lrs.size(), 4u);
  EXPECT_NEAR(lrs.back(), suggestion, suggestion * 1e-6);
  EXPECT_DOUBLE_EQ(callback_state(run_dir / "checkpoints/last.ckpt", "lr_find").at("suggestion").toDouble(), suggestion);
}
