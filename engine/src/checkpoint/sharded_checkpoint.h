// Sharded checkpoint directories (docs/checkpoint.md): one part per rank plus the run's own state,
// committed atomically. A directory `D` (e.g. last.ckpt/) holds
//   meta.ckpt        rank 0: the usual checkpoint dict without state_dict/optimizer, plus
//                    "sharded" = {world_size, strategy}
//   rank<k>.ckpt     rank k's part (the strategy's IShardedCheckpoint::sharded_state()) and, when
//                    its callbacks' states differ per rank, rank k's own (loop/rank_states.h)
// It is written as `.D.partial` next to D; when every rank's part and the meta are on disk, rank 0
// swaps it into place with one rename (renameat2 RENAME_EXCHANGE when D exists), so a crash at any
// point leaves the previous D whole.
#pragma once
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

namespace ember::engine {

// Whether `path` is a sharded checkpoint directory.
bool is_sharded_checkpoint(const std::filesystem::path& path);

struct ShardedWrite {
  int64_t rank = 0, world = 1;
  // Collective: the largest value over the ranks (to agree that a step failed somewhere).
  std::function<double(double)> max_over_ranks;
};
// Every rank calls it with its part (and its own callback states, None when there are none); rank 0
// also passes the meta dict. Throws on every rank when any rank failed, naming what failed where it
// is known.
void write_sharded_checkpoint(const std::filesystem::path& dir, const c10::IValue& part, const c10::IValue& meta,
                              const ShardedWrite& how, const c10::IValue& callback_states = c10::IValue());
// The same in three steps, so the parts can be written on a background thread (checkpoint.async):
// prepare (collective: rank 0 makes the partial directory), write_sharded_part (no collective;
// rank 0 also writes `meta`), commit (collective: every rank passes what its part's write threw,
// "" when it succeeded; rank 0 swaps the directory into place; throws on every rank when any
// failed).
void prepare_sharded_checkpoint(const std::filesystem::path& dir, const ShardedWrite& how);
void write_sharded_part(const std::filesystem::path& dir, int64_t rank, const c10::IValue& part, const c10::IValue& meta,
                        const c10::IValue& callback_states = c10::IValue());
void commit_sharded_checkpoint(const std::filesystem::path& dir, const std::string& part_error, const ShardedWrite& how);

c10::impl::GenericDict read_sharded_meta(const std::filesystem::path& dir);
c10::IValue read_sharded_part(const std::filesystem::path& dir, int64_t rank);
// Rank k's part file whole: the strategy's part and the rank's own callback states (None when the
// file holds none).
struct ShardedPartFile {
  c10::IValue part, callback_states;
};
ShardedPartFile read_sharded_part_file(const std::filesystem::path& dir, int64_t rank);

// Deletes a file or a directory tree (LibTorch's wheel breaks std::filesystem::remove_all).
void remove_tree(const std::filesystem::path& path);

}  // namespace ember::engine
