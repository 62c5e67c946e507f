// The host side of one offloaded optimizer step (what the offload strategy does after backward),
// for 10M, 100M and 500M fp32 parameters held in tensors of 1M elements (a 1024x1024 layer):
//   plain    torch::optim::AdamW (LibTorch's C++ API) over the fp32 masters;
//   fused    ember::optim::FusedAdamW (ATen's _fused_adamw_, multithreaded CPU kernel) over them;
//   and the offload pipeline around the fused step: gradients from the device in the compute
//   dtype into the fp32 host gradients, the step, the updated masters back to the device in the
//   compute dtype (on a CPU device the "copies" are the dtype conversions only).
//   bench_offload [sizes_in_millions=10,100,500] [device=cpu] [compute_dtype=bf16|fp32] [steps=3]
// Each number is the median of `steps` timed steps after one warm-up step. Plain and fused start
// from the same values; plain's tensors are freed before fused's are made (500M parameters with
// AdamW are 8 GB either way).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ember/support/fused_optim.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kChunk = 1024 * 1024;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<at::Tensor> host_tensors(int64_t numel, bool with_grads) {
  std::vector<at::Tensor> out;
  at::manual_seed(0);
  for (int64_t left = numel; left > 0; left -= kChunk) {
    auto p = at::randn({std::min(left, kChunk)}, at::kFloat).requires_grad_(true);
    if (with_grads) p.mutable_grad() = at::randn_like(p) * 1e-2;
    out.push_back(p);
  }
  return out;
}

double time_plain(int64_t numel, int steps) {
  auto params = host_tensors(numel, true);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  opt.step();
  std::vector<double> t;
  for (int i = 0; i < steps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    opt.step();
    t.push_back(seconds_since(t0));
  }
  return median(t);
}

struct Pipeline {
  double to_host = 0, step = 0, to_device = 0;
};

Pipeline time_offload(int64_t numel, const at::Device& device, at::ScalarType compute, int steps) {
  auto masters = host_tensors(numel, false);
  const bool cuda = device.is_cuda();
  std::vector<at::Tensor> host_grads, device_weights, device_grads;
  for (const auto& m : masters) {
    host_grads.push_back(at::empty_like(m, at::TensorOptions().pinned_memory(cuda)));
    device_weights.push_back(m.detach().to(device, compute));
    device_grads.push_back((at::randn_like(m) * 1e-2).to(device, compute));
  }
  ember::optim::FusedAdamW opt(masters, torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  auto sync = [&] {
    if (cuda) device_weights.front().sum().item<float>();
  };
  std::vector<double> a, b, c;
  for (int i = 0; i <= steps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < masters.size(); ++k) {
      host_grads[k].copy_(device_grads[k]);
      masters[k].mutable_grad() = host_grads[k];
    }
    const double ta = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    opt.step();
    const double tb = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    for (size_t k = 0; k < masters.size(); ++k) device_weights[k].copy_(masters[k].detach(), /*non_blocking=*/cuda);
    sync();
    const double tc = seconds_since(t0);
    if (i == 0) continue;  // warm-up: the optimizer state is created in the first step
    a.push_back(ta);
    b.push_back(tb);
    c.push_back(tc);
  }
  return {median(a), median(b), median(c)};
}

// MemAvailable in bytes (a size that does not fit is skipped, not swapped or OOM-killed).
int64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string rest;
  while (in >> key >> kib) {
    std::getline(in, rest);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {10, 100, 500};
  if (argc > 1) {
    sizes.clear();
    std::stringstream ss(argv[1]);
    for (std::string s; std::getline(ss, s, ',');) sizes.push_back(std::stoll(s));
  }
  const at::Device device(argc > 2 ? argv[2] : "cpu");
  const std::string dtype = argc > 3 ? argv[3] : "bf16";
  const at::ScalarType compute = dtype == "fp32" ? at::kFloat : at::kBFloat16;
  const int steps = argc > 4 ? std::stoi(argv[4]) : 3;
  std::printf("host intra-op threads: %d; device %s; compute dtype %s; median of %d steps\n\n", at::get_num_threads(),
              device.str().c_str(), dtype.c_str(), steps);
  std::printf("| parameters | torch::optim::AdamW (s/step) | fused AdamW (s/step) | plain / fused | grads to host (s) | weights to device (s) | offload host step total (s) |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int64_t m : sizes) {
    const int64_t n = m * 1000 * 1000;
    // fp32 masters, gradients and AdamW's two moments (16 bytes a parameter), the compute-dtype
    // copies on top when the device is the CPU, and a margin.
    const int64_t need = n * (16 + (device.is_cpu() ? 2 * static_cast<int64_t>(c10::elementSize(compute)) : 0)) * 5 / 4;
    if (need > mem_available()) {
      std::printf("| %lldM | skipped: needs about %.1f GB, %.1f GB available | | | | | |\n", static_cast<long long>(m), need / 1e9,
                  mem_available() / 1e9);
      continue;
    }
    const double plain = time_plain(n, steps);
    const Pipeline f = time_offload(n, device, compute, steps);
    std::printf("| %lldM | %.3f | %.3f | %.2fx | %.3f | %.3f | %.3f |\n", static_cast<long long>(m), plain, f.step, plain / f.step,
                f.to_host, f.to_device, f.to_host + f.step + f.to_device);
    std::fflush(stdout);
  }
  return 0;
}
