// Ember::activations: see <ember/support/activations.h>.
#include <ember/support/activations.h>

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <torch/csrc/autograd/custom_function.h>

#include "cpu_math.h"

#include <algorithm>
#include <cstdint>

namespace ember {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;
// Elements per thread below which splitting over threads costs more than it saves.
constexpr int64_t kGrainSize = 16384;

// 0.5 (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + e), e = exp(-2u), u = sqrt(2/pi) (x + 0.044715 x^3).
inline float exp_minus_2u(float x) { return cpu_math::exp_f32(-2.0f * kSqrt2OverPi * x * (1.0f + kCubic * x * x)); }

inline float gelu_tanh_value(float x) { return x / (1.0f + exp_minus_2u(x)); }

// d/dx [x s(x)] = s + x s (1 - s) 2 u'(x), u'(x) = sqrt(2/pi) (1 + 3 * 0.044715 x^2), with
// s (1 - s) = e s^2 (no cancellation where s is near 1).
inline float gelu_tanh_slope(float x) {
  const float e = exp_minus_2u(x);
  const float s = 1.0f / (1.0f + e);
  const float du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
  const float one_minus_s = e * s;  // e alone overflows float for x << 0; e s stays below 1
  return s + 2.0f * x * du * one_minus_s * s;
}

EMBER_CPU_CLONES void forward_contiguous(const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = gelu_tanh_value(x[i]);
}

EMBER_CPU_CLONES void backward_contiguous(const float* __restrict grad, const float* __restrict x,
                                          float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = grad[i] * gelu_tanh_slope(x[i]);
}

// Strided operands (a transposed view, a broadcast gradient) go through the contiguous loop in
// chunks copied to the stack, so that every layout gives the same bits (the CPU's FMA contractions
// are the same).
constexpr int64_t kChunk = 256;

template <class T>
T& at_offset(char* base, int64_t stride, int64_t i) {
  return *reinterpret_cast<T*>(base + i * stride);
}

// TensorIterator splits the elements over LibTorch's threads (its for_each runs in libtorch_cpu,
// built with OpenMP) and hands each thread runs of elements with one stride per operand.
at::Tensor forward_cpu(const at::Tensor& x) {
  at::Tensor y;
  at::TensorIterator iter = at::TensorIteratorConfig().add_output(y).add_const_input(x).build();
  iter.for_each(
      [](char** data, const int64_t* strides, int64_t n) {
        if (strides[0] == sizeof(float) && strides[1] == sizeof(float)) {
          forward_contiguous(reinterpret_cast<const float*>(data[1]), reinterpret_cast<float*>(data[0]), n);
          return;
        }
        float in[kChunk], out[kChunk];
        for (int64_t begin = 0; begin < n; begin += kChunk) {
          const int64_t m = std::min(kChunk, n - begin);
          for (int64_t i = 0; i < m; ++i) in[i] = at_offset<const float>(data[1], strides[1], begin + i);
          forward_contiguous(in, out, m);
          for (int64_t i = 0; i < m; ++i) at_offset<float>(data[0], strides[0], begin + i) = out[i];
        }
      },
      kGrainSize);
  return iter.output();
}

at::Tensor backward_cpu(const at::Tensor& grad, const at::Tensor& x) {
  at::Tensor out;
  at::TensorIterator iter =
      at::TensorIteratorConfig().add_output(out).add_const_input(grad).add_const_input(x).build();
  iter.for_each(
      [](char** data, const int64_t* strides, int64_t n) {
        if (strides[0] == sizeof(float) && strides[1] == sizeof(float) && strides[2] == sizeof(float)) {
          backward_contiguous(reinterpret_cast<const float*>(data[1]), reinterpret_cast<const float*>(data[2]),
                              reinterpret_cast<float*>(data[0]), n);
          return;
        }
        float g[kChunk], in[kChunk], result[kChunk];
        for (int64_t begin = 0; begin < n; begin += kChunk) {
          const int64_t m = std::min(kChunk, n - begin);
          for (int64_t i = 0; i < m; ++i) {
            g[i] = at_offset<const float>(data[1], strides[1], begin + i);
            in[i] = at_offset<const float>(data[2], strides[2], begin + i);
          }
          backward_contiguous(g, in, result, m);
          for (int64_t i = 0; i < m; ++i) at_offset<float>(data[0], strides[0], begin + i) = result[i];
        }
      },
      kGrainSize);
  return iter.output();
}

bool runs_here(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.layout() == at::kStrided; }

struct GeluTanhFunction : torch::autograd::Function<GeluTanhFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    return forward_cpu(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor& grad = grads[0];
    // A backward that records a graph (create_graph) needs a differentiable formula: ATen's.
    if (at::GradMode::is_enabled() || !runs_here(grad)) return {at::gelu_backward(grad, x, "tanh")};
    return {backward_cpu(grad, x)};
  }
};

}  // namespace

at::Tensor gelu_tanh(const at::Tensor& x) {
  if (!runs_here(x)) return at::gelu(x, "tanh");
  if (at::GradMode::is_enabled() && x.requires_grad()) return GeluTanhFunction::apply(x);
  return forward_cpu(x);
}

}  // namespace ember
