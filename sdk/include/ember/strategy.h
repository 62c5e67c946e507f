// ember::IStrategy: where things live and how gradients meet (Lightning's Strategy). Owns device
// placement, process launch and rank setup, gradient synchronization, the optimizer step
// (sharded or offloaded strategies replace or wrap it), collectives for metrics, and which rank
// writes. Any IPrecision composes with any IStrategy through the calls below.
#pragma once
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

}  // namespace ember
