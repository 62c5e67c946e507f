// Metrics whose value over N ranks is the value over the whole data set (torchmetrics' Metric, in
// C++). A metric keeps state tensors, each declared with its reduction across ranks; update()
// folds one batch in, compute() reads the value, reset() starts over. Across ranks, sync() (or
// sync_metrics() for many at once, one collective per reduction and dtype) reduces every state
// before compute(), so macro-F1 or AUROC are computed from the whole data set's counts, never
// averaged per batch or per rank.
//
//   ember::metrics::MetricCollection val;
//   val.add("val_f1", ember::metrics::f1(num_classes, ember::metrics::Average::macro));
//   val.add("val_auroc", std::make_unique<ember::metrics::BinnedCurve>(ember::metrics::CurveKind::auroc,
//                                                                      ember::metrics::Task::multiclass, num_classes));
//   val.update(logits, targets);                 // every validation batch (on the device)
//   val.sync(trainer);                           // at epoch end, every rank
//   for (auto& [name, v] : val.compute()) trainer.log_metric(name, v);
//   val.reset();
//
// Header-only and compiled into the plugin or program that uses it; a third party's metric derives
// from Metric and registers its states with add_state. The engine's [metrics] table (docs/metrics.md)
// is built from these.
//   metrics/metric.h          Metric, states and their reductions, sync_metrics
//   metrics/classification.h  confusion matrix, accuracy, precision, recall, F-beta, specificity, top-k
//   metrics/curves.h          AUROC and average precision (exact and binned), calibration error
//   metrics/regression.h      MAE, MSE, RMSE, R2, perplexity, mean / sum / max / min
//   metrics/factory.h         metrics by name (MetricSpec, make_metric): the [metrics] table's names
#pragma once
#include "ember/support/metrics/classification.h"
#include "ember/support/metrics/curves.h"
#include "ember/support/metrics/factory.h"
#include "ember/support/metrics/metric.h"
#include "ember/support/metrics/regression.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ember::metrics {

// Named metrics updated from the same predictions, synced together (one collective per reduction
// and dtype for all of them) and computed into (name, value) pairs. Metrics with the same
// state_key() (accuracy, F1 and the confusion matrix; exact AUROC and average precision) are one
// compute group: one update and one sync for the group, the others take its states.
class MetricCollection {
 public:
  Metric& add(std::string name, std::unique_ptr<Metric> metric) {
    const std::string key = metric->state_key();
    size_t leader = metrics_.size();
    for (size_t i = 0; i < metrics_.size() && !key.empty(); ++i)
      if (leader_[i] == i && metrics_[i].second->state_key() == key) {
        leader = i;
        break;
      }
    metrics_.emplace_back(std::move(name), std::move(metric));
    leader_.push_back(leader);
    return *metrics_.back().second;
  }
  void update(const at::Tensor& preds, const at::Tensor& target) {
    for (size_t i = 0; i < metrics_.size(); ++i)
      if (leader_[i] == i) metrics_[i].second->update(preds, target);
  }
  // The metrics that keep their own states (one per compute group): what a sync reduces.
  std::vector<Metric*> distinct() {
    std::vector<Metric*> out;
    for (size_t i = 0; i < metrics_.size(); ++i)
      if (leader_[i] == i) out.push_back(metrics_[i].second.get());
    return out;
  }
  // Hands each group's states to its other members (before computing them).
  void share() {
    for (size_t i = 0; i < metrics_.size(); ++i)
      if (leader_[i] != i) metrics_[i].second->share_states_of(*metrics_[leader_[i]].second);
  }
  void sync(const SyncGroup& group) { sync_metrics(distinct(), group); }
  void sync(ITrainer& trainer) {
    auto& c = trainer_service<ITrainerCollectives>(trainer, "metrics");
    sync({[&](const at::Tensor& t, ReduceOp op) { return c.reduce(t, op); }, trainer.rank(), trainer.world_size()});
  }
  std::vector<std::pair<std::string, double>> compute() {
    share();
    std::vector<std::pair<std::string, double>> out;
    for (const auto& [name, m] : metrics_) out.emplace_back(name, m->compute());
    return out;
  }
  void reset() {
    for (auto& [name, m] : metrics_) m->reset();
  }
  bool empty() const { return metrics_.empty(); }
  // After share() (compute() calls it), every metric holds its group's states.
  const std::vector<std::pair<std::string, std::unique_ptr<Metric>>>& metrics() const { return metrics_; }

 private:
  std::vector<std::pair<std::string, std::unique_ptr<Metric>>> metrics_;
  std::vector<size_t> leader_;  // the index of the metric whose states each one takes
};

}  // namespace ember::metrics
