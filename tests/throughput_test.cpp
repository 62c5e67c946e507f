// throughput: rates against a known synthetic rate (a test plugin sleeps in every batch).
#include <gtest/gtest.h>

#include "peak_flops.h"
#include "throughput_window.h"
#include "observability_support.h"

using namespace ember::test;
namespace fs = std::filesystem;

TEST(Throughput, WindowRates) {
  ember_tp::Window w(2);
  w.add({0.0, 0, 0, 0});
  w.add({1.0, 1, 10, 100});
  w.add({2.0, 2, 20, 200});
  w.add({4.0, 3, 30, 300});  // the window now spans samples 1..3
  ember_tp::Rates r;
  ASSERT_TRUE(w.rates(&r));
  EXPECT_DOUBLE_EQ(r.batches_per_sec, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(r.samples_per_sec, 20.0 / 3.0);
  EXPECT_DOUBLE_EQ(r.items_per_sec, 200.0 / 3.0);
}

TEST(Throughput, MatchesAKnownSyntheticRate) {
  TempDir dir("observability");
  write_file(dir / "run.toml", kMlp);
  // Every batch sleeps 50 ms: at most 20 batches/s, and the tiny MLP adds little.
  engine_ok(dir, {"--plugins", "throughput,sleeper", "--set", "sleeper.seconds=[0.05]", "--set", "throughput.window_size=4",
                  "--set", "throughput.items=\"input_numel\"", "--set", "trainer.max_epochs=1"});
  const auto rows = read_csv(dir / "runs/run/version_0/metrics.csv");
  int n = 0;
  const double bps = last_value(rows, "train|device|batches_per_sec", &n);
  EXPECT_EQ(n, 6) << "one value per step";
  EXPECT_LE(bps, 20.0);
  EXPECT_GE(bps, 15.0);
  const double sps = last_value(rows, "train|device|samples_per_sec", &n);
  EXPECT_NEAR(sps / bps, 16.0, 1e-9);  // full batches of 16
  const double ips = last_value(rows, "train|items_per_sec", &n);
  EXPECT_NEAR(ips / sps, 8.0, 1e-9);  // 8 input elements per sample
  EXPECT_NEAR(last_value(rows, "train|batches_per_sec", &n), bps, 1e-12);  // one rank
}

TEST(Throughput, LeavesValidationOut) {
  TempDir dir("observability");
  write_file(dir / "run.toml", kMlp);
  // Validation after batch 3 sleeps 0.3 s per batch (0.6 s); counted, it would pull the rate
  // at the epoch's last batch (window: all 6) down to 6 / (0.3 + 0.6) = 6.7/s.
  // On the CPU: on a GPU the window's first batch also holds CUDA's lazy start-up (cuBLAS handles,
  // kernel loading), which is real time but not what this test plants.
  engine_ok(dir, {"--plugins", "throughput,sleeper", "--set", "trainer.accelerator=\"cpu\"", "--set",
                  "sleeper.hooks=[\"on_train_batch_start\", \"on_validation_batch_start\"]", "--set",
                  "sleeper.seconds=[0.05, 0.3]", "--set", "throughput.window_size=6", "--set", "trainer.max_epochs=1",
                  "--set", "trainer.val_check_interval=3", "--set", "trainer.num_sanity_val_steps=0"});
  int n = 0;
  const double bps = last_value(read_csv(dir / "runs/run/version_0/metrics.csv"), "train|device|batches_per_sec", &n);
  EXPECT_LE(bps, 20.0);
  EXPECT_GE(bps, 15.0);
}

namespace {
// The FLOPs of one training batch the rates imply (flops_per_sec / batches_per_sec, same window).
double flops_per_batch(const fs::path& run) {
  const auto rows = read_csv(run / "metrics.csv");
  int n = 0;
  const double fps = last_value(rows, "train|device|flops_per_sec", &n);
  EXPECT_GT(n, 0) << "no flops_per_sec in " << run;
  return fps / last_value(rows, "train|device|batches_per_sec", &n);
}
const char* const kTransformer = R"(
[trainer]
max_epochs = 1
log_every_n_steps = 1
enable_progress_bar = false
enable_model_summary = false
accelerator = "cpu"
[model]
name = "transformer"
d_model = 16
nhead = 2
dim_feedforward = 32
num_layers = 2
dropout = 0.0
num_classes = 4
[data]
name = "synthetic"
shape = [6, 16]
num_classes = 4
num_train = 64
num_val = 16
batch_size = 8
)";
}  // namespace

TEST(Throughput, FlopsPerSecondAndMfuFromTheModel) {
  TempDir dir("observability");
  write_file(dir / "run.toml", kMlp);
  engine_ok(dir, {"--plugins", "throughput,sleeper", "--set", "trainer.accelerator=\"cpu\"", "--set", "sleeper.seconds=[0.05]",
                  "--set", "throughput.window_size=4", "--set", "throughput.peak_tflops=1e-6", "--set", "trainer.max_epochs=1"});
  // mlp 8 -> 16 -> 10 on batches of 16: forward 2*16*(8*16 + 16*10) = 9216 FLOPs; backward
  // 2*16*8*16 for the first layer (its weight only: the data needs no gradient) + 2*2*16*16*10.
  EXPECT_NEAR(flops_per_batch(dir / "runs/run/version_0"), 9216.0 + 4096.0 + 10240.0, 1e-6);
  const auto rows = read_csv(dir / "runs/run/version_0/metrics.csv");
  int n = 0;
  const double fps = last_value(rows, "train|device|flops_per_sec", &n);
  EXPECT_NEAR(last_value(rows, "train|device|mfu", &n), fps / 1e6, 1e-12);  // peak 1e-6 TFLOP/s
  EXPECT_NEAR(last_value(rows, "train|flops_per_sec", &n), fps, 1e-9);     // one rank
}

// The models' own counts agree with LibTorch's profiler counting the same step's matrix products
// (flops = "measure"), so a wrong formula in a model fails here.
TEST(Throughput, ModelFlopsMatchLibTorchsProfilerCount) {
  for (const char* model : {"mlp", "transformer"}) {
    SCOPED_TRACE(model);
    TempDir a("observability"), b("observability");
    for (auto* d : {&a, &b}) write_file(*d / "run.toml", std::string(model) == "mlp" ? kMlp : kTransformer);
    std::vector<std::string> common = {"--plugins", "throughput", "--set", "trainer.accelerator=\"cpu\"", "--set", "trainer.max_epochs=1"};
    auto with = [&](const char* mode) {
      auto v = common;
      v.insert(v.end(), {"--set", std::string("throughput.flops=\"") + mode + "\""});
      return v;
    };
    engine_ok(a, with("model"));
    auto r = engine_ok(b, with("measure"));
    EXPECT_NE(r.err.find("throughput: measured"), std::string::npos) << r.err;
    const double reported = flops_per_batch(a / "runs/run/version_0"), measured = flops_per_batch(b / "runs/run/version_0");
    EXPECT_GT(reported, 0.0);
    EXPECT_NEAR(measured / reported, 1.0, 1e-9) << "model " << reported << " vs profiler " << measured;
  }
}

// cnn's count by hand: 8x8 images, batch 16; conv1 1->2 at 8x8 (forward + weight gradient:
// the data needs no gradient), conv2 2->3 at 4x4 and the linear layers 12->4->2 (forward and
// both gradients); 3x3 kernels, a multiply-add is 2 FLOPs.
TEST(Throughput, CnnReportsTheFlopsOfItsConvolutionsAndLinearLayers) {
  TempDir dir("observability");
  write_file(dir / "run.toml", "[trainer]\nmax_epochs = 1\nlog_every_n_steps = 1\nenable_progress_bar = false\n[model]\nname = \"cnn\"\nimage_size = 8\n"
                               "conv1_channels = 2\nconv2_channels = 3\nhidden = 4\nnum_classes = 2\n[data]\nname = \"synthetic\"\n"
                               "shape = [1, 8, 8]\nnum_classes = 2\nnum_train = 64\nnum_val = 0\nbatch_size = 16\n");
  engine_ok(dir, {"--plugins", "throughput,sleeper", "--set", "trainer.accelerator=\"cpu\"", "--set", "sleeper.seconds=[0.05]",
                  "--set", "throughput.window_size=2", "--set", "throughput.peak_tflops=1e-6", "--set", "throughput.flops=\"model\""});
  const double conv1 = 2.0 * 2 * 16 * 64 * 2 * 1 * 9, conv2 = 3.0 * 2 * 16 * 16 * 3 * 2 * 9;
  const double fc1 = 3.0 * 2 * 16 * 12 * 4, fc2 = 3.0 * 2 * 16 * 4 * 2;
  EXPECT_NEAR(flops_per_batch(dir / "runs/run/version_0"), conv1 + conv2 + fc1 + fc2, 1e-6);
}

TEST(Throughput, ModelWithoutAFlopsReportIsOneClearLine) {
  TempDir dir("observability");
  write_file(dir / "run.toml", "[trainer]\nmax_epochs = 1\n[model]\nname = \"bn_mlp\"\ninput_size = 16\nhidden = 8\nnum_classes = 4\n"
                               "[data]\nname = \"synthetic\"\nshape = [16]\nnum_classes = 4\n"
                               "num_train = 32\nnum_val = 0\nbatch_size = 16\n[throughput]\nflops = \"model\"\n");
  // bn_mlp (a test plugin) reports no FLOPs.
  auto r = run_engine({"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", "throughput"}, dir.path(),
                      {{"OMP_NUM_THREADS", "1"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("run.toml:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not report its FLOPs"), std::string::npos) << r.err;
}

TEST(Throughput, PeakTableKnowsTheCommonGpus) {
  using ember_tp::ComputeDtype;
  EXPECT_DOUBLE_EQ(*ember_tp::cuda_peak_flops("NVIDIA H100 80GB HBM3", ComputeDtype::bf16), 989.4e12);
  EXPECT_DOUBLE_EQ(*ember_tp::cuda_peak_flops("NVIDIA H100 PCIe", ComputeDtype::fp16), 756e12);
  EXPECT_DOUBLE_EQ(*ember_tp::cuda_peak_flops("NVIDIA H200", ComputeDtype::tf32), 494.7e12);
  EXPECT_DOUBLE_EQ(*ember_tp::cuda_peak_flops("NVIDIA A100-SXM4-80GB", ComputeDtype::fp32), 19.5e12);
  EXPECT_DOUBLE_EQ(*ember_tp::cuda_peak_flops("NVIDIA L4", ComputeDtype::bf16), 121e12);
  EXPECT_FALSE(ember_tp::cuda_peak_flops("Tesla V100-SXM2-16GB", ComputeDtype::bf16));  // no bf16 units
  EXPECT_FALSE(ember_tp::cuda_peak_flops("Some Future GPU", ComputeDtype::fp32));
  EXPECT_EQ(ember_tp::compute_dtype("bf16-mixed", "highest"), ComputeDtype::bf16);
  EXPECT_EQ(ember_tp::compute_dtype("16-mixed", "highest"), ComputeDtype::fp16);
  EXPECT_EQ(ember_tp::compute_dtype("32-true", "high"), ComputeDtype::tf32);
  EXPECT_EQ(ember_tp::compute_dtype("32-true", "highest"), ComputeDtype::fp32);
}
