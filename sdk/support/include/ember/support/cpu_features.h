// What the CPU can do fast in reduced precision, for precision handlers (a warning at start-up)
// and the engine (trainer.precision = "auto"). Header-only. The decision functions take the
// features as plain data, so they are testable with any CPU's features on any machine.
#pragma once
#include <ATen/cpu/Utils.h>

#include <string>

namespace ember {

struct CpuFeatures {
  std::string name;          // the CPU's model name as cpuinfo reports it ("" when unknown)
  bool avx512_bf16 = false;  // AVX512-BF16: bfloat16 dot products in vector registers
  bool amx_bf16 = false;     // AMX-BF16: bfloat16 tile matrix multiply (Sapphire Rapids and later)
  bool avx512_fp16 = false;  // AVX512-FP16: float16 arithmetic
  bool amx_fp16 = false;     // AMX-FP16
  bool avx512 = false;       // AVX512F
  bool avx2 = false;
};

// The CPU this process runs on, as LibTorch's cpuinfo sees it.
inline CpuFeatures detect_cpu_features() {
  CpuFeatures f;
  const auto caps = at::cpu::get_cpu_capabilities();
  auto flag = [&](std::initializer_list<const char*> names) {
    for (const char* n : names) {
      auto it = caps.find(n);
      if (it != caps.end() && it->second.isBool() && it->second.toBool()) return true;
    }
    return false;
  };
  f.avx512_bf16 = flag({"avx512_bf16", "avx512bf16"});
  f.amx_bf16 = flag({"amx_bf16"});
  f.avx512_fp16 = flag({"avx512_fp16", "avx512fp16"});
  f.amx_fp16 = flag({"amx_fp16"});
  f.avx512 = flag({"avx512f"});
  f.avx2 = flag({"avx2"});
  for (const char* key : {"name", "cpu_name", "model_name"}) {
    auto it = caps.find(key);
    if (it != caps.end() && it->second.isString()) {
      f.name = it->second.toStringRef();
      break;
    }
  }
  return f;
}

// True when bfloat16 matrix math has native support: without it oneDNN and ATen convert to
// float32 and back around every kernel, and bf16-mixed measured up to 4.7x slower than 32-true
// (an AVX2 AMD EPYC, Fashion-MNIST CNN).
inline bool cpu_runs_bf16_fast(const CpuFeatures& f) { return f.avx512_bf16 || f.amx_bf16; }

// The same for float16 (AVX512-FP16 or AMX-FP16; most CPUs have neither).
inline bool cpu_runs_fp16_fast(const CpuFeatures& f) { return f.avx512_fp16 || f.amx_fp16; }

// The start-up warning for `mode` (a precision whose math runs in `dtype_name`) on a CPU that has
// no native support for it; "" when it has.
inline std::string slow_cpu_precision_warning(const std::string& mode, bool fast, const char* dtype_name) {
  if (fast) return "";
  return mode + " on cpu: this CPU has no native " + dtype_name +
         " matrix instructions (AVX512-BF16/AMX for bfloat16, AVX512-FP16/AMX-FP16 for float16), so LibTorch converts "
         "around every kernel: expect it to run several times slower than 32-true; trainer.precision = \"auto\" picks "
         "the fastest precision this device runs well";
}

}  // namespace ember
