// Gradient helpers for strategies and precision handlers (no device-to-host sync), and the host
// copy strategies' full_model_state returns. Header-only.
#pragma once
#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <vector>

#include "ember/types.h"

namespace ember {

// A host copy of `t` that shares no memory with it: a device tensor's copy to the CPU is one
// already (no second clone), a CPU tensor is cloned. What full_model_state implementations return.
inline at::Tensor detached_host_copy(const at::Tensor& t) {
  const at::Tensor d = t.detach();
  return d.device().is_cpu() ? d.clone() : d.to(at::kCPU);
}

// Every parameter of the optimizer that has a gradient.
inline std::vector<at::Tensor> grads_of(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params())
      if (p.grad().defined()) grads.push_back(p.grad());
  return grads;
}

// The total 2-norm of `grads` (float32, on the first gradient's device; 0 when there are none).
inline at::Tensor total_gradient_norm(const std::vector<at::Tensor>& grads) {
  if (grads.empty()) return at::zeros({}, at::kFloat);
  return at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2)).to(at::kFloat), 2);
}

// clip_grad_norm_ without the host read: scales `grads` so their total 2-norm is at most `max`
// and returns the total norm before clipping (as torch's clip_grad_norm_ does).
inline at::Tensor clip_gradients_norm_in_place(const std::vector<at::Tensor>& grads, double max) {
  at::Tensor total = total_gradient_norm(grads);
  if (grads.empty()) return total;
  auto coef = (max / (total + 1e-6)).clamp_max(1.0);
  for (const auto& g : grads) g.mul_(coef.to(g.scalar_type()));
  return total;
}

// clip_grad_norm_ / clip_grad_value_ without reading the norm back to the host (LibTorch's
// clip_grad_norm_ returns a double and so syncs on every step). Returns the total 2-norm before
// clipping for ClipAlgorithm::norm, an undefined tensor for ClipAlgorithm::value (what
// IStrategy::clip_gradients returns).
inline at::Tensor clip_gradients_in_place(const std::vector<at::Tensor>& grads, double max, ClipAlgorithm algorithm) {
  if (algorithm == ClipAlgorithm::value) {
    for (const auto& g : grads) g.clamp_(-max, max);
    return {};
  }
  return clip_gradients_norm_in_place(grads, max);
}

}  // namespace ember
