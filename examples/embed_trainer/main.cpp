// A program that trains a network it defines itself with Ember as a library (ember::Run), with the
// checkpoint and early_stopping plugins, and reads the results back instead of parsing logs.
//   embed_trainer [OUTPUT_DIR]
#include <ember/run.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <cstdio>
#include <exception>

namespace {

// Four Gaussian blobs in 16 dimensions, 5.7 standard deviations apart: about 99% is learnable in a
// few epochs.
std::vector<at::Tensor> blobs(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto y = at::randint(0, 4, {n}, gen, at::kLong);
  auto x = (at::eye(16).slice(0, 0, 4) * 4.0).index_select(0, y) + at::randn({n, 16}, gen);
  return {x, y};
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string out = argc > 1 ? argv[1] : "runs";
  torch::manual_seed(0);
  auto net = std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  auto forward = [](torch::nn::Module& m, const ember::Batch& b) { return static_cast<torch::nn::SequentialImpl&>(m).forward(b[0]); };

  ember::RunOptions options;
  options.config_toml = R"(
[trainer]
max_epochs = 20
seed = 1
name = "embed_trainer"
enable_progress_bar = false

[data]
batch_size = 64

[optimizer]
name = "adam"
lr = 0.01

[checkpoint]
monitor = "val_loss"
save_top_k = 1

[early_stopping]
monitor = "val_loss"
patience = 2
min_delta = 0.001
)";
  options.overrides = {"trainer.default_root_dir=\"" + out + "\""};
  options.plugins = {"checkpoint", "early_stopping"};
  options.model = std::make_shared<ember::ModuleModel>(
      net, [&](torch::nn::Module& m, const ember::Batch& b) { return torch::nn::functional::cross_entropy(forward(m, b), b[1]); },
      [&](torch::nn::Module& m, const ember::Batch& b) {
        return std::vector<std::pair<std::string, at::Tensor>>{{"acc", forward(m, b).argmax(1).eq(b[1]).to(at::kFloat).mean()}};
      });
  options.data = std::make_shared<ember::TensorData>(blobs(2048, 1), blobs(512, 2), blobs(512, 3));

  ember::Run run(options);
  const auto fit = run.fit();
  std::printf("trained %lld epochs, %lld steps in %s\n", static_cast<long long>(fit.epochs_done),
              static_cast<long long>(fit.global_step), fit.run_dir.c_str());
  std::printf("best checkpoint: %s\n", fit.best_checkpoint.c_str());
  double acc = 0;
  for (const auto& [name, value] : run.test("best")) {
    std::printf("%s = %.4f\n", name.c_str(), value);
    if (name == "test_acc") acc = value;
  }
  return acc > 0.9 ? 0 : 3;
} catch (const std::exception& e) {
  std::fprintf(stderr, "embed_trainer: %s\n", e.what());
  return 1;
}
