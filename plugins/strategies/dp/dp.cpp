// dp: single-process data parallel on CUDA GPUs (Lightning's "dp"). Needs CUDA; on a machine
// without it, start-up stops with one line that points to ddp.
//
// Scope today: one GPU. Splitting a batch over several GPUs needs the model's forward to run on
// module replicas (torch::nn::parallel::replicate + parallel_apply), but in the SDK's step
// contract the loop calls IModel::training_step itself, on the model's own module; a strategy
// has no call in which to run replicas. Until the SDK grows that hook, more than one device is a
// clear start-up error that suggests ddp (which is faster than dp in any case).
#include <ember/error.h>
#include <ember/grad_util.h>
#include <ember/plugin.h>
#include <ember/strategy.h>

#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::IntList("devices", "[]", "CUDA device indices to use; [] = the first trainer.devices GPUs.").at_least(0),
};

class Dp final : public ember::IStrategy {
 public:
  Dp(ember::IHost& host, const ember::IConfig& cfg) : host_(host), devices_(cfg.get_int_list("devices")), where_(cfg.where("devices")) {}

  bool launch(const ember::LaunchRequest& request, int* /*exit_code*/) override {
    if (!torch::cuda::is_available())
      throw ember::RunError("dp needs CUDA GPUs and none is visible; on CPUs use ddp instead: engine --plugins ddp --set trainer.devices=N run.toml");
    if (request.accelerator == "cpu")
      throw ember::ConfigError("dp runs on CUDA GPUs but trainer.accelerator = cpu; use ddp for CPU ranks");
    if (request.num_nodes != 1)
      throw ember::ConfigError("dp is a single-process strategy but trainer.num_nodes = " + std::to_string(request.num_nodes) + "; use ddp across machines");
    const auto count = static_cast<int64_t>(torch::cuda::device_count());
    if (devices_.empty())
      for (int64_t i = 0; i < request.devices; ++i) devices_.push_back(i);
    for (auto d : devices_)
      if (d >= count)
        throw ember::ConfigError(where_ + ": dp.devices names cuda:" + std::to_string(d) + " but " + std::to_string(count) + " CUDA device(s) are visible");
    if (devices_.size() != 1)
      throw ember::ConfigError("dp: " + std::to_string(devices_.size()) +
                               " GPUs asked for, but this dp runs on one GPU only (the model's step cannot run on replicas yet); "
                               "use ddp for several GPUs: engine --plugins ddp --set trainer.devices=" + std::to_string(devices_.size()) + " run.toml");
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(devices_.front()));
    host_.log(ember::LogLevel::info, "dp: training on " + device_.str());
    return true;
  }

  c10::Device root_device() const override { return device_; }
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  int64_t local_rank() const override { return 0; }

  void setup(torch::nn::Module& module, std::shared_ptr<torch::optim::Optimizer>& /*optimizer*/) override { module.to(device_); }

  ember::Batch batch_to_device(ember::Batch batch) override {
    for (auto& t : batch.tensors)
      if (t.defined()) t = t.to(device_, /*non_blocking=*/t.is_pinned());
    return batch;
  }

  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool /*sync_gradients*/) override { precision.backward(loss); }
  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override { return precision.optimizer_step(step); }
  void clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm) override {
    ember::clip_gradients_in_place(ember::grads_of(optimizer), max, algorithm);
  }
  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp /*op*/) override { return value; }
  void barrier(const char* /*name*/) override {}
  bool broadcast_flag(bool value) override { return value; }
  void teardown() override {}

 private:
  ember::IHost& host_;
  std::vector<int64_t> devices_;
  std::string where_;
  c10::Device device_{c10::kCUDA, 0};
};

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) { return new Dp(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "dp", "0.1.0", "Apache-2.0",
             "Single-process data parallel on a CUDA GPU; without CUDA it stops and suggests ddp.", EMBER_CONFIG_KEYS(kKeys), make)
