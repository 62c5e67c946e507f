// Test plugin: writes the model's parameters and buffers to <dir>/epoch<E>.pt at every
// on_train_epoch_end and, with every_step, to <dir>/step<S>.pt after every optimizer step (S =
// global_step after it), so tests can recompute averages by hand. Name it before swa/ema in
// --plugins: it then sees the weights the optimizer produced, before any averaging touches them.
#include <ember/support/callback_base.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/core/Dict.h>
#include <torch/nn/module.h>
#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("dir", "\"snapshots\"", "Folder the snapshots are written to."),
    ember::key::Bool("every_step", "false", "Also write one after every optimizer step."),
};

class WeightSnapshot final : public ember::Callback {
 public:
  explicit WeightSnapshot(const ember::IConfig& cfg) : dir_(cfg.get_string("dir")), every_step_(cfg.get_bool("every_step")) {
    std::filesystem::create_directories(dir_);
  }
  void on_train_epoch_end(ember::ITrainer& t) override { save(t, "epoch" + std::to_string(t.current_epoch())); }
  void on_train_batch_end(ember::ITrainer& t) override {
    if (every_step_ && t.optimizer_stepped()) save(t, "step" + std::to_string(t.global_step()));
  }

 private:
  void save(ember::ITrainer& t, const std::string& stem) {
    c10::Dict<std::string, at::Tensor> d;
    for (const auto& p : t.module().named_parameters()) d.insert(p.key(), p.value().detach().to(at::kCPU).clone());
    for (const auto& b : t.module().named_buffers()) d.insert(b.key(), b.value().detach().to(at::kCPU).clone());
    const auto bytes = torch::pickle_save(c10::IValue(d));
    std::ofstream(dir_ + "/" + stem + ".pt", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  std::string dir_;
  bool every_step_;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new WeightSnapshot(cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "weight_snapshot", "0.0.1", "Apache-2.0", "Test: writes the weights at every epoch end.",
             EMBER_CONFIG_KEYS(kKeys), make)
