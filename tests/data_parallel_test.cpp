// dp's multi-device path (SDK 1.1 IDataParallelModel). Without a GPU the replicas run on CPU
// "devices": <ember/model_support/data_parallel.h> splits the batch, replicates the module, runs the
// replicas on their own threads under the caller's thread-local state and gathers the outputs,
// with the same code it runs on GPUs. The bundled models are loaded as plugins, as the engine
// loads them, and must be cloneable (replicate's requirement) with their parameter names intact.
// The 2-GPU comparison with single_device runs only where two CUDA devices are visible.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <ember/model.h>

#include <mutex>
#include <set>
#include <thread>

#include <ember/model_support/data_parallel.h>
#include "checkpoint/checkpoint_io.h"
#include "config/run_config.h"
#include "registry/plugin_registry.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// What one replica's forward saw.
struct Call {
  std::thread::id thread;
  int64_t rows = 0;
  bool grad_enabled = false;
  bool cpu_autocast = false;
};
struct Calls {
  std::mutex mutex;
  std::vector<Call> list;
};

// A cloneable net that records every forward call; replicas share the record (copied pointer).
class ProbeNet : public torch::nn::Cloneable<ProbeNet> {
 public:
  explicit ProbeNet(std::shared_ptr<Calls> calls) : calls_(std::move(calls)) { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(4, 3)); }
  at::Tensor forward(at::Tensor x) {
    {
      std::lock_guard<std::mutex> lock(calls_->mutex);
      calls_->list.push_back({std::this_thread::get_id(), x.size(0), at::GradMode::is_enabled(), at::autocast::is_autocast_enabled(at::kCPU)});
    }
    if (fail_on_rows > 0 && x.size(0) == fail_on_rows) throw std::runtime_error("replica failed on purpose");
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
  int64_t fail_on_rows = 0;

 private:
  std::shared_ptr<Calls> calls_;
};

const std::vector<c10::Device> kThreeCpus = {c10::Device(c10::kCPU), c10::Device(c10::kCPU), c10::Device(c10::kCPU)};

class TestHost final : public ember::IHost {
 public:
  void log(ember::LogLevel, std::string_view) override {}
  std::string engine_version() const override { return "test"; }
  int sdk_abi_minor() const override { return EMBER_SDK_ABI_MINOR; }
};

class TestContext final : public ember::IStepContext {
 public:
  void log(std::string_view name, const at::Tensor& value, const ember::LogOptions&) override { logged[std::string(name)] = value.item<double>(); }
  void log(std::string_view name, double value, const ember::LogOptions&) override { logged[std::string(name)] = value; }
  ember::Stage stage() const override { return ember::Stage::fit; }
  int64_t batch_idx() const override { return 0; }
  std::map<std::string, double> logged;
};

// A bundled model plugin created exactly as the engine creates it: registry, schema, config.
struct LoadedModel {
  std::unique_ptr<ember::engine::ResolvedConfig> config;
  std::shared_ptr<ember::IModel> model;
  ember::IDataParallelModel* dp = nullptr;
};

ember::engine::PluginRegistry& registry() {
  static ember::engine::PluginRegistry r(ember::engine::PluginRegistry::default_search_paths({}));
  return r;
}

LoadedModel load_model(const std::string& name, const std::vector<std::string>& sets, uint64_t seed = 7) {
  static TestHost host;
  const auto& info = registry().load(name);
  ember::engine::SectionSchema schema;
  schema.name = "model";
  schema.keys = ember::engine::keys_from_descriptor(info.descriptor->config_keys, info.descriptor->num_config_keys);
  ember::engine::RawConfig raw;
  for (const auto& s : sets) raw.add_override("model." + s);
  LoadedModel out;
  out.config = std::make_unique<ember::engine::ResolvedConfig>(ember::engine::ResolvedConfig::resolve(raw, {schema}, {}));
  torch::manual_seed(seed);  // the same initial weights for every instance
  out.model = ember::engine::create_plugin_object<ember::IModel>(info, host, out.config->section("model"));
  out.dp = static_cast<ember::IDataParallelModel*>(out.model->query_interface(ember::kDataParallelModelIid));
  return out;
}

struct ModelCase {
  std::string name;
  std::vector<std::string> sets;
  std::vector<int64_t> input_shape;  // per sample
  std::vector<std::string> expected_names;
};

// Dropout off: replicas draw from other generators than the plain forward does.
std::vector<ModelCase> model_cases() {
  return {
      {"mlp", {"input_size=12", "hidden=[10, 8]", "num_classes=3"}, {12}, {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"}},
      {"cnn", {"image_size=8", "conv1_channels=4", "conv2_channels=6", "hidden=10", "num_classes=3", "dropout_conv=0.0", "dropout_fc=0.0"},
       {1, 8, 8}, {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}},
      {"transformer", {"d_model=8", "nhead=2", "dim_feedforward=16", "num_layers=2", "dropout=0.0", "num_classes=3"},
       {5, 8}, {"layer1.self_attn.in_proj_weight", "layer1.linear1.weight", "layer2.norm2.bias", "head.weight", "head.bias"}},
  };
}

std::vector<std::pair<std::string, at::Tensor>> named(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

// N SGD steps on fixed batches; returns the logged training losses.
std::vector<double> train(ember::IModel& model, const ModelCase& c, int steps, int64_t batch) {
  torch::optim::SGD sgd(model.module().parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<double> losses;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  for (int s = 0; s < steps; ++s) {
    std::vector<int64_t> shape = {batch};
    shape.insert(shape.end(), c.input_shape.begin(), c.input_shape.end());
    ember::Batch b;
    b.tensors = {at::randn(shape, gen), at::randint(0, 3, {batch}, gen, at::kLong)};
    b.size = batch;
    TestContext ctx;
    sgd.zero_grad();
    at::Tensor loss = model.training_step(b, ctx);
    loss.backward();
    sgd.step();
    losses.push_back(ctx.logged.at("train_loss"));
  }
  return losses;
}

}  // namespace

TEST(DataParallel, SplitsTheBatchOverReplicasOnTheirOwnThreadsAndGathersInOrder) {
  auto calls = std::make_shared<Calls>();
  auto net = std::make_shared<ProbeNet>(calls);
  at::Tensor x = at::randn({5, 4});
  at::Tensor plain = net->forward(x);
  calls->list.clear();

  at::Tensor out = ember_models::data_parallel_forward(net, x, kThreeCpus);
  ASSERT_EQ(calls->list.size(), 3u);  // one forward per replica, 5 rows as 2 + 2 + 1
  std::multiset<int64_t> rows;
  std::set<std::thread::id> threads;
  for (const auto& c : calls->list) {
    rows.insert(c.rows);
    threads.insert(c.thread);
  }
  EXPECT_EQ(rows, (std::multiset<int64_t>{1, 2, 2}));
  EXPECT_EQ(threads.size(), 3u);
  EXPECT_EQ(threads.count(std::this_thread::get_id()), 1u);  // the first replica runs on the caller
  ASSERT_EQ(out.sizes(), plain.sizes());
  EXPECT_TRUE(at::allclose(out, plain, 1e-6, 1e-6));  // rows back in batch order

  // Gradients reach the module's own parameters, summed over the replicas.
  at::Tensor target = at::randn({5, 3});
  (plain - target).square().sum().backward();
  const at::Tensor w_plain = net->fc->weight.grad().clone(), b_plain = net->fc->bias.grad().clone();
  net->zero_grad();
  (out - target).square().sum().backward();
  ASSERT_TRUE(net->fc->weight.grad().defined());
  EXPECT_TRUE(at::allclose(net->fc->weight.grad(), w_plain, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(net->fc->bias.grad(), b_plain, 1e-5, 1e-6));

  // A batch too small to split, and fewer than two devices, run the plain forward.
  calls->list.clear();
  ember_models::data_parallel_forward(net, at::randn({1, 4}), kThreeCpus);
  ember_models::data_parallel_forward(net, x, {c10::Device(c10::kCPU)});
  ember_models::data_parallel_forward(net, x, {});
  ASSERT_EQ(calls->list.size(), 3u);
  for (const auto& c : calls->list) EXPECT_EQ(c.thread, std::this_thread::get_id());
}

TEST(DataParallel, ReplicasRunUnderTheCallersNoGradAndAutocast) {
  auto calls = std::make_shared<Calls>();
  auto net = std::make_shared<ProbeNet>(calls);
  at::Tensor x = at::randn({5, 4});  // 2 + 2 + 1 rows
  {
    torch::NoGradGuard no_grad;
    at::Tensor out = ember_models::data_parallel_forward(net, x, kThreeCpus);
    EXPECT_FALSE(out.requires_grad());
  }
  ASSERT_EQ(calls->list.size(), 3u);
  for (const auto& c : calls->list) EXPECT_FALSE(c.grad_enabled) << "a replica ran with gradients on under no_grad";

  calls->list.clear();
  const bool was = at::autocast::is_autocast_enabled(at::kCPU);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::Tensor out = ember_models::data_parallel_forward(net, x, kThreeCpus);
  at::autocast::set_autocast_enabled(at::kCPU, was);
  at::autocast::clear_cache();
  ASSERT_EQ(calls->list.size(), 3u);
  for (const auto& c : calls->list) {
    EXPECT_TRUE(c.cpu_autocast) << "a replica ran outside the caller's autocast region";
    EXPECT_TRUE(c.grad_enabled);
  }
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);  // CPU autocast runs linear in bfloat16 on every replica
}

TEST(DataParallel, AnErrorInAReplicaReachesTheCaller) {
  auto net = std::make_shared<ProbeNet>(std::make_shared<Calls>());
  net->fail_on_rows = 1;  // the last replica of 2 + 2 + 1
  try {
    ember_models::data_parallel_forward(net, at::randn({5, 4}), kThreeCpus);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("replica failed on purpose"), std::string::npos) << e.what();
  }
}

TEST(DataParallel, BundledNetsCloneWithTheSameNamesAndValuesInTheirOwnStorage) {
  for (const auto& c : model_cases()) {
    SCOPED_TRACE(c.name);
    auto loaded = load_model(c.name, c.sets);
    ASSERT_NE(loaded.dp, nullptr) << c.name << " does not implement IDataParallelModel";
    auto& module = loaded.model->module();
    const auto original = named(module);
    std::set<std::string> names;
    for (const auto& [n, _] : original) names.insert(n);
    for (const auto& n : c.expected_names) EXPECT_TRUE(names.count(n)) << n << " missing after the Cloneable rewrite";

    for (const std::optional<c10::Device>& device : {std::optional<c10::Device>(), std::optional<c10::Device>(c10::Device(c10::kCPU))}) {
      std::shared_ptr<torch::nn::Module> copy = module.clone(device);  // virtual: the net's Cloneable::clone
      const auto cloned = named(*copy);
      ASSERT_EQ(cloned.size(), original.size());
      for (size_t i = 0; i < original.size(); ++i) {
        EXPECT_EQ(cloned[i].first, original[i].first);
        EXPECT_TRUE(at::equal(cloned[i].second, original[i].second)) << original[i].first;
        EXPECT_NE(cloned[i].second.data_ptr(), original[i].second.data_ptr()) << original[i].first << " shares storage";
      }
      // Independent: changing the copy leaves the original alone.
      {
        torch::NoGradGuard no_grad;
        for (auto& p : copy->parameters()) p.add_(1.0);
      }
      for (size_t i = 0; i < original.size(); ++i)
        EXPECT_FALSE(at::equal(cloned[i].second, original[i].second)) << original[i].first;
    }
  }
}

TEST(DataParallel, BundledModelsTrainTheSameOnReplicas) {
  constexpr int kSteps = 4;
  for (const auto& c : model_cases()) {
    SCOPED_TRACE(c.name);
    auto plain = load_model(c.name, c.sets);
    auto one = load_model(c.name, c.sets);
    auto split = load_model(c.name, c.sets);
    ASSERT_NE(one.dp, nullptr);
    ASSERT_NE(split.dp, nullptr);
    const auto p0 = named(plain.model->module()), s0 = named(split.model->module());
    ASSERT_EQ(p0.size(), s0.size());
    for (size_t i = 0; i < p0.size(); ++i) ASSERT_TRUE(at::equal(p0[i].second, s0[i].second)) << p0[i].first;
    one.dp->set_data_parallel({c10::Device(c10::kCPU)});
    split.dp->set_data_parallel({c10::Device(c10::kCPU), c10::Device(c10::kCPU)});

    const auto l_plain = train(*plain.model, c, kSteps, 6);
    const auto l_one = train(*one.model, c, kSteps, 6);
    const auto l_split = train(*split.model, c, kSteps, 6);
    const auto w_start = named(load_model(c.name, c.sets).model->module());
    const auto w_plain = named(plain.model->module()), w_one = named(one.model->module()), w_split = named(split.model->module());
    for (size_t i = 0; i < w_plain.size(); ++i) {
      // One device is the plain forward: bit for bit.
      EXPECT_TRUE(at::equal(w_plain[i].second, w_one[i].second)) << w_plain[i].first;
      // Two replicas: the same mathematics, summed in another order.
      const double diff = (w_plain[i].second - w_split[i].second).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5) << w_plain[i].first;
      // ...and training did move the weights (the comparison is not between untouched copies).
      EXPECT_FALSE(at::equal(w_split[i].second, w_start[i].second)) << w_plain[i].first;
    }
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(l_plain[s], l_one[s]);
      EXPECT_NEAR(l_plain[s], l_split[s], 1e-5);
    }

    // Evaluation under no_grad goes through the replicas too.
    TestContext ctx;
    ember::Batch b;
    std::vector<int64_t> shape = {4};
    shape.insert(shape.end(), c.input_shape.begin(), c.input_shape.end());
    b.tensors = {at::randn(shape), at::randint(0, 3, {4}, at::kLong)};
    b.size = 4;
    torch::NoGradGuard no_grad;
    split.model->module().eval();
    split.model->validation_step(b, ctx);
    EXPECT_TRUE(ctx.logged.count("val_loss"));
  }
}

// 2-GPU dp with batch 2b against single_device with batch 2b: the same weights after training.
TEST(Dp, TwoGpusMatchSingleDeviceWithTheSameBatch) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices, " << static_cast<int>(torch::cuda::device_count()) << " visible";
  const char* run = R"(
[trainer]
max_epochs = 2
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 32
hidden = [24, 16]
num_classes = 4
[data]
name = "synthetic"
shape = [32]
num_classes = 4
num_train = 64
num_val = 16
num_test = 0
batch_size = 16
[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
)";
  TempDir single("dp"), dp("dp");
  write_file(single / "run.toml", run);
  write_file(dp / "run.toml", run);
  auto a = run_engine({"run.toml", "--set", "single_device.device=\"cuda:0\""}, single.path(), {}, 300);
  ASSERT_EQ(a.exit_code, 0) << a.err;
  auto b = run_engine({"--plugins", "dp", "run.toml", "--set", "trainer.devices=2"}, dp.path(), {}, 300);
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_NE(b.err.find("dp: training on cuda:0, cuda:1"), std::string::npos) << b.err;
  auto weights = [](const fs::path& ckpt) {
    std::map<std::string, at::Tensor> out;
    for (const auto& e : ember::engine::load_checkpoint_file(ckpt).at("state_dict").toGenericDict())
      out[e.key().toStringRef()] = e.value().toTensor().cpu();
    return out;
  };
  auto wa = weights(single / "runs/run/version_0/checkpoints/last.ckpt");
  auto wb = weights(dp / "runs/run/version_0/checkpoints/last.ckpt");
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) {
    const double diff = (t - wb.at(name)).abs().max().item<double>();
    EXPECT_LE(diff, 1e-4) << name << " differs by " << diff;
  }
}
