// The arithmetic of weight averaging (the swa and ema plugins), header-only so tests/swa_test.cpp
// checks it directly: torch.optim.swa_utils.SWALR's learning rate, and AveragedModel's running
// means (SWA and EMA).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace ember::support {

enum class AnnealStrategy { cos, linear };

// SWALR's anneal_func: 0 at t = 0, 1 at t = 1.
inline double anneal_alpha(AnnealStrategy s, double t) {
  return s == AnnealStrategy::linear ? t : (1.0 - std::cos(3.14159265358979323846 * t)) / 2.0;
}

// The learning rate of the e-th SWA epoch (e = 0 is the first), starting from `lr0`, the rate in
// the optimizer when SWA took over. This is SWALR's recursive get_lr in closed form: SWALR is
// built at the start of epoch swa_start (its first value is lr0) and steps at every epoch end.
// annealing_epochs = 0 jumps to swa_lr at once (SWALR: step = max(1, step)).
inline double swalr(double lr0, double swa_lr, int64_t e, int64_t annealing_epochs, AnnealStrategy s) {
  const int64_t step = annealing_epochs == 0 ? std::max<int64_t>(1, e) : e;
  const double t = std::clamp(static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, annealing_epochs)), 0.0, 1.0);
  const double alpha = anneal_alpha(s, t);
  return swa_lr * alpha + lr0 * (1.0 - alpha);
}

// AveragedModel.update_parameters with the default (SWA) average: the first call copies, later
// ones move the mean by (x - mean) / (n + 1) (torch._foreach_lerp_ with weight 1 / (n + 1)).
inline void swa_update(std::vector<at::Tensor>& averaged, const std::vector<at::Tensor>& current, int64_t n_averaged) {
  for (size_t i = 0; i < averaged.size(); ++i) {
    at::Tensor cur = current[i].detach().to(averaged[i].device(), averaged[i].scalar_type());
    if (n_averaged == 0) averaged[i].copy_(cur);
    else averaged[i].lerp_(cur, 1.0 / static_cast<double>(n_averaged + 1));
  }
}

// get_ema_multi_avg_fn(decay): ema = ema + (1 - decay) * (x - ema); the first call copies.
inline void ema_update(std::vector<at::Tensor>& averaged, const std::vector<at::Tensor>& current, int64_t n_averaged,
                       double decay) {
  for (size_t i = 0; i < averaged.size(); ++i) {
    at::Tensor cur = current[i].detach().to(averaged[i].device(), averaged[i].scalar_type());
    if (n_averaged == 0) averaged[i].copy_(cur);
    else averaged[i].lerp_(cur, 1.0 - decay);
  }
}

}  // namespace ember::support
