// fp32 ("32-true"): parameters, inputs and math in float32; no autocast, no loss scaling.
#include <ember/plugin.h>
#include <ember/precision.h>

#include <torch/nn/module.h>

#include <cstring>

namespace {

class Fp32 final : public ember::IPrecision, public ember::IParameterDtype {
 public:
  void setup(torch::nn::Module& module, const c10::Device& /*device*/) override {
    // A model may have built double or half parameters; "32-true" promises float32.
    module.to(at::kFloat);
  }
  ember::Batch convert_input(ember::Batch batch) override {
    for (auto& t : batch.tensors)
      if (t.defined() && t.is_floating_point() && t.scalar_type() != at::kFloat) t = t.to(at::kFloat);
    return batch;
  }
  c10::ScalarType parameter_dtype() const override { return at::kFloat; }
  void* query_interface(const char* iid) override {
    return std::strcmp(iid, ember::kParameterDtypeIid) == 0 ? static_cast<ember::IParameterDtype*>(this) : nullptr;
  }
  void forward_begin() override {}
  void forward_end() override {}
  void backward(const at::Tensor& loss) override { loss.backward(); }
  bool optimizer_step(ember::IOptimizerStep& step) override {
    step.closure();
    step.before_step();
    step.step();
    return true;
  }
};

ember::IPrecision* make(ember::IHost& /*host*/, const ember::IConfig& /*cfg*/) { return new Fp32(); }

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "fp32", "0.1.0", "Apache-2.0",
             "Full float32 precision (Lightning's \"32-true\").", EMBER_NO_CONFIG_KEYS, make)
