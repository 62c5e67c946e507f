// Private to Ember::losses: the softmax cross-entropy of logit rows as two fused passes, shared by
// ember::cross_entropy and ember::linear_cross_entropy's slices.
//
//   rows_forward:  one read of the logits -> per row m = max(x), log_sum = log(sum(exp(x - m))) and
//                  the loss (m - x[target]) + log_sum (0 where the target is ignore_index)
//   rows_gradient: one read, one write -> (softmax(x) - one_hot(target)) * scale, 0 on ignored rows,
//                  with softmax(x) = exp((x - m) - log_sum)
// Keeping m apart from log_sum keeps x - m exact, as LibTorch's log-softmax does: with logits near
// 1e4 a float32 log-sum-exp is only good to ~1e-3.
//
// The logits stay in their dtype (float32, float64, bf16 or float16); the arithmetic is float32
// (float64 for float64 logits). CPU: loops vectorised for the CPU at hand, split over LibTorch's
// threads. CUDA: Ember's kernels (cross_entropy_rows.cu) where the build compiled them
// (EMBER_LOSSES_CUDA_KERNELS), ATen's kernels otherwise and for float64.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ember::cross_entropy_rows {

struct RowStats {
  at::Tensor max;      // [N], float32 (float64 for float64 logits)
  at::Tensor log_sum;  // [N], same dtype: log(sum(exp(x - max)))
  at::Tensor loss;     // [N], same dtype: (max - x[target]) + log_sum, 0 where ignored
};

// logits [N, V] contiguous; targets [N] int64 contiguous on the logits' device. A target outside
// [0, V) that is not ignore_index: one line on CPU; NaN in that row's loss on CUDA (a check there
// would wait for the GPU).
RowStats rows_forward(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index);

// Writes (softmax - one_hot) * scale into out ([N, V] contiguous, the logits' dtype; it may be the
// logits themselves), from rows_forward's stats of the same logits. scale: a 0-dim tensor on the
// logits' device (float32, or float64 for float64 logits), or undefined for 1.
void rows_gradient(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, const RowStats& stats,
                   const at::Tensor& scale, const at::Tensor& out);

// Whether rows_forward / rows_gradient run Ember's own kernels for these logits (not ATen's).
bool own_kernels(const at::Tensor& logits);

}  // namespace ember::cross_entropy_rows
