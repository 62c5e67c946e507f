// The [metrics] table (docs/metrics.md): metrics the engine computes from what the model hands it
// (IStepContext::update_metrics: scores and targets), per split, over the whole split on every
// rank: the states are reduced across ranks once at the end of the epoch (sync_metrics: one
// collective per reduction and dtype), never averaged per batch. Logged as <split>_<name>
// (val_f1, test_auroc) next to the model's own metrics; the confusion matrix is written as a CSV
// table (and a PNG where the build has cairo) in the run folder.
#pragma once
#include <ember/support/metrics.h>
#include <ember/types.h>

#include <array>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/run_config.h"

namespace ember::engine {

// How the ranks of a run reduce metric states: Runtime::reduce sums over the data-parallel group
// (a device mesh's tensor-parallel peers and pipeline stages each sum their own group's copies)
// and takes max / min over every rank; `broadcast` hands a global rank's tensor to every rank.
struct MetricRanks {
  metrics::Reducer reduce;
  std::function<at::Tensor(const at::Tensor&, int64_t)> broadcast;
  int64_t rank = 0, world_size = 1;
  int64_t data_parallel_rank = 0, data_parallel_size = 1;
};

class ConfiguredMetrics {
 public:
  // Reads [metrics]; throws ConfigError (file:line) for a setting that cannot work. Nothing is
  // computed when `names` is empty.
  explicit ConfiguredMetrics(const Section& section);
  // Whether `split` computes anything.
  bool active(Split split) const { return !names_.empty() && splits_[static_cast<size_t>(split)]; }
  bool on_step() const { return on_step_; }
  // One batch: detached, on its device. The metrics are made at the first batch (num_classes = 0
  // takes the scores' width).
  void update(Split split, const at::Tensor& preds, const at::Tensor& target);
  // metrics.on_step: the training values over the batches since the last call, this rank only
  // (train_<name>_step); empty when there were none.
  std::vector<std::pair<std::string, double>> take_step_values();
  // Collective (every rank, also one that saw no batch): reduces, computes and resets `split`'s
  // metrics, the same values on every rank: summed over the data-parallel group of a rank that saw
  // predictions, then, on a device mesh whose other ranks saw none or copies (pipeline stages,
  // tensor-parallel peers), that rank's states broadcast to all. `ran_batches`: the split ran
  // batches (then no predictions on any rank is an error naming ctx.update_metrics). Returns (name, value) pairs: <split>_<name>, train_<name>_epoch with on_step, and
  // <split>_<name>_<class> for average = "none"; and the confusion matrix when one is asked.
  struct EpochValues {
    std::vector<std::pair<std::string, double>> values;
    at::Tensor confusion_matrix;  // [C, C] on the CPU (rows: targets), multilabel [L, 2, 2], or undefined
  };
  EpochValues finish(Split split, const MetricRanks& ranks, bool ran_batches);
  // After a split's first batch: throws finish's error at once when the split computes metrics and
  // that batch handed no predictions (rather than after a whole epoch).
  void require_predictions(Split split) const;
  // Drops what `split` gathered (a sanity check's batches).
  void discard(Split split);

 private:
  struct SplitMetrics {
    metrics::MetricCollection collection;  // the confusion matrix too, named "confusion_matrix"
    bool made = false;
    bool updated = false;  // predictions came this epoch
    int64_t classes = 0;   // what the metrics were made for
  };
  void make(SplitMetrics& m, int64_t num_classes) const;
  [[noreturn]] void throw_no_predictions(Split split) const;
  int64_t classes_of(const at::Tensor& preds) const;

  std::vector<std::string> names_;
  metrics::MetricSpec spec_;
  std::array<bool, 3> splits_{};
  bool on_step_ = false;
  std::string where_;  // where [metrics] names was set, for messages
  std::array<SplitMetrics, 3> splits_metrics_;
  SplitMetrics step_window_;  // on_step: the batches since the last take_step_values
  bool step_window_used_ = false;
};

// Writes `matrix` as <dir>/<split>_confusion_matrix.csv (rows: targets, columns: predictions; a
// multilabel [L, 2, 2] as a row per label: label,tn,fp,fn,tp; and a .png where the build has
// cairo), each atomically. Returns the image (empty without cairo) for
// the loggers that take images.
struct ConfusionMatrixImage {
  std::string png;
  int64_t width = 0, height = 0;
};
ConfusionMatrixImage write_confusion_matrix(const at::Tensor& matrix, const std::filesystem::path& dir, const std::string& split);

}  // namespace ember::engine
