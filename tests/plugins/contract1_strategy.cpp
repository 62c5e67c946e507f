// Test plugin: a strategy as plugins built against SDK 1.1 wrote them (strategy contract 1:
// IStrategy only, no IModelStateStrategy). Built with SDK minor 1; the engine must keep running
// it through its contract-1 adapter, with the same numbers as single_device on the CPU.
#include <ember/grad_util.h>
#include <ember/plugin.h>
#include <ember/strategy.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

namespace {

class Contract1Strategy final : public ember::IStrategy {
 public:
  bool launch(const ember::LaunchRequest&, int*) override { return true; }
  c10::Device root_device() const override { return c10::Device(c10::kCPU); }
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  int64_t local_rank() const override { return 0; }
  void setup(torch::nn::Module& module, std::shared_ptr<torch::optim::Optimizer>& optimizer) override {
    // Contract 1: called with the engine's optimizer, before the precision handler's setup.
    if (!optimizer) throw std::runtime_error("contract1_strategy: no optimizer in setup");
    module.to(c10::Device(c10::kCPU));
  }
  ember::Batch batch_to_device(ember::Batch batch) override { return batch; }
  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool) override { precision.backward(loss); }
  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override { return precision.optimizer_step(step); }
  void clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm) override {
    ember::clip_gradients_in_place(ember::grads_of(optimizer), max, algorithm);
  }
  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp) override { return value; }
  void barrier(const char*) override {}
  bool broadcast_flag(bool value) override { return value; }
  void teardown() override {}
};

ember::IStrategy* make(ember::IHost&, const ember::IConfig&) { return new Contract1Strategy(); }

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "contract1_strategy", "0.0.1", "Apache-2.0", "Test: a strategy of SDK 1.1 (contract 1).",
             EMBER_NO_CONFIG_KEYS, make)
