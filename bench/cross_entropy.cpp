// Ember::losses' cross_entropy (two fused passes) against LibTorch's at::cross_entropy_loss: the
// loss and its backward together (one training step's loss work), for float32 and bf16 logits, at
// configs/austen_char_gpt.toml's shape (12 x 64 tokens, 81 characters) and at GPT-2's vocabulary
// (50,304) with 2,048 tokens on the CPU (16 x 1,024 on a GPU); LibTorch's path for bf16 logits is
// autocast's (a float32 copy first). The median of interleaved rounds.
//   bench_cross_entropy [threads=2] [rounds=7] [device=cpu|cuda]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ember/support/cross_entropy.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void sync(const at::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

// Milliseconds per call: enough calls to fill ~100 ms, after two warm-up calls.
double time_ms(const std::function<void()>& f, const at::Device& d) {
  f();
  f();
  sync(d);
  int calls = 1;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f();
    sync(d);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (ms > 100 || calls > 10000) return ms / calls;
    calls *= 2;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  const std::string where = argc > 3 ? argv[3] : "cpu";
  if (where == "cuda" && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_cross_entropy: no CUDA device\n");
    return 1;
  }
  const at::Device device = where == "cuda" ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  at::set_num_threads(threads);
  struct Shape {
    const char* name;
    int64_t tokens, vocab;
  };
  const std::vector<Shape> shapes = {{"austen_char_gpt", 12 * 64, 81},
                                     {"GPT-2 vocabulary", device.is_cuda() ? 16 * 1024 : 2048, 50304}};
  std::printf("Ember kernels here: %s (%s, %d threads)\n",
              ember::cross_entropy_has_own_kernels(at::empty({1, 1}, at::TensorOptions().device(device))) ? "yes" : "no (ATen's)",
              device.str().c_str(), threads);
  std::printf("| logits | dtype | LibTorch loss + backward (ms) | Ember (ms) | LibTorch / Ember |\n");
  std::printf("|---|---|---|---|---|\n");
  for (const Shape& shape : shapes) {
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor logits = (at::randn({shape.tokens, shape.vocab}, at::TensorOptions().device(device)) * 3).to(dtype).requires_grad_();
      const at::Tensor targets = at::randint(0, shape.vocab, {shape.tokens}, at::TensorOptions().device(device).dtype(at::kLong));
      // LibTorch as autocast runs it: float32 whatever the logits' dtype.
      auto aten = [&] { torch::autograd::grad({at::cross_entropy_loss(logits.to(at::kFloat), targets)}, {logits}); };
      auto ember = [&] { torch::autograd::grad({ember::cross_entropy(logits, targets)}, {logits}); };
      std::vector<double> a, e;
      for (int r = 0; r < rounds; ++r) {
        a.push_back(time_ms(aten, device));
        e.push_back(time_ms(ember, device));
      }
      std::printf("| %s %lld x %lld | %s | %.3f | %.3f | %.2fx |\n", shape.name, static_cast<long long>(shape.tokens),
                  static_cast<long long>(shape.vocab), dtype == at::kFloat ? "float32" : "bf16", median(a), median(e), median(a) / median(e));
    }
  }
}
