// An output layer and its cross-entropy in one autograd function, a slice of rows at a time, so
// that a language model never holds its whole [tokens, vocabulary] logits. Compiled library
// Ember::losses (static, position-independent); it depends on the SDK only.
//
// linear_cross_entropy(input, weight, targets) is at::cross_entropy_loss(at::linear(input, weight),
// targets) with the mean over the targets that are not ignore_index, under autocast too (the
// matrix products in autocast's dtype, the log-softmax in float32, as autocast runs them). Why:
// with GPT-2's 50,304 tokens, LibTorch's path keeps the bf16 logits, their float32 copy, the
// log-softmax and, in backward, a float32 one-hot gradient and its softmax: ~8 GB for 16 x 1,024
// tokens, more than all twelve blocks' activations, and the same number of passes over memory.
// Here, while grad mode is on, the forward also computes the gradients (Liger-Kernel's fused
// linear cross-entropy): per slice of rows, the logits (ATen's matrix product), then the two passes
// of <ember/support/cross_entropy.h> (Ember's CPU loops and CUDA kernels): one read for each row's
// log-sum-exp and loss, one read and write that leaves the softmax minus the one-hot targets over
// the logits, in the compute dtype; then one product each for the input's and the weight's
// gradients (a frozen weight: the input's slice by slice). What stays for backward is those two
// gradients; backward only scales them by the upstream gradient over the number of counted
// targets. It holds the [tokens, vocabulary] softmax in the compute dtype (bf16: half of LibTorch's
// logits alone) until the gradients are made, plus one float32 slice; with no gradient wanted only
// the slice.
//
// Differences from the two-function path: the gradients are computed even if backward never runs
// (a loss under grad mode that is then dropped pays for them), backward cannot build a graph (no
// double backward), and the input's and weight's gradients are rounded once to the compute dtype
// before the scale (as LibTorch's autocast path rounds the logits' gradient). `chunk_rows` = 0 picks
// slices of at most 2^26 logits (256 MB of float32).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ember {

// input [N, C], weight [V, C], targets [N] (integer class indices, ignore_index left out).
// Returns a 0-dim tensor: float32, or float64 when input and weight are.
at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& targets,
                                int64_t ignore_index = -100, int64_t chunk_rows = 0);

}  // namespace ember
