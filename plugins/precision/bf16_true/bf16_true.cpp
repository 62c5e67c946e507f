// bf16_true ("bf16-true", Lightning's HalfPrecision): bfloat16 parameters, inputs and math, with no
// float32 copy anywhere: half the memory of float32 for weights, gradients and optimizer state, at
// the cost of precision in the update itself. bfloat16 keeps float32's exponent range, so no loss scaling is needed.
// Tensors a model creates inside its step follow the default dtype, which is bfloat16 during
// forward (as Lightning's HalfPrecision does).
#include <ember/plugin.h>
#include <ember/precision.h>
#include <ember/precision_util.h>

#include <c10/core/DefaultDtype.h>
#include <torch/nn/module.h>

namespace {

class Bf16True final : public ember::IPrecision {
 public:
  void setup(torch::nn::Module& module, const c10::Device& device) override {
    ember::check_precision_supported("bf16_true (bf16-true)", device, at::kBFloat16, /*autocast=*/false, "use bf16 (\"bf16-mixed\") or fp32 instead");
    module.to(at::kBFloat16);
  }
  ember::Batch convert_input(ember::Batch batch) override { return ember::cast_floating(std::move(batch), at::kBFloat16); }
  void forward_begin() override {
    saved_default_ = c10::get_default_dtype();
    c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(at::kBFloat16));
  }
  void forward_end() override { c10::set_default_dtype(saved_default_); }
  void backward(const at::Tensor& loss) override { loss.backward(); }
  bool optimizer_step(ember::IOptimizerStep& step) override {
    step.closure();
    step.before_step();
    step.step();
    return true;
  }

 private:
  caffe2::TypeMeta saved_default_ = c10::get_default_dtype();
};

ember::IPrecision* make(ember::IHost&, const ember::IConfig&) { return new Bf16True(); }

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "bf16_true", "0.1.0", "Apache-2.0",
             "Parameters, inputs and math in bfloat16 (Lightning's \"bf16-true\").", EMBER_NO_CONFIG_KEYS, make)
