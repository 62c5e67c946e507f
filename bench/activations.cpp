// Ember::activations' gelu_tanh against LibTorch's at::gelu(x, "tanh"): forward and backward time
// on CPU float32, for the hidden activations of configs/austen_char_gpt.toml (12 x 64 x 512) and of
// GPT-2 124M (8 x 1024 x 3072), with 1 and N threads; the median of interleaved rounds.
//   bench_activations [threads=2] [rounds=7]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ember/support/activations.h>
#include <torch/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Microseconds per call: enough calls to fill ~20 ms, after two warm-up calls.
double time_us(const std::function<void()>& f) {
  f();
  f();
  int calls = 1;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    if (us > 20000 || calls > 100000) return us / calls;
    calls *= 2;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  struct Shape {
    const char* name;
    std::vector<int64_t> sizes;
  };
  const std::vector<Shape> shapes = {{"austen_char_gpt 12x64x512", {12, 64, 512}}, {"GPT-2 124M 8x1024x3072", {8, 1024, 3072}}};
  std::printf("| activations | threads | ATen forward (us) | Ember forward (us) | ATen / Ember | ATen backward (us) | Ember backward (us) | ATen / Ember |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const Shape& shape : shapes) {
    for (int t : {1, threads}) {
      at::set_num_threads(t);
      const at::Tensor x = at::randn(shape.sizes) * 2;
      const at::Tensor g = at::randn(shape.sizes);
      // Backward as autograd runs it: the saved input and the upstream gradient in, the input's gradient out.
      const at::Tensor xg = x.clone().requires_grad_(true);
      const at::Tensor ember_out = ember::gelu_tanh(xg);
      std::vector<double> af, ef, ab, eb;
      for (int r = 0; r < rounds; ++r) {
        af.push_back(time_us([&] { at::gelu(x, "tanh"); }));
        ef.push_back(time_us([&] { ember::gelu_tanh(x); }));
        ab.push_back(time_us([&] { at::gelu_backward(g, x, "tanh"); }));
        eb.push_back(time_us([&] { torch::autograd::grad({ember_out}, {xg}, {g}, true); }));
      }
      std::printf("| %s | %d | %.0f | %.0f | %.2fx | %.0f | %.0f | %.2fx |\n", shape.name, t, median(af), median(ef),
                  median(af) / median(ef), median(ab), median(eb), median(ab) / median(eb));
    }
  }
}
