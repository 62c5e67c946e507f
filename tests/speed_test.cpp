// Fast-by-default settings (issue 15): each fast path computes what the plain path computes.
//   - trainer.num_threads default (sched_getaffinity), flush_denormal, float32_matmul_precision,
//     benchmark: the decision functions, LibTorch's state after apply_numerics, and training
//     with each flag on and off ending at the same weights;
//   - trainer.channels_last: the same weights as contiguous training;
//   - trainer.precision = "auto": the decision for injected CPU/GPU features, what the engine
//     picks on this machine, and bf16's start-up warning on a CPU without native bfloat16;
//   - fashion_mnist: float32 store = uint8 store, validation on the test images, deterministic
//     augmentation (the same with and without loader workers), the speedrun cnn;
//   - image augmentation (<ember/model_support/image_augment.h>): flips and crops are what they claim.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <sched.h>
#include <torch/nn/modules/conv.h>

#include <filesystem>
#include <string>

#include <ember/model_support/image_augment.h>
#include "checkpoint_support.h"
#include "config/run_config.h"
#include "data/device_feed.h"
#include "config/engine_schema.h"
#include "runtime/numerics.h"
#include "support.h"

using namespace ember::test;
using namespace ember::engine;
namespace fs = std::filesystem;

namespace {

ProcessResult train(const TempDir& dir, const std::string& config, std::vector<std::string> extra) {
  write_file(dir / "run.toml", config);
  std::vector<std::string> args = {"run.toml"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args, 300);
}

// A small CNN on generated images: convolutions (channels-last), batch-norm-free.
const char* kCnnRun = R"(
[trainer]
max_epochs = 2
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "cnn"
image_size = 12
conv1_channels = 6
conv2_channels = 8
hidden = 16
num_classes = 4
dropout_conv = 0.0
dropout_fc = 0.0
[data]
name = "synthetic"
shape = [1, 12, 12]
num_classes = 4
num_train = 96
num_val = 32
num_test = 0
batch_size = 32
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
)";

// The same settings the plain path uses, except `key`.
void expect_same_weights(const std::string& config, const std::string& fast, const std::string& plain, double tol) {
  TempDir a("speed"), b("speed");
  train(a, config, {"--set", fast});
  train(b, config, {"--set", plain});
  EXPECT_LE(max_weight_difference(last_checkpoint(a), last_checkpoint(b)), tol) << fast << " vs " << plain;
}

std::string one_line(std::string e) {
  while (!e.empty() && e.back() == '\n') e.pop_back();
  return e;
}

}  // namespace

// ----- threads and numerics -----

TEST(Numerics, DefaultThreadsAreTheUsableCpusSharedByLocalProcesses) {
  EXPECT_EQ(default_num_threads(8, 1, nullptr), 8);
  EXPECT_EQ(default_num_threads(8, 2, nullptr), 4);
  EXPECT_EQ(default_num_threads(2, 4, nullptr), 1);  // never 0
  EXPECT_EQ(default_num_threads(8, 1, "3"), 3);      // OMP_NUM_THREADS wins, as in LibTorch
  EXPECT_EQ(default_num_threads(8, 1, ""), 8);
  EXPECT_EQ(default_num_threads(8, 1, "lots"), 8);   // not a number: ignored
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(usable_cpus(), CPU_COUNT(&set));
}

TEST(Numerics, ApplySetsLibTorchState) {
  const int threads_before = at::get_num_threads();
  const auto precision_before = at::globalContext().float32MatmulPrecision();
  at::globalContext().setFlushDenormal(false);
  // Made before flushing is on: under flushing even the conversion to float would give 0.
  const at::Tensor tiny = at::full({4}, 1e-40f);
  ASSERT_GT(tiny.abs().sum().item<float>(), 0.0f);
  NumericsSettings s;
  s.num_threads = 1;
  s.flush_denormal = true;
  s.float32_matmul_precision = "high";
  s.cudnn_benchmark = true;
  const std::string line = apply_numerics(s);
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_EQ(at::globalContext().float32MatmulPrecision(), at::Float32MatmulPrecision::HIGH);
  EXPECT_TRUE(at::globalContext().benchmarkCuDNN());
  EXPECT_NE(line.find("1 intra-op threads"), std::string::npos) << line;
  // Flushing: a denormal input reads as zero (x86 with SSE3: every machine this runs on).
  if (line.find("flushed to zero") != std::string::npos) EXPECT_EQ((tiny * 2.0f).abs().sum().item<float>(), 0.0f);
  s.flush_denormal = false;
  s.float32_matmul_precision = "medium";
  s.cudnn_benchmark = false;
  EXPECT_NE(apply_numerics(s).find("denormals kept"), std::string::npos);
  EXPECT_GT((tiny * 2.0f).abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(at::globalContext().float32MatmulPrecision(), at::Float32MatmulPrecision::MEDIUM);
  EXPECT_FALSE(at::globalContext().benchmarkCuDNN());
  at::set_num_threads(threads_before);
  at::globalContext().setFloat32MatmulPrecision(precision_before == at::Float32MatmulPrecision::HIGHEST ? "highest"
                                                : precision_before == at::Float32MatmulPrecision::HIGH  ? "high"
                                                                                                         : "medium");
  at::globalContext().setFlushDenormal(false);
}

TEST(Numerics, EngineUsesTheUsableCpusByDefault) {
  TempDir dir("speed");
  write_file(dir / "run.toml", kCnnRun);
  // The test harness sets OMP_NUM_THREADS=1 for every engine it starts; empty = unset.
  auto r = run_engine({"run.toml", "--set", "trainer.max_epochs=1"}, dir.path(), {{"OMP_NUM_THREADS", ""}}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string expected = "numerics: " + std::to_string(usable_cpus()) + " intra-op threads, denormals flushed to zero";
  EXPECT_NE(r.err.find(expected), std::string::npos) << r.err;
  TempDir one("speed");
  r = train(one, kCnnRun, {"--set", "trainer.max_epochs=1", "--set", "trainer.num_threads=1"});
  EXPECT_NE(r.err.find("numerics: 1 intra-op threads"), std::string::npos) << r.err;
}

TEST(Numerics, FlushDenormalTrainsTheSameWeights) {
  expect_same_weights(kCnnRun, "trainer.flush_denormal=true", "trainer.flush_denormal=false", 1e-5);
}

TEST(Numerics, Float32MatmulPrecisionHighTrainsTheSameWeightsOnCpu) {
  // No TF32 on a CPU: high and medium may only use it where oneDNN has bf16/TF32 hardware, and
  // still match to float rounding on this small a model.
  expect_same_weights(kCnnRun, "trainer.float32_matmul_precision=\"high\"", "trainer.float32_matmul_precision=\"highest\"", 1e-3);
}

TEST(Numerics, BadNumericsValuesAreOneLineConfigErrors) {
  TempDir dir("speed");
  write_file(dir / "run.toml", std::string(kCnnRun));
  auto r = run_engine({"run.toml", "--set", "trainer.float32_matmul_precision=\"low\""}, dir.path(), {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("float32_matmul_precision"), std::string::npos) << r.err;
  EXPECT_EQ(one_line(r.err).find('\n'), std::string::npos) << r.err;
  r = run_engine({"run.toml", "--set", "trainer.benchmark=\"yes\""}, dir.path(), {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("trainer.benchmark"), std::string::npos) << r.err;
}

// ----- channels-last -----

TEST(ChannelsLast, ModuleConversionKeepsValuesAndForward) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(3, 5, 3).padding(1));
  const at::Tensor x = at::randn({2, 3, 7, 7});
  const at::Tensor before = conv->forward(x).detach();
  const at::Tensor w = conv->weight.detach().clone();
  to_channels_last(*conv);
  EXPECT_TRUE(conv->weight.is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_FALSE(conv->weight.is_contiguous());
  EXPECT_TRUE(at::equal(conv->weight.detach(), w));
  ember::Batch batch;
  batch.tensors = {x, at::arange(2)};
  batch = batch_to_channels_last(std::move(batch));
  EXPECT_TRUE(batch.tensors[0].is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_EQ(batch.tensors[1].dim(), 1);
  EXPECT_TRUE(at::allclose(conv->forward(batch.tensors[0]), before, 1e-5, 1e-6));
}

TEST(ChannelsLast, TrainsTheSameWeightsAsContiguous) {
  expect_same_weights(kCnnRun, "trainer.channels_last=true", "trainer.channels_last=false", 1e-4);
}

// ----- precision = "auto" -----

TEST(PrecisionAuto, PicksByDeviceFeatures) {
  DeviceForPrecision avx2;
  avx2.cpu.avx2 = true;
  EXPECT_EQ(choose_auto_precision(avx2).precision, "32-true");
  DeviceForPrecision avx512 = avx2;
  avx512.cpu.avx512 = true;  // AVX-512 without its BF16 extension: no native bfloat16
  EXPECT_EQ(choose_auto_precision(avx512).precision, "32-true");
  avx512.cpu.avx512_bf16 = true;
  EXPECT_EQ(choose_auto_precision(avx512).precision, "bf16-mixed");
  DeviceForPrecision amx = avx2;
  amx.cpu.amx_bf16 = true;
  EXPECT_EQ(choose_auto_precision(amx).precision, "bf16-mixed");
  EXPECT_NE(choose_auto_precision(amx).reason.find("AMX"), std::string::npos);
  DeviceForPrecision gpu;
  gpu.cuda = true;
  gpu.cuda_major = 9;  // H100
  EXPECT_EQ(choose_auto_precision(gpu).precision, "bf16-mixed");
  gpu.cuda_major = 7;  // V100, T4
  EXPECT_EQ(choose_auto_precision(gpu).precision, "16-mixed");
  gpu.cuda_major = 6;
  EXPECT_EQ(choose_auto_precision(gpu).precision, "32-true");
  // A GPU run decides by the GPU, not the host CPU.
  gpu.cuda_major = 8;
  gpu.cpu = avx2.cpu;
  EXPECT_EQ(choose_auto_precision(gpu).precision, "bf16-mixed");
}

TEST(PrecisionAuto, SlowPrecisionWarningOnlyWithoutNativeSupport) {
  ember::CpuFeatures plain;
  EXPECT_FALSE(ember::cpu_runs_bf16_fast(plain));
  EXPECT_NE(ember::slow_cpu_precision_warning("bf16", ember::cpu_runs_bf16_fast(plain), "bfloat16").find("slower"),
            std::string::npos);
  ember::CpuFeatures spr;
  spr.amx_bf16 = spr.avx512_bf16 = spr.amx_fp16 = true;
  EXPECT_TRUE(ember::cpu_runs_bf16_fast(spr));
  EXPECT_TRUE(ember::cpu_runs_fp16_fast(spr));
  EXPECT_EQ(ember::slow_cpu_precision_warning("bf16", ember::cpu_runs_bf16_fast(spr), "bfloat16"), "");
}

TEST(PrecisionAuto, EngineRunsAndPrintsTheChoiceForThisMachine) {
  const auto expected = choose_auto_precision(detect_device_for_precision("cpu"));
  TempDir dir("speed");
  auto r = train(dir, kCnnRun, {"--set", "trainer.max_epochs=1", "--set", "trainer.precision=\"auto\"", "--set",
                                "trainer.accelerator=\"cpu\""});
  EXPECT_NE(r.err.find("precision auto: " + expected.precision), std::string::npos) << r.err;
  // The resolved config names the plugin that ran, so feeding it back runs the same.
  const std::string cfg = read_file(dir / "runs/run/version_0/config.toml");
  EXPECT_NE(cfg.find("\nprecision = '" + precision_plugin_for(expected.precision) + "'"), std::string::npos) << cfg;
}

TEST(PrecisionAuto, Bf16WarnsOnceOnACpuWithoutNativeBfloat16) {
  const bool fast = ember::cpu_runs_bf16_fast(ember::detect_cpu_features());
  TempDir dir("speed");
  auto r = train(dir, kCnnRun, {"--set", "trainer.max_epochs=1", "--set", "trainer.precision=\"bf16-mixed\"", "--set",
                                "trainer.accelerator=\"cpu\""});
  const std::string needle = "no native bfloat16";
  const auto at = r.err.find(needle);
  if (fast) {
    EXPECT_EQ(at, std::string::npos) << r.err;
  } else {
    ASSERT_NE(at, std::string::npos) << r.err;
    EXPECT_EQ(r.err.find(needle, at + 1), std::string::npos) << "said more than once: " << r.err;
  }
}

// ----- image augmentation -----

TEST(ImageAugment, FlipsAreMirrorImages) {
  const at::Tensor x = at::randn({16, 2, 5, 6});
  ember_models::ImageAugment a;
  a.flip = true;
  const at::Tensor y = ember_models::augment_images(x, a, 42);
  int flipped = 0;
  for (int64_t i = 0; i < 16; ++i) {
    const bool same = at::equal(y[i], x[i]), mirror = at::equal(y[i], x[i].flip(2));
    EXPECT_TRUE(same || mirror) << i;
    flipped += mirror;
  }
  EXPECT_GT(flipped, 0);
  EXPECT_LT(flipped, 16);
  EXPECT_TRUE(at::equal(ember_models::augment_images(x, a, 42), y));   // seeded
  EXPECT_FALSE(at::equal(ember_models::augment_images(x, a, 43), y));  // by its seed
}

TEST(ImageAugment, CropsAreWindowsOfThePaddedImage) {
  const at::Tensor x = at::randn({12, 1, 6, 6});
  ember_models::ImageAugment a;
  a.crop_padding = 2;
  a.pad_value = -3.0;
  const at::Tensor y = ember_models::augment_images(x, a, 7);
  ASSERT_EQ(y.sizes(), x.sizes());
  const at::Tensor padded = at::constant_pad_nd(x, {2, 2, 2, 2}, -3.0);
  int moved = 0;
  for (int64_t i = 0; i < 12; ++i) {
    bool found = false;
    for (int64_t dy = 0; dy <= 4 && !found; ++dy)
      for (int64_t dx = 0; dx <= 4 && !found; ++dx)
        if (at::equal(y[i], padded[i].narrow(1, dy, 6).narrow(2, dx, 6))) {
          found = true;
          moved += (dy != 2 || dx != 2);
        }
    EXPECT_TRUE(found) << i;
  }
  EXPECT_GT(moved, 0);
}

// ----- fashion_mnist and the speedrun network -----

namespace {
// On the CPU: these compare losses to the last digit, which cuDNN's autotuned algorithms do not
// promise from one run to the next (tests/gpu_paths.sh checks the data paths on a GPU).
const char* kFashionRun = R"(
[trainer]
accelerator = "cpu"
max_epochs = 1
limit_train_batches = 6
limit_val_batches = 2
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
[model]
name = "cnn"
architecture = "speedrun"
width = 4
label_smoothing = 0.1
[data]
name = "fashion_mnist"
batch_size = 64
eval_batch_size = 500
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
)";

std::map<std::string, std::string> last_row_with(const TempDir& d, const std::string& key) {
  auto rows = read_csv(d / "runs/run/version_0/metrics.csv");
  for (auto it = rows.rbegin(); it != rows.rend(); ++it)
    if (it->count(key) && !it->at(key).empty()) return *it;
  ADD_FAILURE() << "no " << key << " in metrics.csv";
  return {};
}
}  // namespace

TEST(FashionMnistSpeed, Float32StoreGivesTheSameBatchesAsUint8) {
  TempDir f("speed"), u("speed");
  train(f, kFashionRun, {"--set", "data.store=\"float32\""});
  train(u, kFashionRun, {"--set", "data.store=\"uint8\""});
  EXPECT_EQ(last_row_with(f, "train_loss_epoch").at("train_loss_epoch"), last_row_with(u, "train_loss_epoch").at("train_loss_epoch"));
  EXPECT_EQ(last_row_with(f, "val_loss").at("val_loss"), last_row_with(u, "val_loss").at("val_loss"));
}

TEST(FashionMnistSpeed, AugmentationIsDeterministicWithWorkersAndChangesTraining) {
  const std::vector<std::string> aug = {"--set", "data.augment_flip=true", "--set", "data.augment_crop_padding=2"};
  TempDir a("speed"), b("speed"), plain("speed");
  auto with_workers = aug;
  with_workers.insert(with_workers.end(), {"--set", "data.num_workers=2"});
  train(a, kFashionRun, aug);
  train(b, kFashionRun, with_workers);
  train(plain, kFashionRun, {});
  const auto la = last_row_with(a, "train_loss_epoch").at("train_loss_epoch");
  EXPECT_EQ(la, last_row_with(b, "train_loss_epoch").at("train_loss_epoch"));
  EXPECT_NE(la, last_row_with(plain, "train_loss_epoch").at("train_loss_epoch"));
  // Validation images are never augmented: the first step's weights see the same val data, so
  // only training differs (checked above); on_device is a no-op on the CPU.
  TempDir c("speed");
  auto on_device = aug;
  on_device.insert(on_device.end(), {"--set", "data.on_device=\"true\""});
  train(c, kFashionRun, on_device);
  EXPECT_EQ(la, last_row_with(c, "train_loss_epoch").at("train_loss_epoch"));
}

TEST(FashionMnistSpeed, ValidatesOnTheTestImagesWhenAsked) {
  TempDir d("speed");
  auto r = train(d, kFashionRun, {"--set", "data.val_on_test=true", "--set", "data.val_split=0.0", "--set",
                                  "trainer.limit_val_batches=1.0"});
  EXPECT_NE(r.err.find("60000 train, 10000 val, 10000 test"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("validating on the test images"), std::string::npos) << r.err;
}
