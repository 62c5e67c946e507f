// Plugin "device_stats": Lightning's DeviceStatsMonitor. After every training batch that took an
// optimizer step it logs, through the trainer's metric store (so every logger gets them at
// trainer.log_every_n_steps):
//   device_stats/host_rss_mb, device_stats/host_peak_rss_mb (VmRSS, VmHWM), device_stats/host_mem_percent
//   device_stats/cpu_percent: CPU time of all this process's threads over wall time since the
//     previous value, in percent of one core (400 = four cores busy)
//   on a CUDA device: device_stats/cuda_allocated_mb, cuda_reserved_mb, cuda_peak_allocated_mb
//     (LibTorch's caching allocator, the numbers torch.cuda.memory_allocated/reserved/max_memory_allocated give)
// MB = 2^20 bytes. GPU utilisation and power (NVML) are not read.
#include <c10/cuda/CUDACachingAllocator.h>
#include <ember/callback_base.h>
#include <ember/config.h>
#include <ember/plugin.h>
#include <ember/trainer.h>
#include <torch/torch.h>

#include <chrono>
#include <string>

#include "host_stats.h"

namespace {

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Bool("cpu_stats", "true", "Log host memory and CPU use (Lightning's cpu_stats)."),
    ember::key::Bool("cuda_stats", "true", "Log CUDA memory when the model is on a CUDA device."),
    ember::key::String("prefix", "\"device_stats/\"", "Prefix of every metric name."),
};
// clang-format on

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr double kMB = 1024.0 * 1024.0;

class DeviceStats final : public ember::Callback {
 public:
  explicit DeviceStats(const ember::IConfig& cfg)
      : cpu_(cfg.get_bool("cpu_stats")), cuda_(cfg.get_bool("cuda_stats")), prefix_(cfg.get_string("prefix")) {}

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
      c10::Device device(c10::kCPU);
      for (const auto& p : t.module().parameters()) {
        device = p.device();
        break;
      }
      if (device.is_cuda()) {
        using c10::CachingAllocator::StatType;
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
        const auto all = static_cast<size_t>(StatType::AGGREGATE);
        log(t, "cuda_allocated_mb", static_cast<double>(stats.allocated_bytes[all].current) / kMB);
        log(t, "cuda_reserved_mb", static_cast<double>(stats.reserved_bytes[all].current) / kMB);
        log(t, "cuda_peak_allocated_mb", static_cast<double>(stats.allocated_bytes[all].peak) / kMB);
      }
    }
  }

 private:
  void log(ember::ITrainer& t, const char* name, double v) {
    ember::LogOptions o;
    o.on_step = 1;
    o.on_epoch = 0;
    t.log_tensor(prefix_ + name, at::scalar_tensor(v, at::kDouble), o);
  }

  const bool cpu_, cuda_;
  const std::string prefix_;
  double last_wall_ = 0, last_cpu_ = 0;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new DeviceStats(cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "device_stats", "0.1.0", "Apache-2.0",
             "Lightning's DeviceStatsMonitor: host RSS and CPU use, CUDA memory allocated/reserved/peak.",
             EMBER_CONFIG_KEYS(kKeys), make)
