// bf16_true ("bf16-true", Lightning's HalfPrecision): bfloat16 parameters, inputs and math, with no
// float32 copy anywhere: half the memory of float32 for weights, gradients and optimizer state, at
// the cost of precision in the update itself. bfloat16 keeps float32's exponent range, so no
// loss scaling is needed.
#include <ember/plugin.h>
#include <ember/precision_util.h>

namespace {

ember::IPrecision* make(ember::IHost&, const ember::IConfig&) {
  return new ember::UniformPrecision("bf16_true (bf16-true)", at::kBFloat16, "use bf16 (\"bf16-mixed\") or fp32 instead");
}

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "bf16_true", "0.1.0", "Apache-2.0", "Parameters, inputs and math in bfloat16 (Lightning's \"bf16-true\").", EMBER_NO_CONFIG_KEYS, make)
