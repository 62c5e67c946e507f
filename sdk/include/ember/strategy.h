// ember::IStrategy: where things live and how gradients meet (Lightning's Strategy). Owns device
// placement, process launch and rank setup, gradient synchronization, the optimizer step
// (sharded or offloaded strategies replace or wrap it), collectives for metrics, and which rank
// writes. Any IPrecision composes with any IStrategy through the calls below.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "ember/precision.h"
#include "ember/trainer.h"
#include "ember/types.h"

namespace torch::nn { class Module; }
namespace torch::optim { class Optimizer; }

namespace ember {

// What the engine hands a strategy when it asks it to launch processes. Crosses the boundary, so
// it carries its size: fields are only appended, and a strategy reads a field only when
// `struct_size` covers it (ember::has_field, ember/types.h).
struct LaunchRequest {
  uint32_t struct_size = sizeof(LaunchRequest);
  std::vector<std::string> argv;  // the engine's own command line (argv[0] is its path)
  int64_t devices = 1;            // trainer.devices
  int64_t num_nodes = 1;          // trainer.num_nodes
  std::string accelerator = "auto";  // trainer.accelerator: auto, cpu or cuda
  // SDK 2.5: the device mesh of the [parallelism] table (ember/tensor_parallel.h), checked by
  // the engine: the product of the four is devices x num_nodes. Ranks are laid out with
  // tensor_parallel innermost (consecutive ranks), then data_parallel_shard, then
  // data_parallel_replicate. A strategy that does not answer kDeviceMeshIid only ever gets
  // tensor_parallel = pipeline_parallel = 1.
  int64_t data_parallel_replicate = 1;
  int64_t data_parallel_shard = 1;
  int64_t tensor_parallel = 1;
  int64_t pipeline_parallel = 1;
  bool sequence_parallel = false;  // activations outside the split layers split by sequence
  // SDK 2.6: trainer.max_restarts. A strategy that starts its own ranks (trainer.devices = N on one
  // node) starts the whole group again, up to this many times, when a rank fails; each attempt's
  // ranks see EMBER_RESTART_COUNT = the attempt and resume from the last checkpoint by themselves.
  int64_t max_restarts = 0;
};

// Implemented by the engine: builds the run's optimizer ([optimizer] table, or the model's
// configure_optimizers with its parameter groups and options kept) over tensors that stand for
// the module's parameters of the same names. Requires: every name is a module parameter, given
// once; the parameters a model's own optimizer uses are all among them. Ensures: the optimizer's
// param groups hold exactly the given tensors, and it has no state yet.
class EMBER_SDK_API IOptimizerFactory {
 public:
  virtual ~IOptimizerFactory() = default;
  virtual std::shared_ptr<torch::optim::Optimizer> build(const std::vector<NamedTensor>& params) = 0;
};

class IModel;

// SDK 2.0: the one strategy contract. The strategy owns the processes, where the model lives,
// its parameters, gradients and optimizer state, and the collectives; the engine's runtime
// (docs/engine.md) is its only caller and sets a run up in this order:
//
//   strategy.launch(request, &code)              processes, ranks, root_device
//   precision.setup(module, root_device)         converts the module (dtypes), before any wrap
//   strategy.setup_module(model)                 places, wraps or shards it
//   optimizer = strategy.setup_optimizer(factory) built over what this rank trains
//
// after which the engine never touches parameters, gradients or optimizer state itself: zero_grad,
// the forward region, clipping, checkpoints and weight averaging all go through the calls below.
// Most strategies derive from a base of <ember/support/replicating_strategy.h>, which implements
// the model-state half for strategies whose every rank holds the whole model; docs/strategy.md.
class EMBER_SDK_API IStrategy : public IPluginObject {
 public:
  // ---- processes
  // First call, before data or model exist. A multi-process strategy may start workers here.
  // Returns true when this process should go on training; false when it only launched others,
  // in which case *exit_code is what the engine exits with.
  virtual bool launch(const LaunchRequest& request, int* exit_code) = 0;
  // Requires launch() returned true. Ensures: the same values for the whole run.
  virtual c10::Device root_device() const = 0;
  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  virtual int64_t local_rank() const = 0;
  bool is_global_zero() const { return rank() == 0; }

  // ---- the model's state
  // Places, wraps or shards model.module() (already converted by the precision handler). A model
  // may declare units (ember/model_units.h); a strategy that acts around them installs its hooks
  // here. Collective (e.g. rank 0's initial weights are broadcast).
  virtual void setup_module(IModel& model) = 0;
  // Builds the optimizer through `factory` over the tensors this rank trains (full parameters, or
  // shards) and keeps it. Ensures: not null; returned for the engine, schedulers and precisions.
  virtual std::shared_ptr<torch::optim::Optimizer> setup_optimizer(IOptimizerFactory& factory) = 0;
  // Around every forward of the whole model (training step, evaluation step, tuners' passes):
  // e.g. gathers the parameters that belong to no unit. `grad_enabled` tells whether a backward
  // of this forward follows. Always called in pairs; forward_end also runs when the step threw.
  virtual void forward_begin(bool grad_enabled) = 0;
  virtual void forward_end() = 0;
  // Drops the gradients of everything this rank trains (set to none).
  virtual void zero_grad() = 0;
  // What the optimizer trains, one entry per module parameter in named_parameters() order: the
  // parameters themselves, or this rank's 1-D shard of each (possibly empty).
  virtual std::vector<NamedTensor> trained_parameters() = 0;
  // Brings the module's parameters up to date after trained_parameters() changed in place.
  // Collective.
  virtual void parameters_changed() = 0;
  // Full state (world-size independent; what single_device saves and loads). Collective: every
  // rank calls these at the same point. Ensures: on rank 0 (on every rank when rank0_only is
  // false) the result holds every parameter and buffer of the module under its own name, whole,
  // as a CPU tensor; other ranks get an empty dict and build nothing.
  virtual c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only) = 0;
  // Requires: every rank passes the same full dict. Throws ember::RunError naming the first
  // tensor that is missing or has another shape.
  virtual void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) = 0;
  // The optimizer state as torch::save writes it for an optimizer over the full parameters (so a
  // checkpoint resumes under any strategy and world size); "" off rank 0 when rank0_only.
  virtual std::string full_optimizer_state(bool rank0_only) = 0;
  virtual void load_full_optimizer_state(const std::string& bytes) = 0;

  // ---- sharded checkpoints (docs/checkpoint.md): one part per rank, nothing gathered
  // A strategy that answers query_interface(kShardedCheckpointsIid) implements the three calls;
  // the engine makes none of them on one that does not. Whether this run writes its checkpoints
  // as sharded directories (the strategy's setting); it reads them either way.
  virtual bool sharded_checkpoints() const = 0;
  // This rank's part of the model and optimizer state, with what re-sharding needs (names,
  // shapes, dtypes, offsets, the world size). Collective.
  virtual c10::IValue sharded_state() = 0;
  // Restores from the parts of all `saved_world` ranks of the saving run, whatever its world size
  // was; `read_part(k)` returns saved rank k's part (read only the parts needed, one at a time).
  // Throws ember::RunError naming the first tensor that does not fit the model. A strategy that
  // cannot read sharded directories throws ember::RunError saying so.
  virtual void load_sharded_state(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part) = 0;

  // ---- the step
  virtual Batch batch_to_device(Batch batch) = 0;
  // Backward of one micro-batch. `sync_gradients` is false while gradients are being accumulated
  // (no communication then), true on the micro-batch that completes an optimizer step.
  virtual void backward(const at::Tensor& loss, IPrecision& precision, bool sync_gradients) = 0;
  // One optimizer step; normally `return precision.optimizer_step(step)`, with the strategy's
  // own part around it. Requires: step.closure() is called exactly once. Returns false when the
  // step was skipped.
  virtual bool optimizer_step(IOptimizerStep& step, IPrecision& precision) = 0;
  // Clips the gradients the optimizer will use, in place, without a device-to-host sync; the
  // gradients are unscaled. For ClipAlgorithm::norm returns the total 2-norm before clipping as a
  // device tensor, over every rank's share when gradients are split across ranks (what torch's
  // clip_grad_norm_ returns); an undefined tensor for ClipAlgorithm::value.
  virtual at::Tensor clip_gradients(torch::optim::Optimizer& optimizer, double max, ClipAlgorithm algorithm) = 0;

  // ---- collectives for metrics and control (identity on one process)
  virtual at::Tensor reduce(const at::Tensor& value, ReduceOp op) = 0;
  virtual void barrier(const char* name) = 0;
  // Rank 0's value of a flag (used so every rank stops at the same step).
  virtual bool broadcast_flag(bool value) = 0;
  // torch.distributed.broadcast (Lightning's fabric.broadcast). Collective. Returns rank `src`'s
  // tensor (its dtype, shape and values) on every rank; the other ranks' `value` only says on
  // which device they want it (undefined: the strategy's device). Any dense (strided,
  // non-quantized) tensor; otherwise every rank throws the same RunError.
  virtual at::Tensor broadcast(const at::Tensor& value, int64_t src) = 0;

  // Called at the end of the run, success or not.
  virtual void teardown() = 0;
};

// Capability: IStrategy::query_interface(kShardedCheckpointsIid) != nullptr says that this
// strategy saves and restores its state as one part per rank (sharded_state, load_sharded_state)
// and so reads sharded checkpoint directories of any world size. The pointer it returns is never
// dereferenced (return `this`).
inline constexpr const char* kShardedCheckpointsIid = "ember.capability.ShardedCheckpoints/1";

// Optional interface (IStrategy::query_interface(kDeviceModelStateIid), since SDK 2.14): a
// strategy whose rank 0 holds every parameter and buffer of the model whole in its module (no
// shards, no tensor- or pipeline-parallel parts: single_device, ddp without a mesh) hands them over
// where they live. An asynchronous save then copies each tensor once, from the GPU straight into
// pinned host memory (on the CPU: one clone), instead of taking full_model_state's host copy and
// copying that again for the writer thread. No collective: the engine calls it on rank 0 only, in
// place of full_model_state(rank0_only = true), which then must need no collective either.
class EMBER_SDK_API IDeviceModelState {
 public:
  // Every parameter and buffer under its name (as full_model_state names them), detached, on its
  // device, in its dtype. They alias the live model: the caller copies them before training goes on.
  virtual c10::Dict<std::string, at::Tensor> device_model_state() = 0;

 protected:
  ~IDeviceModelState() = default;
};
inline constexpr const char* kDeviceModelStateIid = "ember.IDeviceModelState/1";

// Optional interface (IStrategy::query_interface(kShardedModelStateIid), since SDK 2.23): a strategy
// that reads sharded checkpoint directories restores the model's parameters and buffers alone from
// one, leaving its optimizer as it is. `[model] init_checkpoint` of a sharded directory: a
// pretraining run's weights under this run's fresh optimizer (of any kind and settings), each rank
// reading only the parts it needs, with the whole model gathered nowhere.
class EMBER_SDK_API IShardedModelState {
 public:
  // IStrategy::load_sharded_state's restore without the optimizer: the parts' optimizer state is
  // not read. Collective. Throws ember::RunError naming the first tensor that does not fit the
  // model.
  virtual void load_sharded_model_state(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part) = 0;

 protected:
  ~IShardedModelState() = default;
};
inline constexpr const char* kShardedModelStateIid = "ember.IShardedModelState/1";

// Where a tensor of the model takes its value from in IShardedModelStateSelective.
enum class InitialTensor : int32_t {
  from_checkpoint = 0,          // the parts hold it with the model's shape, else the load fails
  own = 1,                      // not read or checked: it keeps its value ([model] init_exclude)
  from_checkpoint_if_saved = 2, // read where the parts hold it, else it keeps its value (what a
                                // plugin added to the model, LoRA's adapters: absent from a
                                // pretraining run's checkpoint, present in a LoRA run's)
};

// Optional interface (IStrategy::query_interface(kShardedModelStateSelectiveIid), since SDK 2.24):
// IShardedModelState's restore with each tensor's source chosen. `[model] init_checkpoint` of a
// sharded directory with `init_exclude` (a new head for other classes keeps this run's initial
// values) or with a plugin that added tensors (LoRA's adapters, which a pretraining run never had).
class EMBER_SDK_API IShardedModelStateSelective {
 public:
  // load_sharded_model_state, with `pick(name)` (a parameter's or buffer's name as
  // full_model_state names it) saying where each tensor's value comes from. Collective; every rank
  // passes the same choice. Throws ember::RunError naming the first tensor that does not fit the
  // model or that the parts lack where it must come from them.
  virtual void load_sharded_model_state_selective(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part,
                                                  const std::function<InitialTensor(const std::string&)>& pick) = 0;

 protected:
  ~IShardedModelStateSelective() = default;
};
inline constexpr const char* kShardedModelStateSelectiveIid = "ember.IShardedModelStateSelective/1";

// Capability: IStrategy::query_interface(kCapturableStepIid) != nullptr says that this
// strategy's backward and optimizer step, on the process count it runs with, do no host work and
// no collective between forward and the optimizer step (no gradient hooks that leave the device,
// no communication), so the engine may capture forward, loss and backward of a step as one CUDA
// graph and replay it (trainer.cuda_graph, docs/step.md). The engine never asks for a strategy
// by name; a strategy without this answer is refused for trainer.cuda_graph in one line. The
// pointer it returns is never dereferenced (return `this`).
inline constexpr const char* kCapturableStepIid = "ember.capability.CapturableStep/1";

}  // namespace ember
