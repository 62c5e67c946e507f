// Metrics whose value over N ranks is the value over the whole data set (torchmetrics' Metric, in
// C++). A metric keeps state tensors, each declared with its reduction across ranks; update()
// folds one batch in, compute() reads the value, reset() starts over. Across ranks, sync() reduces
// every state once (through the trainer's collectives service, ember/trainer.h) before compute(),
// so macro-F1 or AUROC are computed from the whole data set's counts, never averaged per batch or
// per rank. Constant memory: states are counts, sums and binned curves, never the samples.
//
//   ember::metrics::F1 f1(num_classes, ember::metrics::Average::macro);
//   f1.update(logits, targets);                 // every validation batch (on the device)
//   f1.sync(collectives);                        // at epoch end, every rank
//   trainer.log_metric("val_f1", f1.compute()); f1.reset();
//
// Header-only and compiled into the plugin that uses it; a third party's metric derives from
// Metric and registers its states with add_state.
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ember/error.h"
#include "ember/trainer.h"
#include "ember/types.h"

namespace ember::metrics {

// How a state combines across ranks (and across shards of the data: merge).
enum class StateReduce { sum, max, min };

class Metric {
 public:
  virtual ~Metric() = default;
  // Folds one batch in. `preds`: scores or class indices as the metric says; `target`: labels or
  // values. Any device; states follow the first batch's device.
  virtual void update(const at::Tensor& preds, const at::Tensor& target) = 0;
  // The value of everything folded in (after sync(): on every rank's data). NaN when undefined
  // (no sample yet, a class never seen for a macro average counts as 0 as torchmetrics does).
  virtual double compute() const = 0;

  // Back to the state before the first update.
  void reset() {
    for (auto& s : states_) s.value = s.initial.clone();
  }
  // Collective: every rank's states reduced by their declared reduction, in place.
  void sync(ITrainerCollectives& collectives) {
    sync([&](const at::Tensor& t, ReduceOp op) { return collectives.reduce(t, op); });
  }
  void sync(const std::function<at::Tensor(const at::Tensor&, ReduceOp)>& reduce) {
    for (auto& s : states_) {
      const ReduceOp op = s.reduce == StateReduce::sum ? ReduceOp::sum : s.reduce == StateReduce::max ? ReduceOp::max : ReduceOp::min;
      s.value = reduce(s.value, op).to(s.value.device());
    }
  }
  // Folds another metric of the same kind and settings in, as sync() would across ranks.
  void merge(const Metric& other) {
    if (other.states_.size() != states_.size()) throw RunError("metrics: merging metrics of different kinds");
    for (size_t i = 0; i < states_.size(); ++i) {
      auto& s = states_[i];
      const at::Tensor o = other.states_[i].value.to(s.value.device());
      if (s.reduce == StateReduce::sum) s.value = s.value + o;
      else if (s.reduce == StateReduce::max) s.value = at::maximum(s.value, o);
      else s.value = at::minimum(s.value, o);
    }
  }

 protected:
  // Registers a state (call in the constructor, in a fixed order: sync() pairs states by order).
  // Returns its index for state().
  size_t add_state(at::Tensor initial, StateReduce reduce) {
    states_.push_back({initial.clone(), initial.clone(), reduce});
    return states_.size() - 1;
  }
  at::Tensor& state(size_t i) { return states_[i].value; }
  const at::Tensor& state(size_t i) const { return states_[i].value; }
  // Moves every state to `device` (the first update's).
  void follow(const c10::Device& device) {
    for (auto& s : states_)
      if (s.value.device() != device) s.value = s.value.to(device);
  }

 private:
  struct State {
    at::Tensor value, initial;
    StateReduce reduce;
  };
  std::vector<State> states_;
};

// Multiclass predictions: scores [N, C] (logits or probabilities; the arg-max is the class) or
// class indices [N]; targets [N] in [0, C). Samples whose target is `ignore_index` are left out.
inline std::pair<at::Tensor, at::Tensor> multiclass_labels(const at::Tensor& preds, const at::Tensor& target, int64_t num_classes,
                                                           int64_t ignore_index) {
  at::Tensor p = preds.dim() == target.dim() + 1 ? preds.argmax(-1) : preds;
  at::Tensor t = target;
  if (p.sizes() != t.sizes())
    throw RunError("metrics: predictions of shape " + std::string(c10::str(preds.sizes())) + " do not match targets of shape " +
                   std::string(c10::str(target.sizes())));
  p = p.reshape({-1}).to(at::kLong);
  t = t.reshape({-1}).to(at::kLong);
  if (ignore_index >= 0) {
    const at::Tensor keep = t != ignore_index;
    p = p.masked_select(keep);
    t = t.masked_select(keep);
  }
  (void)num_classes;
  return {p, t};
}

// The confusion matrix C[target][predicted] (torchmetrics' MulticlassConfusionMatrix); the state
// of every multiclass metric below.
class ConfusionMatrix : public Metric {
 public:
  explicit ConfusionMatrix(int64_t num_classes, int64_t ignore_index = -1)
      : num_classes_(num_classes), ignore_index_(ignore_index) {
    if (num_classes < 2) throw RunError("metrics: num_classes must be at least 2, got " + std::to_string(num_classes));
    matrix_ = add_state(at::zeros({num_classes, num_classes}, at::kLong), StateReduce::sum);
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    auto [p, t] = multiclass_labels(preds, target, num_classes_, ignore_index_);
    const at::Tensor flat = t * num_classes_ + p;
    state(matrix_) += at::bincount(flat, {}, num_classes_ * num_classes_).reshape({num_classes_, num_classes_}).to(state(matrix_).device());
  }
  // Accuracy of everything seen (the trace over the total).
  double compute() const override {
    const auto m = state(matrix_).to(at::kDouble);
    const double total = m.sum().item<double>();
    return total > 0 ? m.trace().item<double>() / total : std::numeric_limits<double>::quiet_NaN();
  }
  // The matrix itself, on the CPU (rows: targets, columns: predictions).
  at::Tensor matrix() const { return state(matrix_).to(at::kCPU); }
  int64_t num_classes() const { return num_classes_; }

 private:
  int64_t num_classes_, ignore_index_;
  size_t matrix_ = 0;
};

// How per-class values become one (torchmetrics' `average`).
enum class Average { micro, macro, weighted, none };

// Precision, recall, F-beta, specificity and accuracy from a confusion matrix, averaged as asked.
// `none` computes the per-class values (per_class()); compute() then returns their mean.
class ClassificationScore : public ConfusionMatrix {
 public:
  enum class Kind { accuracy, precision, recall, fbeta, specificity };
  ClassificationScore(Kind kind, int64_t num_classes, Average average, double beta = 1.0, int64_t ignore_index = -1)
      : ConfusionMatrix(num_classes, ignore_index), kind_(kind), average_(average), beta_(beta) {}

  double compute() const override {
    const auto m = matrix().to(at::kDouble);
    const auto tp = m.diagonal(), fp = m.sum(0) - tp, fn = m.sum(1) - tp;
    const auto tn = m.sum() - tp - fp - fn;
    if (average_ == Average::micro) {
      const double TP = tp.sum().item<double>(), FP = fp.sum().item<double>(), FN = fn.sum().item<double>(), TN = tn.sum().item<double>();
      return score(TP, FP, FN, TN);
    }
    const auto per = per_class();
    const auto support = m.sum(1);
    if (average_ == Average::weighted) {
      const double total = support.sum().item<double>();
      return total > 0 ? (per * support).sum().item<double>() / total : std::numeric_limits<double>::quiet_NaN();
    }
    return per.mean().item<double>();
  }
  // One value per class (a class with no sample and no prediction scores 0, as torchmetrics').
  at::Tensor per_class() const {
    const auto m = matrix().to(at::kDouble);
    const auto tp = m.diagonal(), fp = m.sum(0) - tp, fn = m.sum(1) - tp;
    const auto tn = m.sum() - tp - fp - fn;
    std::vector<double> out;
    for (int64_t c = 0; c < num_classes(); ++c)
      out.push_back(score(tp[c].item<double>(), fp[c].item<double>(), fn[c].item<double>(), tn[c].item<double>()));
    return at::tensor(out, at::kDouble);
  }

 private:
  double score(double tp, double fp, double fn, double tn) const {
    auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
    switch (kind_) {
      case Kind::accuracy:
        // Multiclass accuracy (torchmetrics'): micro is the share of right answers, i.e. the
        // summed tp over the summed support; per class it is the class's recall.
        return ratio(tp, tp + fn);
      case Kind::precision: return ratio(tp, tp + fp);
      case Kind::recall: return ratio(tp, tp + fn);
      case Kind::specificity: return ratio(tn, tn + fp);
      case Kind::fbeta: {
        const double b2 = beta_ * beta_;
        return ratio((1 + b2) * tp, (1 + b2) * tp + b2 * fn + fp);
      }
    }
    return std::numeric_limits<double>::quiet_NaN();
  }
  Kind kind_;
  Average average_;
  double beta_;
};

inline std::unique_ptr<ClassificationScore> accuracy(int64_t c, Average a = Average::micro) {
  return std::make_unique<ClassificationScore>(ClassificationScore::Kind::accuracy, c, a);
}
inline std::unique_ptr<ClassificationScore> precision(int64_t c, Average a = Average::macro) {
  return std::make_unique<ClassificationScore>(ClassificationScore::Kind::precision, c, a);
}
inline std::unique_ptr<ClassificationScore> recall(int64_t c, Average a = Average::macro) {
  return std::make_unique<ClassificationScore>(ClassificationScore::Kind::recall, c, a);
}
inline std::unique_ptr<ClassificationScore> f1(int64_t c, Average a = Average::macro) {
  return std::make_unique<ClassificationScore>(ClassificationScore::Kind::fbeta, c, a, 1.0);
}
inline std::unique_ptr<ClassificationScore> specificity(int64_t c, Average a = Average::macro) {
  return std::make_unique<ClassificationScore>(ClassificationScore::Kind::specificity, c, a);
}

// Binary AUROC from `thresholds` evenly spaced score bins (torchmetrics' BinaryAUROC with
// thresholds=N): constant memory, exact up to the binning. `preds`: probabilities in [0, 1] (or
// logits when `logits`), `target`: 0/1.
class BinnedAuroc : public Metric {
 public:
  explicit BinnedAuroc(int64_t thresholds = 200, bool logits = false) : thresholds_(thresholds), logits_(logits) {
    if (thresholds < 2) throw RunError("metrics: AUROC needs at least 2 thresholds, got " + std::to_string(thresholds));
    pos_ = add_state(at::zeros({thresholds}, at::kLong), StateReduce::sum);
    neg_ = add_state(at::zeros({thresholds}, at::kLong), StateReduce::sum);
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    at::Tensor p = preds.reshape({-1}).to(at::kDouble);
    if (logits_) p = p.sigmoid();
    const at::Tensor bin = (p.clamp(0, 1) * static_cast<double>(thresholds_ - 1)).floor().to(at::kLong);
    const at::Tensor positive = target.reshape({-1}).to(at::kBool);
    state(pos_) += at::bincount(bin.masked_select(positive), {}, thresholds_).to(state(pos_).device());
    state(neg_) += at::bincount(bin.masked_select(positive.logical_not()), {}, thresholds_).to(state(neg_).device());
  }
  // The area under the ROC curve through the bins' points, from the highest score down.
  double compute() const override {
    const auto pos = state(pos_).to(at::kCPU, at::kDouble).flip(0).cumsum(0), neg = state(neg_).to(at::kCPU, at::kDouble).flip(0).cumsum(0);
    const double P = pos[-1].item<double>(), N = neg[-1].item<double>();
    if (P == 0 || N == 0) return std::numeric_limits<double>::quiet_NaN();
    const auto tpr = at::cat({at::zeros({1}, at::kDouble), pos / P}), fpr = at::cat({at::zeros({1}, at::kDouble), neg / N});
    return at::trapezoid(tpr, fpr).item<double>();
  }

 private:
  int64_t thresholds_;
  bool logits_;
  size_t pos_ = 0, neg_ = 0;
};

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
