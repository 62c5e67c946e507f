// Plugin "device_stats": Lightning's DeviceStatsMonitor. After every training batch that took an
// optimizer step it logs, through the trainer's metric store (so every logger gets them at
// trainer.log_every_n_steps):
//   device_stats/host_rss_mb, device_stats/host_peak_rss_mb (VmRSS, VmHWM), device_stats/host_mem_percent
//   device_stats/cpu_percent: CPU time of all this process's threads over wall time since the
//     previous value, in percent of one core (400 = four cores busy)
//   on a CUDA device: device_stats/cuda_allocated_mb, cuda_reserved_mb, cuda_peak_allocated_mb
//     (LibTorch's caching allocator, the numbers torch.cuda.memory_allocated/reserved/max_memory_allocated give)
//     and, through NVML (nvml.h: the driver's libnvidia-ml, loaded at run time), gpu_utilization_percent,
//     gpu_memory_busy_percent and gpu_power_watts
// MB = 2^20 bytes.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <ember/host.h>
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/plugin.h>
#include <ember/trainer.h>
#include <torch/torch.h>

#include <chrono>
#include <string>

#include "host_stats.h"
#include "nvml.h"

namespace {

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Bool("cpu_stats", "true", "Log host memory and CPU use (Lightning's cpu_stats)."),
    ember::key::Bool("cuda_stats", "true", "Log CUDA memory when the model is on a CUDA device."),
    ember::key::Bool("nvml", "true", "On a CUDA device, also log GPU utilisation, memory-busy share and power through NVML (the driver's libnvidia-ml)."),
    ember::key::String("prefix", "\"device_stats/\"", "Prefix of every metric name."),
};
// clang-format on

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr double kMB = 1024.0 * 1024.0;

class DeviceStats final : public ember::Callback {
 public:
  DeviceStats(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host), cpu_(cfg.get_bool("cpu_stats")), cuda_(cfg.get_bool("cuda_stats")), nvml_wanted_(cfg.get_bool("nvml")),
        prefix_(cfg.get_string("prefix")) {}

  void on_train_start(ember::ITrainer&) override {
    last_wall_ = now();
    last_cpu_ = ember_ds::cpu_seconds();
  }

  void on_train_batch_end(ember::ITrainer& t) override {
    if (!t.optimizer_stepped()) return;
    if (cpu_) {
      double rss = 0, peak = 0;
      if (ember_ds::rss_bytes(&rss, &peak)) {
        log(t, "host_rss_mb", rss / kMB);
        log(t, "host_peak_rss_mb", peak / kMB);
        log(t, "host_mem_percent", 100.0 * rss / ember_ds::total_memory_bytes());
      }
      const double wall = now(), cpu = ember_ds::cpu_seconds();
      if (wall > last_wall_) log(t, "cpu_percent", 100.0 * (cpu - last_cpu_) / (wall - last_wall_));
      last_wall_ = wall;
      last_cpu_ = cpu;
    }
    if (cuda_) {
      const c10::Device device = t.root_device();
      if (device.is_cuda()) {
        using c10::CachingAllocator::StatType;
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
        const auto all = static_cast<size_t>(StatType::AGGREGATE);
        log(t, "cuda_allocated_mb", static_cast<double>(stats.allocated_bytes[all].current) / kMB);
        log(t, "cuda_reserved_mb", static_cast<double>(stats.reserved_bytes[all].current) / kMB);
        log(t, "cuda_peak_allocated_mb", static_cast<double>(stats.allocated_bytes[all].peak) / kMB);
        if (nvml_wanted_) log_nvml(t, device);
      }
    }
  }

 private:
  void log_nvml(ember::ITrainer& t, const c10::Device& device) {
    if (!nvml_tried_) {
      nvml_tried_ = true;
      const auto* props = at::cuda::getDeviceProperties(device.index());
      std::string why;
      nvml_ = ember_ds::Nvml::open(ember_ds::pci_bus_id(props->pciDomainID, props->pciBusID, props->pciDeviceID), &why);
      if (!nvml_) host_.log(ember::LogLevel::warn, "device_stats: no GPU utilisation or power: " + why + " (set device_stats.nvml = false to silence)");
    }
    if (!nvml_) return;
    const auto r = nvml_->read();
    if (r.utilization_percent >= 0) log(t, "gpu_utilization_percent", r.utilization_percent);
    if (r.memory_busy_percent >= 0) log(t, "gpu_memory_busy_percent", r.memory_busy_percent);
    if (r.power_watts >= 0) log(t, "gpu_power_watts", r.power_watts);
  }
  void log(ember::ITrainer& t, const char* name, double v) {
    ember::LogOptions o;
    o.on_step = 1;
    o.on_epoch = 0;
    t.log_tensor(prefix_ + name, at::scalar_tensor(v, at::kDouble), o);
  }

  ember::IHost& host_;
  const bool cpu_, cuda_, nvml_wanted_;
  bool nvml_tried_ = false;
  std::optional<ember_ds::Nvml> nvml_;
  const std::string prefix_;
  double last_wall_ = 0, last_cpu_ = 0;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new DeviceStats(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "device_stats", "0.1.0", "Apache-2.0",
             "Lightning's DeviceStatsMonitor: host RSS and CPU use; CUDA memory allocated/reserved/peak, GPU utilisation and power (NVML).",
             EMBER_CONFIG_KEYS(kKeys), make)
