// model_summary: Lightning's human-readable counts (table.h), and the table a run prints.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "callback_runs.h"
#include "checkpoint_support.h"
#include "table.h"

using namespace ember::test;
using namespace ember::test::callback_runs;

TEST(ModelSummaryTable, HumanReadableCountsAsLightning) {
  namespace ms = ember_model_summary;
  EXPECT_EQ(ms::human_count(0), "0  ");
  EXPECT_EQ(ms::human_count(320), "320  ");
  EXPECT_EQ(ms::human_count(18496), "18.5 K");
  EXPECT_EQ(ms::human_count(401536), "401 K");
  EXPECT_EQ(ms::human_count(1290), "1.3 K");
  EXPECT_EQ(ms::human_count(2500000), "2.5 M");
  EXPECT_EQ(ms::short_type("torch::nn::Conv2dImpl"), "Conv2d");
}

TEST(ModelSummaryRun, ListsTheCnnLayersOnce) {
  TempDir dir("summary");
  const std::string toml = R"(
[trainer]
max_steps = 1
enable_progress_bar = false
[model]
name = "cnn"
[data]
name = "synthetic"
shape = [1, 28, 28]
num_train = 16
num_val = 0
batch_size = 8
)";
  auto r = run(dir, "s", toml);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // conv1: 1*32*9 + 32; conv2: 32*64*9 + 64; fc1: 64*7*7*128 + 128; fc2: 128*10 + 10.
  for (const char* row : {"| conv1        | Conv2d  | 320    | train", "| conv2        | Conv2d  | 18.5 K | train",
                          "| dropout_conv | Dropout | 0      | train", "| fc1          | Linear  | 401 K  | train",
                          "| fc2          | Linear  | 1.3 K  | train"})
    EXPECT_NE(r.err.find(row), std::string::npos) << row << "\n" << r.err;
  EXPECT_NE(r.err.find("421 K     Trainable params"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("0         Non-trainable params"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("421 K     Total params"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("1.687     Total estimated model params size (MB)"), std::string::npos) << r.err;
  EXPECT_EQ(count(r.err, "Total params"), 1u) << r.err;  // the engine prints no summary of its own
  auto off = run(dir, "off", toml, {"--set", "trainer.enable_model_summary=false"});
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_EQ(count(off.err, "Total params"), 0u) << off.err;
  auto none = run(dir, "zero", toml, {"--set", "model_summary.max_depth=0"});
  ASSERT_EQ(none.exit_code, 0) << none.err;
  EXPECT_EQ(count(none.err, "Total params"), 0u) << none.err;
}
