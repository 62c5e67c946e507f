// fp16_true ("16-true", Lightning's HalfPrecision): float16 parameters, inputs and math, with no
// float32 copy anywhere: half the memory of float32 for weights, gradients and optimizer state, at
// the cost of precision in the update itself. No loss scaling, so gradients below float16's
// range (~6e-8) flush to zero; use amp16 when that matters.
#include <ember/plugin.h>
#include <ember/support/precision_util.h>

namespace {

ember::IPrecision* make(ember::IHost&, const ember::IConfig&) {
  return new ember::UniformPrecision("fp16_true (16-true)", at::kHalf, "use amp16 (\"16-mixed\") or bf16_true instead");
}

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "fp16_true", "0.1.0", "Apache-2.0", "Parameters, inputs and math in float16 (Lightning's \"16-true\").", EMBER_NO_CONFIG_KEYS, make)
