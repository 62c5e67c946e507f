#include "runtime/numerics.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <torch/cuda.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <dlfcn.h>
#include <sched.h>

#include <cstdlib>
#include <string>

#include "config/run_config.h"
#include "runtime/accelerator.h"

namespace ember::engine {

int64_t usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

int64_t default_num_threads(int64_t usable, int64_t local_processes, const char* omp_num_threads) {
  if (omp_num_threads != nullptr && *omp_num_threads != '\0') {
    char* end = nullptr;
    const long v = std::strtol(omp_num_threads, &end, 10);
    if (end != omp_num_threads && *end == '\0' && v > 0) return v;
  }
  return std::max<int64_t>(1, usable / std::max<int64_t>(1, local_processes));
}

NumericsSettings numerics_settings(const Section& t, bool on_cpu, int64_t local_processes) {
  NumericsSettings s;
  const int64_t threads = t.get_int("num_threads");
  s.num_threads = threads > 0 ? threads : default_num_threads(usable_cpus(), on_cpu ? local_processes : 1, std::getenv("OMP_NUM_THREADS"));
  s.flush_denormal = t.get_bool("flush_denormal");
  s.float32_matmul_precision = t.get_string("float32_matmul_precision");
  // Lightning's benchmark = None: cudnn.benchmark stays off under deterministic; Ember turns it
  // on otherwise (fast by default; it only matters on CUDA).
  s.cudnn_benchmark = t.has("benchmark") ? t.get_bool("benchmark") : !t.get_bool("deterministic");
  s.detect_anomaly = t.get_bool("detect_anomaly");
  return s;
}

std::string apply_numerics(const NumericsSettings& s) {
  at::set_num_threads(static_cast<int>(s.num_threads));
  // setFlushDenormal answers false where the CPU cannot (no SSE3, or not x86).
  const bool flushing = at::globalContext().setFlushDenormal(s.flush_denormal) && s.flush_denormal;
  at::globalContext().setFloat32MatmulPrecision(s.float32_matmul_precision);
  at::globalContext().setBenchmarkCuDNN(s.cudnn_benchmark);
  torch::autograd::AnomalyMode::set_enabled(s.detect_anomaly);
  return std::string(s.detect_anomaly ? "autograd anomaly detection on (trainer.detect_anomaly: slow); " : "") + "numerics: " + std::to_string(s.num_threads) + " intra-op threads, denormals " +
         (flushing ? "flushed to zero" : "kept") + ", float32 matmul precision " + s.float32_matmul_precision +
         ", cudnn.benchmark " + (s.cudnn_benchmark ? "on" : "off") + ", allocator " + host_allocator();
}

const char* host_allocator() {
  // The malloc the process runs on: the engine binary links tcmalloc when its build found it
  // (EMBER_TCMALLOC, docs/build.md); a program embedding libember.so brings its own.
  if (::dlsym(RTLD_DEFAULT, "tc_malloc") != nullptr) return "tcmalloc";
  if (::dlsym(RTLD_DEFAULT, "mallctl") != nullptr) return "jemalloc";
  return "glibc malloc";
}

PrecisionChoice choose_auto_precision(const DeviceForPrecision& d) {
  if (d.cuda) {
    if (d.cuda_major >= 8) return {"bf16-mixed", "a CUDA device of compute capability 8.0 or newer runs bfloat16 natively"};
    if (d.cuda_major >= 7) return {"16-mixed", "a CUDA device with float16 tensor cores but no native bfloat16 (compute capability 7.x)"};
    return {"32-true", "a CUDA device without tensor cores (compute capability below 7.0)"};
  }
  if (cpu_runs_bf16_fast(d.cpu))
    return {"bf16-mixed", std::string("the CPU has ") + (d.cpu.amx_bf16 ? "AMX-BF16" : "AVX512-BF16") +
                              " (native bfloat16 matrix math)"};
  return {"32-true", "the CPU has no AVX512-BF16/AMX, where bf16-mixed runs several times slower than 32-true"};
}

int64_t visible_devices(const std::string& accelerator) {
  if (accelerator == "cpu") return 1;
  for (const auto* a : all_accelerators())
    if (a->device_type() != c10::DeviceType::CPU && a->is_available() && a->device_count() > 0) return a->device_count();
  return 1;
}

DeviceForPrecision detect_device_for_precision(const std::string& accelerator) {
  DeviceForPrecision d;
  d.cuda = accelerator != "cpu" && torch::cuda::is_available();
  if (d.cuda) d.cuda_major = at::cuda::getDeviceProperties(0)->major;
  d.cpu = detect_cpu_features();
  return d;
}

}  // namespace ember::engine
