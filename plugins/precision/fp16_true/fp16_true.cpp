// fp16_true ("16-true", Lightning's HalfPrecision): float16 parameters, inputs and math, with no
// float32 copy anywhere: half the memory of float32 for weights, gradients and optimizer state, at
// the cost of precision in the update itself. No loss scaling, so gradients below float16's range (~6e-8) flush to zero;
// use amp16 when that matters.
// Tensors a model creates inside its step follow the default dtype, which is float16 during
// forward (as Lightning's HalfPrecision does).
#include <ember/plugin.h>
#include <ember/precision.h>
#include <ember/precision_util.h>

#include <c10/core/DefaultDtype.h>
#include <torch/nn/module.h>

namespace {

class Fp16True final : public ember::IPrecision {
 public:
  void setup(torch::nn::Module& module, const c10::Device& device) override {
    ember::check_precision_supported("fp16_true (16-true)", device, at::kHalf, /*autocast=*/false, "use amp16 (\"16-mixed\") or bf16_true instead");
    module.to(at::kHalf);
  }
  ember::Batch convert_input(ember::Batch batch) override { return ember::cast_floating(std::move(batch), at::kHalf); }
  void forward_begin() override {
    saved_default_ = c10::get_default_dtype();
    c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(at::kHalf));
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

ember::IPrecision* make(ember::IHost&, const ember::IConfig&) { return new Fp16True(); }

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "fp16_true", "0.1.0", "Apache-2.0",
             "Parameters, inputs and math in float16 (Lightning's \"16-true\").", EMBER_NO_CONFIG_KEYS, make)
