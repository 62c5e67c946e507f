// dp: single-process data parallel on CUDA GPUs (Lightning's "dp"). Needs CUDA; on a machine
// without it, start-up stops with one line that points to ddp.
//
// The module lives on devices[0]; each batch goes to devices[0] whole. With several devices the
// model splits its forward (SDK 1.1 IDataParallelModel, which the engine's loop cannot do for it,
// since it calls IModel::training_step on the model's own module): replicate the module onto
// the devices, scatter the batch along dim 0, run the replicas in parallel, gather the outputs on
// devices[0], where the model computes loss and metrics as usual. Replica parameters carry
// gradient edges back to the original parameters, so backward leaves the summed gradient on
// devices[0] and clipping and the optimizer step stay single-device operations.
#include <ember/error.h>
#include <ember/grad_util.h>
#include <ember/model.h>
#include <ember/plugin.h>
#include <ember/replicated_state.h>
#include <ember/strategy.h>
#include <ember/trainer.h>

#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::IntList("devices", "[]", "CUDA device indices to split each batch over (the first one holds the module and gathers the outputs); [] = the first trainer.devices GPUs.").at_least(0),
};

class Dp final : public ember::ReplicatingStrategy, public ember::ITrainerAware {
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
    if (devices_.empty())
      throw ember::ConfigError(where_ + ": dp needs at least one GPU: set trainer.devices >= 1 or list dp.devices");
    for (size_t i = 0; i < devices_.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (devices_[i] == devices_[j])
          throw ember::ConfigError(where_ + ": dp.devices names cuda:" + std::to_string(devices_[i]) + " twice; list each GPU once");
    std::string names;
    for (auto d : devices_) {
      gpus_.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(d));
      names += (names.empty() ? "" : ", ") + gpus_.back().str();
    }
    device_ = gpus_.front();
    host_.log(ember::LogLevel::info, "dp: training on " + names + (gpus_.size() > 1 ? " (batches split along dim 0, gathered on " + device_.str() + ")" : ""));
    return true;
  }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kTrainerAwareIid) == 0) return static_cast<ember::ITrainerAware*>(this);
    return ReplicatingStrategy::query_interface(iid);
  }

  // Called after setup, when the model is known: hands it the devices to split its forward over.
  void attach_trainer(ember::ITrainer* trainer) override {
    if (trainer == nullptr || gpus_.size() < 2) return;
    auto* model = static_cast<ember::IDataParallelModel*>(trainer->model().query_interface(ember::kDataParallelModelIid));
    if (model == nullptr)
      throw ember::ConfigError("dp: model '" + model_name(trainer->resolved_config()) + "' cannot split its forward over " +
                               std::to_string(gpus_.size()) + " GPUs (it does not implement ember::IDataParallelModel, SDK 1.1); "
                               "use ddp instead: engine --plugins ddp --set trainer.devices=" + std::to_string(gpus_.size()) +
                               " run.toml, or dp on one GPU");
    model->set_data_parallel(gpus_);
  }

  c10::Device root_device() const override { return device_; }
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  int64_t local_rank() const override { return 0; }

  void place_module(torch::nn::Module& module) override { module.to(device_); }

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
  // The [model] table's name in the resolved TOML, for the error above (plugins see only their
  // own section through IConfig).
  static std::string model_name(const std::string& toml) {
    auto table = toml.find("\n[model]");
    if (table == std::string::npos) return "?";
    auto end = toml.find("\n[", table + 1);
    auto key = toml.find("\nname = \"", table);
    if (key == std::string::npos || (end != std::string::npos && key > end)) return "?";
    key += 9;
    auto quote = toml.find('"', key);
    return quote == std::string::npos ? "?" : toml.substr(key, quote - key);
  }

  std::string where_;
  std::vector<c10::Device> gpus_;
  c10::Device device_{c10::kCUDA, 0};
};

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) { return new Dp(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "dp", "0.1.0", "Apache-2.0",
             "Single-process data parallel over one or more CUDA GPUs (module replicas); without CUDA it stops and suggests ddp.", EMBER_CONFIG_KEYS(kKeys), make)
