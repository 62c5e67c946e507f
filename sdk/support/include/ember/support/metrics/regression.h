// Regression, text and aggregation metrics: MAE, MSE, RMSE, R2 (scikit-learn's values), perplexity,
// and the mean / sum / max / min of a value. Sums only: constant memory, exact across ranks.
#pragma once
#include "ember/support/metrics/metric.h"

#include <cmath>

namespace ember::metrics {

// Regression: mean absolute error, mean squared error (RMSE with squared = false), R2.
class Regression : public Metric {
 public:
  enum class Kind { mae, mse, rmse, r2 };
  explicit Regression(Kind kind) : kind_(kind) {
    n_ = add_state(at::zeros({}, at::kDouble), StateReduce::sum);
    abs_ = add_state(at::zeros({}, at::kDouble), StateReduce::sum);
    sq_ = add_state(at::zeros({}, at::kDouble), StateReduce::sum);
    y_ = add_state(at::zeros({}, at::kDouble), StateReduce::sum);
    y2_ = add_state(at::zeros({}, at::kDouble), StateReduce::sum);
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    const at::Tensor p = preds.reshape({-1}).to(at::kDouble), t = target.reshape({-1}).to(at::kDouble).to(p.device());
    if (p.numel() != t.numel()) throw RunError("metrics: " + std::to_string(p.numel()) + " predictions for " + std::to_string(t.numel()) + " targets");
    const at::Tensor d = p - t;
    state(n_) += static_cast<double>(p.numel());
    state(abs_) += d.abs().sum();
    state(sq_) += (d * d).sum();
    state(y_) += t.sum();
    state(y2_) += (t * t).sum();
  }
  double compute() const override {
    const double n = state(n_).item<double>();
    if (n == 0) return std::numeric_limits<double>::quiet_NaN();
    switch (kind_) {
      case Kind::mae: return state(abs_).item<double>() / n;
      case Kind::mse: return state(sq_).item<double>() / n;
      case Kind::rmse: return std::sqrt(state(sq_).item<double>() / n);
      case Kind::r2: {
        const double mean = state(y_).item<double>() / n;
        const double total = state(y2_).item<double>() - n * mean * mean;
        return total > 0 ? 1.0 - state(sq_).item<double>() / total : std::numeric_limits<double>::quiet_NaN();
      }
    }
    return std::numeric_limits<double>::quiet_NaN();
  }

 private:
  Kind kind_;
  size_t n_ = 0, abs_ = 0, sq_ = 0, y_ = 0, y2_ = 0;
};

// Perplexity: exp of the mean negative log-likelihood per token. `preds`: logits [..., V];
// `target`: token ids [...]; tokens equal to `ignore_index` are left out.
class Perplexity : public Metric {
 public:
  explicit Perplexity(int64_t ignore_index = -100) : ignore_index_(ignore_index) {
    nll_ = add_state(at::zeros({}, at::kDouble), StateReduce::sum);
    count_ = add_state(at::zeros({}, at::kDouble), StateReduce::sum);
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    const at::Tensor logp = preds.reshape({-1, preds.size(-1)}).to(at::kDouble).log_softmax(-1);
    const at::Tensor t = target.reshape({-1}).to(at::kLong);
    const at::Tensor keep = t != ignore_index_;
    const at::Tensor picked = logp.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1).masked_select(keep);
    state(nll_) -= picked.sum();
    state(count_) += keep.sum().to(at::kDouble);
  }
  double compute() const override {
    const double n = state(count_).item<double>();
    return n > 0 ? std::exp(state(nll_).item<double>() / n) : std::numeric_limits<double>::quiet_NaN();
  }

 private:
  int64_t ignore_index_;
  size_t nll_ = 0, count_ = 0;
};

// Aggregations of a value per sample or per batch: mean, sum, max, min (`target` is the weight
// for the mean, or undefined for 1 each).
class Aggregate : public Metric {
 public:
  enum class Kind { mean, sum, max, min };
  explicit Aggregate(Kind kind) : kind_(kind) {
    const double inf = std::numeric_limits<double>::infinity();
    value_ = add_state(at::scalar_tensor(kind == Kind::max ? -inf : kind == Kind::min ? inf : 0.0, at::kDouble),
                       kind == Kind::max ? StateReduce::max : kind == Kind::min ? StateReduce::min : StateReduce::sum);
    weight_ = add_state(at::zeros({}, at::kDouble), StateReduce::sum);
  }
  void update(const at::Tensor& values, const at::Tensor& weights) override {
    follow(values.device());
    const at::Tensor v = values.reshape({-1}).to(at::kDouble);
    const at::Tensor w = weights.defined() ? weights.reshape({-1}).to(at::kDouble).to(v.device()).expand_as(v) : at::ones_like(v);
    switch (kind_) {
      case Kind::mean: state(value_) += (v * w).sum(); break;
      case Kind::sum: state(value_) += v.sum(); break;
      case Kind::max: state(value_) = at::maximum(state(value_), v.max()); break;
      case Kind::min: state(value_) = at::minimum(state(value_), v.min()); break;
    }
    state(weight_) += w.sum();
  }
  double compute() const override {
    if (kind_ != Kind::mean) return state(value_).item<double>();
    const double w = state(weight_).item<double>();
    return w > 0 ? state(value_).item<double>() / w : std::numeric_limits<double>::quiet_NaN();
  }

 private:
  Kind kind_;
  size_t value_ = 0, weight_ = 0;
};

}  // namespace ember::metrics
