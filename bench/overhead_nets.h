// The two networks bench/overhead.sh trains, shared by its C++ variants (the hand-written loop and
// the Fabric loop) so both train exactly the same model: `Net`, models/cnn's default CNN, and
// `Mlp`, 32 -> 32 -> 10, so small that a loop's own overhead shows.
#pragma once
#include <torch/torch.h>

struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Dropout drop_conv{nullptr}, drop_fc{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  NetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
    drop_conv = register_module("drop_conv", torch::nn::Dropout(0.25));
    fc1 = register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128));
    drop_fc = register_module("drop_fc", torch::nn::Dropout(0.5));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = drop_conv(x).flatten(1);
    x = drop_fc(torch::relu(fc1(x)));
    return fc2(x);
  }
};
TORCH_MODULE(Net);

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, head{nullptr};
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(32, 32));
    head = register_module("head", torch::nn::Linear(32, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(fc1(x))); }
};
TORCH_MODULE(Mlp);
