// Callback states that differ between ranks. A checkpoint holds each plugin's state once, taken on
// rank 0, which is right while every rank's state is the same. Under a sharding strategy weight
// averaging (ema, swa) keeps this rank's shards of its averages and of the model's own weights, so
// rank 0's state alone would give every rank rank 0's shards on resume. Such states are kept one
// per rank (in a file, gathered into "callbacks_by_rank"; in a sharded directory, each in its
// rank's part) and a resume with as many ranks gives each rank its own. With another number of
// ranks: refused in one line naming the callback when the writing run's strategy trained shards
// and the state holds tensors (they would not fit the new shards), else each rank takes rank 0's
// state as before (a timer's clock, a loss window).
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
  std::function<at::Tensor(const at::Tensor&, ReduceOp)> reduce;      // max: over every rank
  std::function<at::Tensor(const at::Tensor&, int64_t)> broadcast;     // rank src's tensor on every rank
  // A digest of how this rank's shards are cut (what it trains and where it sits in the mesh): a
  // resume on as many ranks but another mesh (tensor-parallel degree, pipeline stages) cuts them
  // otherwise, and a shard-shaped state would not fit, or fit with other elements.
  int64_t layout = 0;
};

// Where the states that differ go. A checkpoint file is whole on rank 0, so every rank's state
// travels there. A sharded directory has one part per rank, so each rank writes its own state into
// its part and nothing travels: rank 0 would otherwise hold every rank's shards of a large average
// while saving, which is what sharding the checkpoint avoids.
enum class StatesGo { to_rank0, into_own_part };

struct RankStates {
  // The checkpoint's "callbacks_by_rank" (meta.ckpt for a directory), on rank 0: {"world_size": w,
  // "trains_shards": bool, "with_tensors": [names whose state holds tensors], "layouts": [each
  // rank's RankCollectives::layout], and either
  // "states": {name: [rank 0's state, ..., rank w-1's]} (to_rank0) or "in_parts": [names]
  // (into_own_part)} for the callbacks whose state differs between ranks. Empty on other ranks, on
  // one process, and when every state is the same everywhere.
  c10::impl::GenericDict record{c10::StringType::get(), c10::AnyType::get()};
  // into_own_part: this rank's states of those callbacks, by name (written into its part).
  c10::impl::GenericDict own{c10::StringType::get(), c10::AnyType::get()};
};

// Collective: every rank calls it with its callbacks' states (name, state_dict()) in the same
// order.
RankStates gather_differing_states(const std::vector<std::pair<std::string, c10::IValue>>& states, bool trains_shards, StatesGo go,
                                   const RankCollectives& c);

// The state callback `name` loads on `rank`: its own, from `by_rank` (a checkpoint's
// "callbacks_by_rank" with "states") or from `own_part` (the callback states of this rank's part of
// a sharded directory, when by_rank lists the name "in_parts"), when it was written by `world`
// ranks cut as this run's (`other_cut` false: no rank's layout differs from the one it saved);
// else `shared`. Throws RunError (`where` names the checkpoint) when by_rank holds one, was written
// by another number of ranks or another cut, its strategy trained shards and the state holds
// tensors, or when this rank's part lacks a state by_rank says it holds.
c10::IValue state_for_rank(const std::string& name, const c10::IValue& shared, const c10::impl::GenericDict& by_rank,
                           const c10::IValue& own_part, int64_t rank, int64_t world, bool other_cut, const std::string& where);

// Collective (every rank calls it with the same by_rank): whether any rank's shards are cut
// otherwise than when by_rank was written (its "layouts" against `layout`, this rank's now). False
// for another number of ranks (state_for_rank's own rule) and for checkpoints without layouts.
bool shards_cut_otherwise(const c10::impl::GenericDict& by_rank, int64_t rank, int64_t world, int64_t layout,
                          const std::function<bool(bool)>& any_rank);

// Whether by_rank says callback `name`'s states per rank lie in the parts of a sharded directory.
bool states_in_parts(const c10::impl::GenericDict& by_rank);

}  // namespace ember::engine
