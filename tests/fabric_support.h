// What the Fabric tests share (fabric_test.cpp, fabric_checkpoint_test.cpp,
// fabric_distributed_test.cpp): a small net with the mlp model plugin's names, its data, Adam,
// weight and gradient comparisons, Fabric's training loop, and "one line" error checks.
#pragma once
#include <gtest/gtest.h>

#include <ember/error.h>
#include <ember/fabric.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

namespace ember::test::fabric {

// The mlp model plugin's parameter names and shapes (input_size 8, hidden [4], 10 classes), so the
// engine can resume what Fabric saved.
struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 4));
    head = register_module("head", torch::nn::Linear(4, 10));
  }
  at::Tensor forward(const at::Tensor& x) { return head(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, head{nullptr};
};

inline std::shared_ptr<Net> make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return std::make_shared<Net>();
}

struct Data {
  at::Tensor x, y;
};
inline Data make_data(int64_t n) {
  torch::manual_seed(1234);
  return {torch::randn({n, 8}), torch::randint(0, 10, {n})};
}

inline ember::OptimizerFactory adam(double lr = 1e-2) {
  return [lr](std::vector<at::Tensor> p) {
    return std::make_shared<torch::optim::Adam>(std::move(p), torch::optim::AdamOptions(lr));
  };
}

inline std::vector<at::Tensor> weights(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

inline double max_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}

// The total 2-norm of the module's gradients, in double.
inline double gradient_norm(torch::nn::Module& m) {
  double sq = 0;
  for (const auto& p : m.parameters())
    if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  return std::sqrt(sq);
}

// Trains `steps` batches of 16 with Fabric's loop.
inline void fabric_steps(ember::Fabric& f, Net& net, const Data& d, int64_t steps, int64_t first = 0) {
  for (int64_t s = first; s < first + steps; ++s) {
    auto x = f.to_device(d.x.narrow(0, (s * 16) % d.x.size(0), 16));
    auto y = f.to_device(d.y.narrow(0, (s * 16) % d.y.size(0), 16));
    f.zero_grad();
    at::Tensor loss;
    {
      auto region = f.autocast();
      loss = torch::cross_entropy_loss(net.forward(x), y);
    }
    f.backward(loss);
    EXPECT_TRUE(f.optimizer_step());
  }
}

// One line, naming what was wrong.
template <class E = ember::ConfigError, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

}  // namespace ember::test::fabric
