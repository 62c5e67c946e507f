// The engine's data loader: turns an IDataModule split into batches. Owns sampling (shuffle seeded
// by seed and epoch, so an epoch's order never depends on what ran before it), distributed
// sharding (equal batches on every rank), drop_last, length grouping (data.group_by_length), and
// worker threads that prefetch batches in order. A data module stored in groups (tar shards:
// ISampleGroups) is read group by group, each rank taking one contiguous part of the epoch.
#pragma once
#include <ember/data.h>
#include <ember/sample_groups.h>
#include <ember/sample_lengths.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ember::engine {

struct LoaderOptions {
  int64_t batch_size = 32;
  bool shuffle = false;
  bool drop_last = false;
  int64_t num_workers = 0;
  int64_t prefetch_factor = 2;
  uint64_t seed = 0;
  int64_t rank = 0;
  int64_t world_size = 1;
  // Batches of samples of similar length (the data module's ISampleLengths); training only.
  bool group_by_length = false;
  // With the data module's sample groups: shuffling permutes the groups, then the samples of
  // shuffle_groups consecutive groups together (data.shuffle_groups).
  int64_t shuffle_groups = 4;
  // Evaluation: every sample counts once on any number of ranks. The ranks still take the same
  // number of batches (collectives inside a step need that), but DistributedSampler's padding
  // (the first samples repeated so the ranks' shares are equal) is left out of a rank's last batch;
  // a batch of padding only is run with Batch::size 0, which the metrics count for nothing.
  bool exact = false;
};

// Sample indices of one rank for one epoch (exposed for tests). `lengths` (one per sample, or
// empty) are used when options.group_by_length is set. `groups` (each sample's group id, or
// empty): the epoch is ordered by group and each rank takes a contiguous part of it.
std::vector<int64_t> epoch_indices(int64_t dataset_size, const LoaderOptions& options, int64_t epoch,
                                   const std::vector<int64_t>& lengths = {}, const std::vector<int64_t>& groups = {});
// How many of this rank's epoch_indices are real samples (the rest, at the end, are padding).
// `contiguous`: the rank's part is a run of the epoch (grouped data), not every world_size-th sample.
int64_t real_samples_on_rank(int64_t dataset_size, const LoaderOptions& options, bool contiguous = false);

class DataLoader {
 public:
  // `lengths` is read once here when options.group_by_length is set (it must then be given);
  // `groups`, when given, once here too.
  DataLoader(const IDataModule& data, Split split, LoaderOptions options, const ISampleLengths* lengths = nullptr,
             const ISampleGroups* groups = nullptr);
  int64_t num_batches() const;  // batches per epoch on this rank
  int64_t dataset_size() const { return size_; }

  // One pass over batches [first, first + count) of `epoch`.
  class Pass {
   public:
    Pass(const DataLoader& loader, int64_t epoch, int64_t first, int64_t count);
    ~Pass();
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;
    // Returns false at the end of the pass. Rethrows an error raised by get_batch in a worker.
    bool next(Batch& out);

   private:
    Batch load(int64_t batch) const;
    void worker();
    const DataLoader& loader_;
    std::vector<int64_t> indices_;
    int64_t real_ = 0;                 // indices_[0, real_) are real samples, the rest padding
    int64_t next_ = 0, end_ = 0;       // next batch to hand out, one past the last
    int64_t next_to_load_ = 0;         // next batch a worker will take
    std::map<int64_t, Batch> ready_;
    std::exception_ptr error_;
    bool stopping_ = false;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::vector<std::thread> threads_;
  };

  std::unique_ptr<Pass> pass(int64_t epoch, int64_t first, int64_t count) const;

 private:
  const IDataModule& data_;
  Split split_;
  LoaderOptions options_;
  int64_t size_;
  std::vector<int64_t> lengths_;  // per sample, when grouping by length
  std::vector<int64_t> groups_;   // per sample, when the data is stored in groups
};

}  // namespace ember::engine
