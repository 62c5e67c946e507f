// bf16_true ("bf16-true", Lightning's HalfPrecision): bfloat16 parameters, inputs and math, with no
// float32 copy anywhere: half the memory of float32 for weights, gradients and optimizer state, at
// the cost of precision in the update itself. bfloat16 keeps float32's exponent range, so no
// loss scaling is needed.
#include <ember/support/cpu_features.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/support/precision_util.h>

namespace {

class Bf16True final : public ember::UniformPrecision {
 public:
  explicit Bf16True(ember::IHost& host)
      : UniformPrecision("bf16_true (bf16-true)", at::kBFloat16, "use bf16 (\"bf16-mixed\") or fp32 instead"), host_(host) {}
  void setup(torch::nn::Module& module, const c10::Device& device) override {
    UniformPrecision::setup(module, device);
    // Said once, at start-up: without native bfloat16 a CPU runs this mode several times slower.
    if (device.is_cpu())
      if (auto w = ember::slow_cpu_precision_warning("bf16_true (bf16-true)",
                                                     ember::cpu_runs_bf16_fast(ember::detect_cpu_features()), "bfloat16");
          !w.empty())
        host_.log(ember::LogLevel::warn, w);
  }

 private:
  ember::IHost& host_;
};

ember::IPrecision* make(ember::IHost& host, const ember::IConfig&) { return new Bf16True(host); }

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "bf16_true", "0.1.0", "Apache-2.0", "Parameters, inputs and math in bfloat16 (Lightning's \"bf16-true\").", EMBER_NO_CONFIG_KEYS, make)
