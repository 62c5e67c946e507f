// Plugin "batch_size_finder": Lightning's BatchSizeFinder. At fit start it tries batch sizes
// (power: doubling; binsearch: doubling, then bisection) with `steps_per_trial` real optimizer
// steps each, and keeps the largest that fits: on CUDA, one that does not run out of memory; on
// CPU, one whose steps stay within memory_budget_mb of tensor memory (and never run out). Then
// it restores the model, optimizer, loop and RNG state from a temporary checkpoint and trains
// with the size found. A resumed run reuses the size without searching.
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#if EMBER_CUDA_VERSION > 0
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "cpu_memory.h"
#include "search.h"

namespace {

// The trainer services this tuner uses (ember/trainer.h).
ember::ITrainerSettings& loop_settings(ember::ITrainer& t) { return ember::trainer_service<ember::ITrainerSettings>(t, "batch_size_finder"); }
ember::ITrainerCheckpoints& checkpoints(ember::ITrainer& t) { return ember::trainer_service<ember::ITrainerCheckpoints>(t, "batch_size_finder"); }
ember::ITrainerPasses& passes(ember::ITrainer& t) { return ember::trainer_service<ember::ITrainerPasses>(t, "batch_size_finder"); }

namespace bs = ember_batch_size;
namespace fs = std::filesystem;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::String("mode", "\"power\"",
        "power: double the size until it fails; binsearch: then bisect between the last fit and the failure.").choices("power|binsearch"),
    ember::key::Int("steps_per_trial", "3", "Optimizer steps run at each size tried.").at_least(1),
    ember::key::Int("init_val", "2", "First size tried.").at_least(1),
    ember::key::Int("max_trials", "25", "Most sizes that may succeed before the search ends.").at_least(1),
    ember::key::Int("max_val", "8192", "Largest size tried.").at_least(1),
    ember::key::Float("margin", "0.05",
        "binsearch only: the size found is reduced by this fraction as a safety margin.").at_least(0.0).below(1.0),
    ember::key::Float("memory_budget_mb", "0",
        "CPU training: most tensor memory (MB, 1e6 bytes) a training step may allocate beyond what exists when the trial starts; 0 = no budget (only a real out-of-memory stops the search).").at_least(0.0),
    ember::key::Elsewhere("batch_arg_name", "Ember's finder sets the loaders' batch size (data.batch_size) itself, not a model "
                                            "attribute; remove the key"),
};
// clang-format on

std::string mb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

class BatchSizeFinder final : public ember::Callback {
 public:
  BatchSizeFinder(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        steps_(cfg.get_int("steps_per_trial")),
        budget_bytes_(static_cast<int64_t>(cfg.get_float("memory_budget_mb") * 1e6)) {
    settings_.mode = cfg.get_string("mode") == "binsearch" ? bs::Mode::binsearch : bs::Mode::power;
    settings_.init_val = cfg.get_int("init_val");
    settings_.max_trials = cfg.get_int("max_trials");
    settings_.max_val = cfg.get_int("max_val");
    settings_.margin = cfg.get_float("margin");
    if (settings_.init_val > settings_.max_val)
      throw ember::ConfigError("batch_size_finder.init_val = " + std::to_string(settings_.init_val) + " (" +
                               cfg.where("init_val") + ") is above max_val = " + std::to_string(settings_.max_val) +
                               " (" + cfg.where("max_val") + "): lower init_val or raise max_val");
  }

  void on_fit_start(ember::ITrainer& t) override {
    if (found_ > 0) {  // resumed: the checkpoint's loop position counts batches of this size
      host_.log(ember::LogLevel::info, "batch_size_finder: using batch size " + std::to_string(found_) +
                                           " found before this resume");
      loop_settings(t).set_batch_size(found_);
      return;
    }
    if (t.world_size() > 1)
      throw ember::RunError("batch_size_finder: runs in single-process training only (an out-of-memory on one rank "
                            "would leave the others waiting); find the size with trainer.devices = 1, then set "
                            "[data] batch_size");
    const int64_t configured = loop_settings(t).batch_size();
    cuda_ = t.root_device().is_cuda();
    if (cuda_ && budget_bytes_ > 0)
      host_.log(ember::LogLevel::warn, "batch_size_finder: memory_budget_mb applies to CPU training; on CUDA the "
                                       "search stops at the first out-of-memory");

    const fs::path tmp = fs::path(t.run_dir()) / (".batch_size_finder." + std::to_string(::getpid()) + ".ckpt");
    checkpoints(t).save_checkpoint(tmp.string());
    bs::Result result;
    try {
      result = bs::search(settings_, [&](int64_t n) { return trial(t, n); });
    } catch (...) {
      restore(t, tmp);
      loop_settings(t).set_batch_size(configured);
      throw;
    }
    restore(t, tmp);  // also resets this plugin's state: set found_ after
    if (result.size == 0) {
      loop_settings(t).set_batch_size(configured);
      throw ember::RunError("batch_size_finder: not even batch size 1 fits" +
                            std::string(!cuda_ && budget_bytes_ > 0 ? " in memory_budget_mb" : "") +
                            "; raise the budget or make the model smaller");
    }
    found_ = result.size;
    loop_settings(t).set_batch_size(found_);
    host_.log(ember::LogLevel::info, "batch_size_finder: batch size " + std::to_string(found_) + " (" +
                                         (settings_.mode == bs::Mode::power ? "power" : "binsearch") + ", largest that fit: " +
                                         std::to_string(result.largest_fitting) + ", " + std::to_string(result.trials.size()) +
                                         " trials; configured " + std::to_string(configured) + ")");
  }

  // {batch_size: int} (0 until a search ran)
  c10::IValue state_dict() const override {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert(std::string("batch_size"), found_);
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    try {
      found_ = state.toGenericDict().at(std::string("batch_size")).toInt();
    } catch (const c10::Error&) {
      throw ember::RunError("batch_size_finder: malformed state in the checkpoint (expected {batch_size: int})");
    }
  }

 private:
  // steps_per_trial optimizer steps at batch size n.
  bs::Outcome trial(ember::ITrainer& t, int64_t n) {
    loop_settings(t).set_batch_size(n);
    if (t.num_batches(ember::Split::train) == 0) return data_limited(n);
    bool data_limit = false;
    int64_t done = 0, peak = 0;
    const bool count = !cuda_ && budget_bytes_ > 0;
    try {
      std::optional<bs::CountingScope> scope;
      if (count) scope.emplace();
      auto& counter = bs::CountingCpuAllocator::instance();
      int64_t base = counter.current();
      counter.reset_peak();
      while (done < steps_ && !data_limit) {
        int64_t pass = 0;
        passes(t).for_each_batch(ember::Split::train, steps_ - done, [&](const ember::Batch& batch) {
          if (pass++ == 0 && batch.size < n) {  // a pass's first batch is a full one if the data has n samples
            data_limit = true;
            return false;
          }
          passes(t).run_trial_step(batch);
          ++done;
          return true;
        });
        if (pass == 0) break;
      }
      if (count) peak = counter.peak() - base;
    } catch (const c10::OutOfMemoryError&) {
      free_cuda_cache();
      log_trial(n, "out of memory");
      return bs::Outcome::too_big;
    }
    if (data_limit) return data_limited(n);
    if (count && peak > budget_bytes_) {
      log_trial(n, "over the memory budget (" + mb(peak) + " > " + mb(budget_bytes_) + ")");
      return bs::Outcome::too_big;
    }
    log_trial(n, count ? "fits (" + mb(peak) + " of " + mb(budget_bytes_) + ")" : "fits");
    return bs::Outcome::fits;
  }

  bs::Outcome data_limited(int64_t n) {
    log_trial(n, "larger than the training data");
    return bs::Outcome::data_limit;
  }

  void log_trial(int64_t n, const std::string& what) {
    host_.log(ember::LogLevel::info, "batch_size_finder: batch size " + std::to_string(n) + ": " + what);
  }

  void free_cuda_cache() {
#if EMBER_CUDA_VERSION > 0
    if (cuda_) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  }

  void restore(ember::ITrainer& t, const fs::path& tmp) {
    checkpoints(t).load_checkpoint(tmp.string());
    std::error_code ec;
    fs::remove(tmp, ec);
  }

  ember::IHost& host_;
  bs::Settings settings_;
  int64_t steps_;
  int64_t budget_bytes_;
  bool cuda_ = false;
  int64_t found_ = 0;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new BatchSizeFinder(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "batch_size_finder", "0.1.0", "Apache-2.0",
             "Finds the largest batch size that fits (CUDA memory, or a CPU memory budget) and trains with it (Lightning's BatchSizeFinder).",
             EMBER_CONFIG_KEYS(kKeys), make)
