// What this rank holds of the model (FSDP2's layout, shard_layout.h): every parameter with its
// shard, and the groups they are gathered and reduce-scattered in: one per unit the model declares
// (with at least auto_wrap_min_params), the others in runs of about bucket_cap_mb.
#pragma once
#include <ember/model.h>
#include <ember/model_units.h>
#include <ember/pipeline.h>

#include <torch/nn/module.h>

#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

#include "shard_layout.h"
#include "zero_strategy.h"

namespace ember_shard {

inline constexpr size_t kNone = std::numeric_limits<size_t>::max();

struct ShardTable {
  std::vector<ShardedParam> params;
  std::vector<ShardGroup> groups;
  std::vector<size_t> unit_group;  // unit -> its group (kNone: the unit is gathered with the step)
  std::vector<size_t> order;       // reduce-scatter order: backward's
  std::unordered_map<const void*, size_t> param_of_shard;  // optimizer tensor -> params index
  ember::IUnitModel* units = nullptr;                       // the model's units, when it declares some

  // The parameters of `module` and their groups. Throws ember::RunError for what cannot be sharded
  // (no parameters, a non-contiguous one, a unit with a parameter outside module() or with mixed dtypes).
  // `held`: under pipeline parallelism, the units of this rank's stages (the others left the
  // module); null: every unit.
  void build(torch::nn::Module& module, ember::IModel& model, const ZeroOptions& o, const std::vector<ember::UnitRange>* held = nullptr);
  // Chunk, real elements and row offset of every parameter for `rank` of `world`.
  void lay_out(int64_t rank, int64_t world);
  // Once the shards exist: which parameter each optimizer tensor is.
  void index_shards();

  size_t group_of_unit(int64_t unit) const;
  // Whether group g holds a parameter that trains no gradient (frozen: LoRA's base weights).
  bool has_frozen(size_t g) const;
  // This rank's part of a whole tensor shaped like parameter p.
  static at::Tensor my_part(const ShardedParam& p, const at::Tensor& whole, int64_t rank);
  const ShardedParam& param_of(const at::Tensor& shard) const { return params[param_of_shard.at(shard.unsafeGetTensorImpl())]; }
};

}  // namespace ember_shard
