// Fused vs plain optimizer step time (ember/fused_optim.h against LibTorch's own classes):
// AdamW (weight decay 0.01) and SGD (momentum 0.9) over 1M, 10M and 100M fp32 parameters held
// in tensors of 256K elements (a 512x512 layer), on the CPU (and CUDA when present and asked).
//   bench_optimizers [sizes_in_millions=1,10,100] [device=cpu]
// Each line: the median of timed steps after two warm-up steps; fused and plain start from the
// same parameters and see the same gradients. Prints the CPU model, its SIMD flags and the
// intra-op thread count first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ember/support/fused_optim.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

void print_cpu() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown", flags;
  while (std::getline(in, line)) {
    auto value = [&] { return line.substr(line.find(':') + 2); };
    if (model == "unknown" && line.rfind("model name", 0) == 0) model = value();
    if (flags.empty() && line.rfind("flags", 0) == 0) flags = value();
  }
  std::istringstream fs(flags);
  std::string f, simd;
  static const std::set<std::string> keep = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                             "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"};
  while (fs >> f)
    if (keep.count(f)) simd += (simd.empty() ? "" : " ") + f;
  std::printf("cpu: %s\nsimd flags: %s\nintra-op threads: %d\n", model.c_str(), simd.empty() ? "(none of note)" : simd.c_str(),
              at::get_num_threads());
}

using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<at::Tensor>&)>;

// Median seconds per step.
double time_steps(const Factory& make, int64_t numel, const at::Device& device, int steps) {
  constexpr int64_t kChunk = 512 * 512;
  std::vector<at::Tensor> params;
  auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  for (int64_t left = numel; left > 0; left -= kChunk) {
    auto p = at::randn({std::min(left, kChunk)}, opts).requires_grad_(true);
    p.mutable_grad() = at::randn_like(p) * 1e-2;
    params.push_back(p);
  }
  auto opt = make(params);
  auto sync = [&] {
    if (device.is_cuda()) params[0].sum().item<float>();
  };
  for (int i = 0; i < 2; ++i) opt->step();
  sync();
  std::vector<double> t;
  for (int i = 0; i < steps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    opt->step();
    sync();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {1, 10, 100};
  if (argc > 1) {
    sizes.clear();
    std::stringstream ss(argv[1]);
    for (std::string s; std::getline(ss, s, ',');) sizes.push_back(std::stoll(s));
  }
  const at::Device device(argc > 2 ? argv[2] : "cpu");
  print_cpu();
  std::printf("device: %s\n\n", device.str().c_str());
  using namespace torch::optim;
  struct Opt {
    const char* name;
    Factory fused, plain;
  };
  const std::vector<Opt> opts = {
      {"adamw", [](auto& p) { return std::make_unique<ember::optim::FusedAdamW>(p, AdamWOptions(1e-3).weight_decay(0.01)); },
       [](auto& p) { return std::make_unique<AdamW>(p, AdamWOptions(1e-3).weight_decay(0.01)); }},
      {"sgd momentum", [](auto& p) { return std::make_unique<ember::optim::FusedSGD>(p, SGDOptions(0.1).momentum(0.9)); },
       [](auto& p) { return std::make_unique<SGD>(p, SGDOptions(0.1).momentum(0.9)); }},
  };
  std::printf("| optimizer | parameters | plain (ms/step) | fused (ms/step) | plain / fused |\n");
  std::printf("|---|---:|---:|---:|---:|\n");
  for (const auto& o : opts)
    for (int64_t m : sizes) {
      const int64_t n = m * 1000 * 1000;
      const int steps = m >= 100 ? 5 : m >= 10 ? 10 : 30;
      const double plain = time_steps(o.plain, n, device, steps);
      const double fused = time_steps(o.fused, n, device, steps);
      std::printf("| %s | %lldM | %.2f | %.2f | %.2fx |\n", o.name, static_cast<long long>(m), plain * 1e3, fused * 1e3,
                  plain / fused);
      std::fflush(stdout);
    }
  return 0;
}
