// Whole parameters from the shards: a group's all-gather (one rank: a copy from the shard; under
// offload from the host masters, asynchronously on a GPU), materialising the module's parameters
// before the forward or backward that needs them, prefetching the next unit, and freeing them
// again (stage 3). Stages 1 and 2 gather every parameter after each optimizer step.
#pragma once
#include <cstdint>

#include "shard_table.h"
#include "zero_context.h"

namespace ember_shard {

class ParameterGather {
 public:
  ParameterGather(ShardTable& table, ZeroContext ctx) : t_(table), c_(ctx) {}

  // The module's parameters of group g hold the whole current values (gathered now if needed).
  void materialize(size_t g);
  // Starts gathering `unit`'s group, unless it is there or on its way (counted as a prefetch).
  void prefetch_unit(int64_t unit);
  // Stage 3: frees group g's parameters (a prefetch nobody used is completed first).
  void release(size_t g);
  void release_all();
  // Stages 1 and 2 after a step, and after trained values changed: every parameter from the shards.
  void gather_all_into_parameters();
  // Sharded without offload, one rank, stages 1-2: the shard is the parameter itself.
  bool shard_is_parameter() const { return !c_.o.offload && c_.world() == 1 && c_.o.stage < 3; }

 private:
  void start_gather(size_t g);
  void wait_gather(ShardGroup& grp);
  void finish_gather(size_t g);
  // Rank r's chunks of parameter p, joined: the whole tensor (a view into the gather buffer).
  at::Tensor whole_from_gather(const ShardGroup& grp, const ShardedParam& p) const;

  ShardTable& t_;
  ZeroContext c_;
};

}  // namespace ember_shard
