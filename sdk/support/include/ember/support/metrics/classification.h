// Classification metrics (torchmetrics' names and definitions; scikit-learn's values, checked in
// tests/metric_library_test.cpp): the confusion matrix, accuracy, precision, recall, F-beta and
// specificity for binary, multiclass and multilabel tasks, averaged micro / macro / weighted / none,
// and top-k accuracy. All of them keep counts: constant memory, exact across ranks.
#pragma once
#include "ember/support/metrics/metric.h"

#include <array>
#include <memory>
#include <string>

namespace ember::metrics {

// binary: one score per sample (the positive class's), targets 0/1. multiclass: scores [N, C] or
// class indices [N], targets [N] in [0, C). multilabel: scores [N, L], targets [N, L] of 0/1.
enum class Task { binary, multiclass, multilabel };
// How per-class values become one (torchmetrics' and scikit-learn's `average`).
enum class Average { micro, macro, weighted, none };
// What the scores are: logits (softmax / sigmoid applied), probabilities, or decided per batch
// (auto: multiclass rows that are non-negative and sum to 1 are probabilities; binary and
// multilabel scores all in [0, 1] are; torchmetrics' rule).
enum class Scores { automatic, logits, probabilities };

inline const char* task_name(Task t) { return t == Task::binary ? "binary" : t == Task::multiclass ? "multiclass" : "multilabel"; }

// Scores as probabilities (double), as `scores` says.
inline at::Tensor probabilities(const at::Tensor& preds, Task task, Scores scores) {
  at::Tensor p = preds.detach().to(at::kDouble);
  if (scores == Scores::probabilities) return p;
  bool logits = scores == Scores::logits;
  if (scores == Scores::automatic) {
    if (task == Task::multiclass)
      logits = p.numel() > 0 && !(p.min().item<double>() >= 0 && (p.sum(-1) - 1).abs().max().item<double>() < 1e-4);
    else
      logits = p.numel() > 0 && !(p.min().item<double>() >= 0 && p.max().item<double>() <= 1);
  }
  if (!logits) return p;
  return task == Task::multiclass ? p.softmax(-1) : p.sigmoid();
}

inline std::string shape_text(const at::Tensor& t) { return std::string(c10::str(t.sizes())); }

// Multiclass predictions as class indices: scores [N, C] (the arg-max is the class) or indices [N];
// targets [N]. Samples whose target is `ignore_index` are left out.
inline std::pair<at::Tensor, at::Tensor> multiclass_labels(const at::Tensor& preds, const at::Tensor& target, int64_t num_classes,
                                                           int64_t ignore_index) {
  at::Tensor p = preds.dim() == target.dim() + 1 ? preds.argmax(-1) : preds;
  at::Tensor t = target;
  if (p.sizes() != t.sizes())
    throw RunError("metrics: predictions of shape " + shape_text(preds) + " do not match targets of shape " + shape_text(target));
  if (preds.dim() == target.dim() + 1 && preds.size(-1) != num_classes)
    throw RunError("metrics: scores for " + std::to_string(preds.size(-1)) + " classes, the metric counts " + std::to_string(num_classes) +
                   " (set [metrics] num_classes to the model's outputs)");
  p = p.reshape({-1}).to(at::kLong);
  t = t.reshape({-1}).to(at::kLong).to(p.device());
  if (ignore_index >= 0) {
    const at::Tensor keep = t != ignore_index;
    p = p.masked_select(keep);
    t = t.masked_select(keep);
  }
  if (t.numel() > 0 && (t.min().item<int64_t>() < 0 || t.max().item<int64_t>() >= num_classes))
    throw RunError("metrics: a target outside [0, " + std::to_string(num_classes) + "): " + std::to_string(t.min().item<int64_t>()) + ".." +
                   std::to_string(t.max().item<int64_t>()) + " (set [metrics] num_classes, or ignore_index for a padding label)");
  return {p, t};
}

// Binary / multilabel predictions as 0/1 labels [N, L] (L = 1 for binary) and targets [N, L].
inline std::pair<at::Tensor, at::Tensor> label_decisions(const at::Tensor& preds, const at::Tensor& target, Task task, double threshold,
                                                         Scores scores) {
  if (preds.numel() != target.numel())
    throw RunError("metrics: " + std::string(task_name(task)) + " scores of shape " + shape_text(preds) + " do not match targets of shape " +
                   shape_text(target));
  const int64_t labels = task == Task::binary ? 1 : (preds.dim() >= 2 ? preds.size(-1) : 1);
  const at::Tensor p = probabilities(preds, task, scores).reshape({-1, labels}) >= threshold;
  return {p.to(at::kLong), target.reshape({-1, labels}).to(at::kLong).to(p.device())};
}

// Per class: the ratio, or 0 where the denominator is 0 (torchmetrics' and scikit-learn's
// zero_division = 0).
inline at::Tensor safe_ratio(const at::Tensor& a, const at::Tensor& b) { return at::where(b > 0, a / b.clamp_min(1e-300), at::zeros_like(a)); }

enum class ScoreKind { accuracy, precision, recall, fbeta, specificity };

// The score of each entry of tp, fp, fn, tn (double tensors of one shape). `label_accuracy`: the
// binary / multilabel accuracy (tp + tn) / all, not the multiclass one (a class's recall).
inline at::Tensor score_of(ScoreKind kind, double beta, const at::Tensor& tp, const at::Tensor& fp, const at::Tensor& fn, const at::Tensor& tn,
                           bool label_accuracy) {
  switch (kind) {
    case ScoreKind::accuracy: return label_accuracy ? safe_ratio(tp + tn, tp + fp + fn + tn) : safe_ratio(tp, tp + fn);
    case ScoreKind::precision: return safe_ratio(tp, tp + fp);
    case ScoreKind::recall: return safe_ratio(tp, tp + fn);
    case ScoreKind::specificity: return safe_ratio(tn, tn + fp);
    case ScoreKind::fbeta: {
      const double b2 = beta * beta;
      return safe_ratio((1 + b2) * tp, (1 + b2) * tp + b2 * fn + fp);
    }
  }
  return at::full_like(tp, std::numeric_limits<double>::quiet_NaN());
}

// tp, fp, fn, tn per class -> one value (or the per-class values' mean for `none`; per_class()
// has them). Weighted: by the class's support (tp + fn).
inline double average_scores(ScoreKind kind, double beta, Average average, const at::Tensor& tp, const at::Tensor& fp, const at::Tensor& fn,
                             const at::Tensor& tn, bool label_accuracy) {
  if (average == Average::micro)
    return score_of(kind, beta, tp.sum(), fp.sum(), fn.sum(), tn.sum(), label_accuracy).item<double>();
  const at::Tensor per = score_of(kind, beta, tp, fp, fn, tn, label_accuracy);
  if (average == Average::weighted) {
    const at::Tensor support = tp + fn;
    const double total = support.sum().item<double>();
    return total > 0 ? (per * support).sum().item<double>() / total : std::numeric_limits<double>::quiet_NaN();
  }
  return per.numel() > 0 ? per.mean().item<double>() : std::numeric_limits<double>::quiet_NaN();
}

// The multiclass confusion matrix C[target][predicted] (torchmetrics' MulticlassConfusionMatrix),
// or binary's 2 x 2 (with `threshold` on the positive class's probability).
class ConfusionMatrix : public Metric {
 public:
  explicit ConfusionMatrix(int64_t num_classes, int64_t ignore_index = -1) : num_classes_(num_classes), ignore_index_(ignore_index) {
    if (num_classes < 2) throw RunError("metrics: num_classes must be at least 2, got " + std::to_string(num_classes));
    matrix_ = add_state(at::zeros({num_classes, num_classes}, at::kLong), StateReduce::sum);
  }
  // Binary: the 2 x 2 matrix of (target, score >= threshold).
  static std::unique_ptr<ConfusionMatrix> binary(double threshold = 0.5, Scores scores = Scores::automatic) {
    auto m = std::make_unique<ConfusionMatrix>(2);
    m->binary_ = true;
    m->threshold_ = threshold;
    m->scores_ = scores;
    return m;
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    at::Tensor p, t;
    if (binary_) {
      auto [pl, tl] = label_decisions(preds, target, Task::binary, threshold_, scores_);
      p = pl.reshape({-1});
      t = tl.reshape({-1});
    } else {
      std::tie(p, t) = multiclass_labels(preds, target, num_classes_, ignore_index_);
    }
    state(matrix_) += at::bincount(t * num_classes_ + p, {}, num_classes_ * num_classes_).reshape({num_classes_, num_classes_}).to(state(matrix_).device());
  }
  // Accuracy of everything seen (the trace over the total).
  double compute() const override {
    const auto m = matrix().to(at::kDouble);
    const double total = m.sum().item<double>();
    return total > 0 ? m.trace().item<double>() / total : std::numeric_limits<double>::quiet_NaN();
  }
  // The matrix itself, on the CPU (rows: targets, columns: predictions).
  at::Tensor matrix() const { return state(matrix_).to(at::kCPU); }
  int64_t num_classes() const { return num_classes_; }
  std::string state_key() const override {
    return "confusion " + std::to_string(num_classes_) + " " + std::to_string(ignore_index_) + " " + (binary_ ? "binary " : "multiclass ") +
           std::to_string(threshold_) + " " + std::to_string(static_cast<int>(scores_));
  }

 protected:
  // tp, fp, fn, tn per class (double, CPU).
  std::array<at::Tensor, 4> class_counts() const {
    const auto m = matrix().to(at::kDouble);
    const auto tp = m.diagonal(), fp = m.sum(0) - tp, fn = m.sum(1) - tp;
    return {tp, fp, fn, m.sum() - tp - fp - fn};
  }

 private:
  int64_t num_classes_, ignore_index_;
  size_t matrix_ = 0;
  bool binary_ = false;
  double threshold_ = 0.5;
  Scores scores_ = Scores::automatic;
};

// Multiclass accuracy, precision, recall, F-beta and specificity from a confusion matrix, averaged
// as asked (micro accuracy is the share of right answers). `none`: per_class() has the values,
// compute() their mean.
class ClassificationScore : public ConfusionMatrix {
 public:
  using Kind = ScoreKind;
  ClassificationScore(Kind kind, int64_t num_classes, Average average, double beta = 1.0, int64_t ignore_index = -1)
      : ConfusionMatrix(num_classes, ignore_index), kind_(kind), average_(average), beta_(beta) {}
  double compute() const override {
    const auto [tp, fp, fn, tn] = class_counts();
    return average_scores(kind_, beta_, average_, tp, fp, fn, tn, /*label_accuracy=*/false);
  }
  // One value per class (a class with no sample and no prediction scores 0, as torchmetrics').
  at::Tensor per_class() const override {
    const auto [tp, fp, fn, tn] = class_counts();
    return score_of(kind_, beta_, tp, fp, fn, tn, false);
  }

 private:
  Kind kind_;
  Average average_;
  double beta_;
};

// Binary and multilabel accuracy, precision, recall, F-beta and specificity: tp, fp, fn, tn per
// label (binary: of the positive class; multilabel accuracy is per label, (tp + tn) / all, so its
// micro average is 1 - scikit-learn's hamming_loss).
class LabelScore : public Metric {
 public:
  LabelScore(ScoreKind kind, Task task, int64_t num_labels, Average average, double threshold = 0.5, double beta = 1.0,
             Scores scores = Scores::automatic)
      : kind_(kind), task_(task), labels_(task == Task::binary ? 1 : num_labels), average_(average), threshold_(threshold), beta_(beta), scores_(scores) {
    if (task == Task::multiclass) throw RunError("metrics: LabelScore is for binary and multilabel tasks (multiclass: ClassificationScore)");
    if (labels_ < 1) throw RunError("metrics: a multilabel metric needs num_labels >= 1, got " + std::to_string(num_labels));
    counts_ = add_state(at::zeros({labels_, 4}, at::kLong), StateReduce::sum);
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    auto [p, t] = label_decisions(preds, target, task_, threshold_, scores_);
    if (p.size(1) != labels_)
      throw RunError("metrics: scores for " + std::to_string(p.size(1)) + " labels, the metric counts " + std::to_string(labels_));
    const at::Tensor tp = (p * t).sum(0), fp = (p * (1 - t)).sum(0), fn = ((1 - p) * t).sum(0), tn = ((1 - p) * (1 - t)).sum(0);
    state(counts_) += at::stack({tp, fp, fn, tn}, 1).to(state(counts_).device());
  }
  double compute() const override {
    const at::Tensor c = state(counts_).to(at::kCPU, at::kDouble);
    if (c.sum().item<double>() == 0) return std::numeric_limits<double>::quiet_NaN();
    // Binary: the positive class's value, whatever the average.
    return average_scores(kind_, beta_, task_ == Task::binary ? Average::micro : average_, c.select(1, 0), c.select(1, 1), c.select(1, 2),
                          c.select(1, 3), /*label_accuracy=*/true);
  }
  at::Tensor per_class() const override {
    const at::Tensor c = state(counts_).to(at::kCPU, at::kDouble);
    return score_of(kind_, beta_, c.select(1, 0), c.select(1, 1), c.select(1, 2), c.select(1, 3), true);
  }
  std::string state_key() const override {
    return std::string("labels ") + task_name(task_) + " " + std::to_string(labels_) + " " + std::to_string(threshold_) + " " +
           std::to_string(static_cast<int>(scores_));
  }

 protected:
  // tp, fp, fn, tn per label: int64 [labels, 4], on the CPU.
  at::Tensor counts() const { return state(counts_).to(at::kCPU); }

 private:
  ScoreKind kind_;
  Task task_;
  int64_t labels_;
  Average average_;
  double threshold_, beta_;
  Scores scores_;
  size_t counts_ = 0;
};

// The multilabel confusion matrices: one 2 x 2 per label, [L, 2, 2] = [[tn, fp], [fn, tp]] (rows:
// target 0 / 1, columns: predicted 0 / 1), as scikit-learn's multilabel_confusion_matrix and
// torchmetrics' MultilabelConfusionMatrix lay them out. It keeps LabelScore's counts (one compute
// group with the multilabel precision, recall, F1...); compute() is the micro label accuracy.
class MultilabelConfusionMatrix : public LabelScore {
 public:
  explicit MultilabelConfusionMatrix(int64_t num_labels, double threshold = 0.5, Scores scores = Scores::automatic)
      : LabelScore(ScoreKind::accuracy, Task::multilabel, num_labels, Average::micro, threshold, 1.0, scores) {}
  at::Tensor matrix() const {
    const at::Tensor c = counts();  // tp, fp, fn, tn
    return at::stack({c.select(1, 3), c.select(1, 1), c.select(1, 2), c.select(1, 0)}, 1).reshape({-1, 2, 2});
  }
};

// Multiclass top-k accuracy (scikit-learn's top_k_accuracy_score for micro): a sample counts when
// its target is among the k highest scores. Per class: hits / support, averaged as asked.
class TopKAccuracy : public Metric {
 public:
  TopKAccuracy(int64_t num_classes, int64_t k, Average average = Average::micro, int64_t ignore_index = -1)
      : num_classes_(num_classes), k_(k), average_(average), ignore_index_(ignore_index) {
    if (k < 1 || k > num_classes)
      throw RunError("metrics: top_k must be in [1, num_classes = " + std::to_string(num_classes) + "], got " + std::to_string(k));
    hits_ = add_state(at::zeros({num_classes}, at::kLong), StateReduce::sum);
    support_ = add_state(at::zeros({num_classes}, at::kLong), StateReduce::sum);
  }
  void update(const at::Tensor& preds, const at::Tensor& target) override {
    follow(preds.device());
    if (preds.dim() != 2 || preds.size(1) != num_classes_)
      throw RunError("metrics: top-k accuracy needs scores [N, " + std::to_string(num_classes_) + "], got " + shape_text(preds));
    at::Tensor t = target.reshape({-1}).to(at::kLong).to(preds.device());
    at::Tensor s = preds.detach();
    if (ignore_index_ >= 0) {
      const at::Tensor keep = t != ignore_index_;
      s = s.index({keep});
      t = t.masked_select(keep);
    }
    const at::Tensor top = std::get<1>(s.topk(k_, 1));
    const at::Tensor hit = (top == t.unsqueeze(1)).any(1).to(at::kLong);
    state(hits_) += at::zeros({num_classes_}, at::kLong).to(t.device()).index_add_(0, t, hit).to(state(hits_).device());
    state(support_) += at::bincount(t, {}, num_classes_).to(state(support_).device());
  }
  double compute() const override {
    const at::Tensor h = state(hits_).to(at::kCPU, at::kDouble), n = state(support_).to(at::kCPU, at::kDouble);
    const double total = n.sum().item<double>();
    if (total == 0) return std::numeric_limits<double>::quiet_NaN();
    if (average_ == Average::micro) return h.sum().item<double>() / total;
    const at::Tensor per = safe_ratio(h, n);
    if (average_ == Average::weighted) return (per * n).sum().item<double>() / total;
    return per.mean().item<double>();
  }
  at::Tensor per_class() const override { return safe_ratio(state(hits_).to(at::kCPU, at::kDouble), state(support_).to(at::kCPU, at::kDouble)); }
  std::string state_key() const override {
    return "topk " + std::to_string(num_classes_) + " " + std::to_string(k_) + " " + std::to_string(ignore_index_);
  }

 private:
  int64_t num_classes_, k_;
  Average average_;
  int64_t ignore_index_;
  size_t hits_ = 0, support_ = 0;
};

inline std::unique_ptr<ClassificationScore> accuracy(int64_t c, Average a = Average::micro) {
  return std::make_unique<ClassificationScore>(ScoreKind::accuracy, c, a);
}
inline std::unique_ptr<ClassificationScore> precision(int64_t c, Average a = Average::macro) {
  return std::make_unique<ClassificationScore>(ScoreKind::precision, c, a);
}
inline std::unique_ptr<ClassificationScore> recall(int64_t c, Average a = Average::macro) {
  return std::make_unique<ClassificationScore>(ScoreKind::recall, c, a);
}
inline std::unique_ptr<ClassificationScore> f1(int64_t c, Average a = Average::macro) {
  return std::make_unique<ClassificationScore>(ScoreKind::fbeta, c, a, 1.0);
}
inline std::unique_ptr<ClassificationScore> specificity(int64_t c, Average a = Average::macro) {
  return std::make_unique<ClassificationScore>(ScoreKind::specificity, c, a);
}

}  // namespace ember::metrics
