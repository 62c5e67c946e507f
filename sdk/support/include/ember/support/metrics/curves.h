// Ranking and calibration metrics: AUROC and average precision, exact (every score kept, bounded)
// or binned (constant memory: per-bin counts, exact when the scores lie on the bins' grid), for
// binary, multiclass (one-vs-rest) and multilabel tasks; and the expected calibration error.
// scikit-learn's roc_auc_score / average_precision_score values (tests/metric_library_test.cpp).
#pragma once
#include "ember/support/metrics/classification.h"

#include <string>

namespace ember::metrics {

enum class CurveKind { auroc, average_precision };

// The value of one binary problem from its cumulative true and false positives at each distinct
// threshold, highest score first (double, CPU). NaN when undefined: AUROC without a positive or a
// negative sample, average precision without a positive.
inline double curve_value(CurveKind kind, const at::Tensor& tps, const at::Tensor& fps) {
  if (tps.numel() == 0) return std::numeric_limits<double>::quiet_NaN();
  const double P = tps[-1].item<double>(), N = fps[-1].item<double>();
  if (P == 0 || (kind == CurveKind::auroc && N == 0)) return std::numeric_limits<double>::quiet_NaN();
  const at::Tensor zero = at::zeros({1}, at::kDouble);
  if (kind == CurveKind::auroc) return at::trapezoid(at::cat({zero, tps / P}), at::cat({zero, fps / N})).item<double>();
  // Average precision: the sum of precision at each threshold times the recall it adds.
  const at::Tensor recall = at::cat({zero, tps / P});
  const at::Tensor precision = safe_ratio(tps, tps + fps);
  return ((recall.narrow(0, 1, tps.numel()) - recall.narrow(0, 0, tps.numel())) * precision).sum().item<double>();
}

// One binary problem from its scores and 0/1 targets: sorted, ties grouped into one threshold.
inline double exact_curve_value(CurveKind kind, const at::Tensor& scores, const at::Tensor& positive) {
  if (scores.numel() == 0) return std::numeric_limits<double>::quiet_NaN();
  const auto sorted = scores.to(at::kCPU, at::kDouble).sort(/*stable=*/true, 0, /*descending=*/true);
  const at::Tensor s = std::get<0>(sorted), y = positive.to(at::kCPU, at::kDouble).index_select(0, std::get<1>(sorted));
  // The last index of every run of equal scores.
  const at::Tensor last = at::cat({at::nonzero(s.narrow(0, 1, s.numel() - 1) != s.narrow(0, 0, s.numel() - 1)).reshape({-1}),
                                   at::tensor({s.numel() - 1}, at::kLong)});
  const at::Tensor tps = y.cumsum(0).index_select(0, last);
  const at::Tensor fps = (last + 1).to(at::kDouble) - tps;
  return curve_value(kind, tps, fps);
}

// Per-class values -> one: macro over the classes whose value is defined (a class with no positive
// or, for AUROC, no negative sample has no curve), weighted by the positives.
inline double average_curves(const std::vector<double>& values, const std::vector<double>& positives, Average average) {
  double sum = 0, weight = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    if (std::isnan(values[i])) continue;
    const double w = average == Average::weighted ? positives[i] : 1.0;
    sum += w * values[i];
    weight += w;
  }
  return weight > 0 ? sum / weight : std::numeric_limits<double>::quiet_NaN();
}

// The columns of a task: binary one, multiclass one per class (one-vs-rest), multilabel one per label.
inline int64_t curve_columns(Task task, int64_t num_classes) { return task == Task::binary ? 1 : num_classes; }

// Probabilities [N, K] and 0/1 targets [N, K] (multiclass: one-hot), ignore_index rows left out.
inline std::pair<at::Tensor, at::Tensor> curve_inputs(const at::Tensor& preds, const at::Tensor& target, Task task, int64_t columns,
                                                      Scores scores, int64_t ignore_index) {
  at::Tensor p = probabilities(preds, task, scores);
  at::Tensor t = target.detach().to(at::kLong).to(p.device());
  if (task == Task::multiclass) {
    if (p.dim() != 2 || p.size(1) != columns || t.numel() != p.size(0))
      throw RunError("metrics: multiclass curves need scores [N, " + std::to_string(columns) + "] and targets [N], got " + shape_text(preds) +
                     " and " + shape_text(target));
    t = t.reshape({-1});
    if (ignore_index >= 0) {
      const at::Tensor keep = t != ignore_index;
      p = p.index({keep});
      t = t.masked_select(keep);
    }
    if (t.numel() > 0 && (t.min().item<int64_t>() < 0 || t.max().item<int64_t>() >= columns))
      throw RunError("metrics: a target outside [0, " + std::to_string(columns) + ") (set [metrics] num_classes, or ignore_index)");
    return {p, at::one_hot(t, columns)};
  }
  if (p.numel() != t.numel())
    throw RunError("metrics: " + std::string(task_name(task)) + " scores of shape " + shape_text(preds) + " do not match targets of shape " +
                   shape_text(target));
  return {p.reshape({-1, columns}), t.reshape({-1, columns})};
}

// Exact AUROC or average precision: every (score, target) kept (a `cat` state bounded by
// `max_samples`), sorted at compute(). micro (multilabel, multiclass one-hot): all columns as one
// problem.
class ExactCurve : public Metric {
 public:
  ExactCurve(CurveKind kind, Task task, int64_t num_classes = 2, Average average = Average::macro, int64_t max_samples = 1'000'000,
             Scores scores = Scores::automatic, int64_t ignore_index = -1)
      : kind_(kind), task_(task), columns_(curve_columns(task, num_classes)), average_(average), scores_(scores), ignore_index_(ignore_index) {
    const std::string fix = "raise [metrics] max_samples, or set [metrics] thresholds (binned curves, constant memory)";
    scores_state_ = add_state(at::zeros({0, columns_}, at::kFloat), StateReduce::cat, max_samples, fix);
    targets_ = add_state(at::zeros({0, columns_}, at::kByte), StateReduce::cat, max_samples, fix);
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    auto [p, t] = curve_inputs(preds, target, task_, columns_, scores_, ignore_index_);
    // float32 scores: the ranking of probabilities survives, and the state is half the size.
    append(scores_state_, p.to(at::kFloat));
    append(targets_, t.to(at::kByte));
  }
  double compute() const override {
    const at::Tensor s = cat_state(scores_state_).to(at::kCPU, at::kDouble), t = cat_state(targets_).to(at::kCPU, at::kDouble);
    if (average_ == Average::micro && task_ != Task::binary) return exact_curve_value(kind_, s.reshape({-1}), t.reshape({-1}));
    const at::Tensor per = per_class();
    std::vector<double> values(per.data_ptr<double>(), per.data_ptr<double>() + per.numel());
    const at::Tensor pos = t.sum(0);
    return average_curves(values, std::vector<double>(pos.data_ptr<double>(), pos.data_ptr<double>() + pos.numel()), average_);
  }
  at::Tensor per_class() const override {
    const at::Tensor s = cat_state(scores_state_).to(at::kCPU, at::kDouble), t = cat_state(targets_).to(at::kCPU, at::kDouble);
    std::vector<double> out;
    for (int64_t c = 0; c < columns_; ++c) out.push_back(exact_curve_value(kind_, s.select(1, c).contiguous(), t.select(1, c).contiguous()));
    return at::tensor(out, at::kDouble);
  }
  // AUROC and average precision keep the same scores.
  std::string state_key() const override {
    return std::string("scores ") + task_name(task_) + " " + std::to_string(columns_) + " " + std::to_string(static_cast<int>(scores_)) + " " +
           std::to_string(ignore_index_);
  }

 private:
  CurveKind kind_;
  Task task_;
  int64_t columns_;
  Average average_;
  Scores scores_;
  int64_t ignore_index_;
  size_t scores_state_ = 0, targets_ = 0;
};

// Binned AUROC or average precision (torchmetrics' thresholds = T): positives and negatives
// counted per score bin, bin k holding [k / (T - 1), (k + 1) / (T - 1)). Constant memory; equal to
// the exact value when every score is a multiple of 1 / (T - 1).
class BinnedCurve : public Metric {
 public:
  BinnedCurve(CurveKind kind, Task task, int64_t num_classes = 2, Average average = Average::macro, int64_t thresholds = 200,
              Scores scores = Scores::automatic, int64_t ignore_index = -1)
      : kind_(kind), task_(task), columns_(curve_columns(task, num_classes)), average_(average), thresholds_(thresholds), scores_(scores),
        ignore_index_(ignore_index) {
    if (thresholds < 2) throw RunError("metrics: binned curves need at least 2 thresholds, got " + std::to_string(thresholds));
    pos_ = add_state(at::zeros({columns_, thresholds}, at::kLong), StateReduce::sum);
    neg_ = add_state(at::zeros({columns_, thresholds}, at::kLong), StateReduce::sum);
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    auto [p, t] = curve_inputs(preds, target, task_, columns_, scores_, ignore_index_);
    // The small epsilon keeps a score on the grid (k / (T - 1), rounded) in bin k; truncation is
    // the floor of a non-negative number. One bincount over (positive?, column, bin).
    const int64_t n = columns_ * thresholds_;
    const at::Tensor bin = (p.clamp(0, 1) * static_cast<double>(thresholds_ - 1) + 1e-9).to(at::kLong).clamp_max_(thresholds_ - 1);
    const at::Tensor flat = bin + at::arange(0, n, thresholds_, bin.options()).unsqueeze(0) + t.to(at::kLong) * n;
    const at::Tensor counts = at::bincount(flat.reshape({-1}), {}, 2 * n).reshape({2, columns_, thresholds_});
    state(neg_) += counts[0].to(state(neg_).device());
    state(pos_) += counts[1].to(state(pos_).device());
  }
  double compute() const override {
    const at::Tensor pos = state(pos_).to(at::kCPU, at::kDouble), neg = state(neg_).to(at::kCPU, at::kDouble);
    if (average_ == Average::micro && task_ != Task::binary) return value(pos.sum(0), neg.sum(0));
    const at::Tensor per = per_class();
    std::vector<double> values(per.data_ptr<double>(), per.data_ptr<double>() + per.numel());
    const at::Tensor p = pos.sum(1);
    return average_curves(values, std::vector<double>(p.data_ptr<double>(), p.data_ptr<double>() + p.numel()), average_);
  }
  at::Tensor per_class() const override {
    const at::Tensor pos = state(pos_).to(at::kCPU, at::kDouble), neg = state(neg_).to(at::kCPU, at::kDouble);
    std::vector<double> out;
    for (int64_t c = 0; c < columns_; ++c) out.push_back(value(pos[c], neg[c]));
    return at::tensor(out, at::kDouble);
  }
  std::string state_key() const override {
    return std::string("bins ") + task_name(task_) + " " + std::to_string(columns_) + " " + std::to_string(thresholds_) + " " +
           std::to_string(static_cast<int>(scores_)) + " " + std::to_string(ignore_index_);
  }

 private:
  // From the highest bin down; bins nobody fell in add no point.
  double value(const at::Tensor& pos, const at::Tensor& neg) const {
    const at::Tensor p = pos.flip(0), n = neg.flip(0);
    const at::Tensor used = at::nonzero((p + n) > 0).reshape({-1});
    return curve_value(kind_, p.cumsum(0).index_select(0, used), n.cumsum(0).index_select(0, used));
  }
  CurveKind kind_;
  Task task_;
  int64_t columns_;
  Average average_;
  int64_t thresholds_;
  Scores scores_;
  int64_t ignore_index_;
  size_t pos_ = 0, neg_ = 0;
};

// Binary AUROC from `thresholds` bins (the metric of SDK 2.4's library, kept by name).
class BinnedAuroc : public BinnedCurve {
 public:
  explicit BinnedAuroc(int64_t thresholds = 200, bool logits = false)
      : BinnedCurve(CurveKind::auroc, Task::binary, 2, Average::macro, thresholds, logits ? Scores::logits : Scores::probabilities) {}
};

// Expected calibration error (torchmetrics' BinaryCalibrationError / MulticlassCalibrationError):
// the confidences (binary: the positive probability, multiclass: the top class's) in `bins`
// equal-width bins; per bin the gap between the mean confidence and the accuracy (binary: the
// share of positives). l1: the gaps weighted by the bins' shares (ECE); l2: their root mean square;
// max: the largest gap (MCE).
class CalibrationError : public Metric {
 public:
  enum class Norm { l1, l2, max };
  CalibrationError(Task task, int64_t bins = 15, Norm norm = Norm::l1, Scores scores = Scores::automatic, int64_t ignore_index = -1)
      : task_(task), bins_(bins), norm_(norm), scores_(scores), ignore_index_(ignore_index) {
    if (task == Task::multilabel) throw RunError("metrics: calibration_error is for binary and multiclass tasks");
    if (bins < 1) throw RunError("metrics: calibration_error needs at least 1 bin, got " + std::to_string(bins));
    count_ = add_state(at::zeros({bins}, at::kDouble), StateReduce::sum);
    confidence_ = add_state(at::zeros({bins}, at::kDouble), StateReduce::sum);
    correct_ = add_state(at::zeros({bins}, at::kDouble), StateReduce::sum);
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    at::Tensor conf, right;
    if (task_ == Task::binary) {
      conf = probabilities(preds, task_, scores_).reshape({-1});
      right = target.reshape({-1}).to(at::kDouble).to(conf.device());
      if (conf.numel() != right.numel())
        throw RunError("metrics: binary scores of shape " + shape_text(preds) + " do not match targets of shape " + shape_text(target));
    } else {
      at::Tensor p = probabilities(preds, task_, scores_);
      at::Tensor t = target.reshape({-1}).to(at::kLong).to(p.device());
      if (ignore_index_ >= 0) {
        const at::Tensor keep = t != ignore_index_;
        p = p.index({keep});
        t = t.masked_select(keep);
      }
      const auto top = p.max(-1);
      conf = std::get<0>(top);
      right = (std::get<1>(top) == t).to(at::kDouble);
    }
    // Bin b holds (b / bins, (b + 1) / bins] (scikit-learn's calibration_curve).
    const at::Tensor bin = (conf * static_cast<double>(bins_)).ceil().sub(1).clamp(0, bins_ - 1).to(at::kLong);
    state(count_) += at::zeros({bins_}, at::kDouble).to(conf.device()).index_add_(0, bin, at::ones_like(conf)).to(state(count_).device());
    state(confidence_) += at::zeros({bins_}, at::kDouble).to(conf.device()).index_add_(0, bin, conf).to(state(confidence_).device());
    state(correct_) += at::zeros({bins_}, at::kDouble).to(conf.device()).index_add_(0, bin, right).to(state(correct_).device());
  }
  double compute() const override {
    const at::Tensor n = state(count_).to(at::kCPU), c = state(confidence_).to(at::kCPU), a = state(correct_).to(at::kCPU);
    const double total = n.sum().item<double>();
    if (total == 0) return std::numeric_limits<double>::quiet_NaN();
    const at::Tensor gap = (safe_ratio(c, n) - safe_ratio(a, n)).abs(), share = n / total;
    switch (norm_) {
      case Norm::l1: return (gap * share).sum().item<double>();
      case Norm::l2: return std::sqrt((gap * gap * share).sum().item<double>());
      case Norm::max: return gap.masked_select(n > 0).max().item<double>();
    }
    return std::numeric_limits<double>::quiet_NaN();
  }

 private:
  Task task_;
  int64_t bins_;
  Norm norm_;
  Scores scores_;
  int64_t ignore_index_;
  size_t count_ = 0, confidence_ = 0, correct_ = 0;
};

}  // namespace ember::metrics
