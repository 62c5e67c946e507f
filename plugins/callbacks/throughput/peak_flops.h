// Dense peak FLOP/s of common GPUs per compute dtype, for MFU. Figures are NVIDIA's data-sheet
// numbers without sparsity, as in Lightning's throughput table (lightning.fabric.utilities.
// throughput._CUDA_FLOPS). Header-only and free of Ember types so unit tests include it.
#pragma once
#include <algorithm>
#include <cctype>
#include <optional>
#include <string>

namespace ember_tp {

enum class ComputeDtype { fp64, fp32, tf32, bf16, fp16 };

inline const char* dtype_name(ComputeDtype d) {
  switch (d) {
    case ComputeDtype::fp64: return "fp64";
    case ComputeDtype::fp32: return "fp32";
    case ComputeDtype::tf32: return "tf32";
    case ComputeDtype::bf16: return "bf16";
    case ComputeDtype::fp16: return "fp16";
  }
  return "?";
}

// trainer.precision ("bf16-mixed", "16-true", ...) and float32_matmul_precision ("highest",
// "high", "medium") -> the dtype the matrix units compute in.
inline ComputeDtype compute_dtype(const std::string& precision, const std::string& matmul_precision) {
  if (precision.rfind("bf16", 0) == 0) return ComputeDtype::bf16;
  if (precision.rfind("16", 0) == 0) return ComputeDtype::fp16;
  if (precision.rfind("64", 0) == 0) return ComputeDtype::fp64;
  return matmul_precision == "high" || matmul_precision == "medium" ? ComputeDtype::tf32 : ComputeDtype::fp32;
}

// Peak FLOP/s of the device named `name` (as CUDA reports it, e.g. "NVIDIA H100 80GB HBM3"), or
// nothing for a device not in the table.
inline std::optional<double> cuda_peak_flops(std::string name, ComputeDtype d) {
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  struct Row { double fp64, fp32, tf32, bf16, fp16; };  // TFLOP/s
  std::optional<Row> r;
  if (has("h200")) r = Row{67, 67, 494.7, 989.4, 989.4};
  else if (has("gh200")) r = Row{67, 67, 494.7, 989.4, 989.4};
  else if (has("h100") && has("nvl")) r = Row{60, 60, 417.5, 835, 835};
  else if (has("h100") && has("pcie")) r = Row{51, 51, 378, 756, 756};
  else if (has("h100")) r = Row{67, 67, 494.7, 989.4, 989.4};  // SXM ("H100 80GB HBM3")
  else if (has("a100")) r = Row{19.5, 19.5, 156, 312, 312};
  else if (has("l40s")) r = Row{0, 91.6, 183, 362, 362};
  else if (has("l4")) r = Row{0, 30.3, 60, 121, 121};
  else if (has("a10g")) r = Row{0, 31.2, 62.5, 125, 125};
  else if (has("a10")) r = Row{0, 31.2, 62.5, 125, 125};
  else if (has("v100")) r = Row{7.8, 15.7, 0, 0, 125};
  else if (has("t4")) r = Row{0, 8.1, 0, 0, 65};
  if (!r) return std::nullopt;
  double tflops = 0;
  switch (d) {
    case ComputeDtype::fp64: tflops = r->fp64; break;
    case ComputeDtype::fp32: tflops = r->fp32; break;
    case ComputeDtype::tf32: tflops = r->tf32; break;
    case ComputeDtype::bf16: tflops = r->bf16; break;
    case ComputeDtype::fp16: tflops = r->fp16; break;
  }
  if (tflops <= 0) return std::nullopt;
  return tflops * 1e12;
}

}  // namespace ember_tp
