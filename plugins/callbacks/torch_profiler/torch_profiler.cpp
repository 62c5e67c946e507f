// Plugin "torch_profiler": Lightning's PyTorchProfiler on LibTorch's Kineto profiler (the C++ side
// of torch.profiler). Counts training batches from on_train_start and follows torch.profiler's
// schedule: `wait` batches idle, `warmup` batches with the profiler prepared (not recording),
// `active` batches recorded, repeated `repeat` times. Each recorded cycle writes
//   <run_dir>/torch_profiler/trace-rank<r>[-<cycle>].json   Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev)
//   <run_dir>/torch_profiler/key_averages-rank<r>[-<cycle>].txt   operators by self time
// and rank 0 logs the table. Activities: CPU, plus CUDA when the model is on a GPU.
//
// Ember's phases are user ranges (record_function, USER_SCOPE) in the trace, delimited by hooks:
//   ProfilerStep#<n>       on_train_batch_start -> on_train_batch_end (PyTorch's step marker)
//   ember/training_step    on_train_batch_start -> on_before_zero_grad / on_before_backward
//   ember/backward         on_before_backward -> on_after_backward
//   ember/optimizer_step   on_before_optimizer_step -> on_train_batch_end (clipping and the update)
//   ember/data_fetch       on_train_batch_end -> next on_train_batch_start (loading, transfer, logging)
//   ember/validation       on_validation_start -> on_validation_end
// A range includes the hooks of the callbacks named after this one.
//
// emit_nvtx = true replaces all of that with NVTX ranges for NVIDIA Nsight Systems
// (torch.autograd.profiler.emit_nvtx): every operator and the ranges above, for the whole
// training, with nothing written by Ember; run `nsys profile -t cuda,nvtx engine ...` to record them.
#include <ATen/record_function.h>
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("wait", "1", "Training batches to skip before each cycle.").at_least(0),
    ember::key::Int("warmup", "1", "Batches with the profiler warming up (not recorded).").at_least(0),
    ember::key::Int("active", "3", "Batches recorded per cycle.").at_least(1),
    ember::key::Int("repeat", "1", "Cycles (0 = until training ends).").at_least(0),
    ember::key::Bool("record_shapes", "false", "Record operator input shapes."),
    ember::key::Bool("profile_memory", "false", "Record tensor allocations and frees."),
    ember::key::Bool("with_stack", "false", "Record source locations (C++ frames are not symbolized)."),
    ember::key::Int("row_limit", "20", "Rows of the key-averages table.").at_least(1),
    ember::key::Bool("print", "true", "Log the key-averages table (rank 0)."),
    ember::key::Bool("emit_nvtx", "false",
        "Emit NVTX ranges (operators and Ember's phases) for Nsight Systems over the whole training instead of a Kineto trace."),
};
// clang-format on

struct Averages {
  int64_t calls = 0;
  double self_us = 0, total_us = 0;
};

// torch.autograd.profiler's key_averages().table(sort_by="self_cpu_time_total") for the events of
// a recording: self time = own duration minus that of the events directly nested in it (same thread).
// `name` cut to `width` characters, "..." marking a cut.
std::string clip(const std::string& name, size_t width) {
  if (name.size() <= width) return name;
  std::string out(name, 0, width - 3);
  out.append("...");
  return out;
}

std::string key_averages(const std::vector<prof::KinetoEvent>& events, int64_t row_limit) {
  std::map<std::string, Averages> cpu, device;
  std::map<uint64_t, std::vector<const prof::KinetoEvent*>> by_thread;
  for (const auto& e : events) {
    if (e.deviceType() == c10::DeviceType::CPU) by_thread[e.startThreadId()].push_back(&e);
    else {
      auto& a = device[e.name()];
      a.calls += 1;
      a.self_us += static_cast<double>(e.durationNs()) / 1e3;
      a.total_us += static_cast<double>(e.durationNs()) / 1e3;
    }
  }
  double self_sum = 0;
  for (auto& [_, list] : by_thread) {
    std::sort(list.begin(), list.end(), [](auto* a, auto* b) {
      return a->startNs() != b->startNs() ? a->startNs() < b->startNs() : a->endNs() > b->endNs();
    });
    std::vector<std::pair<const prof::KinetoEvent*, double>> stack;  // event, children's time
    auto close = [&](uint64_t until) {
      while (!stack.empty() && stack.back().first->endNs() <= until) {
        auto [ev, children] = stack.back();
        stack.pop_back();
        const double dur = static_cast<double>(ev->durationNs()) / 1e3;
        auto& a = cpu[ev->name()];
        a.calls += 1;
        a.total_us += dur;
        a.self_us += std::max(0.0, dur - children);
        self_sum += std::max(0.0, dur - children);
        if (!stack.empty()) stack.back().second += dur;
      }
    };
    for (const auto* e : list) {
      close(e->startNs());
      stack.emplace_back(e, 0.0);
    }
    close(UINT64_MAX);
  }
  std::vector<std::pair<std::string, Averages>> rows(cpu.begin(), cpu.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.self_us > b.second.self_us; });
  char line[512];
  std::string out;
  std::snprintf(line, sizeof(line), "%-48s %14s %9s %14s %14s %8s\n", "Name", "Self CPU (us)", "Self CPU %", "CPU total (us)",
                "CPU avg (us)", "Calls");
  out += line;
  out += std::string(std::string(line).size() - 1, '-') + "\n";
  for (size_t i = 0; i < rows.size() && static_cast<int64_t>(i) < row_limit; ++i) {
    const auto& [name, a] = rows[i];
    const std::string shown = clip(name, 48);
    std::snprintf(line, sizeof(line), "%-48s %14.1f %9.2f%% %14.1f %14.1f %8lld\n", shown.c_str(), a.self_us,
                  self_sum > 0 ? 100.0 * a.self_us / self_sum : 0.0, a.total_us, a.total_us / static_cast<double>(a.calls),
                  static_cast<long long>(a.calls));
    out += line;
  }
  std::snprintf(line, sizeof(line), "Self CPU time total: %.3f ms\n", self_sum / 1e3);
  out += line;
  if (!device.empty()) {
    std::vector<std::pair<std::string, Averages>> d(device.begin(), device.end());
    std::sort(d.begin(), d.end(), [](const auto& a, const auto& b) { return a.second.self_us > b.second.self_us; });
    out += "Device activity (kernels, copies):\n";
    for (size_t i = 0; i < d.size() && static_cast<int64_t>(i) < row_limit; ++i) {
      const std::string shown = clip(d[i].first, 48);
      std::snprintf(line, sizeof(line), "%-48s %14.1f %8lld\n", shown.c_str(), d[i].second.self_us,
                    static_cast<long long>(d[i].second.calls));
      out += line;
    }
  }
  return out;
}

class TorchProfiler final : public ember::Callback {
 public:
  TorchProfiler(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        wait_(cfg.get_int("wait")),
        warmup_(cfg.get_int("warmup")),
        active_(cfg.get_int("active")),
        repeat_(cfg.get_int("repeat")),
        shapes_(cfg.get_bool("record_shapes")),
        memory_(cfg.get_bool("profile_memory")),
        stack_(cfg.get_bool("with_stack")),
        row_limit_(cfg.get_int("row_limit")),
        print_(cfg.get_bool("print")),
        nvtx_(cfg.get_bool("emit_nvtx")) {}

  ~TorchProfiler() override {
    ranges_.clear();
    if (state_ == State::recording || state_ == State::warming || state_ == State::nvtx) {
      try {
        prof::disableProfiler();
      } catch (...) {
      }
    }
  }

  void on_train_start(ember::ITrainer& t) override {
    cuda_ = t.root_device().is_cuda();
    if (nvtx_ && state_ == State::idle) {
      prof::enableProfiler(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::NVTX, shapes_), {},
                           {at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE, at::RecordScope::BACKWARD_FUNCTION});
      state_ = State::nvtx;
      if (t.is_global_zero())
        host_.log(ember::LogLevel::info, "torch_profiler: emitting NVTX ranges for the whole training (record them with `nsys profile -t cuda,nvtx`)");
    }
  }

  void on_train_batch_start(ember::ITrainer& t) override {
    end("ember/data_fetch");
    advance(t);
    begin("ProfilerStep#" + std::to_string(batch_));
    begin("ember/training_step");
  }
  void on_before_zero_grad(ember::ITrainer&) override { end("ember/training_step"); }
  void on_before_backward(ember::ITrainer&) override {
    end("ember/training_step");
    begin("ember/backward");
  }
  void on_after_backward(ember::ITrainer&) override { end("ember/backward"); }
  void on_before_optimizer_step(ember::ITrainer&) override { begin("ember/optimizer_step"); }
  void on_train_batch_end(ember::ITrainer&) override {
    end("ember/optimizer_step");
    end("ProfilerStep#" + std::to_string(batch_));
    ++batch_;
    begin("ember/data_fetch");
  }
  void on_validation_start(ember::ITrainer&) override { begin("ember/validation"); }
  void on_validation_end(ember::ITrainer&) override { end("ember/validation"); }
  void on_train_epoch_end(ember::ITrainer&) override { end("ember/data_fetch"); }
  void on_train_end(ember::ITrainer& t) override {
    ranges_.clear();
    if (state_ == State::nvtx) {
      prof::disableProfiler();
      state_ = State::done;
      return;
    }
    if (state_ == State::recording) finish(t);
    else if (state_ == State::warming) {
      prof::disableProfiler();
      state_ = State::idle;
    }
  }
  void on_exception(ember::ITrainer&) override { ranges_.clear(); }

 private:
  enum class State { idle, warming, recording, nvtx, done };

  // Moves the schedule to batch `batch_` (counted from on_train_start), before the batch runs.
  void advance(ember::ITrainer& t) {
    if (state_ == State::done || state_ == State::nvtx) return;
    const int64_t len = wait_ + warmup_ + active_;
    const int64_t cycle = batch_ / len, pos = batch_ % len;
    // The batch after a cycle's last active one ends the recording.
    if (state_ == State::recording && pos == 0) {
      finish(t);
      if (state_ == State::done) return;
    }
    if (repeat_ > 0 && cycle >= repeat_) return;
    if (pos == wait_ && warmup_ > 0 && state_ == State::idle) {
      prof::prepareProfiler(config(), activities());
      state_ = State::warming;
    }
    if (pos == wait_ + warmup_ && state_ != State::recording) {
      if (state_ == State::idle) prof::prepareProfiler(config(), activities());
      prof::enableProfiler(config(), activities(),
                           {at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE, at::RecordScope::BACKWARD_FUNCTION});
      state_ = State::recording;
      cycle_ = cycle;
    }
  }

  void finish(ember::ITrainer& t) {
    // The recorded batches' kernels may still be running: wait for them, as torch.profiler does on
    // stop, or the trace ends with the last kernels missing.
    if (cuda_) torch::cuda::synchronize();
    auto result = prof::disableProfiler();
    state_ = (repeat_ > 0 && cycle_ + 1 >= repeat_) ? State::done : State::idle;
    const fs::path dir = fs::path(t.run_dir()) / "torch_profiler";
    char suffix_buf[64];
    if (repeat_ == 1) std::snprintf(suffix_buf, sizeof suffix_buf, "rank%lld", static_cast<long long>(t.rank()));
    else std::snprintf(suffix_buf, sizeof suffix_buf, "rank%lld-%lld", static_cast<long long>(t.rank()), static_cast<long long>(cycle_));
    const std::string suffix = suffix_buf;
    try {
      fs::create_directories(dir);
      result->save((dir / ("trace-" + suffix + ".json")).string());
      const std::string table = key_averages(result->events(), row_limit_);
      std::ofstream(dir / ("key_averages-" + suffix + ".txt")) << table;
      if (print_ && t.is_global_zero())
        host_.log(ember::LogLevel::info, "torch_profiler: cycle " + std::to_string(cycle_) + ", trace in " +
                                             (dir / ("trace-" + suffix + ".json")).string() + "\n" + table);
    } catch (const std::exception& e) {
      throw ember::RunError("torch_profiler: cannot write " + dir.string() + ": " + e.what());
    }
  }

  torch::profiler::impl::ProfilerConfig config() const {
    return torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO, shapes_, memory_, stack_);
  }
  std::set<ActivityType> activities() const {
    std::set<ActivityType> a{ActivityType::CPU};
    if (cuda_) a.insert(ActivityType::CUDA);
    return a;
  }

  void begin(const std::string& name) {
    if (state_ != State::recording && state_ != State::nvtx) return;
    auto rf = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (rf->isActive()) rf->before(name);
    ranges_.emplace_back(name, std::move(rf));
  }
  void end(const std::string& name) {
    for (auto it = ranges_.rbegin(); it != ranges_.rend(); ++it) {
      if (it->first == name) {
        ranges_.erase(std::next(it).base());
        return;
      }
    }
  }

  ember::IHost& host_;
  const int64_t wait_, warmup_, active_, repeat_;
  const bool shapes_, memory_, stack_;
  const int64_t row_limit_;
  const bool print_, nvtx_;
  bool cuda_ = false;
  State state_ = State::idle;
  int64_t batch_ = 0, cycle_ = 0;
  std::vector<std::pair<std::string, std::unique_ptr<at::RecordFunction>>> ranges_;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new TorchProfiler(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "torch_profiler", "0.1.0", "Apache-2.0",
             "LibTorch's Kineto profiler on a wait/warmup/active schedule: Chrome trace per rank, key averages by self time.",
             EMBER_CONFIG_KEYS(kKeys), make)
