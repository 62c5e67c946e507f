#include "runtime/accelerator.h"

#include <ember/error.h>

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>
#include <torch/utils.h>

namespace ember::engine {
namespace {

class CpuAccelerator final : public Accelerator {
 public:
  const char* name() const override { return "cpu"; }
  c10::DeviceType device_type() const override { return c10::kCPU; }
  bool is_available() const override { return true; }
  int64_t device_count() const override { return 1; }
  void manual_seed_all(uint64_t seed) const override { torch::manual_seed(seed); }
  std::vector<at::Tensor> rng_states() const override { return {at::detail::getDefaultCPUGenerator().get_state()}; }
  void set_rng_states(const std::vector<at::Tensor>& states) const override {
    if (states.empty()) return;
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle on the global generator
    gen.set_state(states.front());
  }
  std::optional<int64_t> total_memory(const c10::Device&) const override { return std::nullopt; }
  std::optional<int64_t> peak_allocated(const c10::Device&) const override { return std::nullopt; }
  bool copies_ahead() const override { return false; }
};

class CudaAccelerator final : public Accelerator {
 public:
  const char* name() const override { return "cuda"; }
  c10::DeviceType device_type() const override { return c10::kCUDA; }
  bool is_available() const override { return torch::cuda::is_available(); }
  int64_t device_count() const override { return is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0; }
  void manual_seed_all(uint64_t seed) const override {
    if (is_available()) torch::cuda::manual_seed_all(seed);
  }
  std::vector<at::Tensor> rng_states() const override {
    std::vector<at::Tensor> out;
    for (int64_t i = 0; i < device_count(); ++i) out.push_back(generator(i).get_state());
    return out;
  }
  void set_rng_states(const std::vector<at::Tensor>& states) const override {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(states.size()), device_count());
    for (int64_t i = 0; i < n; ++i) {
      at::Generator gen = generator(i);
      gen.set_state(states[static_cast<size_t>(i)]);
    }
  }
  std::optional<int64_t> total_memory(const c10::Device& device) const override {
    return static_cast<int64_t>(at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
  }
  std::optional<int64_t> peak_allocated(const c10::Device& device) const override {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
  bool copies_ahead() const override { return true; }

 private:
  static at::Generator generator(int64_t index) {
    return at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)));
  }
};

}  // namespace

const std::vector<const Accelerator*>& all_accelerators() {
  static const CpuAccelerator cpu;
  static const CudaAccelerator cuda;
  static const std::vector<const Accelerator*> all = {&cpu, &cuda};
  return all;
}

const Accelerator& accelerator_for(c10::DeviceType type) {
  for (const auto* a : all_accelerators())
    if (a->device_type() == type) return *a;
  throw RunError(std::string("no accelerator for device type ") + c10::DeviceTypeName(type) +
                 " in this build of the engine (it knows cpu and cuda)");
}

}  // namespace ember::engine
