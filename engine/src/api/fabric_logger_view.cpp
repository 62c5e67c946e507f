// The ITrainer that logger plugins see under ember::Fabric (ILogger::setup takes one): what a
// logger reads (run folder, ranks, configuration, the step) is there; what only the engine's
// training loop has throws RunError naming the call, and it offers no trainer services.
#include <ember/error.h>
#include <ember/trainer.h>

#include "api/fabric_impl.h"

namespace ember::engine {
namespace {

class LoggerView final : public ITrainer {
 public:
  LoggerView(std::string run_dir, std::string config, int64_t rank, int64_t world, c10::Device device, const int64_t* step)
      : run_dir_(std::move(run_dir)), config_(std::move(config)), rank_(rank), world_(world), device_(device), step_(step) {}

  Stage stage() const override { return Stage::fit; }
  int64_t current_epoch() const override { return 0; }
  int64_t global_step() const override { return *step_; }
  int64_t batch_idx() const override { return 0; }
  int64_t max_epochs() const override { return -1; }
  int64_t max_steps() const override { return -1; }
  int64_t num_training_batches() const override { return 0; }
  bool sanity_checking() const override { return false; }
  bool metric(std::string_view, double*) const override { return false; }
  std::vector<std::string> metric_names() const override { return {}; }
  void request_stop(std::string_view) override { throw missing("request_stop"); }
  bool stop_requested() const override { return false; }
  torch::nn::Module& module() override { throw missing("module"); }
  IModel& model() override { throw missing("model"); }
  torch::optim::Optimizer& optimizer() override { throw missing("optimizer"); }
  const Batch& current_batch() const override { throw missing("current_batch"); }
  at::Tensor current_loss() const override { throw missing("current_loss"); }
  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_; }
  bool is_global_zero() const override { return rank_ == 0; }
  std::string run_dir() const override { return run_dir_; }
  std::string resolved_config() const override { return config_; }
  void log_metric(std::string_view, double) override { throw missing("log_metric (use Fabric::log)"); }
  void log_tensor(std::string_view, const at::Tensor&, const LogOptions&) override { throw missing("log_tensor (use Fabric::log)"); }
  bool optimizer_stepped() const override { return false; }
  bool optimizer_step_skipped() const override { return false; }
  int64_t num_batches(Split) const override { return 0; }
  // No services: checkpoints are Fabric::save/load, the rest is the program's own loop.
  void* query_interface(const char*) override { return nullptr; }
  c10::Device root_device() const override { return device_; }

 private:
  static RunError missing(const char* call) {
    return RunError(std::string("ember::Fabric: a logger plugin called ITrainer::") + call +
                    ", which only the engine's training loop has (under Fabric the program runs the loop)");
  }
  std::string run_dir_, config_;
  int64_t rank_, world_;
  c10::Device device_;
  const int64_t* step_;
};

}  // namespace

std::unique_ptr<ITrainer> make_logger_view(const std::string& run_dir, const std::string& config_toml, int64_t rank,
                                           int64_t world_size, c10::Device device, const int64_t* last_step) {
  return std::make_unique<LoggerView>(run_dir, config_toml, rank, world_size, device, last_step);
}

}  // namespace ember::engine
