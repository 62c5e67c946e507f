// Plugin "throughput": Lightning's ThroughputMonitor. After each training batch it logs, over the
// last `window_size` batches of this rank: train|device|batches_per_sec, train|device|samples_per_sec
// and (with `items`) train|device|items_per_sec, and the same for the whole job without "device|"
// (this rank's rate times the world size, as Lightning's Throughput does). Time spent in
// validation is left out of the training rates. Values go through the trainer's metric store, so
// every logger gets them at trainer.log_every_n_steps.
//
// Not here (yet): FLOP/s and MFU. They need the model's FLOPs per batch (an SDK extension a model
// would implement: LibTorch has no FLOP counter like torch.utils.flop_counter) and the device's
// peak FLOP/s (a table of GPUs).
#include <ember/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/plugin.h>
#include <ember/trainer.h>
#include <torch/torch.h>

#include <chrono>
#include <string>

#include "throughput_window.h"

namespace {

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("window_size", "100", "Batches the rates are averaged over.").at_least(1),
    ember::key::String("items", "\"none\"",
        "Items per batch for items_per_sec: none, or input_numel (elements of the batch's first tensor: tokens of a [batch, length] input).")
        .choices("none|input_numel"),
    ember::key::Bool("sync_cuda", "true", "On CUDA, wait for the device before reading the clock (exact, costs a sync per batch)."),
};
// clang-format on

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Throughput final : public ember::Callback {
 public:
  explicit Throughput(const ember::IConfig& cfg)
      : window_(cfg.get_int("window_size")),
        items_(cfg.get_string("items") == "input_numel"),
        sync_cuda_(cfg.get_bool("sync_cuda")) {}

  void on_train_epoch_start(ember::ITrainer&) override {
    // Epoch boundaries (loader restart, checkpoints) are not part of the rate.
    window_.clear();
    started_ = false;
  }

  void on_train_batch_start(ember::ITrainer& t) override {
    if (started_) return;
    sync(t);
    started_ = true;
    paused_ = 0;
    t0_ = now();
    batches_ = samples_ = items_seen_ = 0;
    window_.add({0.0, 0, 0, items_ ? 0.0 : -1.0});
  }

  void on_train_batch_end(ember::ITrainer& t) override {
    sync(t);
    const ember::Batch& b = t.current_batch();
    batches_ += 1;
    samples_ += static_cast<double>(b.size);
    if (items_ && !b.tensors.empty()) items_seen_ += static_cast<double>(b[0].numel());
    window_.add({now() - t0_ - paused_, batches_, samples_, items_ ? items_seen_ : -1.0});
    ember_tp::Rates r;
    if (!window_.rates(&r)) return;
    const double world = static_cast<double>(t.world_size());
    log(t, "train|device|batches_per_sec", r.batches_per_sec);
    log(t, "train|device|samples_per_sec", r.samples_per_sec);
    log(t, "train|batches_per_sec", r.batches_per_sec * world);
    log(t, "train|samples_per_sec", r.samples_per_sec * world);
    if (r.items_per_sec >= 0) {
      log(t, "train|device|items_per_sec", r.items_per_sec);
      log(t, "train|items_per_sec", r.items_per_sec * world);
    }
  }

  void on_validation_start(ember::ITrainer& t) override {
    if (started_ && !t.sanity_checking()) pause_start_ = now();
  }
  void on_validation_end(ember::ITrainer& t) override {
    if (pause_start_ >= 0) paused_ += now() - pause_start_;
    pause_start_ = -1;
  }

 private:
  void sync(ember::ITrainer& t) {
    if (!sync_cuda_ || !torch::cuda::is_available()) return;
    for (const auto& p : t.module().parameters()) {
      if (p.is_cuda()) torch::cuda::synchronize(p.device().index());
      break;
    }
  }
  static void log(ember::ITrainer& t, const char* name, double v) {
    ember::LogOptions o;
    o.on_step = 1;
    o.on_epoch = 0;
    t.log_tensor(name, at::scalar_tensor(v, at::kDouble), o);
  }

  ember_tp::Window window_;
  const bool items_, sync_cuda_;
  bool started_ = false;
  double t0_ = 0, paused_ = 0, pause_start_ = -1;
  double batches_ = 0, samples_ = 0, items_seen_ = 0;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new Throughput(cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "throughput", "0.1.0", "Apache-2.0",
             "Lightning's ThroughputMonitor: batches/s, samples/s and items/s over a window of training batches.",
             EMBER_CONFIG_KEYS(kKeys), make)
