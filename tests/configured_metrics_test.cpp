// The [metrics] table end to end (docs/metrics.md): the engine computes the named metrics from the
// scores the model hands over (IStepContext::update_metrics), exactly over every rank: the same
// numbers and the same confusion matrix on 1, 2 and 3 ranks (10,000 test images do not divide by
// 3), no sample counted twice by tensor-parallel peers or pipeline stages, monitors and loggers
// see <split>_<name>, and bad settings are one line naming the file and line.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "checkpoint_support.h"
#include "mesh_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

const char* kFashion = R"([trainer]
accelerator = "cpu"
max_epochs = 1
limit_train_batches = 40
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
hidden = [64]
[data]
name = "fashion_mnist"
batch_size = 64
eval_batch_size = 500
limit_train_samples = 6000
[metrics]
names = ["accuracy", "f1", "auroc", "confusion_matrix"]
)";

// A value of the metric table `engine test` prints ("test_f1   0.7651").
std::string printed(const std::string& out, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("(^|\\n)" + name + "\\s+(\\S+)"))) return "missing";
  return m[2].str();
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The file `name` under `root` (a run folder somewhere below it); "" when there is none.
fs::path find_file(const fs::path& root, const std::string& name) {
  if (!fs::exists(root)) return {};
  for (const auto& e : fs::recursive_directory_iterator(root))
    if (e.path().filename() == name) return e.path();
  return {};
}

int64_t matrix_total(const std::string& csv) {
  std::istringstream in(csv);
  std::string line;
  std::getline(in, line);  // header
  int64_t total = 0;
  while (std::getline(in, line)) {
    std::istringstream cells(line);
    std::string cell;
    std::getline(cells, cell, ',');  // the row's class
    while (std::getline(cells, cell, ',')) total += std::stoll(cell);
  }
  return total;
}

// The metrics.csv column `name`: its non-empty values, in row order.
std::vector<std::string> column(const fs::path& csv, const std::string& name) {
  std::ifstream in(csv);
  std::string header, line;
  std::getline(in, header);
  std::vector<std::string> cols;
  std::istringstream h(header);
  for (std::string c; std::getline(h, c, ',');) cols.push_back(c);
  const auto it = std::find(cols.begin(), cols.end(), name);
  if (it == cols.end()) return {};
  const size_t k = static_cast<size_t>(it - cols.begin());
  std::vector<std::string> out;
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::istringstream l(line);
    for (std::string c; std::getline(l, c, ',');) cells.push_back(c);
    if (k < cells.size() && !cells[k].empty()) out.push_back(cells[k]);
  }
  return out;
}

}  // namespace

// The issue's check: one checkpoint tested on the 10,000 Fashion-MNIST test images under
// single_device and ddp on 2 and 3 CPU ranks gives the same test_acc, F1, AUROC and confusion
// matrix, and predict writes one row per image.
TEST(ConfiguredMetrics, FashionMnistTestIsTheSameOnOneTwoAndThreeRanks) {
  if (!EMBER_TEST_WITH_MPI) GTEST_SKIP() << "CPU ranks need Open MPI (libopenmpi-dev)";
  TempDir dir("configured_metrics");
  write_file(dir / "run.toml", kFashion);
  run_engine_ok(dir, {"run.toml", "--set", "trainer.default_root_dir=\"train\""});
  const std::string ckpt = find_file(dir / "train", "last.ckpt").string();
  ASSERT_FALSE(ckpt.empty());
  std::vector<std::string> outs, matrices;
  for (int ranks : {1, 2, 3}) {
    const std::string root = "test" + std::to_string(ranks);
    std::vector<std::string> args = {"test", "--ckpt", ckpt, "run.toml", "--set", "trainer.default_root_dir=\"" + root + "\""};
    if (ranks > 1) args.insert(args.end(), {"--plugins", "ddp", "--set", "trainer.devices=" + std::to_string(ranks), "--set", "ddp.timeout=30.0"});
    auto r = run_engine_ok(dir, args, 300);
    outs.push_back(r.out);
    const fs::path cm = find_file(dir / root, "test_confusion_matrix.csv");
    ASSERT_FALSE(cm.empty()) << "no test_confusion_matrix.csv under " << root << "\n" << r.err;
    matrices.push_back(read_text(cm));
  }
  EXPECT_EQ(matrix_total(matrices[0]), 10000) << matrices[0];
  for (const char* name : {"test_acc", "test_accuracy", "test_f1", "test_auroc"}) {
    ASSERT_NE(printed(outs[0], name), "missing") << name << "\n" << outs[0];
    EXPECT_EQ(printed(outs[0], name), printed(outs[1], name)) << name << " on 2 ranks\n" << outs[0] << outs[1];
    EXPECT_EQ(printed(outs[0], name), printed(outs[2], name)) << name << " on 3 ranks\n" << outs[0] << outs[2];
  }
  EXPECT_EQ(matrices[0], matrices[1]);
  EXPECT_EQ(matrices[0], matrices[2]);
  // A model that learned something: the metrics are not an all-zero artefact.
  EXPECT_GT(std::stod(printed(outs[0], "test_f1")), 0.5) << outs[0];
  auto p = run_engine_ok(dir, {"predict", "--ckpt", ckpt, "run.toml", "--set", "trainer.default_root_dir=\"predict\""});
  const fs::path csv = find_file(dir / "predict", "predictions.csv");
  ASSERT_FALSE(csv.empty()) << p.err;
  std::ifstream in(csv);
  int64_t lines = 0;
  for (std::string l; std::getline(in, l);) ++lines;
  EXPECT_EQ(lines, 10001) << "a header and one row per test image";
}

// Training metrics per epoch and per log window, per-class values, monitors on a configured
// metric, and a confusion matrix for each evaluated split in the run folder.
TEST(ConfiguredMetrics, TrainStepValuesPerClassValuesAndMonitors) {
  TempDir dir("configured_metrics");
  write_file(dir / "run.toml", synthetic_mlp_toml({.accelerator = "cpu", .hidden = "[16]", .num_train = 128, .num_val = 40}) + R"(
[metrics]
names = ["accuracy", "f1", "confusion_matrix"]
splits = ["train", "val"]
on_step = true
average = "none"
[checkpoint]
monitor = "val_f1"
mode = "max"
filename = "{epoch}-{val_f1:.4f}"
)");
  auto r = run_engine_ok(dir, {"run.toml", "--set", "trainer.max_epochs=2", "--set", "trainer.log_every_n_steps=2"});
  const fs::path metrics = find_file(dir.path(), "metrics.csv");
  ASSERT_FALSE(metrics.empty());
  EXPECT_EQ(column(metrics, "val_f1").size(), 2u) << read_text(metrics);
  EXPECT_EQ(column(metrics, "train_f1_epoch").size(), 2u) << read_text(metrics);
  EXPECT_GE(column(metrics, "train_f1_step").size(), 2u) << read_text(metrics);
  EXPECT_EQ(column(metrics, "val_f1_0").size(), 2u) << "average = \"none\" logs each class";
  // average = "none": the headline value is the mean of the per-class values.
  const auto f1 = column(metrics, "val_f1");
  double mean = 0;
  int classes = 0;
  for (; !column(metrics, "val_f1_" + std::to_string(classes)).empty(); ++classes) mean += std::stod(column(metrics, "val_f1_" + std::to_string(classes)).back());
  ASSERT_GT(classes, 1);
  EXPECT_NEAR(std::stod(f1.back()), mean / classes, 1e-6);
  // The checkpoint callback monitored val_f1 (its file name carries the value).
  bool named = false;
  for (const auto& e : fs::recursive_directory_iterator(dir.path()))
    named |= e.path().filename().string().find("val_f1=") != std::string::npos;
  EXPECT_TRUE(named) << r.err;
  for (const char* f : {"val_confusion_matrix.csv", "train_confusion_matrix.csv"}) EXPECT_FALSE(find_file(dir.path(), f).empty()) << f;
  EXPECT_EQ(matrix_total(read_text(find_file(dir.path(), "val_confusion_matrix.csv"))), 40);
  if (EMBER_TEST_WITH_CAIRO) EXPECT_FALSE(find_file(dir.path(), "val_confusion_matrix.png").empty());
}

// Tensor-parallel peers see the same batch and pipeline stages before the last see no scores: the
// confusion matrix still counts every validation sample once, and the metrics equal
// single_device's.
TEST(ConfiguredMetrics, MeshesCountEverySampleOnce) {
  if (!EMBER_TEST_WITH_MPI) GTEST_SKIP() << "CPU ranks need Open MPI (libopenmpi-dev)";
  TempDir dir("configured_metrics");
  write_file(dir / "run.toml", transformer_mesh_toml(2) + R"(
[metrics]
names = ["f1", "auroc", "confusion_matrix"]
num_classes = 4
)");
  struct Mesh {
    std::string root;
    std::vector<std::string> extra;
  };
  const std::vector<Mesh> meshes = {
      {"single", {}},
      {"tp2", {"--plugins", "ddp", "--set", "trainer.devices=2", "--set", "parallelism.tensor_parallel=2", "--set", "ddp.timeout=30.0"}},
      {"pp2", {"--plugins", "ddp", "--set", "trainer.devices=2", "--set", "parallelism.pipeline_parallel=2", "--set", "ddp.timeout=30.0"}}};
  std::vector<std::string> f1, auroc;
  for (const auto& m : meshes) {
    std::vector<std::string> args = {"run.toml", "--set", "trainer.default_root_dir=\"" + m.root + "\""};
    args.insert(args.end(), m.extra.begin(), m.extra.end());
    auto r = run_engine_ok(dir, args, 300);
    const fs::path cm = find_file(dir / m.root, "val_confusion_matrix.csv");
    ASSERT_FALSE(cm.empty()) << m.root << "\n" << r.err;
    EXPECT_EQ(matrix_total(read_text(cm)), 24) << m.root << ": every validation sample once";
    const auto values = column(find_file(dir / m.root, "metrics.csv"), "val_f1");
    ASSERT_EQ(values.size(), 2u) << m.root;
    f1.push_back(values.back());
    const auto areas = column(find_file(dir / m.root, "metrics.csv"), "val_auroc");
    ASSERT_EQ(areas.size(), 2u) << m.root;
    auroc.push_back(areas.back());
  }
  EXPECT_NEAR(std::stod(f1[1]), std::stod(f1[0]), 1e-6) << "tensor parallel";
  EXPECT_NEAR(std::stod(f1[2]), std::stod(f1[0]), 1e-6) << "pipeline parallel";
  // The exact AUROC keeps every score (cat states): gathered and handed to every rank as well.
  EXPECT_NEAR(std::stod(auroc[1]), std::stod(auroc[0]), 1e-6) << "tensor parallel";
  EXPECT_NEAR(std::stod(auroc[2]), std::stod(auroc[0]), 1e-6) << "pipeline parallel";
}

// Bad settings stop before training with one line that says where and what to do.
#ifdef EMBER_TEST_PYTHON
// Multilabel end to end: mlp with task = "multilabel" (binary cross-entropy) on arrays from numpy
// learns three labels that are linear in the features; [metrics] writes one 2 x 2 matrix per label
// (label,tn,fp,fn,tp), each counting every validation sample once, and the per-label F1 logged is
// the one those counts give. Targets of the wrong width are one line.
TEST(ConfiguredMetrics, MultilabelConfusionMatricesPerLabel) {
  TempDir dir("configured_metrics");
  ASSERT_EQ(run_process({EMBER_TEST_PYTHON, "-c",
                         "import numpy as np\n"
                         "rng = np.random.default_rng(0)\n"
                         "x = rng.normal(size=(500, 8)).astype(np.float32)\n"
                         "y = np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0.5, x[:, 3] < -0.8], 1).astype(np.int64)\n"
                         "np.save('x.npy', x); np.save('y.npy', y); np.save('y2.npy', y[:, :2])\n"},
                        dir.path(), {}, 60).exit_code,
            0);
  write_file(dir / "run.toml", R"([trainer]
accelerator = "cpu"
max_epochs = 8
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [32]
num_classes = 3
task = "multilabel"
[data]
name = "tensor_files"
train = ["x.npy", "y.npy"]
val_split = 0.2
batch_size = 25
[optimizer]
name = "adam"
lr = 0.01
[metrics]
names = ["f1", "auroc", "confusion_matrix"]
task = "multilabel"
splits = ["val"]
average = "none"
)");
  auto r = run_engine_ok(dir, {"run.toml"});
  const fs::path metrics = find_file(dir.path(), "metrics.csv");
  const fs::path cm = find_file(dir.path(), "val_confusion_matrix.csv");
  ASSERT_FALSE(cm.empty()) << r.err;
  const auto counts = read_label_counts(cm);
  ASSERT_EQ(counts.size(), 3u);
  for (size_t l = 0; l < counts.size(); ++l) {
    const auto [tn, fp, fn, tp] = counts[l];
    EXPECT_EQ(tn + fp + fn + tp, 100) << "every validation sample once: label " << l;
    // The last epoch's per-label F1 is the one these counts give.
    const auto f1 = column(metrics, "val_f1_" + std::to_string(l));
    ASSERT_FALSE(f1.empty());
    EXPECT_NEAR(std::stod(f1.back()), 2.0 * static_cast<double>(tp) / static_cast<double>(2 * tp + fp + fn), 1e-6) << "label " << l;
    EXPECT_GT(std::stod(f1.back()), 0.8) << "a linear label is learnt: label " << l;
  }
  EXPECT_GT(std::stod(column(metrics, "val_auroc").back()), 0.95);
  if (EMBER_TEST_WITH_CAIRO) EXPECT_FALSE(find_file(dir.path(), "val_confusion_matrix.png").empty());
  auto bad = run_engine({"run.toml", "--set", "data.train=[\"x.npy\", \"y2.npy\"]"}, dir.path(), {}, 60);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("mlp: multilabel needs 0/1 targets of shape [25, 3], got Long [25, 2]: set [model] num_classes to the number of labels"),
            std::string::npos) << bad.err;
}
#endif

TEST(ConfiguredMetrics, BadSettingsAreOneLineWithTheirPlace) {
  TempDir dir("configured_metrics");
  const std::string base = synthetic_mlp_toml({.accelerator = "cpu", .hidden = "[8]", .num_train = 32, .num_val = 16});
  struct Case {
    std::string metrics, expect;
  };
  const std::vector<Case> cases = {
      {"names = [\"f2\"]", "run.toml:"},
      {"names = [\"f2\"]", "metrics.names: unknown metric 'f2' (known: accuracy,"},
      {"names = [\"f1\", \"f1\"]", "'f1' is named twice"},
      {"names = [\"f1\"]\ntop_k = 3", "top_k > 1 applies to multiclass accuracy only"},
      {"names = [\"f1\"]\nsplits = [\"holdout\"]", "unknown split 'holdout'"},
      {"names = [\"f1\"]\non_step = true", "add \"train\" to metrics.splits"},
  };
  for (const auto& c : cases) {
    write_file(dir / "run.toml", base + "\n[metrics]\n" + c.metrics + "\n");
    auto r = run_engine({"run.toml"}, dir.path(), {}, 60);
    EXPECT_EQ(r.exit_code, 2) << c.metrics << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.metrics << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  // A model that never hands its scores over: named, with what its steps must call.
  write_file(dir / "run.toml", R"([trainer]
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
[metrics]
names = ["f1"]
splits = ["train"]
)");
  auto r = run_engine({"--plugin-path", test_plugin_dir("good").string(), "run.toml"}, dir.path(), {}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("the model handed no predictions on the train split: its steps must call ctx.update_metrics"), std::string::npos) << r.err;
}
