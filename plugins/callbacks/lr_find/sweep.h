// The LR range test without a trainer (Lightning's _LRFinder, _ExponentialLR/_LinearLR and
// _LRCallback): the rate of each trial step, loss smoothing, the divergence stop and the
// suggested rate.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace ember_lr_find {

enum class Mode { exponential, linear };

// The rate of trial step i of n: min_lr * (max_lr / min_lr)^(i / n), or the linear
// interpolation, with Lightning's r = i / n (the first step uses min_lr).
inline double lr_at(Mode mode, double min_lr, double max_lr, int64_t i, int64_t n) {
  const double r = static_cast<double>(i) / static_cast<double>(n);
  return mode == Mode::exponential ? min_lr * std::pow(max_lr / min_lr, r) : min_lr + r * (max_lr - min_lr);
}

// Exponential moving average of the loss with bias correction (beta 0.98, as Lightning). The
// correction uses the number of values seen (Lightning uses global_step + 1, which is off by
// one in a fresh run and no correction at all after earlier training).
class Smoother {
 public:
  explicit Smoother(double beta = 0.98) : beta_(beta) {}
  double add(double loss) {
    avg_ = beta_ * avg_ + (1.0 - beta_) * loss;
    ++n_;
    return avg_ / (1.0 - std::pow(beta_, static_cast<double>(n_)));
  }

 private:
  double beta_;
  double avg_ = 0.0;
  int64_t n_ = 0;
};

// Lightning's early stop: after the first step, stop once the smoothed loss exceeds
// threshold * the best smoothed loss so far. threshold <= 0 disables it. A non-finite loss also
// stops (a NaN compares false and would otherwise run on).
class Divergence {
 public:
  explicit Divergence(double threshold) : threshold_(threshold) {}
  bool add(double smoothed) {
    bool stop = false;
    if (threshold_ > 0 && n_ >= 1 && (!std::isfinite(smoothed) || smoothed > threshold_ * best_)) stop = true;
    if (n_ == 0 || smoothed < best_) best_ = smoothed;
    ++n_;
    return stop;
  }

 private:
  double threshold_;
  double best_ = 0.0;
  int64_t n_ = 0;
};

// Index of the suggested rate: the steepest descent of the smoothed loss, skipping the first
// `skip_begin` and last `skip_end` points and non-finite values (Lightning's suggestion()).
// The slope is taken along the sweep (per step: log lr for the exponential mode, lr for the
// linear one) as np.gradient/torch.gradient with uniform spacing. nullopt with fewer than 2
// usable points.
inline std::optional<size_t> suggestion(const std::vector<double>& smoothed, size_t skip_begin = 10, size_t skip_end = 1) {
  if (smoothed.size() <= skip_begin + skip_end) return std::nullopt;
  std::vector<size_t> idx;
  std::vector<double> f;
  for (size_t i = skip_begin; i < smoothed.size() - skip_end; ++i)
    if (std::isfinite(smoothed[i])) {
      idx.push_back(i);
      f.push_back(smoothed[i]);
    }
  if (f.size() < 2) return std::nullopt;
  const size_t n = f.size();
  size_t best = 0;
  double best_grad = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = i == 0 ? f[1] - f[0] : i == n - 1 ? f[n - 1] - f[n - 2] : (f[i + 1] - f[i - 1]) / 2.0;
    if (i == 0 || g < best_grad) {
      best = i;
      best_grad = g;
    }
  }
  return idx[best];
}

}  // namespace ember_lr_find
