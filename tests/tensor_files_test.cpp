// The tensor_files data plugin: arrays prepared elsewhere, written by numpy.save or safetensors,
// memory-mapped. The same data from .npy files and from .safetensors files trains identically
// (every logged value equal), learns the problem, and bad files are one line naming them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

#ifdef EMBER_TEST_PYTHON
namespace {
std::string run_toml(const std::string& train, const std::string& test) {
  return R"([trainer]
accelerator = "cpu"
max_epochs = 3
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
test_after_fit = true
test_ckpt = "current"
deterministic = true
[model]
name = "mlp"
input_size = 8
hidden = [32]
num_classes = 3
[data]
name = "tensor_files"
train = )" + train + R"(
test = )" + test + R"(
val_split = 0.2
batch_size = 32
[optimizer]
name = "adam"
lr = 0.01
)";
}
std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
}  // namespace

TEST(TensorFiles, NpyAndSafetensorsTrainIdenticallyAndLearn) {
  TempDir dir("tensor_files");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/tensor_files.py").string(), "arr"}, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  fs::create_directories(dir / "npy");
  fs::create_directories(dir / "st");
  write_file(dir / "npy/run.toml", run_toml(R"(["../arr/x_train.npy", "../arr/y_train.npy"])", R"(["../arr/x_test.npy", "../arr/y_test.npy"])"));
  write_file(dir / "st/run.toml", run_toml(R"(["../arr/train.safetensors"])", R"(["../arr/test.safetensors"])"));
  auto a = run_engine({"run.toml"}, dir / "npy", {}, 240), b = run_engine({"run.toml"}, dir / "st", {}, 240);
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_NE(a.err.find("tensor_files: 480 train, 120 val, 250 test samples, inputs Float [8], labels Long"), std::string::npos) << a.err;
  EXPECT_EQ(slurp(dir / "npy/runs/run/version_0/metrics.csv"), slurp(dir / "st/runs/run/version_0/metrics.csv"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(a.out, m, std::regex("test_acc\\s+(\\S+)"))) << a.out;
  EXPECT_GT(std::stod(m[1]), 0.85) << a.out;
}

TEST(TensorFiles, BadFilesAreOneLineNamingThem) {
  TempDir dir("tensor_files");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/tensor_files.py").string(), "arr"}, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  struct Case {
    std::string train, expect;
  };
  const std::vector<Case> cases = {
      {R"(["arr/x_fortran.npy", "arr/y_train.npy"])", "arr/x_fortran.npy: Fortran order"},
      {R"(["arr/x_train.npy", "arr/y_short.npy"])", "do not hold the same number of samples"},
      {R"(["arr/y_train.npy"])", "takes [\"inputs.npy\", \"labels.npy\"] or [\"file.safetensors\"]"},
      {R"(["arr/run.toml.npy", "arr/y_train.npy"])", "cannot open arr/run.toml.npy"},
  };
  for (const auto& c : cases) {
    write_file(dir / "run.toml", run_toml(c.train, "[]"));
    auto e = run_engine({"run.toml"}, dir.path(), {}, 60);
    EXPECT_NE(e.exit_code, 0) << c.train;
    EXPECT_NE(e.err.find(c.expect), std::string::npos) << c.train << "\n" << e.err;
  }
  write_file(dir / "run.toml", run_toml(R"(["arr/train.safetensors"])", "[]"));
  auto named = run_engine({"run.toml", "--set", "data.inputs_name=\"x\""}, dir.path(), {}, 60);
  EXPECT_NE(named.err.find("arr/train.safetensors has no tensor 'x' (set [data] inputs_name to one of its tensors)"), std::string::npos) << named.err;
}
#endif
