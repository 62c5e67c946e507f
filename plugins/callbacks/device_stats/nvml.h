// GPU utilisation and power through NVML (the library behind nvidia-smi), loaded at run time with
// dlopen("libnvidia-ml.so.1"): it ships with the NVIDIA driver, not with the CUDA toolkit or
// LibTorch, so nothing links against it and a machine without a driver simply has no readings.
// The few entry points used are declared here from NVML's stable C API (nvml.h, API version 2).
#pragma once
#include <dlfcn.h>

#include <cstdio>
#include <optional>
#include <string>

namespace ember_ds {

struct GpuReadings {
  double utilization_percent = -1;  // kernel time share over NVML's last sample period
  double memory_busy_percent = -1;  // device-memory read/write time share
  double power_watts = -1;
};

class Nvml {
 public:
  // Loads NVML and finds the device with this PCI address ("0000:65:00.0"); empty on failure
  // with the reason in *why.
  static std::optional<Nvml> open(const std::string& pci_bus_id, std::string* why) {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      *why = "libnvidia-ml.so.1 not found (it comes with the NVIDIA driver)";
      return std::nullopt;
    }
    Nvml n;
    n.lib_ = lib;
    auto sym = [&](const char* name) { return dlsym(lib, name); };
    auto init = reinterpret_cast<int (*)()>(sym("nvmlInit_v2"));
    auto by_bus = reinterpret_cast<int (*)(const char*, Device*)>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
    n.util_ = reinterpret_cast<int (*)(Device, Utilization*)>(sym("nvmlDeviceGetUtilizationRates"));
    n.power_ = reinterpret_cast<int (*)(Device, unsigned*)>(sym("nvmlDeviceGetPowerUsage"));
    if (!init || !by_bus || !n.util_ || !n.power_) {
      *why = "libnvidia-ml.so.1 lacks the NVML v2 entry points";
      return std::nullopt;
    }
    if (int rc = init(); rc != 0) {
      *why = "nvmlInit_v2 failed (NVML error " + std::to_string(rc) + ")";
      return std::nullopt;
    }
    if (int rc = by_bus(pci_bus_id.c_str(), &n.device_); rc != 0) {
      *why = "NVML does not know the device at " + pci_bus_id + " (NVML error " + std::to_string(rc) + ")";
      return std::nullopt;
    }
    return n;
  }

  GpuReadings read() const {
    GpuReadings r;
    Utilization u{};
    if (util_(device_, &u) == 0) {
      r.utilization_percent = u.gpu;
      r.memory_busy_percent = u.memory;
    }
    unsigned milliwatts = 0;
    if (power_(device_, &milliwatts) == 0) r.power_watts = milliwatts / 1000.0;
    return r;
  }

 private:
  using Device = struct NvmlDeviceOpaque*;  // nvmlDevice_t
  struct Utilization {                      // nvmlUtilization_t
    unsigned gpu, memory;
  };
  void* lib_ = nullptr;  // never closed: NVML stays loaded for the process
  Device device_ = nullptr;
  int (*util_)(Device, Utilization*) = nullptr;
  int (*power_)(Device, unsigned*) = nullptr;
};

// NVML's PCI address format for a CUDA device's domain/bus/device ids.
inline std::string pci_bus_id(int domain, int bus, int device) {
  char s[32];
  std::snprintf(s, sizeof s, "%08x:%02x:%02x.0", domain, bus, device);
  return s;
}

}  // namespace ember_ds
