// Metrics by name, as the engine's [metrics] table and Fabric programs ask for them
// ("f1", "auroc", ...), with the settings they share (task, classes, average, ...).
#pragma once
#include "ember/support/metrics/classification.h"
#include "ember/support/metrics/curves.h"
#include "ember/support/metrics/regression.h"

#include <memory>
#include <string>
#include <vector>

namespace ember::metrics {

struct MetricSpec {
  std::string name;                // one of metric_names()
  Task task = Task::multiclass;
  int64_t num_classes = 2;         // classes (multiclass) or labels (multilabel)
  Average average = Average::macro;
  int64_t top_k = 1;               // accuracy: the target among the k highest scores
  double threshold = 0.5;          // binary / multilabel: a probability at or above it says 1
  double beta = 1.0;               // fbeta
  int64_t thresholds = 0;          // auroc / average_precision: 0 = exact, else bins
  int64_t max_samples = 1'000'000; // exact curves: the most samples kept
  int64_t bins = 15;               // calibration_error
  CalibrationError::Norm norm = CalibrationError::Norm::l1;
  Scores scores = Scores::automatic;
  int64_t ignore_index = -1;       // a target that is left out (padding)
};

inline const std::vector<std::string>& metric_names() {
  static const std::vector<std::string> names = {"accuracy",  "precision", "recall",   "f1",         "fbeta", "specificity",
                                                 "auroc",     "average_precision",     "calibration_error", "confusion_matrix",
                                                 "mae",       "mse",       "rmse",     "r2",         "perplexity"};
  return names;
}
inline bool is_regression_metric(const std::string& n) { return n == "mae" || n == "mse" || n == "rmse" || n == "r2"; }

inline Average parse_average(const std::string& s) {
  if (s == "micro") return Average::micro;
  if (s == "macro") return Average::macro;
  if (s == "weighted") return Average::weighted;
  if (s == "none") return Average::none;
  throw RunError("metrics: unknown average '" + s + "' (micro, macro, weighted or none)");
}
inline Task parse_task(const std::string& s) {
  if (s == "binary") return Task::binary;
  if (s == "multiclass") return Task::multiclass;
  if (s == "multilabel") return Task::multilabel;
  throw RunError("metrics: unknown task '" + s + "' (binary, multiclass or multilabel)");
}

// The metric `spec` names. Throws RunError (one line) for an unknown name or a setting it cannot
// honour.
inline std::unique_ptr<Metric> make_metric(const MetricSpec& spec) {
  const std::string& n = spec.name;
  auto refuse = [&](const std::string& why) -> std::unique_ptr<Metric> { throw RunError("metrics: " + n + ": " + why); };
  const bool multiclass = spec.task == Task::multiclass;
  auto score = [&](ScoreKind kind) -> std::unique_ptr<Metric> {
    if (spec.top_k > 1) {
      if (kind != ScoreKind::accuracy || !multiclass) return refuse("top_k > 1 applies to multiclass accuracy only");
      return std::make_unique<TopKAccuracy>(spec.num_classes, spec.top_k, spec.average, spec.ignore_index);
    }
    if (multiclass) return std::make_unique<ClassificationScore>(kind, spec.num_classes, spec.average, spec.beta, spec.ignore_index);
    return std::make_unique<LabelScore>(kind, spec.task, spec.num_classes, spec.average, spec.threshold, spec.beta, spec.scores);
  };
  if (n == "accuracy") return score(ScoreKind::accuracy);
  if (n == "precision") return score(ScoreKind::precision);
  if (n == "recall") return score(ScoreKind::recall);
  if (n == "fbeta") return score(ScoreKind::fbeta);
  if (n == "f1") {
    MetricSpec one = spec;
    one.name = "fbeta";
    one.beta = 1.0;
    return make_metric(one);
  }
  if (n == "specificity") return score(ScoreKind::specificity);
  if (n == "auroc" || n == "average_precision") {
    const CurveKind kind = n == "auroc" ? CurveKind::auroc : CurveKind::average_precision;
    if (spec.thresholds == 1 || spec.thresholds < 0) return refuse("thresholds must be 0 (exact) or at least 2");
    if (spec.thresholds == 0)
      return std::make_unique<ExactCurve>(kind, spec.task, spec.num_classes, spec.average, spec.max_samples, spec.scores, spec.ignore_index);
    return std::make_unique<BinnedCurve>(kind, spec.task, spec.num_classes, spec.average, spec.thresholds, spec.scores, spec.ignore_index);
  }
  if (n == "calibration_error") return std::make_unique<CalibrationError>(spec.task, spec.bins, spec.norm, spec.scores, spec.ignore_index);
  if (n == "confusion_matrix") {
    if (spec.task == Task::binary) return ConfusionMatrix::binary(spec.threshold, spec.scores);
    if (multiclass) return std::make_unique<ConfusionMatrix>(spec.num_classes, spec.ignore_index);
    return std::make_unique<MultilabelConfusionMatrix>(spec.num_classes, spec.threshold, spec.scores);
  }
  if (n == "mae") return std::make_unique<Regression>(Regression::Kind::mae);
  if (n == "mse") return std::make_unique<Regression>(Regression::Kind::mse);
  if (n == "rmse") return std::make_unique<Regression>(Regression::Kind::rmse);
  if (n == "r2") return std::make_unique<Regression>(Regression::Kind::r2);
  if (n == "perplexity") return std::make_unique<Perplexity>(spec.ignore_index >= 0 ? spec.ignore_index : -100);
  std::string known;
  for (const auto& k : metric_names()) known += (known.empty() ? "" : ", ") + k;
  throw RunError("metrics: unknown metric '" + n + "' (known: " + known + ")");
}

}  // namespace ember::metrics
