// The loaders a run trains and evaluates from: [data]'s loader options (batch sizes, shuffling,
// workers, length grouping, shard order, this rank's share), the trainer's limits (limit_*_batches,
// overfit_batches), the train / val / test loaders built from them, and their batch counts per
// epoch. Rebuilt when a tuner changes the batch size.
#pragma once
#include <ember/data.h>
#include <ember/sample_lengths.h>

#include <cstdint>
#include <memory>
#include <string>

#include "data/data_loader.h"
#include "loop/trainer_settings.h"

namespace ember::engine {

class Section;

class DataPlan {
 public:
  // Reads [data] (`data_cfg`) for `data`, the data plugin named `data_name`; `rank` of `world`
  // ranks takes its share. Throws UsageError (with file:line) for settings the data cannot meet.
  // Builds the loaders.
  DataPlan(IDataModule& data, const std::string& data_name, const Section& data_cfg, const Section& trainer_cfg,
           const TrainerSettings& settings, int64_t rank, int64_t world);

  // The split's loader (nullptr when the split is empty) and its batches per epoch after the
  // trainer's limit (0 when there is none).
  DataLoader* loader(Split split) const;
  int64_t num_batches(Split split) const;
  bool validates() const { return val_ && num_val_ > 0; }
  // Batches of `available` that trainer.limit_predict_batches lets through.
  int64_t predict_batches(int64_t available) const;

  // Options of the evaluation loaders (unshuffled, nothing dropped), for loaders made elsewhere
  // (predict).
  const LoaderOptions& eval_options() const { return eval_opts_; }
  // Training batch size per rank; setting it rebuilds the loaders (the evaluation ones too when
  // no data.eval_batch_size is set).
  int64_t batch_size() const { return train_opts_.batch_size; }
  void set_batch_size(int64_t size);

 private:
  void build();
  int64_t limit(int64_t available, double limit, bool is_count) const;

  IDataModule& data_;
  const Section& trainer_cfg_;
  const TrainerSettings& settings_;
  LoaderOptions train_opts_, eval_opts_;
  bool eval_batch_size_set_ = false;
  const ISampleLengths* sample_lengths_ = nullptr;  // the data module's, when data.group_by_length
  const ISampleGroups* sample_groups_ = nullptr;    // the data module's, when it is stored in groups
  std::unique_ptr<DataLoader> train_, val_, test_;
  int64_t num_train_ = 0, num_val_ = 0, num_test_ = 0;
};

}  // namespace ember::engine
