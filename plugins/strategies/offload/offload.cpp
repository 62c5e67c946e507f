// offload: ZeRO-Offload (docs/strategy.md). fp32 master weights, their gradients and the optimizer
// state live in host memory (pinned when the device is a GPU); each gradient group is copied to the
// host as soon as backward produced it (a side stream on GPUs) and accumulated there in fp32; the
// optimizer steps on the host with ATen's fused CPU kernels; the updated weights go back to the
// device in the compute dtype. offload_params = true keeps the parameters themselves on the host
// and copies each unit's in just before it runs, forward and backward (ZeRO-Infinity's parameter
// offload). With trainer.devices = N each rank offloads its 1/N shard (ZeRO-2 / ZeRO-3 + offload).
// The machinery is plugins/strategies/shard_core, shared with sharded.
#include <ember/error.h>
#include <ember/plugin.h>

#include "zero_strategy.h"

namespace {

constexpr EmberConfigKey kKeys[] = {
    EMBER_DIST_CONFIG_KEYS,
    ember::key::Bool("offload_params", "false",
                     "Keep the parameters on the host too: each unit of the model is copied to the device just before its "
                     "forward (the next one prefetched) and again before its backward, and freed after (ZeRO-Infinity's "
                     "offload_param; ZeRO stage 3). false: the device holds every weight in the compute dtype (ZeRO-Offload; stage 2)."),
    ember::key::Bool("pin_memory", "true",
                     "Page-lock the host tensors when the device is a GPU, so copies run asynchronously on a side stream."),
    ember::key::Float("max_host_memory_mb", "0.0",
                      "Host memory this rank may take for masters, gradients and optimizer state, in MiB; 0: what the host has "
                      "available (MemAvailable). Start-up stops with one line giving the bytes needed and available when it "
                      "does not fit.")
        .at_least(0.0),
    ember::key::String("compute_dtype", "\"auto\"",
                       "dtype of the weights on the device: auto keeps the precision plugin's (fp32 under 16-mixed and "
                       "bf16-mixed, bf16 under bf16-true), bf16 or fp16 store them in 16 bits (half the device memory and "
                       "copies) while the masters stay fp32 on the host.")
        .choices("auto|bf16|fp16"),
    EMBER_ZERO_CONFIG_KEYS,
};

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) {
  auto o = ember_shard::read_zero_options("offload", cfg);
  o.offload = true;
  o.stage = cfg.get_bool("offload_params") ? 3 : 2;
  o.pin_memory = cfg.get_bool("pin_memory");
  o.max_host_bytes = static_cast<int64_t>(cfg.get_float("max_host_memory_mb") * 1024.0 * 1024.0);
  o.where_max_host = cfg.where("max_host_memory_mb");
  const std::string dtype = cfg.get_string("compute_dtype");
  if (dtype == "bf16") o.compute_dtype = at::kBFloat16;
  else if (dtype == "fp16") o.compute_dtype = at::kHalf;
  return ember_shard::make_zero_strategy(host, cfg, std::move(o));
}

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "offload", "0.1.0", "Apache-2.0",
             "ZeRO-Offload: fp32 master weights, gradients and optimizer state in host memory, the optimizer step on the host "
             "(ATen's fused CPU kernels); optionally the parameters too, copied in per unit (offload_params). Composes with "
             "sharding over ranks.",
             EMBER_CONFIG_KEYS(kKeys), make)
