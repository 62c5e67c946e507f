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

// What the engine hands a strategy when it asks it to launch processes.
struct LaunchRequest {
  std::vector<std::string> argv;  // the engine's own command line (argv[0] is its path)
  int64_t devices = 1;            // trainer.devices
  int64_t num_nodes = 1;          // trainer.num_nodes
  std::string accelerator = "auto";  // trainer.accelerator: auto, cpu or cuda
};

class EMBER_SDK_API IStrategy : public IPluginObject {
 public:
  // First call, before data or model exist. A multi-process strategy may start workers here.
  // Returns true when this process should go on training; false when it only launched others,
  // in which case *exit_code is what the engine exits with.
  virtual bool launch(const LaunchRequest& request, int* exit_code) = 0;

  virtual c10::Device root_device() const = 0;
  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  virtual int64_t local_rank() const = 0;
  bool is_global_zero() const { return rank() == 0; }

  // Moves the module to its device(s) and sets up synchronization. May replace `optimizer` (for
  // sharded optimizer state); it is called after the optimizer was built, and before precision
  // setup.
  virtual void setup(torch::nn::Module& module, std::shared_ptr<torch::optim::Optimizer>& optimizer) = 0;
  virtual Batch batch_to_device(Batch batch) = 0;

  // Backward of one micro-batch. `sync_gradients` is false while gradients are being accumulated
  // (no communication then), true on the micro-batch that completes an optimizer step.
  virtual void backward(const at::Tensor& loss, IPrecision& precision, bool sync_gradients) = 0;
  // One optimizer step; normally `return precision.optimizer_step(step)`, with the strategy's
  // own part around it. Returns false when the step was skipped.
  virtual bool optimizer_step(IOptimizerStep& step, IPrecision& precision) = 0;
  // Clips gradients in place, without a device-to-host sync. Strategies that shard parameters
  // compute the norm across ranks.
  virtual void clip_gradients(torch::optim::Optimizer& optimizer, double max, ClipAlgorithm algorithm) = 0;

  // Collectives for metrics and control (`sync_dist`, stop requests). Identity on one process.
  virtual at::Tensor reduce(const at::Tensor& value, ReduceOp op) = 0;
  virtual void barrier(const char* name) = 0;
  // Rank 0's value of a flag (used so every rank stops at the same step).
  virtual bool broadcast_flag(bool value) = 0;

  // Called at the end of the run, success or not.
  virtual void teardown() = 0;
};

// Extension interface (IStrategy::query_interface(kGradientNormClipIid)): clipping by norm that
// also returns the total 2-norm of the gradients before clipping (what torch's clip_grad_norm_
// and Lightning's fabric.clip_gradients return), as a device tensor (no host sync). A strategy
// whose gradients are split across ranks implements it (the norm covers all ranks); for the
// others the caller takes the norm of the optimizer's gradients, which every rank holds whole.
// Additive in SDK 1.2 (docs/abi.md).
inline constexpr const char* kGradientNormClipIid = "ember.IGradientNormClip/1";
class EMBER_SDK_API IGradientNormClip {
 public:
  virtual ~IGradientNormClip() = default;
  virtual at::Tensor clip_gradients_norm(torch::optim::Optimizer& optimizer, double max_norm) = 0;
};

// Extension interface (IStrategy::query_interface(kTensorBroadcastIid)) of a multi-process
// strategy: torch.distributed.broadcast through its communicator (Lightning's fabric.broadcast).
// Collective. Returns rank `src`'s tensor (its dtype, shape and values) on every rank; the other
// ranks' `value` only says on which device they want it (undefined: the strategy's device). Any
// dense (strided, non-quantized) tensor; otherwise every rank throws the same RunError.
// Additive in SDK 1.2 (docs/abi.md).
inline constexpr const char* kTensorBroadcastIid = "ember.ITensorBroadcast/1";
class EMBER_SDK_API ITensorBroadcast {
 public:
  virtual ~ITensorBroadcast() = default;
  virtual at::Tensor broadcast(const at::Tensor& value, int64_t src) = 0;
};

// Capability (SDK 1.3): IStrategy::query_interface(kCapturableStepIid) != nullptr says that this
// strategy's backward and optimizer step, on the process count it runs with, do no host work and
// no collective between forward and the optimizer step (no gradient hooks that leave the device,
// no communication), so the engine may capture forward, loss and backward of a step as one CUDA
// graph and replay it (trainer.cuda_graph, docs/step.md). The engine never asks for a strategy
// by name; a strategy without this answer is refused for trainer.cuda_graph in one line. The
// pointer it returns is never dereferenced (return `this`).
inline constexpr const char* kCapturableStepIid = "ember.capability.CapturableStep/1";

// ---------------------------------------------------------------------------------------------
// SDK 1.2: strategy contract 2, "the strategy owns the model's state" (docs/strategy.md).
//
// A strategy whose IPluginObject::query_interface(kModelStateStrategyIid) returns this interface
// owns parameter storage, the optimizer and the model/optimizer state, the way Lightning's
// Strategy does for FSDP and DeepSpeed. The engine then sets a run up in this order:
//
//   strategy.launch(...)                         (processes, ranks, root_device)
//   precision.setup(module, root_device)         converts the module (dtypes), before any wrap
//   state.setup_module(model)                    places, wraps or shards it
//   optimizer = state.setup_optimizer(factory)   built by the strategy over what it trains
//
// and never touches parameters, gradients or optimizer state itself afterwards: zero_grad, the
// forward region, checkpoints and weight averaging all go through the calls below. A strategy
// without this interface (SDK 1.0/1.1) keeps its old contract: the engine builds the optimizer
// over the module's parameters, calls IStrategy::setup, then precision.setup, and reads state
// from the module directly.
inline constexpr const char* kModelStateStrategyIid = "ember.IModelStateStrategy/1";

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

class EMBER_SDK_API IModelStateStrategy {
 public:
  virtual ~IModelStateStrategy() = default;

  // Places, wraps or shards model.module() (already converted by the precision handler).
  // A model may declare units (ember/model_units.h); a strategy that acts around them installs
  // its hooks here. Collective (e.g. rank 0's initial weights are broadcast).
  virtual void setup_module(IModel& model) = 0;
  // Builds the optimizer through `factory` over the tensors this rank trains (full parameters,
  // or shards) and keeps it. Returns it for the engine, schedulers and precision handlers.
  virtual std::shared_ptr<torch::optim::Optimizer> setup_optimizer(IOptimizerFactory& factory) = 0;

  // Around every forward of the whole model (training step, evaluation step, tuners' passes):
  // e.g. gathers the parameters that belong to no unit. `grad_enabled` tells whether a backward
  // of this forward follows. Always called in pairs; forward_end also runs when the step threw.
  virtual void forward_begin(bool grad_enabled) = 0;
  virtual void forward_end() = 0;
  // Drops the gradients of everything this rank trains (set to none).
  virtual void zero_grad() = 0;

  // What the optimizer trains, one entry per module parameter in named_parameters() order:
  // the parameters themselves, or this rank's 1-D shard of each (possibly empty).
  virtual std::vector<NamedTensor> trained_parameters() = 0;
  // Brings the module's parameters up to date after trained_parameters() changed in place.
  // Collective.
  virtual void parameters_changed() = 0;

  // Full state (world-size independent; what single_device saves and loads). Collective: every
  // rank calls these at the same point. Ensures: on rank 0 (on every rank when rank0_only is
  // false) the result holds every parameter and buffer of the module under its own name, whole,
  // as a CPU tensor; other ranks get an empty dict and build nothing.
  virtual c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only) = 0;
  // Every rank passes the same full dict. Throws ember::RunError naming the first tensor that is
  // missing or has another shape.
  virtual void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) = 0;
  // The optimizer state as torch::save writes it for an optimizer over the full parameters (so a
  // checkpoint resumes under any strategy and world size); "" off rank 0 when rank0_only.
  virtual std::string full_optimizer_state(bool rank0_only) = 0;
  virtual void load_full_optimizer_state(const std::string& bytes) = 0;
};

// SDK 1.2: a strategy that can save and restore checkpoints as one part per rank (a sharded
// checkpoint directory: docs/checkpoint.md), found through query_interface(kShardedCheckpointIid)
// next to IModelStateStrategy. The engine writes every rank's part into a temporary directory,
// the run's own state (loops, RNG, plugins) next to them, and commits the directory atomically.
inline constexpr const char* kShardedCheckpointIid = "ember.IShardedCheckpoint/1";
class EMBER_SDK_API IShardedCheckpoint {
 public:
  virtual ~IShardedCheckpoint() = default;
  // Whether this run's checkpoints are sharded directories (the strategy's setting).
  virtual bool sharded_checkpoints() const = 0;
  // This rank's part of the model and optimizer state, with what re-sharding needs (names,
  // shapes, dtypes, offsets, the world size). Every rank calls it at the same point.
  virtual c10::IValue sharded_state() = 0;
  // Restores from the parts of all `saved_world` ranks of the saving run, whatever its world size
  // was; `read_part(k)` returns saved rank k's part (the strategy reads only the parts it needs,
  // one at a time). Throws ember::RunError naming the first tensor that does not fit the model.
  virtual void load_sharded_state(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part) = 0;
};

}  // namespace ember
