// The csv logger (plugins/loggers/csv): a flush appends the new rows to metrics.csv in place
// (durable, linear in the rows written, not a copy of the whole file), new columns rewrite the file
// under the new header, and a resumed run drops a last row a crash cut short as well as the rows
// after its checkpoint.
#include <gtest/gtest.h>

#include <ember/fabric.h>
#include <ember/run.h>

#include <sys/stat.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "metrics_csv.h"
#include "support.h"

namespace fs = std::filesystem;
using ember::test::TempDir;

namespace {

ino_t inode_of(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_ino;
}

}  // namespace

TEST(CsvLogger, FlushAppendsInPlaceAndNewColumnsRewriteTheHeader) {
  TempDir dir("csv_logger");
  ember::Fabric f({.accelerator = "cpu", .plugin_config = "[csv]\nflush_logs_every_n_steps = 1\n", .loggers = {"csv"},
                   .root_dir = dir.path().string()});
  f.log("a", 1.0, 0);  // every call flushes
  const fs::path csv = fs::path(f.log_dir()) / "metrics.csv";
  EXPECT_EQ(ember::test::read_file(csv), "a,step\n1,0\n");
  const ino_t first = inode_of(csv);
  f.log("a", 2.0, 1);
  EXPECT_EQ(ember::test::read_file(csv), "a,step\n1,0\n2,1\n");
  EXPECT_EQ(inode_of(csv), first);  // appended to the same file, not a copy renamed over it
  f.log_dict({{"a", 3.0}, {"b", 4.0}}, 2);  // a new column: the file is rewritten under a,b,step
  EXPECT_EQ(ember::test::read_file(csv), "a,b,step\n1,,0\n2,,1\n3,4,2\n");
  const ino_t rewritten = inode_of(csv);
  f.log("b", 5.0, 3);
  EXPECT_EQ(ember::test::read_file(csv), "a,b,step\n1,,0\n2,,1\n3,4,2\n,5,3\n");
  EXPECT_EQ(inode_of(csv), rewritten);
  for (const auto& e : fs::directory_iterator(csv.parent_path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();  // no temporary left
}

TEST(CsvLogger, DurableAppendAndCompleteRecords) {
  TempDir dir("csv_logger");
  const fs::path p = dir / "m.csv";
  ember_csv::write_atomic(p, "a,step\n");
  ember_csv::append_durable(p, "1,0\n");
  ember_csv::append_durable(p, "\"x\ny\",1\n");
  EXPECT_EQ(ember::test::read_file(p), "a,step\n1,0\n\"x\ny\",1\n");
  EXPECT_THROW(ember_csv::append_durable(dir / "missing.csv", "1\n"), std::runtime_error);
  EXPECT_EQ(ember_csv::complete_records("a,step\n1,0\n2,"), 11u);         // a row cut short
  EXPECT_EQ(ember_csv::complete_records("a,step\n1,0\n\"x\ny"), 11u);     // cut inside a quoted line break
  EXPECT_EQ(ember_csv::complete_records("a,step\n\"x\ny\",1\n"), 15u);    // a quoted line break is not an end
  EXPECT_EQ(ember_csv::complete_records("a,step\r\n1,0\r\n"), 13u);
  EXPECT_EQ(ember_csv::complete_records(""), 0u);
}

// A crash while appending can leave half a row at the end of metrics.csv; the resumed run drops it
// (and, as before, the rows after its checkpoint), so every epoch has its row exactly once.
TEST(CsvLogger, ResumeDropsARowACrashCutShort) {
  TempDir dir("csv_logger");
  auto make_options = [&](int64_t epochs, const std::string& resume) {
    torch::manual_seed(0);
    auto net = std::make_shared<torch::nn::LinearImpl>(4, 2);
    ember::RunOptions o;
    o.config_toml = "[trainer]\nmax_epochs = " + std::to_string(epochs) +
                    "\nseed = 7\nenable_progress_bar = false\nenable_model_summary = false\nnum_sanity_val_steps = 0\n"
                    "default_root_dir = \"" + dir.path().string() + "\"\nname = \"csv\"\n"
                    "[data]\nbatch_size = 16\n[optimizer]\nname = \"sgd\"\nlr = 0.1\n";
    o.model = std::make_shared<ember::ModuleModel>(net, [](torch::nn::Module& m, const ember::Batch& b) {
      return torch::nn::functional::cross_entropy(static_cast<torch::nn::LinearImpl&>(m).forward(b[0]), b[1]);
    });
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    auto x = at::randn({64, 4}, gen);
    auto y = x.select(1, 0).gt(0).to(at::kLong);
    o.data = std::make_shared<ember::TensorData>(std::vector<at::Tensor>{x, y}, std::vector<at::Tensor>{x, y});
    o.resume = resume;
    return o;
  };
  {
    ember::Run run(make_options(2, ""));
    run.fit();
  }
  const fs::path csv = dir / "csv/version_0/metrics.csv";
  ASSERT_TRUE(fs::exists(csv));
  std::ofstream(csv, std::ios::app) << "0.125,1,99";  // half a row, no line end
  {
    ember::Run run(make_options(3, "last"));
    run.fit();
  }
  EXPECT_FALSE(fs::exists(dir / "csv/version_1"));
  const std::string text = ember::test::read_file(csv);
  EXPECT_EQ(text.find("0.125,1,99"), std::string::npos) << text;
  EXPECT_EQ(text.back(), '\n');
  std::map<std::string, int> val_rows_per_epoch;
  const auto rows = ember::test::read_csv(csv);
  EXPECT_EQ(rows.size(), 6u) << text;  // per epoch: a validation row and a training-epoch row
  for (const auto& row : rows) {
    EXPECT_NE(row.at("epoch"), "0.125") << text;
    if (!row.at("val_loss").empty()) ++val_rows_per_epoch[row.at("epoch")];
  }
  EXPECT_EQ(val_rows_per_epoch, (std::map<std::string, int>{{"0", 1}, {"1", 1}, {"2", 1}}));
}
