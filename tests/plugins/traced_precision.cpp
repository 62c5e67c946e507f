// Test plugin: float32 precision that appends each call it receives to a file (the same file the
// hook recorder writes), so a test can check the nesting of docs/step.md.
#include <ember/plugin.h>
#include <ember/precision.h>

#include <torch/nn/module.h>

#include <fstream>
#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("path", "\"hooks.txt\"", "File the calls are appended to."),
    ember::key::Bool("skip_closure", "false", "A broken handler that steps without running the closure (the runtime must refuse it)."),
};

class TracedPrecision final : public ember::IPrecision {
 public:
  explicit TracedPrecision(const ember::IConfig& cfg)
      : out_(cfg.get_string("path"), std::ios::app), skip_closure_(cfg.get_bool("skip_closure")) {}
  void setup(torch::nn::Module& module, const c10::Device&) override {
    trace("precision.setup");
    module.to(at::kFloat);
  }
  ember::Batch convert_input(ember::Batch batch) override { return batch; }
  void forward_begin() override { trace("precision.forward_begin"); }
  void forward_end() override { trace("precision.forward_end"); }
  void backward(const at::Tensor& loss) override {
    trace("precision.backward");
    loss.backward();
  }
  bool optimizer_step(ember::IOptimizerStep& step) override {
    trace("precision.optimizer_step");
    if (!skip_closure_) step.closure();
    step.before_step();
    trace("precision.step");
    step.step();
    return true;
  }

 private:
  void trace(const char* what) { out_ << what << "\n" << std::flush; }
  std::ofstream out_;
  bool skip_closure_;
};

ember::IPrecision* make(ember::IHost&, const ember::IConfig& cfg) { return new TracedPrecision(cfg); }

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "traced_precision", "0.0.1", "Apache-2.0", "Test: fp32 that traces its calls.",
             EMBER_CONFIG_KEYS(kKeys), make)
