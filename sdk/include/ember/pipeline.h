// Pipeline parallelism (SDK 2.6): the model cut into stages at its units (ember/model_units.h),
// one stage per rank of the mesh's pipeline dimension (two or more with virtual stages), and a
// batch split into micro-batches that flow through the stages on a schedule (GPipe, 1F1B,
// interleaved 1F1B). The strategy owns the micro-batch window: the engine hands it a whole batch
// and gets the loss back. docs/parallelism.md.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ember/export.h"
#include "ember/model.h"
#include "ember/precision.h"
#include "ember/types.h"

namespace ember {

// Units [begin, end) of a model's units: one pipeline stage.
struct UnitRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// A model that can be cut into pipeline stages (found through query_interface). It declares units
// (IUnitModel); a stage is a run of consecutive units, the first stage also holding what comes
// before the first unit (embeddings), the last what comes after the last (head, loss).
class EMBER_SDK_API IPipelineModel {
 public:
  virtual ~IPipelineModel() = default;
  // Requires: called once, before the optimizer is built and before any tensor-parallel plan;
  // `stages` are this rank's (one, or several with virtual stages), in order, not overlapping.
  // Ensures: module() holds only the parameters and buffers of those stages, under the names
  // they have in the whole model (the rest are removed from module(), and freed).
  virtual void keep_pipeline_stages(const std::vector<UnitRange>& stages) = 0;
  // One micro-batch through one of this rank's stages. `input` is the previous stage's output
  // (undefined for the stage that begins at unit 0). Returns the stage's output (one tensor, of
  // any shape and dtype, which the next stage takes as `input`), or, for
  // the stage that ends at the last unit, the loss as training_step would return it, logging
  // through `ctx` as the model's step of ctx.stage() does (validation and test steps log, and may
  // return an undefined tensor).
  virtual at::Tensor pipeline_forward(const UnitRange& stage, const Batch& micro_batch, const at::Tensor& input, IStepContext& ctx) = 0;
  // Parameters that more than one stage holds after keep_pipeline_stages (a tied embedding the
  // first stage looks tokens up in and the last stage's head multiplies by), by name: the
  // strategy sums their gradients over the stages that hold them before every step, so the copies
  // stay equal, and counts them once in the gradient norm and in checkpoints.
  virtual std::vector<std::string> pipeline_shared_parameters() const { return {}; }
};
inline constexpr const char* kPipelineModelIid = "ember.IPipelineModel/1";

// [parallelism]'s pipeline settings, which the engine hands a strategy that answers
// kPipelineParallelIid (after launch, before setup_module). Crosses the boundary, so it carries its
// size: fields are only appended.
struct PipelineOptions {
  uint32_t struct_size = sizeof(PipelineOptions);
  std::string schedule = "1f1b";  // gpipe, 1f1b or interleaved_1f1b
  int64_t microbatches = 0;       // a batch's micro-batches; 0: as many as there are stages
  int64_t virtual_stages = 1;     // stages per rank (interleaved_1f1b: 2 or more)
  std::vector<int64_t> stage_units;  // units per stage, in order (empty: balanced by parameter count)
  // Where the settings come from ("run.toml:12"), for error lines.
  std::string where_pipeline_parallel, where_schedule, where_microbatches, where_virtual_stages, where_stage_units;
};

// A strategy's answer to query_interface(kPipelineParallelIid) when its mesh has pipeline stages:
// it cuts the model (setup_module), runs a batch's micro-batches through the stages on the
// schedule, and makes the run look like one model: every rank gets the batch loss, and the
// values the last stage's steps log reach every rank's context, so the metrics agree everywhere.
class EMBER_SDK_API IPipelineParallel {
 public:
  virtual ~IPipelineParallel() = default;
  // Before setup_module. Throws ember::ConfigError for settings the mesh cannot run.
  virtual void set_pipeline_options(const PipelineOptions& options) = 0;
  virtual int64_t pipeline_rank() const = 0;
  virtual int64_t pipeline_size() const = 0;
  // One batch of a training window: forward and backward of each micro-batch on the schedule, the
  // loss divided by `loss_divisor` (gradient accumulation) before backward through `precision`,
  // gradients synchronised over the data-parallel ranks when `sync_gradients`. Returns the batch's
  // loss (the micro-batches' mean weighted by their sizes, detached), the same on every rank.
  // Collective over every rank.
  virtual at::Tensor pipeline_train_batch(const Batch& batch, IModel& model, IStepContext& ctx, IPrecision& precision, double loss_divisor,
                                          bool sync_gradients) = 0;
  // One evaluation batch (validation, test, a tuner's forward pass): forward only, logging as
  // above. Returns the batch loss on every rank (undefined when the last stage returned none).
  // Collective over every rank.
  virtual at::Tensor pipeline_evaluate_batch(const Batch& batch, IModel& model, IStepContext& ctx) = 0;
};
inline constexpr const char* kPipelineParallelIid = "ember.IPipelineParallel/1";

}  // namespace ember
