// ember::Fabric's state (engine/include/ember/fabric.h), shared by fabric.cpp (set-up, the step,
// collectives, logging) and fabric_checkpoint.cpp (save/load).
#pragma once
#include <ember/fabric.h>
#include <ember/logger.h>
#include <ember/model.h>
#include <ember/precision.h>
#include <ember/strategy.h>
#include <ember/tensor_parallel.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "registry/composition.h"
#include "runtime/runtime.h"

namespace ember::engine {

// The program's module, seen as the IModel the strategy contract takes. Fabric never runs the
// model's steps: the program does.
class ProgramModule final : public IModel, public ITensorParallelModel {
 public:
  using Plan = std::function<std::vector<TensorShard>(torch::nn::Module&, ITensorParallelGroup&)>;
  ProgramModule(std::shared_ptr<torch::nn::Module> module, Plan plan) : module_(std::move(module)), plan_(std::move(plan)) {}
  torch::nn::Module& module() override { return *module_; }
  // FabricOptions::parallelize, when the program gave one.
  void* query_interface(const char* iid) override {
    if (plan_ && std::string_view(iid) == kTensorParallelModelIid) return static_cast<ITensorParallelModel*>(this);
    return nullptr;
  }
  std::vector<TensorShard> parallelize_tensors(ITensorParallelGroup& group) override { return plan_(*module_, group); }
  at::Tensor training_step(const Batch&, IStepContext&) override { throw not_here("training_step"); }
  void validation_step(const Batch&, IStepContext&) override { throw not_here("validation_step"); }
  void test_step(const Batch&, IStepContext&) override { throw not_here("test_step"); }

 private:
  static RunError not_here(const char* what) {
    return RunError(std::string("ember::Fabric: a plugin called the model's ") + what + ", but under Fabric the program runs its own steps");
  }
  std::shared_ptr<torch::nn::Module> module_;
  Plan plan_;
};

// The ITrainer logger plugins are set up with (ILogger::setup takes one): the run folder, the
// ranks and the configuration. What only a training loop has throws RunError.
std::unique_ptr<ITrainer> make_logger_view(const std::string& run_dir, const std::string& config_toml, int64_t rank,
                                           int64_t world_size, c10::Device device, const int64_t* last_step);

}  // namespace ember::engine

namespace ember {

class __attribute__((visibility("hidden"))) Fabric::Impl {  // not exported from libember.so
 public:
  explicit Impl(FabricOptions options);

  // Ranks started and this process is one of them (false on a launcher, with its exit code).
  bool launch_ranks(int* exit_code);
  // The single-process launch setup() and friends do when the program did not call launch().
  void ensure_launched();
  void require_setup(const char* call) const;
  void finish(const std::string& status);
  // save / save_async (fabric_checkpoint.cpp): launched, and set up when the state holds the
  // model or the optimizer; and what the checkpoint holds besides those, built on rank 0 while
  // the call runs.
  void require_model_for(const FabricState& state, const char* call);
  engine::Runtime::CheckpointMeta checkpoint_meta(const FabricState& state);

  FabricOptions options;
  engine::Plan plan;
  engine::EngineHost host;
  // Declaration order is destruction order reversed: the runtime (its strategy) outlives what it
  // placed. Every call to the strategy and the precision handler goes through it.
  std::unique_ptr<engine::Runtime> runtime;
  std::vector<engine::Named<ILogger>> loggers;
  std::shared_ptr<engine::ProgramModule> model;
  std::vector<engine::Runtime::ForwardRegion> forward_regions;  // autocast() regions open now, innermost last

  bool launched = false, finished = false, failed = false;
  bool sync_gradients = true;  // false inside no_backward_sync()
  bool backward_pending = false;
  at::Tensor last_loss;           // between backward() and optimizer_step()
  Batch single_tensor_batch;      // to_device(tensor)'s, reused

  // Loggers (rank 0), started by the first log().
  bool loggers_started = false;
  std::string log_dir;
  int64_t last_logged_step = 0;
  std::unique_ptr<ITrainer> logger_view;
};

}  // namespace ember
