// Test and bench plugin: what the model's state occupies on this rank at an optimizer step,
// measured, not computed from parameter counts:
//   - parameters, gradients and the tensors the optimizer trains (shards, under sharding): the
//     bytes their storages really hold at on_before_optimizer_step (a stage-3 parameter whose
//     storage is freed counts 0), each storage once;
//   - optimizer state: the CPU bytes the first optimizer step allocates and keeps, counted by a
//     counting allocator around that step (LibTorch creates the state lazily in step 1);
//   - the step's peak: the most CPU bytes that the forward and backward of the measured step's
//     batch had allocated and not yet freed at once (activations kept for backward, the
//     gradients being made, communication buffers), counted from the batch's start.
// Logs one line per rank after the step given by `at_step`:
//   memory_probe: rank R step S: parameters P gradients G trained T optimizer_state O total X bytes step_peak K bytes
#include <ember/support/callback_base.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <atomic>
#include <set>
#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("at_step", "2", "Optimizer step (1-based) at whose start the state is measured; >= 2, so the state exists.").at_least(2),
};

// Counts live CPU bytes while installed (the same technique as batch_size_finder).
class Counter final : public c10::Allocator {
 public:
  static Counter& get() {
    static Counter* c = new Counter();
    return *c;
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* block = new Block{std::move(inner), static_cast<int64_t>(n)};
    const int64_t now = current_ += block->bytes;
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    return c10::DataPtr(data, block, &Counter::release, device);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  void install() {
    base_ = c10::GetCPUAllocator();
    c10::SetCPUAllocator(this, 255);
  }
  void uninstall() { c10::SetCPUAllocator(base_, 255); }
  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_ = current_.load(); }

 private:
  struct Block {
    c10::DataPtr inner;
    int64_t bytes;
  };
  static void release(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    get().current_ -= b->bytes;
    delete b;
  }
  c10::Allocator* base_ = nullptr;
  std::atomic<int64_t> current_{0}, peak_{0};
};

class MemoryProbe final : public ember::Callback {
 public:
  MemoryProbe(ember::IHost& host, const ember::IConfig& cfg) : host_(host), at_step_(cfg.get_int("at_step")) {}

  void on_train_batch_start(ember::ITrainer& t) override {
    if (t.global_step() + 1 != at_step_ || counting_ || peak_counting_) return;
    Counter::get().install();
    peak_counting_ = true;
    Counter::get().reset_peak();
    peak_base_ = Counter::get().current();
  }

  void on_before_optimizer_step(ember::ITrainer& t) override {
    const int64_t step = t.global_step() + 1;  // the step about to be taken
    int64_t step_peak = 0;
    if (peak_counting_ && step == at_step_) {
      step_peak = Counter::get().peak() - peak_base_;
      Counter::get().uninstall();
      peak_counting_ = false;
    }
    if (step == 1 && !counting_) {
      Counter::get().install();
      counting_ = true;
      before_ = Counter::get().current();
    }
    if (step != at_step_) return;
    std::set<const void*> seen;
    auto bytes_of = [&](const at::Tensor& x) -> int64_t {
      if (!x.defined()) return 0;
      const void* s = x.storage().unsafeGetStorageImpl();
      if (!seen.insert(s).second) return 0;
      return static_cast<int64_t>(x.storage().nbytes());
    };
    int64_t params = 0, grads = 0, trained = 0;
    for (const auto& p : t.module().parameters()) params += bytes_of(p);
    for (const auto& p : t.module().parameters()) grads += bytes_of(p.grad());
    for (const auto& n : ember::trainer_service<ember::ITrainerWeights>(t, "memory_probe").trained_parameters()) trained += bytes_of(n.tensor);
    for (const auto& n : ember::trainer_service<ember::ITrainerWeights>(t, "memory_probe").trained_parameters()) grads += bytes_of(n.tensor.grad());
    const int64_t total = params + grads + trained + optimizer_;
    host_.log(ember::LogLevel::info, "memory_probe: rank " + std::to_string(t.rank()) + " step " + std::to_string(step) +
                                         ": parameters " + std::to_string(params) + " gradients " + std::to_string(grads) +
                                         " trained " + std::to_string(trained) + " optimizer_state " + std::to_string(optimizer_) +
                                         " total " + std::to_string(total) + " bytes step_peak " + std::to_string(step_peak) +
                                         " bytes");
  }
  void on_train_batch_end(ember::ITrainer& t) override {
    if (counting_ && t.optimizer_stepped()) {
      // What the first step allocated and still holds: the optimizer's state.
      optimizer_ = Counter::get().current() - before_;
      Counter::get().uninstall();
      counting_ = false;
    }
  }

 private:
  ember::IHost& host_;
  int64_t at_step_;
  bool counting_ = false, peak_counting_ = false;
  int64_t before_ = 0, optimizer_ = 0, peak_base_ = 0;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new MemoryProbe(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "memory_probe", "0.0.1", "Apache-2.0",
             "Test/bench: logs the bytes of parameters, gradients, trained shards and optimizer state on each rank at a step.",
             EMBER_CONFIG_KEYS(kKeys), make)
