// fp64 ("64-true", Lightning's DoublePrecision): parameters, inputs and math in float64. For
// numerics checks and problems that need the range; several times slower than float32, and
// most GPUs have little float64 throughput.
#include <ember/plugin.h>
#include <ember/precision.h>
#include <ember/precision_util.h>

#include <c10/core/DefaultDtype.h>
#include <torch/nn/module.h>

namespace {

class Fp64 final : public ember::IPrecision {
 public:
  void setup(torch::nn::Module& module, const c10::Device& device) override {
    ember::check_precision_supported("fp64 (64-true)", device, at::kDouble, /*autocast=*/false, "use fp32 instead");
    module.to(at::kDouble);
  }
  ember::Batch convert_input(ember::Batch batch) override { return ember::cast_floating(std::move(batch), at::kDouble); }
  // Tensors the model creates in its step (constants, masks) are float64 too.
  void forward_begin() override {
    saved_default_ = c10::get_default_dtype();
    c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(at::kDouble));
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

ember::IPrecision* make(ember::IHost&, const ember::IConfig&) { return new Fp64(); }

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "fp64", "0.1.0", "Apache-2.0",
             "Parameters, inputs and math in float64 (Lightning's \"64-true\").", EMBER_NO_CONFIG_KEYS, make)
