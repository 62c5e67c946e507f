// Process-wide numeric and threading settings of a run ([trainer] num_threads, flush_denormal,
// float32_matmul_precision, benchmark), applied once before any plugin builds tensors, and the
// decision behind trainer.precision = "auto".
#pragma once
#include <ember/support/cpu_features.h>

#include <cstdint>
#include <string>

namespace ember::engine {

class Section;

// CPUs this process may run on (sched_getaffinity), at least 1.
int64_t usable_cpus();

// The intra-op thread count when trainer.num_threads = 0: OMP_NUM_THREADS when set (LibTorch's
// own rule), else the usable CPUs shared evenly by the processes of this node that train on the
// CPU (`local_processes`), at least 1.
int64_t default_num_threads(int64_t usable, int64_t local_processes, const char* omp_num_threads);

struct NumericsSettings {
  int64_t num_threads = 1;
  bool flush_denormal = true;
  std::string float32_matmul_precision = "highest";
  bool cudnn_benchmark = false;
  bool detect_anomaly = false;  // trainer.detect_anomaly: autograd's anomaly mode
};

// [trainer]'s values with the defaults resolved for this process.
NumericsSettings numerics_settings(const Section& trainer, bool on_cpu, int64_t local_processes);

// Sets LibTorch's global state from `s` and returns one line saying what was set. Call on the
// main thread before the first parallel region (denormal flushing is a per-thread CPU flag that
// threads created later inherit).
std::string apply_numerics(const NumericsSettings& s);

// "tcmalloc", "jemalloc" or "glibc malloc": the allocator this process runs on (said in the
// numerics line at start-up).
const char* host_allocator();

// trainer.precision = "auto": the fastest precision the device runs well.
struct PrecisionChoice {
  std::string precision;  // Lightning's string: "bf16-mixed", "16-mixed" or "32-true"
  std::string reason;
};
struct DeviceForPrecision {
  bool cuda = false;
  int cuda_major = 0;  // compute capability of the CUDA device
  CpuFeatures cpu;
};
PrecisionChoice choose_auto_precision(const DeviceForPrecision& device);

}  // namespace ember::engine

namespace ember::engine {
// The device a run with trainer.accelerator = `accelerator` trains on, as choose_auto_precision
// needs it (CUDA device 0 when CUDA is chosen; ranks of one job see the same kind of device).
DeviceForPrecision detect_device_for_precision(const std::string& accelerator);
// How many devices trainer.devices = "auto" / -1 means with trainer.accelerator = `accelerator`:
// every visible CUDA device, else 1 (one process on the CPU).
int64_t visible_devices(const std::string& accelerator);
}  // namespace ember::engine
