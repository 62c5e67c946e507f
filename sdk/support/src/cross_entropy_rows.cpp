// Ember::losses: see cross_entropy_rows.h.
#include "cross_entropy_rows.h"

#include "cpu_math.h"
#include "cross_entropy_rows_cuda.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>
#ifdef EMBER_LOSSES_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace ember::cross_entropy_rows {
namespace {

// Logits per thread below which splitting rows over threads costs more than it saves.
constexpr int64_t kGrainLogits = 16384;
// Below this exp(d) is under float32's normal range: exactly 0 in the gradient (exp_f32 clamps).
constexpr float kExpFloor = -87.0f;
constexpr int kLanes = 16;  // independent accumulators, so that the reductions vectorise

EMBER_CPU_CLONES float row_max(const float* __restrict x, int64_t n) {
  float acc[kLanes];
  for (float& a : acc) a = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] = acc[k] > x[i + k] ? acc[k] : x[i + k];
  for (; i < n; ++i) acc[0] = acc[0] > x[i] ? acc[0] : x[i];
  float m = acc[0];
  for (int k = 1; k < kLanes; ++k) m = m > acc[k] ? m : acc[k];
  return m;
}

EMBER_CPU_CLONES float row_sum_exp(const float* __restrict x, int64_t n, float m) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += cpu_math::exp_f32(x[i + k] - m);
  for (; i < n; ++i) acc[0] += cpu_math::exp_f32(x[i] - m);
  float s = 0.0f;
  for (float a : acc) s += a;
  return s;
}

// y = exp((x - m) - log_sum) * scale; x and y may be the same memory.
EMBER_CPU_CLONES void row_scaled_softmax(const float* x, float* y, int64_t n, float m, float log_sum, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = (x[i] - m) - log_sum;
    y[i] = (d < kExpFloor ? 0.0f : cpu_math::exp_f32(d)) * scale;
  }
}

// The row's maximum and log(sum(exp(x - max))).
std::pair<float, float> max_and_log_sum(const float* x, int64_t n) {
  const float m = row_max(x, n);
  if (m == -std::numeric_limits<float>::infinity()) return {m, m};  // every logit -inf: log(0)
  return {m, std::log(row_sum_exp(x, n, m))};
}

std::pair<double, double> max_and_log_sum(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) m = m > x[i] ? m : x[i];
  if (m == -std::numeric_limits<double>::infinity()) return {m, m};
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(x[i] - m);
  return {m, std::log(s)};
}

void row_scaled_softmax(const double* x, double* y, int64_t n, double m, double log_sum, double scale) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp((x[i] - m) - log_sum) * scale;
}

void check_targets_cpu(const at::Tensor& targets, int64_t cols, int64_t ignore_index) {
  const int64_t* t = targets.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < targets.numel(); ++r)
    if (t[r] != ignore_index && (t[r] < 0 || t[r] >= cols))
      throw RunError(c10::str("cross_entropy: target ", t[r], " of row ", r, " is outside the ", cols,
                              " classes of the logits (0 to ", cols - 1, ", or ignore_index ", ignore_index,
                              "): the targets and the model's vocabulary do not match"));
}

// S: the logits' element type; A: float, or double for double logits. Rows of a lower-precision
// dtype go through a float buffer, one row at a time.
template <class S, class A>
void forward_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, const RowStats& out) {
  const int64_t rows = logits.size(0), cols = logits.size(1);
  const S* x = logits.const_data_ptr<S>();
  const int64_t* t = targets.const_data_ptr<int64_t>();
  A* max_out = out.max.data_ptr<A>();
  A* log_sum_out = out.log_sum.data_ptr<A>();
  A* loss_out = out.loss.data_ptr<A>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainLogits / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<A> buffer(std::is_same_v<S, A> ? 0 : cols);
    for (int64_t r = r0; r < r1; ++r) {
      const A* row;
      if constexpr (std::is_same_v<S, A>) {
        row = x + r * cols;
      } else {
        for (int64_t i = 0; i < cols; ++i) buffer[i] = static_cast<A>(x[r * cols + i]);
        row = buffer.data();
      }
      const auto [m, log_sum] = max_and_log_sum(row, cols);
      max_out[r] = m;
      log_sum_out[r] = log_sum;
      loss_out[r] = t[r] == ignore_index ? A(0) : (m - row[t[r]]) + log_sum;
    }
  });
}

template <class S, class A>
void gradient_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, const RowStats& stats, A scale,
                  const at::Tensor& out) {
  const int64_t rows = logits.size(0), cols = logits.size(1);
  const S* x = logits.const_data_ptr<S>();
  S* y = out.data_ptr<S>();
  const int64_t* t = targets.const_data_ptr<int64_t>();
  const A* m = stats.max.const_data_ptr<A>();
  const A* log_sum = stats.log_sum.const_data_ptr<A>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainLogits / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<A> buffer(std::is_same_v<S, A> ? 0 : cols);
    for (int64_t r = r0; r < r1; ++r) {
      S* y_row = y + r * cols;
      if (t[r] == ignore_index) {
        std::fill(y_row, y_row + cols, S(0));
        continue;
      }
      if constexpr (std::is_same_v<S, A>) {
        row_scaled_softmax(x + r * cols, y_row, cols, m[r], log_sum[r], scale);
        y_row[t[r]] -= scale;
      } else {
        for (int64_t i = 0; i < cols; ++i) buffer[i] = static_cast<A>(x[r * cols + i]);
        row_scaled_softmax(buffer.data(), buffer.data(), cols, m[r], log_sum[r], scale);
        buffer[t[r]] -= scale;
        for (int64_t i = 0; i < cols; ++i) y_row[i] = static_cast<S>(buffer[i]);  // one rounding, to nearest even
      }
    }
  });
}

at::ScalarType accumulate_type(const at::Tensor& logits) { return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// ATen's kernels, for what Ember's do not cover (CUDA float64, CUDA builds without Ember's kernels).
RowStats forward_aten(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  const at::Tensor x = logits.to(accumulate_type(logits));
  const at::Tensor keep = targets.ne(ignore_index);
  const at::Tensor safe = at::where(keep, targets, at::zeros({}, targets.options())).unsqueeze(1);
  RowStats out;
  out.max = std::get<0>(x.max(1));
  out.log_sum = (x - out.max.unsqueeze(1)).exp_().sum(1).log_();
  out.loss = ((out.max - x.gather(1, safe).squeeze(1)) + out.log_sum).masked_fill(keep.logical_not(), 0);
  return out;
}

void gradient_aten(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, const RowStats& stats, const at::Tensor& scale,
                   const at::Tensor& out) {
  const at::ScalarType acc = accumulate_type(logits);
  const at::Tensor keep = targets.ne(ignore_index).unsqueeze(1);
  const at::Tensor safe = at::where(keep.squeeze(1), targets, at::zeros({}, targets.options())).unsqueeze(1);
  at::Tensor g = ((logits.to(acc) - stats.max.unsqueeze(1)) - stats.log_sum.unsqueeze(1)).exp_();
  g.scatter_add_(1, safe, keep.to(acc).neg());
  g.mul_(keep.to(acc));
  if (scale.defined()) g.mul_(scale.to(acc));
  out.copy_(g);
}

#ifdef EMBER_LOSSES_CUDA_KERNELS
cuda::Dtype cuda_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::Dtype::float32;
    case at::kBFloat16: return cuda::Dtype::bfloat16;
    default: return cuda::Dtype::float16;
  }
}

void check_launch(const char* error, const char* kernel) {
  if (error != nullptr) throw RunError(c10::str("cross_entropy: the CUDA kernel for the ", kernel, " did not launch: ", error));
}

void check_rows(int64_t rows) {
  if (rows > std::numeric_limits<int32_t>::max())
    throw RunError(c10::str("cross_entropy: ", rows, " rows of logits: at most 2^31 - 1 in one call (split the batch)"));
}
#endif

}  // namespace

bool own_kernels(const at::Tensor& logits) {
  const at::ScalarType t = logits.scalar_type();
  const bool float_type = t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
  if (logits.device().is_cpu()) return float_type || t == at::kDouble;
#ifdef EMBER_LOSSES_CUDA_KERNELS
  if (logits.device().is_cuda()) return float_type;
#endif
  return false;
}

RowStats rows_forward(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  if (!own_kernels(logits)) return forward_aten(logits, targets, ignore_index);
  const int64_t rows = logits.size(0), cols = logits.size(1);
  const at::TensorOptions acc = logits.options().dtype(accumulate_type(logits));
  RowStats out{at::empty({rows}, acc), at::empty({rows}, acc), at::empty({rows}, acc)};
  if (logits.device().is_cpu()) {
    check_targets_cpu(targets, cols, ignore_index);
    switch (logits.scalar_type()) {
      case at::kDouble: forward_cpu<double, double>(logits, targets, ignore_index, out); break;
      case at::kFloat: forward_cpu<float, float>(logits, targets, ignore_index, out); break;
      case at::kBFloat16: forward_cpu<at::BFloat16, float>(logits, targets, ignore_index, out); break;
      default: forward_cpu<at::Half, float>(logits, targets, ignore_index, out); break;
    }
    return out;
  }
#ifdef EMBER_LOSSES_CUDA_KERNELS
  check_rows(rows);
  const c10::cuda::CUDAGuard guard(logits.device());
  check_launch(cuda::launch_forward(cuda_dtype(logits.scalar_type()), logits.const_data_ptr(), rows, cols, targets.const_data_ptr<int64_t>(),
                                    ignore_index, out.max.data_ptr<float>(), out.log_sum.data_ptr<float>(), out.loss.data_ptr<float>(),
                                    c10::cuda::getCurrentCUDAStream(logits.device().index()).stream()),
               "loss");
#endif
  return out;
}

void rows_gradient(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, const RowStats& stats, const at::Tensor& scale,
                   const at::Tensor& out) {
  if (!own_kernels(logits)) return gradient_aten(logits, targets, ignore_index, stats, scale, out);
  if (logits.device().is_cpu()) {
    const double s = scale.defined() ? scale.item<double>() : 1.0;
    switch (logits.scalar_type()) {
      case at::kDouble: gradient_cpu<double, double>(logits, targets, ignore_index, stats, s, out); break;
      case at::kFloat: gradient_cpu<float, float>(logits, targets, ignore_index, stats, static_cast<float>(s), out); break;
      case at::kBFloat16: gradient_cpu<at::BFloat16, float>(logits, targets, ignore_index, stats, static_cast<float>(s), out); break;
      default: gradient_cpu<at::Half, float>(logits, targets, ignore_index, stats, static_cast<float>(s), out); break;
    }
    return;
  }
#ifdef EMBER_LOSSES_CUDA_KERNELS
  const int64_t rows = logits.size(0), cols = logits.size(1);
  check_rows(rows);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor scale_f = scale.defined() ? scale.to(at::kFloat).contiguous() : at::Tensor();
  check_launch(cuda::launch_gradient(cuda_dtype(logits.scalar_type()), logits.const_data_ptr(), out.data_ptr(), rows, cols,
                                     targets.const_data_ptr<int64_t>(), ignore_index, stats.max.const_data_ptr<float>(),
                                     stats.log_sum.const_data_ptr<float>(), scale_f.defined() ? scale_f.const_data_ptr<float>() : nullptr,
                                     c10::cuda::getCurrentCUDAStream(logits.device().index()).stream()),
               "gradient");
#endif
}

}  // namespace ember::cross_entropy_rows
