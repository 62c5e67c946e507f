// single_device: one process, one device (the CPU or one CUDA GPU). The reference strategy: every
// other strategy must give the same numbers as this one does on one device.
#include <ember/error.h>
#include <ember/plugin.h>
#include <ember/support/replicating_strategy.h>
#include <ember/strategy.h>

#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstring>
#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("device", "\"auto\"",
                       "Device to train on: auto (follows trainer.accelerator: cuda:0 when present, else cpu), cpu, cuda or cuda:N."),
};

class SingleDevice final : public ember::ReplicatingStrategy {
 public:
  SingleDevice(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host), requested_(cfg.get_string("device")), where_(cfg.where("device")) {
    try {
      if (requested_ != "auto") (void)c10::Device(requested_);
    } catch (const std::exception&) {
      throw ember::ConfigError(where_ + ": single_device.device: '" + requested_ +
                               "' is not a device; use auto, cpu, cuda or cuda:N");
    }
  }

  bool launch(const ember::LaunchRequest& request, int* /*exit_code*/) override {
    if (request.devices != 1 || request.num_nodes != 1)
      throw ember::ConfigError("single_device runs one process on one device, but trainer.devices = " +
                               std::to_string(request.devices) + " and trainer.num_nodes = " +
                               std::to_string(request.num_nodes) + " (use a multi-device strategy such as ddp)");
    const bool cuda = torch::cuda::is_available();
    std::string choice = requested_;
    if (choice == "auto") choice = request.accelerator == "cpu" ? "cpu" : (request.accelerator == "cuda" || cuda) ? "cuda:0" : "cpu";
    device_ = c10::Device(choice);
    if (device_.is_cpu() && request.accelerator == "cuda")
      throw ember::ConfigError(where_ + ": single_device.device = cpu conflicts with trainer.accelerator = cuda");
    if (device_.is_cuda()) {
      if (request.accelerator == "cpu")
        throw ember::ConfigError(where_ + ": single_device.device = " + choice + " conflicts with trainer.accelerator = cpu");
      if (!cuda)
        throw ember::RunError("single_device: " + choice + " was asked for but no CUDA device is visible "
                              "(check the driver and CUDA_VISIBLE_DEVICES, or set trainer.accelerator = \"cpu\")");
      const auto index = device_.has_index() ? device_.index() : 0;
      if (index >= static_cast<int>(torch::cuda::device_count()))
        throw ember::RunError("single_device: " + choice + " does not exist; " + std::to_string(torch::cuda::device_count()) +
                              " CUDA device(s) are visible");
      device_ = c10::Device(c10::kCUDA, index);
    }
    host_.log(ember::LogLevel::info, "single_device: training on " + device_.str());
    return true;
  }

  // One process, no gradient hooks, no collectives: a step can be captured as a CUDA graph, and
  // the module holds the whole model where it trains (asynchronous saves copy it from there).
  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kCapturableStepIid) == 0) return this;
    if (std::strcmp(iid, ember::kDeviceModelStateIid) == 0) return static_cast<ember::IDeviceModelState*>(this);
    return ReplicatingStrategy::query_interface(iid);
  }

  c10::Device root_device() const override { return device_; }
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  int64_t local_rank() const override { return 0; }

  void place_module(torch::nn::Module& module) override { module.to(device_); }

  ember::Batch batch_to_device(ember::Batch batch) override {
    if (device_.is_cpu()) return batch;
    for (auto& t : batch.tensors)
      if (t.defined()) t = t.to(device_, /*non_blocking=*/t.is_pinned());
    return batch;
  }

  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool /*sync_gradients*/) override {
    precision.backward(loss);
  }

  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override {
    return precision.optimizer_step(step);
  }

  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp /*op*/) override { return value; }
  void barrier(const char* /*name*/) override {}
  bool broadcast_flag(bool value) override { return value; }
  void teardown() override {}

 private:
  ember::IHost& host_;
  std::string requested_, where_;
  c10::Device device_{c10::kCPU};
};

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) { return new SingleDevice(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "single_device", "0.1.0", "Apache-2.0",
             "One process on one device: the CPU or a single CUDA GPU.", EMBER_CONFIG_KEYS(kKeys), make)
