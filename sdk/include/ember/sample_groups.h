// Extension interface for data stored in groups that are far cheaper to read together than apart
// (the samples of one tar shard, one file, one remote object): a data module says which group each
// sample belongs to, and the engine's loader orders an epoch by group so that every rank reads a
// few groups at a time instead of touching all of them every batch. Optional, found through
// IPluginObject::query_interface.
//
// With it the loader (docs/data.md, "Sharded data"):
//   - training (data.shuffle): permutes the groups by (seed, epoch), takes them data.shuffle_groups
//     at a time and permutes the samples of those together (a shuffle buffer that is exact and
//     reproducible); without shuffling the samples keep their index order;
//   - gives each rank one contiguous part of that sequence (not every world_size-th sample), so a
//     rank reads about 1/world_size of the groups, and the ranks' parts joined in rank order are
//     the same sequence on any number of ranks.
#pragma once
#include <cstdint>

#include "ember/types.h"

namespace ember {

// IDataModule::query_interface(kSampleGroupsIid). Called after setup(), from the engine's thread.
inline constexpr const char* kSampleGroupsIid = "ember.ISampleGroups/1";
class EMBER_SDK_API ISampleGroups {
 public:
  virtual ~ISampleGroups() = default;
  // The group of sample `index` (in [0, size(split))) of `split`: an id >= 0. Ids need not be
  // contiguous; samples of a group keep their index order when the loader does not shuffle.
  virtual int64_t sample_group(Split split, int64_t index) const = 0;
};

}  // namespace ember
