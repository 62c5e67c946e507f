// Softmax cross-entropy over logit rows as two fused passes, in the logits' own dtype. Compiled
// library Ember::losses (static, position-independent); it depends on the SDK only.
//
// cross_entropy(logits, targets) is at::cross_entropy_loss(logits, targets) (the mean over the
// targets that are not ignore_index) where autocast would compute it: in float32 whatever the
// logits' dtype (float64 for float64 logits). Why: for bf16 logits LibTorch's path makes a float32
// copy, keeps its float32 log-softmax for backward and there builds a float32 one-hot gradient, the
// softmax and a bf16 copy: about six passes over [tokens, vocabulary] floats each way (GPT-2's
// 16 x 1,024 tokens and 50,304-token vocabulary: 3.3 GB per float32 pass). Here the forward reads
// the logits once and keeps one float per row (log-sum-exp); backward reads them once more and
// writes the gradient, softmax minus one-hot, rounded once to the logits' dtype. What stays for
// backward is the logits themselves (no copy), the targets and those row sums.
//
// Kernels: on CPU Ember's loops (vectorised for the CPU at hand, split over LibTorch's threads);
// on CUDA Ember's kernels (one thread block per row) where the build compiled them (`cmake
// -DEMBER_CUDA_KERNELS`, on by default where nvcc and a CUDA LibTorch are found), ATen's
// otherwise and for float64. Backward cannot build a graph (no double backward). A target outside
// the vocabulary is one line on CPU and makes the loss NaN on CUDA (checking there would wait for
// the GPU).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ember {

// logits [N, V] (float32, float64, bf16 or float16), targets [N] (integer class indices;
// ignore_index rows count for nothing). Returns a 0-dim tensor: float32, or float64 for float64
// logits.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index = -100);

// Whether cross_entropy runs Ember's own kernels for logits like these (CPU always; CUDA where the
// build compiled them and the dtype is not float64), rather than ATen's.
bool cross_entropy_has_own_kernels(const at::Tensor& logits);

}  // namespace ember
