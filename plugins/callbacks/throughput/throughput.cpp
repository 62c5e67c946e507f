// Plugin "throughput": Lightning's ThroughputMonitor. After each training batch it logs, over the
// last `window_size` batches of this rank: train|device|batches_per_sec, train|device|samples_per_sec
// and (with `items`) train|device|items_per_sec, and the same for the whole job without "device|"
// (this rank's rate times the world size, as Lightning's Throughput does). Time spent in
// validation is left out of the training rates. Values go through the trainer's metric store, so
// every logger gets them at trainer.log_every_n_steps.
//
//
// FLOP/s and MFU (train|device|flops_per_sec, train|flops_per_sec, train|device|mfu): the FLOPs
// of a training batch come from the model (ember/model_flops.h) or are counted once with
// LibTorch's profiler (flops = "measure": the matrix products it knows forward and backward, and
// convolutions forward only: the profiler gives convolution_backward no count; scaled by batch
// size afterwards); the device's peak comes from peak_flops.h's
// table of GPUs for the run's compute dtype, or from peak_tflops (CPUs: look up your own).
#include <ATen/cuda/CUDAContext.h>
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/model.h>
#include <ember/model_flops.h>
#include <ember/plugin.h>
#include <ember/trainer.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <cstdio>
#include <optional>
#include <set>
#include <toml++/toml.h>

#include <chrono>
#include <string>

#include "peak_flops.h"
#include "throughput_window.h"

namespace {

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("window_size", "100", "Batches the rates are averaged over.").at_least(1),
    ember::key::String("items", "\"none\"",
        "Items per batch for items_per_sec: none, or input_numel (elements of the batch's first tensor: tokens of a [batch, length] input).")
        .choices("none|input_numel"),
    ember::key::Bool("sync_cuda", "true", "On CUDA, wait for the device before reading the clock (exact, costs a sync per batch)."),
    ember::key::String("flops", "\"auto\"",
        "FLOPs per training batch for flops_per_sec and mfu: auto (the model's report when it gives one, else none), model, "
        "measure (count them once with LibTorch's profiler) or none.")
        .choices("auto|model|measure|none"),
    ember::key::Float("peak_tflops", "0.0",
        "The device's peak TFLOP/s for mfu; 0 looks CUDA devices up in the built-in table for the run's precision.")
        .at_least(0.0),
    ember::key::Elsewhere("batch_size_fn", "Ember counts each batch's samples itself; remove the key"),
    ember::key::Elsewhere("length_fn", "set items = \"input_numel\" to count the elements (tokens) of each batch's input"),
};
// clang-format on

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Throughput final : public ember::Callback {
 public:
  Throughput(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        window_(cfg.get_int("window_size")),
        items_(cfg.get_string("items") == "input_numel"),
        sync_cuda_(cfg.get_bool("sync_cuda")),
        flops_mode_(cfg.get_string("flops")),
        where_flops_(cfg.where("flops")),
        peak_tflops_(cfg.get_float("peak_tflops")) {}

  void on_fit_start(ember::ITrainer& t) override {
    model_flops_ = static_cast<ember::IModelFlops*>(t.model().query_interface(ember::kModelFlopsIid));
    if (flops_mode_ == "model" && model_flops_ == nullptr)
      throw ember::ConfigError(where_flops_ + ": throughput.flops = \"model\", but this model does not report its FLOPs "
                               "(ember/model_flops.h): use flops = \"measure\" to count them with LibTorch's profiler, or \"none\"");
    if (flops_mode_ == "auto") flops_mode_ = model_flops_ != nullptr ? "model" : "none";
    if (flops_mode_ == "none") return;
    // The device's peak, for MFU.
    std::string device = "cpu";
    if (const c10::Device d = t.root_device(); d.is_cuda()) device = at::cuda::getDeviceProperties(d.index())->name;
    const auto dtype = run_compute_dtype(t);
    if (peak_tflops_ > 0) {
      peak_ = peak_tflops_ * 1e12;
    } else if (device != "cpu") {
      peak_ = ember_tp::cuda_peak_flops(device, dtype);
    }
    char line[256];
    if (peak_)
      std::snprintf(line, sizeof line, "throughput: FLOPs per batch from %s; peak %.1f TFLOP/s (%s, %s) for mfu",
                    flops_mode_ == "model" ? "the model" : "LibTorch's profiler", *peak_ / 1e12,
                    peak_tflops_ > 0 ? "throughput.peak_tflops" : device.c_str(), ember_tp::dtype_name(dtype));
    else
      std::snprintf(line, sizeof line, "throughput: FLOPs per batch from %s; no peak known for %s (%s): set throughput.peak_tflops for mfu",
                    flops_mode_ == "model" ? "the model" : "LibTorch's profiler", device.c_str(), ember_tp::dtype_name(dtype));
    if (t.is_global_zero()) host_.log(ember::LogLevel::info, line);
  }

  void on_train_epoch_start(ember::ITrainer&) override {
    // Epoch boundaries (loader restart, checkpoints) are not part of the rate.
    window_.clear();
    started_ = false;
  }

  void on_train_batch_start(ember::ITrainer& t) override {
    if (flops_mode_ == "measure" && flops_per_sample_ < 0 && !counting_) start_counting();
    if (started_) return;
    sync(t);
    started_ = true;
    paused_ = 0;
    t0_ = now();
    batches_ = samples_ = items_seen_ = 0;
    flops_seen_ = 0;
    window_.add({0.0, 0, 0, items_ ? 0.0 : -1.0, flops_mode_ == "none" ? -1.0 : 0.0});
  }

  void on_train_batch_end(ember::ITrainer& t) override {
    sync(t);
    const ember::Batch& b = t.current_batch();
    batches_ += 1;
    samples_ += static_cast<double>(b.size);
    if (items_ && !b.tensors.empty()) items_seen_ += static_cast<double>(b[0].numel());
    if (counting_) stop_counting(t, b);
    const double batch_flops = flops_of(b);
    if (batch_flops >= 0) flops_seen_ += batch_flops;
    const double flops = flops_mode_ == "none" || (flops_mode_ == "measure" && flops_per_sample_ < 0) ? -1.0 : flops_seen_;
    window_.add({now() - t0_ - paused_, batches_, samples_, items_ ? items_seen_ : -1.0, flops});
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
    if (r.flops_per_sec >= 0) {
      log(t, "train|device|flops_per_sec", r.flops_per_sec);
      log(t, "train|flops_per_sec", r.flops_per_sec * world);
      if (peak_) log(t, "train|device|mfu", r.flops_per_sec / *peak_);
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
  // FLOPs of this training batch (< 0: unknown yet).
  double flops_of(const ember::Batch& b) const {
    if (flops_mode_ == "model") return model_flops_->training_flops(b);
    if (flops_mode_ == "measure" && flops_per_sample_ >= 0) return flops_per_sample_ * static_cast<double>(b.size);
    return -1.0;
  }
  void start_counting() {
    namespace prof = torch::autograd::profiler;
    if (prof::profilerEnabled()) {  // torch_profiler (or another) records this batch: count a later one
      return;
    }
    prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true, /*profile_memory=*/false,
                                /*with_stack=*/false, /*with_flops=*/true, /*with_modules=*/false);
    const std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    counting_ = true;
  }
  void stop_counting(ember::ITrainer& t, const ember::Batch& b) {
    auto result = torch::autograd::profiler::disableProfiler();
    counting_ = false;
    // Matrix products and convolutions only: the profiler also gives elementwise mul/add a count
    // (the loss, the optimizer), which the models' own counts and PyTorch's FLOP counter leave out.
    double flops = 0;
    for (const auto& e : result->events()) {
      const std::string name = e.name();
      if (name.find("mm") != std::string::npos || name.find("conv") != std::string::npos) flops += static_cast<double>(e.flops());
    }
    if (b.size <= 0) return;
    flops_per_sample_ = flops / static_cast<double>(b.size);
    if (t.is_global_zero()) {
      char line[160];
      std::snprintf(line, sizeof line, "throughput: measured %.4g FLOPs per training sample (LibTorch's profiler, one batch)", flops_per_sample_);
      host_.log(ember::LogLevel::info, line);
    }
  }
  // trainer.precision and trainer.float32_matmul_precision from the run's resolved config.
  static ember_tp::ComputeDtype run_compute_dtype(ember::ITrainer& t) {
    std::string precision = "32-true", matmul = "highest";
    try {
      const auto cfg = toml::parse(t.resolved_config());
      precision = cfg["trainer"]["precision"].value_or(precision);
      matmul = cfg["trainer"]["float32_matmul_precision"].value_or(matmul);
    } catch (const std::exception&) {
    }
    return ember_tp::compute_dtype(precision, matmul);
  }
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

  ember::IHost& host_;
  ember_tp::Window window_;
  const bool items_, sync_cuda_;
  std::string flops_mode_, where_flops_;
  double peak_tflops_;
  ember::IModelFlops* model_flops_ = nullptr;
  std::optional<double> peak_;
  bool counting_ = false;
  double flops_per_sample_ = -1, flops_seen_ = 0;
  bool started_ = false;
  double t0_ = 0, paused_ = 0, pause_start_ = -1;
  double batches_ = 0, samples_ = 0, items_seen_ = 0;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new Throughput(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "throughput", "0.1.0", "Apache-2.0",
             "Lightning's ThroughputMonitor: batches/s, samples/s, items/s, FLOP/s and MFU over a window of training batches.",
             EMBER_CONFIG_KEYS(kKeys), make)
