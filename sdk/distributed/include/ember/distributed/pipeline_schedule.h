// Pipeline schedules (ember/pipeline.h): which forward and backward each rank runs, in which
// order, for a batch of m micro-batches on p ranks holding v stages each (stage c * p + r on rank
// r, Megatron's interleaved layout). Pure functions, so the orders are tested without processes.
//   gpipe             every forward, then every backward (GPipe): m micro-batches' activations alive
//   1f1b              p - r - 1 forwards to fill the pipe, then one forward one backward (PipeDream-
//                     Flush, Megatron's default): at most p micro-batches' activations alive
//   interleaved_1f1b  1f1b over v stages per rank (Megatron-LM's interleaved schedule, m divisible
//                     by p): the bubble shrinks v-fold for v-fold more messages
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ember_dist {

enum class PipelineScheduleKind { gpipe, one_f_one_b, interleaved_1f1b };

struct PipelineAction {
  bool backward = false;
  int64_t microbatch = 0;
  int64_t stage = 0;  // the global stage (c * p + r)
};

// The schedule's name as [parallelism] writes it, and back (false for an unknown name).
const char* schedule_name(PipelineScheduleKind kind);
bool parse_schedule(const std::string& name, PipelineScheduleKind* kind);

// Requires: ranks >= 1, microbatches >= 1, virtual_stages >= 1 (1 unless interleaved), and for
// interleaved_1f1b microbatches % ranks == 0. Returns, per rank, its actions in order: each of its
// stages' forward and backward of every micro-batch exactly once.
std::vector<std::vector<PipelineAction>> pipeline_schedule(PipelineScheduleKind kind, int64_t ranks, int64_t microbatches,
                                                           int64_t virtual_stages);

// What running `schedule` takes when a stage's forward costs `forward` and its backward
// `backward` time units (communication free), with sends never waiting (they are buffered) and
// receives waiting for their message. `deadlock` is set when some rank waits forever;
// `bubble` = 1 - busy / (ranks x makespan).
struct PipelineSimulation {
  bool deadlock = false;
  double makespan = 0;
  double bubble = 0;
  int64_t peak_alive = 0;  // the most micro-batches whose activations one rank holds at once
};
PipelineSimulation simulate_pipeline(const std::vector<std::vector<PipelineAction>>& schedule, int64_t microbatches, int64_t virtual_stages,
                                     double forward = 1.0, double backward = 2.0);

// The schedule's bubble in theory: (p - 1) / (m + p - 1) for gpipe and 1f1b (forward and backward
// alike), (p - 1) / (v m + p - 1) interleaved.
double theoretical_bubble(PipelineScheduleKind kind, int64_t ranks, int64_t microbatches, int64_t virtual_stages);

// Cuts `unit_weights` (one per unit, e.g. its parameter count) into `stages` runs of consecutive
// units, each non-empty, minimising the heaviest run. Requires 1 <= stages <= unit_weights.size().
// Returns the units per stage.
std::vector<int64_t> balance_stages(const std::vector<int64_t>& unit_weights, int64_t stages);

}  // namespace ember_dist
