#include "loop/data_plan.h"

#include <c10/util/StringUtil.h>

#include <algorithm>

#include "common/log.h"
#include "config/run_config.h"

namespace ember::engine {

DataPlan::DataPlan(IDataModule& data, const std::string& data_name, const Section& d, const Section& trainer_cfg,
                   const TrainerSettings& settings, int64_t rank, int64_t world)
    : data_(data), trainer_cfg_(trainer_cfg), settings_(settings) {
  train_opts_.batch_size = d.get_int("batch_size");
  train_opts_.shuffle = d.get_bool("shuffle");
  train_opts_.drop_last = d.get_bool("drop_last");
  train_opts_.num_workers = d.get_int("num_workers");
  train_opts_.prefetch_factor = d.get_int("prefetch_factor");
  train_opts_.seed = settings.seed;
  train_opts_.rank = rank;
  train_opts_.world_size = world;
  train_opts_.group_by_length = d.get_bool("group_by_length");
  train_opts_.shuffle_groups = d.get_int("shuffle_groups");
  sample_groups_ = static_cast<const ISampleGroups*>(data.query_interface(kSampleGroupsIid));
  if (sample_groups_ != nullptr && train_opts_.group_by_length)
    throw UsageError(d.where("group_by_length") + ": data.group_by_length = true, but data plugin '" + data_name +
                     "' is read group by group (its shards: ember.ISampleGroups/1), which orders the batches already: remove the key");
  if (train_opts_.group_by_length) {
    sample_lengths_ = static_cast<const ISampleLengths*>(data.query_interface(kSampleLengthsIid));
    if (sample_lengths_ == nullptr)
      throw UsageError(d.where("group_by_length") + ": data.group_by_length = true, but data plugin '" + data_name +
                       "' does not report sample lengths (ember.ISampleLengths/1): remove the key, or use a data plugin "
                       "with samples of different lengths (e.g. text_classification)");
  }
  if (settings.overfit_batches > 0) {
    // The first batches in the split's order, the same ones every epoch (Lightning's sequential
    // sampler for overfit_batches).
    train_opts_.shuffle = false;
    train_opts_.group_by_length = false;
    const std::string first = trainer_cfg.is_integer("overfit_batches")
                                  ? c10::str(static_cast<int64_t>(settings.overfit_batches), " batch(es)")
                                  : c10::str(settings.overfit_batches * 100, "% of the batches");
    if (rank == 0)
      log::info("overfit_batches: training and validating on the first " + first +
                " of each split, the same ones every epoch (no shuffling)");
  }
  eval_opts_ = train_opts_;
  eval_opts_.shuffle = false;
  eval_opts_.drop_last = false;
  eval_opts_.group_by_length = false;  // evaluation keeps the split's order
  eval_opts_.exact = true;             // every sample counted once on any number of ranks
  eval_batch_size_set_ = d.has("eval_batch_size");
  if (eval_batch_size_set_) eval_opts_.batch_size = d.get_int("eval_batch_size");
  build();
}

int64_t DataPlan::limit(int64_t available, double limit, bool is_count) const {
  if (is_count) return std::min<int64_t>(available, static_cast<int64_t>(limit));
  return static_cast<int64_t>(static_cast<double>(available) * limit);
}

int64_t DataPlan::predict_batches(int64_t available) const {
  return limit(available, settings_.limit_predict, settings_.limit_predict_is_count);
}

void DataPlan::build() {
  train_.reset();
  val_.reset();
  test_.reset();
  if (data_.size(Split::train) > 0)
    train_ = std::make_unique<DataLoader>(data_, Split::train, train_opts_, sample_lengths_, sample_groups_);
  if (data_.size(Split::val) > 0) val_ = std::make_unique<DataLoader>(data_, Split::val, eval_opts_, nullptr, sample_groups_);
  if (data_.size(Split::test) > 0) test_ = std::make_unique<DataLoader>(data_, Split::test, eval_opts_, nullptr, sample_groups_);
  const auto& s = settings_;
  num_train_ = train_ ? limit(train_->num_batches(), s.limit_train, s.limit_train_is_count) : 0;
  num_val_ = val_ ? limit(val_->num_batches(), s.limit_val, s.limit_val_is_count) : 0;
  num_test_ = test_ ? limit(test_->num_batches(), s.limit_test, s.limit_test_is_count) : 0;
  if (s.val_check_is_count && s.check_val_every_n_epoch > 0 && validates() && static_cast<int64_t>(s.val_check_interval) > num_train_)
    throw UsageError(trainer_cfg_.where("val_check_interval") + ": trainer.val_check_interval (" +
                     std::to_string(static_cast<int64_t>(s.val_check_interval)) + ") is more than the training batches per epoch (" +
                     std::to_string(num_train_) + "); lower it, or set check_val_every_n_epoch = 0 to count batches across epochs");
}

DataLoader* DataPlan::loader(Split split) const {
  switch (split) {
    case Split::train: return train_.get();
    case Split::val: return val_.get();
    case Split::test: return test_.get();
  }
  return nullptr;
}

int64_t DataPlan::num_batches(Split split) const {
  switch (split) {
    case Split::train: return num_train_;
    case Split::val: return num_val_;
    case Split::test: return num_test_;
  }
  return 0;
}

void DataPlan::set_batch_size(int64_t size) {
  train_opts_.batch_size = size;
  if (!eval_batch_size_set_) eval_opts_.batch_size = size;
  build();
}

}  // namespace ember::engine
