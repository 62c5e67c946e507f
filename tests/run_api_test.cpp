// ember::Run, the engine as a library (engine/include/ember/run.h), driven in this process: a
// program's own module, data and callback objects next to plugins chosen by name, results
// returned instead of printed, and the loop's semantics (hook order, accumulation, stop
// decisions) checked without forking an engine.
#include <gtest/gtest.h>

#include <ember/support/callback_base.h>
#include <ember/run.h>

#include <torch/nn/modules/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <utility>

#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// Three linearly separable classes in 8 dimensions: learnable in a few epochs.
std::vector<at::Tensor> blobs(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto y = at::randint(0, 3, {n}, gen, at::kLong);
  auto centers = at::eye(8).slice(0, 0, 3) * 3.0;
  auto x = centers.index_select(0, y) + at::randn({n, 8}, gen);
  return {x, y};
}

std::shared_ptr<ember::ModuleModel> linear_model() {
  torch::manual_seed(0);
  auto net = std::make_shared<torch::nn::LinearImpl>(8, 3);
  return std::make_shared<ember::ModuleModel>(
      net,
      [](torch::nn::Module& m, const ember::Batch& b) {
        return torch::nn::functional::cross_entropy(static_cast<torch::nn::LinearImpl&>(m).forward(b[0]), b[1]);
      },
      [](torch::nn::Module& m, const ember::Batch& b) {
        auto pred = static_cast<torch::nn::LinearImpl&>(m).forward(b[0]).argmax(1);
        return std::vector<std::pair<std::string, at::Tensor>>{{"acc", pred.eq(b[1]).to(at::kFloat).mean()}};
      });
}

std::shared_ptr<ember::TensorData> blob_data() {
  return std::make_shared<ember::TensorData>(blobs(256, 1), blobs(64, 2), blobs(64, 3));
}

std::string config(const fs::path& root, const std::string& extra = "") {
  return "[trainer]\nmax_epochs = 3\nseed = 7\nenable_progress_bar = false\nenable_model_summary = false\n"
         "default_root_dir = \"" + root.string() + "\"\nname = \"embedded\"\n"
         "[data]\nbatch_size = 32\n[optimizer]\nname = \"sgd\"\nlr = 0.1\n" + extra;
}

double metric(const ember::MetricList& list, const std::string& name) {
  for (const auto& [k, v] : list)
    if (k == name) return v;
  throw std::runtime_error("no metric " + name);
}

// Records every hook and can ask to stop at a given global step.
class HookLog final : public ember::ICallback {
 public:
  std::vector<std::string> hooks;
  int64_t stop_at_step = -1;
  void on_hook(ember::Hook hook, ember::ITrainer& t) override {
    hooks.push_back(ember::hook_name(hook));
    if (hook == ember::Hook::on_train_batch_end && t.global_step() == stop_at_step) t.request_stop("test asked");
  }
  int64_t count(const std::string& h) const { return std::count(hooks.begin(), hooks.end(), h); }
};

// Records every hook; setup and teardown with the stage they ran for ("setup(validate)").
class StageLog final : public ember::ICallback {
 public:
  std::vector<std::string> hooks;
  void on_hook(ember::Hook hook, ember::ITrainer& t) override {
    std::string name = ember::hook_name(hook);
    if (hook == ember::Hook::setup || hook == ember::Hook::teardown) name += "(" + stage_name(t.stage()) + ")";
    hooks.push_back(name);
  }
  std::vector<std::string> take() { return std::exchange(hooks, {}); }

 private:
  static std::string stage_name(ember::Stage s) {
    switch (s) {
      case ember::Stage::fit: return "fit";
      case ember::Stage::validate: return "validate";
      case ember::Stage::test: return "test";
      case ember::Stage::predict: return "predict";
      default: return "stage " + std::to_string(static_cast<int>(s));
    }
  }
};

}  // namespace

// Lightning's trainer.validate/test/predict: the setup hooks run first with the call's stage and
// the teardown hooks last; fit keeps its own setup(fit)/teardown(fit).
TEST(RunApi, ValidateTestAndPredictRunTheStageSetupAndTeardownHooks) {
  TempDir dir("run_api");
  auto log = std::make_shared<StageLog>();
  torch::manual_seed(0);
  auto net = std::make_shared<torch::nn::LinearImpl>(8, 3);
  auto logits = [](torch::nn::Module& m, const ember::Batch& b) { return static_cast<torch::nn::LinearImpl&>(m).forward(b[0]); };
  ember::RunOptions o;
  o.config_toml = config(dir.path(), "");
  o.overrides = {"trainer.max_epochs=1", "trainer.num_sanity_val_steps=0"};
  o.model = std::make_shared<ember::ModuleModel>(
      net, [&](torch::nn::Module& m, const ember::Batch& b) { return torch::nn::functional::cross_entropy(logits(m, b), b[1]); },
      [&](torch::nn::Module& m, const ember::Batch& b) {
        return std::vector<std::pair<std::string, at::Tensor>>{{"acc", logits(m, b).argmax(1).eq(b[1]).to(at::kFloat).mean()}};
      },
      [&](torch::nn::Module& m, const ember::Batch& b) { return logits(m, b).softmax(1); });
  o.data = blob_data();
  o.callbacks = {log};
  ember::Run run(o);
  run.fit();
  auto hooks = log->take();
  ASSERT_GE(hooks.size(), 2u);
  EXPECT_EQ(hooks.front(), "setup(fit)");
  EXPECT_EQ(hooks.back(), "teardown(fit)");

  run.validate("last");
  hooks = log->take();
  EXPECT_EQ(hooks, (std::vector<std::string>{"setup(validate)", "on_validation_start", "on_validation_epoch_start",
                                             "on_validation_batch_start", "on_validation_batch_end", "on_validation_batch_start",
                                             "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end",
                                             "teardown(validate)"}));
  run.test("last");
  hooks = log->take();
  ASSERT_GE(hooks.size(), 4u);
  EXPECT_EQ(std::vector<std::string>(hooks.begin(), hooks.begin() + 2), (std::vector<std::string>{"setup(test)", "on_test_start"}));
  EXPECT_EQ(std::vector<std::string>(hooks.end() - 2, hooks.end()), (std::vector<std::string>{"on_test_end", "teardown(test)"}));
  run.predict("last");
  EXPECT_EQ(log->take(), (std::vector<std::string>{"setup(predict)", "teardown(predict)"}));  // the SDK has no on_predict_* hooks
}

TEST(RunApi, TrainsTheProgramsModuleAndTestsTheBestCheckpoint) {
  TempDir dir("run_api");
  ember::RunOptions o;
  o.config_toml = config(dir.path(), "[checkpoint]\nmonitor = \"val_loss\"\n");
  o.plugins = {"early_stopping"};
  o.overrides = {"early_stopping.monitor=\"val_loss\""};
  o.model = linear_model();
  o.data = blob_data();
  ember::Run run(o);
  ASSERT_FALSE(run.is_launcher());
  const double before = metric(run.validate(), "val_loss");
  const auto fit = run.fit();
  EXPECT_EQ(fit.epochs_done, 3);  // Lightning's current_epoch after fit: the epochs completed
  EXPECT_EQ(fit.global_step, 3 * 8);
  EXPECT_EQ(fit.run_dir, run.run_dir());
  EXPECT_TRUE(fs::exists(fs::path(fit.run_dir) / "metrics.csv"));
  ASSERT_FALSE(fit.best_checkpoint.empty());
  EXPECT_TRUE(fs::exists(fit.best_checkpoint));
  const double after = metric(fit.metrics, "val_loss");
  EXPECT_LT(after, before * 0.5) << "training did not reduce the validation loss";
  const auto test = run.test("best");
  EXPECT_GT(metric(test, "test_acc"), 0.9);
  // The best checkpoint's weights are what test() measured: a second run reads the same file.
  run.finish();
  ember::RunOptions o2 = o;
  o2.plugins = {};
  o2.overrides = {};
  o2.model = linear_model();
  ember::Run again(o2);
  EXPECT_DOUBLE_EQ(metric(again.test(fit.best_checkpoint), "test_loss"), metric(test, "test_loss"));
}

TEST(RunApi, TwoRunsInOneProcessShareNothing) {
  TempDir dir("run_api");
  auto train = [&] {
    ember::RunOptions o;
    o.config_toml = config(dir.path());
    o.model = linear_model();
    o.data = blob_data();
    ember::Run run(o);
    run.fit();
    auto& m = run.trainer().module();
    std::vector<at::Tensor> w;
    for (const auto& p : m.parameters()) w.push_back(p.detach().clone());
    return w;
  };
  const auto a = train();
  const auto b = train();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
}

TEST(RunApi, HookOrderAccumulationAndStopDecisionInProcess) {
  TempDir dir("run_api");
  auto log = std::make_shared<HookLog>();
  log->stop_at_step = 5;  // mid-epoch: 8 batches of 32 per epoch, accumulation 2 -> 4 steps per epoch
  ember::RunOptions o;
  o.config_toml = config(dir.path(), "");
  o.overrides = {"trainer.accumulate_grad_batches=2", "trainer.num_sanity_val_steps=1", "trainer.enable_checkpointing=false"};
  o.model = linear_model();
  o.data = blob_data();
  o.callbacks = {log};
  ember::Run run(o);
  const auto fit = run.fit();
  EXPECT_EQ(fit.global_step, 5);  // stopped right after the step that asked, not at the epoch's end
  EXPECT_EQ(fit.epochs_done, 1);
  EXPECT_EQ(log->count("on_train_batch_start"), 4 * 2 + 2);  // epoch 0: 8 micro-batches; epoch 1: 2
  EXPECT_EQ(log->count("on_before_optimizer_step"), 5);
  EXPECT_EQ(log->count("on_before_zero_grad"), 5);
  const std::vector<std::string> head = {"setup", "on_fit_start", "on_sanity_check_start", "on_validation_start"};
  ASSERT_GE(log->hooks.size(), head.size());
  EXPECT_EQ(std::vector<std::string>(log->hooks.begin(), log->hooks.begin() + head.size()), head);
  const std::vector<std::string> tail = {"on_train_end", "on_fit_end", "teardown"};
  EXPECT_EQ(std::vector<std::string>(log->hooks.end() - tail.size(), log->hooks.end()), tail);
}

TEST(RunApi, BadInputIsOneLineWithItsPosition) {
  TempDir dir("run_api");
  auto error_of = [&](ember::RunOptions o) -> std::string {
    try {
      ember::Run run(o);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  ember::RunOptions o;
  o.model = linear_model();
  o.data = blob_data();
  o.config_toml = config(dir.path()) + "[trainer]\nmax_epochs = 2\n";  // `[trainer]` twice
  EXPECT_NE(error_of(o).find("config:"), std::string::npos) << error_of(o);
  o.config_toml = config(dir.path());
  o.overrides = {"trainer.max_epochz=2"};
  EXPECT_NE(error_of(o).find("max_epochz"), std::string::npos);
  o.overrides = {"model.name=\"mlp\""};
  EXPECT_NE(error_of(o).find("provides its own model object"), std::string::npos) << error_of(o);
  o.overrides = {};
  o.plugins = {"no_such_plugin"};
  EXPECT_NE(error_of(o).find("no_such_plugin"), std::string::npos);
  for (const auto& msg : {error_of(o)}) EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_THROW(ember::TensorData({at::zeros({4, 2}), at::zeros({3})}), std::runtime_error);
}

// ddp with 2 CPU ranks from a program: the constructor starts the ranks by running this test
// binary again (same arguments, rank in the environment); each rank trains, the first process
// only waits and reports their exit code.
TEST(RunApi, TwoCpuRanksRunTheProgramAgain) {
  EMBER_SKIP_WITHOUT_MPI();
  // Parent and ranks must agree on the folder: the parent makes it, the ranks inherit its name.
  std::unique_ptr<TempDir> dir;
  const char* inherited = std::getenv("EMBER_RUN_API_TEST_ROOT");
  if (!inherited) {
    dir = std::make_unique<TempDir>("run_api_ddp");
    ::setenv("EMBER_RUN_API_TEST_ROOT", dir->path().c_str(), 1);
  }
  const fs::path root = inherited ? fs::path(inherited) : dir->path();
  ember::RunOptions o;
  o.config_toml = config(root, "");
  o.overrides = {"trainer.strategy=\"ddp\"", "trainer.devices=2", "trainer.accelerator=\"cpu\"", "trainer.max_epochs=2",
                 "trainer.num_sanity_val_steps=0"};
  o.model = linear_model();
  o.data = blob_data();
  // The ranks run this test alone (by default they would get this process's own command line).
  o.argv = {fs::read_symlink("/proc/self/exe").string(), "--gtest_filter=RunApi.TwoCpuRanksRunTheProgramAgain"};
  ember::Run run(o);
  if (run.is_launcher()) {
    ::unsetenv("EMBER_RUN_API_TEST_ROOT");
    EXPECT_EQ(run.launcher_exit_code(), 0) << "a rank failed (its output is above)";
    EXPECT_TRUE(fs::exists(root / "embedded/version_0/checkpoints/last.ckpt"));
    return;
  }
  EXPECT_EQ(run.world_size(), 2);
  const auto fit = run.fit();
  EXPECT_EQ(fit.global_step, 2 * 4);  // 256 samples / 2 ranks / batch 32 = 4 steps an epoch
  EXPECT_LT(fit.metrics.empty() ? 1e9 : metric(fit.metrics, "val_loss"), 0.5);
}

// Lightning's trainer.predict from a program: one row per test sample, the probabilities the
// module computes with the checkpoint's weights, and predictions as accurate as test() says.
TEST(RunApi, PredictWritesEverySampleWithTheCheckpointsProbabilities) {
  TempDir dir("run_api");
  auto net = std::make_shared<torch::nn::LinearImpl>(8, 3);
  auto logits = [](torch::nn::Module& m, const ember::Batch& b) { return static_cast<torch::nn::LinearImpl&>(m).forward(b[0]); };
  auto make_model = [&] {
    return std::make_shared<ember::ModuleModel>(
        net, [&](torch::nn::Module& m, const ember::Batch& b) { return torch::nn::functional::cross_entropy(logits(m, b), b[1]); },
        [&](torch::nn::Module& m, const ember::Batch& b) {
          return std::vector<std::pair<std::string, at::Tensor>>{{"acc", logits(m, b).argmax(1).eq(b[1]).to(at::kFloat).mean()}};
        },
        [&](torch::nn::Module& m, const ember::Batch& b) { return logits(m, b).softmax(1); });
  };
  const auto test_split = blobs(64, 3);
  ember::RunOptions o;
  o.config_toml = config(dir.path(), "[checkpoint]\nmonitor = \"val_loss\"\n");
  o.model = make_model();
  o.data = std::make_shared<ember::TensorData>(blobs(256, 1), blobs(64, 2), test_split);
  std::string best;
  double test_acc = 0;
  {
    ember::Run run(o);
    best = run.fit().best_checkpoint;
    ASSERT_FALSE(best.empty());
    test_acc = metric(run.test(best), "test_acc");
  }
  torch::manual_seed(123);  // other weights in the module: predict must restore the checkpoint's
  for (auto& p : net->parameters()) p.data().normal_();
  ember::Run run(o);
  const fs::path csv = run.predict(best);
  EXPECT_EQ(csv.parent_path(), fs::path(run.run_dir()));
  const auto rows = read_csv(csv);
  ASSERT_EQ(rows.size(), 64u);
  EXPECT_EQ(rows[0].count("prob_2"), 1u);
  // net now holds the checkpoint's weights, on the device the run chose (a GPU where there is one).
  const at::Tensor expected =
      logits(*net, ember::Batch{.tensors = {test_split[0].to(net->weight.device())}, .size = 64}).softmax(1).to(at::kCPU);
  const auto y = test_split[1];
  int64_t correct = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].at("id"), std::to_string(i));
    double sum = 0;
    for (int k = 0; k < 3; ++k) {
      const double p = std::stod(rows[i].at("prob_" + std::to_string(k)));
      EXPECT_NEAR(p, expected[static_cast<int64_t>(i)][k].item<double>(), 1e-5) << "row " << i;
      sum += p;
    }
    EXPECT_NEAR(sum, 1.0, 1e-5);
    correct += std::stoll(rows[i].at("prediction")) == y[static_cast<int64_t>(i)].item<int64_t>();
  }
  EXPECT_NEAR(static_cast<double>(correct) / 64.0, test_acc, 1e-6);
}

TEST(EnginePredict, WritesPredictionsCsvAndRefusesWhatItCannotDo) {
  TempDir dir("predict");
  write_file(dir / "p.toml", R"(
[trainer]
max_epochs = 1
enable_progress_bar = false
enable_model_summary = false
default_root_dir = "runs"
accelerator = "cpu"
[model]
name = "mlp"
input_size = 12
hidden = [16]
num_classes = 3
[data]
name = "synthetic"
shape = [12]
num_classes = 3
num_train = 128
num_val = 32
num_test = 40
batch_size = 16
)");
  auto r = run_engine({"p.toml"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run_engine({"predict", "--ckpt", "last", "p.toml", "--set", "trainer.limit_predict_batches=2"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto rows = read_csv(dir / "runs/p/version_1/predictions.csv");
  ASSERT_EQ(rows.size(), 32u);  // two batches of 16
  for (const auto& row : rows) {
    double sum = 0, best = -1;
    std::string argmax;
    for (int k = 0; k < 3; ++k) {
      const double p = std::stod(row.at("prob_" + std::to_string(k)));
      sum += p;
      if (p > best) best = p, argmax = std::to_string(k);
    }
    EXPECT_NEAR(sum, 1.0, 1e-5);
    EXPECT_EQ(row.at("prediction"), argmax);
  }
  EXPECT_NE(r.err.find("wrote 32 predictions of the test split"), std::string::npos) << r.err;
  // One line each, exit 2 for bad input.
  r = run_engine({"predict", "--ckpt", "missing.ckpt", "p.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--ckpt missing.ckpt: no such checkpoint file"), std::string::npos) << r.err;
  r = run_engine({"p.toml", "--ckpt", "last"}, dir.path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--ckpt is for `engine validate|test|predict`"), std::string::npos) << r.err;
  r = run_engine({"test", "--ckpt", "best", "p.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("test_acc"), std::string::npos) << r.out;
}
