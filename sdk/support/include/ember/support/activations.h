// Activations whose LibTorch CPU kernel is slow enough to matter. Compiled library
// Ember::activations (static, position-independent); it depends on the SDK only.
//
// gelu_tanh: GELU with the tanh approximation (GPT-2's "gelu_new", PyTorch's
// gelu(x, approximate="tanh")), 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). LibTorch 2.11's
// float32 CPU kernels for it take ~4x the time of its tanh (402 us forward, 421 us backward for a
// small GPT's 12 x 64 x 512 hidden activations on 2 threads), about a seventh of that GPT's step.
// Here, on CPU float32 tensors, forward and backward are one pass each computing the identical
// x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) with one exponential (the backward recomputes it
// from x rather than storing it, so memory is what at::gelu keeps), vectorised for the CPU at hand
// and split over LibTorch's threads: ~3x faster (bench/activations.sh), values within ~1 float32
// ulp of |x| and gradients within 2.3e-7 of the upstream gradient (ATen's own: 1e-6). Any other
// device, dtype or layout than strided, and a backward that builds a graph (double backward), go
// to at::gelu / at::gelu_backward.
#pragma once
#include <ATen/core/Tensor.h>

namespace ember {

at::Tensor gelu_tanh(const at::Tensor& x);

}  // namespace ember
