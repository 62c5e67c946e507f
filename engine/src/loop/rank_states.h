// Callback states that differ between ranks. A checkpoint holds each plugin's state once, taken on
// rank 0, which is right while every rank's state is the same. Under a sharding strategy weight
// averaging (ema, swa) keeps this rank's shards of its averages and of the model's own weights, so
// rank 0's state alone would give every rank rank 0's shards on resume. Such states are gathered
// into the checkpoint as one per rank ("callbacks_by_rank") and a resume with as many ranks gives
// each rank its own. With another number of ranks: refused in one line naming the callback when
// the writing run's strategy trained shards and the state holds tensors (they would not fit the new
// shards), else each rank takes rank 0's state as before (a timer's clock, a loss window).
// Only runs whose strategy trains shards compare and gather: under a replicating strategy a large
// state (ema of a big model) would otherwise be pickled on every rank at every save, for states that
// only a clock or a loss window tells apart.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ember/types.h>

namespace ember::engine {

struct RankCollectives {
  int64_t rank = 0, world = 1;
  c10::Device device = c10::kCPU;  // where the collectives take tensors (the strategy's root device)
  std::function<at::Tensor(const at::Tensor&, ReduceOp)> reduce;      // over every rank
  std::function<at::Tensor(const at::Tensor&, int64_t)> broadcast;     // rank src's tensor on every rank
};

// Collective: every rank calls it with its callbacks' states (name, state_dict()) in the same
// order. Returns, on rank 0, {"world_size": w, "trains_shards": bool, "with_tensors": [names whose
// state holds tensors], "states": {name: [rank 0's state, ..., rank w-1's]}} for the callbacks
// whose state differs between ranks; an empty dict on other ranks, on one process, and when every
// state is the same everywhere.
c10::impl::GenericDict gather_differing_states(const std::vector<std::pair<std::string, c10::IValue>>& states, bool trains_shards,
                                               const RankCollectives& c);

// The state callback `name` loads on `rank`: its own from `by_rank` (a checkpoint's
// "callbacks_by_rank") when that holds one for it and was written by `world` ranks, else `shared`.
// Throws RunError (`where` names the checkpoint) when by_rank holds one, was written by another
// number of ranks, its strategy trained shards and the state holds tensors.
c10::IValue state_for_rank(const std::string& name, const c10::IValue& shared, const c10::impl::GenericDict& by_rank, int64_t rank,
                           int64_t world, const std::string& where);

}  // namespace ember::engine
