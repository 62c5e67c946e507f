// What every part of the ZeRO strategy shares (zero_strategy_impl.h ties them together): the plugin's
// options, the communicator, the host copies of offloading, the host-memory budget and the
// counters its closing line reports.
#pragma once
#include <cstdint>
#include <string>

#include <ember/distributed/communicator.h>

#include "host_offload.h"
#include "zero_strategy.h"

namespace ember_shard {

struct ZeroStats {
  int64_t gathers = 0, prefetched = 0, scatters = 0, scatters_early = 0, steps = 0;
  int64_t host_copies = 0, host_copies_early = 0, host_bytes = 0;  // offload: gradient parts to the host
};

// Offload: the host memory this rank took (masters, gradients, staging, optimizer state), checked
// against what the host has (or max_host_bytes) before each new piece.
class HostBudget {
 public:
  explicit HostBudget(const ZeroOptions& o) : o_(o) {}
  // Throws ember::RunError naming `what`, the bytes and the fix when `bytes` more do not fit;
  // otherwise counts them as taken.
  void take(int64_t bytes, const std::string& what);
  int64_t taken() const { return taken_; }

 private:
  const ZeroOptions& o_;
  int64_t taken_ = 0;
};

// The parts' common view of the run. Shards are cut over `group`, the data-parallel ranks: every
// rank of the run, or, with tensor parallelism, the ranks that hold the same slices, or, under
// hybrid sharding, one replica's ranks; `replicas` holds the same shard in the other replicas
// (a group of one without hybrid sharding), over which the reduced gradients are averaged.
struct ZeroContext {
  const ZeroOptions& o;
  ember_dist::Communicator& comm;
  ember_dist::Subgroup& group;
  ember_dist::Subgroup& replicas;
  HostCopies& copies;
  HostBudget& budget;
  ZeroStats& stats;
  int64_t world() const { return group.size; }
  int64_t rank() const { return group.rank; }
  c10d::Backend& backend() const { return *group.backend; }
};

}  // namespace ember_shard
