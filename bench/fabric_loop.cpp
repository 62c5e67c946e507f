// The Fabric variant of bench/overhead.sh: bench/handwritten_loop.cpp's loop, model, data and
// optimizer, with every step going through ember::Fabric (libember.so) on single_device, 32-true:
// to_device, the autocast region, backward and optimizer_step through the strategy and precision
// plugins. The optimizer is the same torch::optim::Adam (the plain per-tensor kernel) as the
// hand-written loop's, so the difference is Fabric's own. Prints "epoch <i> <seconds> loss <l>".
//   bench_fabric_loop <cnn|mlp> <samples> <batch_size> <epochs> <threads>
#include <ember/fabric.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "overhead_nets.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: bench_fabric_loop <cnn|mlp> <samples> <batch_size> <epochs> <threads>\n");
    return 2;
  }
  const bool cnn = std::string(argv[1]) == "cnn";
  const int64_t n = std::atoll(argv[2]), bs = std::atoll(argv[3]), epochs = std::atoll(argv[4]);
  torch::set_num_threads(std::atoi(argv[5]));
  ember::Fabric fabric({.accelerator = "cpu", .strategy = "single_device", .precision = "32-true"});
  return fabric.launch([&](ember::Fabric& f) {
    f.seed_everything(0);
    auto x = cnn ? torch::randn({n, 1, 28, 28}) : torch::randn({n, 32});
    auto y = torch::randint(0, 10, {n});
    auto conv_net = std::make_shared<NetImpl>();
    auto mlp_net = std::make_shared<MlpImpl>();
    std::shared_ptr<torch::nn::Module> net = cnn ? std::static_pointer_cast<torch::nn::Module>(conv_net) : mlp_net;
    auto forward = [&](const torch::Tensor& in) { return cnn ? conv_net->forward(in) : mlp_net->forward(in); };
    f.setup(net, [](std::vector<at::Tensor> p) {
      return std::make_shared<torch::optim::Adam>(std::move(p), torch::optim::AdamOptions(2e-3));
    });
    net->train();
    for (int64_t e = 0; e < epochs; ++e) {
      auto t0 = std::chrono::steady_clock::now();
      auto perm = torch::randperm(n);
      double loss_sum = 0;
      for (int64_t b = 0; b < n; b += bs) {
        auto idx = perm.slice(0, b, std::min(n, b + bs));
        auto xb = f.to_device(x.index_select(0, idx));
        auto yb = f.to_device(y.index_select(0, idx));
        at::Tensor loss;
        {
          auto region = f.autocast();
          loss = torch::nn::functional::cross_entropy(forward(xb), yb);
        }
        f.zero_grad();  // where the hand-written loop has it: after the forward
        f.backward(loss);
        f.optimizer_step();
        loss_sum += loss.item<double>();  // as the hand-written loop reports its loss
      }
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("epoch %lld %.4f loss %.4f\n", static_cast<long long>(e), secs, loss_sum / static_cast<double>((n + bs - 1) / bs));
      std::fflush(stdout);
    }
  });
}
