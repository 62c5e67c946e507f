// The baseline for bench/overhead.sh: the same CNN and data sizes as the Ember run, trained by the
// loop a LibTorch user would write by hand. Prints one line per epoch: "epoch <i> <seconds>".
//   handwritten_loop <cnn|mlp> <samples> <batch_size> <epochs> <threads>
// mlp: 32 inputs, one hidden layer of 32, 10 classes: so small that the loop's own overhead shows.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "overhead_nets.h"


int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: handwritten_loop <cnn|mlp> <samples> <batch_size> <epochs> <threads>\n");
    return 2;
  }
  const bool cnn = std::string(argv[1]) == "cnn";
  const int64_t n = std::atoll(argv[2]), bs = std::atoll(argv[3]), epochs = std::atoll(argv[4]);
  torch::set_num_threads(std::atoi(argv[5]));
  torch::manual_seed(0);
  auto x = cnn ? torch::randn({n, 1, 28, 28}) : torch::randn({n, 32});
  auto y = torch::randint(0, 10, {n});
  Net conv_net;
  Mlp mlp_net;
  torch::nn::Module& net_module = cnn ? static_cast<torch::nn::Module&>(*conv_net) : *mlp_net;
  auto forward = [&](const torch::Tensor& in) { return cnn ? conv_net->forward(in) : mlp_net->forward(in); };
  torch::optim::Adam opt(net_module.parameters(), torch::optim::AdamOptions(2e-3));
  net_module.train();
  for (int64_t e = 0; e < epochs; ++e) {
    auto t0 = std::chrono::steady_clock::now();
    auto perm = torch::randperm(n);
    double loss_sum = 0;
    for (int64_t b = 0; b < n; b += bs) {
      auto idx = perm.slice(0, b, std::min(n, b + bs));
      auto loss = torch::nn::functional::cross_entropy(forward(x.index_select(0, idx)), y.index_select(0, idx));
      opt.zero_grad();
      loss.backward();
      opt.step();
      loss_sum += loss.item<double>();  // what a hand-written loop typically does to report the loss
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("epoch %lld %.4f loss %.4f\n", static_cast<long long>(e), secs, loss_sum / static_cast<double>((n + bs - 1) / bs));
    std::fflush(stdout);
  }
}
