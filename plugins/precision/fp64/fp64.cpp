// fp64 ("64-true", Lightning's DoublePrecision): parameters, inputs and math in float64. For
// numerics checks and problems that need the range; several times slower than float32, and
// most GPUs have little float64 throughput.
#include <ember/plugin.h>
#include <ember/support/precision_util.h>

namespace {

ember::IPrecision* make(ember::IHost&, const ember::IConfig&) {
  return new ember::UniformPrecision("fp64 (64-true)", at::kDouble, "use fp32 instead");
}

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "fp64", "0.1.0", "Apache-2.0", "Parameters, inputs and math in float64 (Lightning's \"64-true\").", EMBER_NO_CONFIG_KEYS, make)
