// sharded: ZeRO / FSDP data parallel (docs/strategy.md): stage 1 shards the optimizer state, 2
// also the gradients, 3 also the parameters (gathered per unit of the model). The machinery is
// plugins/strategies/shard_core (shared with offload); this plugin is its keys and options.
#include <ember/plugin.h>

#include "zero_strategy.h"

namespace {

constexpr EmberConfigKey kKeys[] = {
    EMBER_DIST_CONFIG_KEYS,
    ember::key::Int("stage", "3",
                    "ZeRO stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters (FSDP's FULL_SHARD).")
        .at_least(1)
        .at_most(3),
    EMBER_ZERO_CONFIG_KEYS,
};

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) {
  auto o = ember_shard::read_zero_options("sharded", cfg);
  o.stage = static_cast<int>(cfg.get_int("stage"));
  return ember_shard::make_zero_strategy(host, cfg, std::move(o));
}

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "sharded", "0.1.0", "Apache-2.0",
             "ZeRO / FSDP data parallel: optimizer state (stage 1), gradients (2) and parameters (3) sharded over the ranks, "
             "gathered per unit of the model; x tensor parallel on a [parallelism] mesh (" EMBER_DIST_BACKENDS ").",
             EMBER_CONFIG_KEYS(kKeys), make)
