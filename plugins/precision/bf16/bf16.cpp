// bf16 ("bf16-mixed"): float32 parameters, forward and loss under autocast to bfloat16. bfloat16
// has float32's exponent range, so gradients neither underflow nor overflow the way float16's
// do: no loss scaling, every step is taken.
#include <ember/support/cpu_features.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/precision.h>
#include <ember/support/precision_util.h>

#include <torch/nn/module.h>

#include <cstring>
#include <optional>

namespace {

class Bf16 final : public ember::IPrecision, public ember::IParameterDtype {
 public:
  explicit Bf16(ember::IHost& host) : host_(host) {}
  void setup(torch::nn::Module& module, const c10::Device& device) override {
    module.to(at::kFloat);
    device_ = device;
    ember::check_precision_supported("bf16 (bf16-mixed)", device, at::kBFloat16, /*autocast=*/true,
                                     "use amp16 (\"16-mixed\") or fp32 instead");
    // Said once, at start-up: without native bfloat16 a CPU runs this mode several times slower.
    if (device.is_cpu())
      if (auto w = ember::slow_cpu_precision_warning("bf16 (bf16-mixed)", ember::cpu_runs_bf16_fast(ember::detect_cpu_features()),
                                                     "bfloat16");
          !w.empty())
        host_.log(ember::LogLevel::warn, w);
  }
  ember::Batch convert_input(ember::Batch batch) override { return ember::cast_floating(std::move(batch), at::kFloat); }
  c10::ScalarType parameter_dtype() const override { return at::kFloat; }
  void* query_interface(const char* iid) override {
    return std::strcmp(iid, ember::kParameterDtypeIid) == 0 ? static_cast<ember::IParameterDtype*>(this) : nullptr;
  }
  void forward_begin() override { region_.emplace(device_.type(), at::kBFloat16); }
  void forward_end() override { region_.reset(); }
  void backward(const at::Tensor& loss) override { loss.backward(); }
  bool optimizer_step(ember::IOptimizerStep& step) override {
    step.closure();
    step.before_step();
    step.step();
    return true;
  }

 private:
  ember::IHost& host_;
  c10::Device device_{c10::kCPU};
  std::optional<ember::AutocastRegion> region_;
};

ember::IPrecision* make(ember::IHost& host, const ember::IConfig&) { return new Bf16(host); }

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "bf16", "0.1.0", "Apache-2.0",
             "Mixed precision: bfloat16 autocast, no loss scaling (Lightning's \"bf16-mixed\").", EMBER_NO_CONFIG_KEYS, make)
