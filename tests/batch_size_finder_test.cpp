// batch_size_finder: power and binary search (search.h), and runs against a planted limit, a CPU
// memory budget and out-of-memory, resume included.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "callback_runs.h"
#include "checkpoint_support.h"
#include "search.h"

using namespace ember::test;
using namespace ember::test::callback_runs;

TEST(BatchSizeSearch, PowerAndBinsearchFindAPlantedLimit) {
  namespace bs = ember_batch_size;
  auto limit = [](int64_t max) {
    return [max](int64_t n) { return n <= max ? bs::Outcome::fits : bs::Outcome::too_big; };
  };
  bs::Settings s;
  EXPECT_EQ(bs::search(s, limit(37)).size, 32);
  EXPECT_EQ(bs::search(s, limit(1)).size, 1);
  EXPECT_EQ(bs::search(s, limit(0)).size, 0);
  s.max_val = 20;
  EXPECT_EQ(bs::search(s, limit(100)).size, 20);
  s = {};
  s.mode = bs::Mode::binsearch;
  s.margin = 0;
  for (int64_t max : {1, 2, 3, 37, 64, 100, 1000}) EXPECT_EQ(bs::search(s, limit(max)).size, max) << max;
  s.margin = 0.05;
  EXPECT_EQ(bs::search(s, limit(100)).size, 95);
  s.margin = 0;
  s.init_val = 64;
  EXPECT_EQ(bs::search(s, limit(5)).size, 5);
  // The data's own size is a limit like memory.
  auto data = [](int64_t n) { return n <= 48 ? bs::Outcome::fits : bs::Outcome::data_limit; };
  s.init_val = 2;
  EXPECT_EQ(bs::search(s, data).size, 48);
}

namespace {
std::string bsf_toml(const std::string& model_extra, const std::string& finder) {
  return R"(
plugins = ["batch_size_finder"]
[trainer]
# The planted limits are CPU memory budgets.
accelerator = "cpu"
max_steps = 2
enable_progress_bar = false
enable_model_summary = false
log_every_n_steps = 1
[model]
name = "tune_probe"
dim = 4
)" + model_extra + R"(
[data]
name = "synthetic"
task = "regression"
shape = [4]
num_classes = 4
num_train = 256
num_val = 0
batch_size = 4
[optimizer]
name = "sgd"
lr = 0.01
[batch_size_finder]
)" + finder;
}

int64_t found_size(const fs::path& run_dir) {
  return callback_state(run_dir / "checkpoints/last.ckpt", "batch_size_finder").at("batch_size").toInt();
}
}  // namespace

TEST(BatchSizeFinderRun, CpuMemoryBudgetAdmitsThePlantedSize) {
  TempDir dir("bsf");
  // tune_probe holds 1 MiB per sample from forward to backward and allocates nothing else of
  // that size: a step's peak is 1 MiB per sample plus a few KB. A budget of 37.5 MiB admits
  // exactly 37.
  const std::string model = "bytes_per_sample = 1048576\n";
  const std::string budget = "memory_budget_mb = " + std::to_string((37 * 1048576 + 524288) / 1e6) + "\n";
  struct Case {
    const char* name;
    std::string finder;
    int64_t expected;
  };
  for (const auto& c : std::vector<Case>{{"power", budget, 32},
                                         {"bin", budget + "mode = \"binsearch\"\nmargin = 0.0\n", 37},
                                         {"margin", budget + "mode = \"binsearch\"\n", 35}}) {
    auto r = run(dir, c.name, bsf_toml(model, c.finder));
    ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << r.err;
    const fs::path run_dir = dir / "runs" / c.name / "version_0";
    EXPECT_EQ(found_size(run_dir), c.expected) << c.name << "\n" << r.err;
    const auto sizes = column(run_dir, "probe_batch");  // the batches training then used
    ASSERT_EQ(sizes.size(), 2u) << c.name;
    for (double s : sizes) EXPECT_EQ(s, static_cast<double>(c.expected)) << c.name;
    EXPECT_EQ(load(run_dir / "checkpoints/last.ckpt").at("global_step").toInt(), 2) << c.name;  // trials not counted
  }
}

TEST(BatchSizeFinderRun, OutOfMemoryEndsTheSearchAndResumeReusesTheSize) {
  TempDir dir("bsf");
  // The model throws c10::OutOfMemoryError above 40 samples, as CUDA's allocator would.
  auto power = run(dir, "power", bsf_toml("oom_above = 40\n", ""));
  ASSERT_EQ(power.exit_code, 0) << power.err;
  EXPECT_NE(power.err.find("batch size 64: out of memory"), std::string::npos) << power.err;
  EXPECT_EQ(found_size(dir / "runs/power/version_0"), 32);
  auto bin = run(dir, "bin", bsf_toml("oom_above = 40\n", "mode = \"binsearch\"\nmargin = 0.0\n"));
  ASSERT_EQ(bin.exit_code, 0) << bin.err;
  const fs::path run_dir = dir / "runs/bin/version_0";
  EXPECT_EQ(found_size(run_dir), 40);
  // Resumed: the size is reapplied without searching.
  auto again = run(dir, "bin", bsf_toml("oom_above = 40\n", "mode = \"binsearch\"\nmargin = 0.0\n"),
                   {"--resume", "last", "--set", "trainer.max_steps=4"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.err.find("using batch size 40 found before this resume"), std::string::npos) << again.err;
  EXPECT_EQ(again.err.find("out of memory"), std::string::npos) << again.err;
  const auto sizes = column(run_dir, "probe_batch");
  ASSERT_EQ(sizes.size(), 4u);
  for (double s : sizes) EXPECT_EQ(s, 40.0);
  EXPECT_EQ(found_size(run_dir), 40);
  // Nothing fits: a clear error.
  auto none = run(dir, "none", bsf_toml("bytes_per_sample = 1048576\n", "memory_budget_mb = 1.0\n"));
  EXPECT_EQ(none.exit_code, 1) << none.err;
  EXPECT_NE(none.err.find("not even batch size 1 fits"), std::string::npos) << none.err;
}
