// The ZeRO machinery the `sharded` and `offload` strategies share (docs/strategy.md): the flat
// shard layout, gradient reduce-scatter per group as backward produces it, the unit gather/free
// hooks of stage 3, the optimizer-state tensors and the checkpoint I/O (full and per rank), and
// the host tier of ZeRO-Offload (fp32 masters, gradients and optimizer state in host memory).
// Each plugin is its key table plus make_zero_strategy with its options.
#pragma once
#include <ember/config.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/strategy.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

#include <ember/distributed/communicator.h>

namespace ember_shard {

struct ZeroOptions {
  std::string name;  // the plugin's: prefixes every message
  int stage = 3;     // 1, 2 or 3 (offload: 2, or 3 with offload_params)
  int64_t bucket_cap_bytes = 25 << 20;
  bool prefetch = true;
  int64_t min_unit_params = 0;
  bool broadcast_buffers = true;
  bool sharded_checkpoints = false;
  // ZeRO-Offload: what the optimizer trains (fp32 masters), their gradients and the optimizer
  // state live in host memory; the step runs there; the device holds the compute-dtype weights.
  bool offload = false;
  bool pin_memory = true;
  int64_t max_host_bytes = 0;                     // 0: what the host has available
  std::optional<at::ScalarType> compute_dtype;    // device copy of the weights; none: the module's
  std::string where_max_host;                     // config location, for the memory error line
  std::string where_state_dict_type;              // config location of state_dict_type
  std::string where_broadcast_buffers;            // config location of broadcast_buffers
  bool deferred_init = true;                      // take the model piece by piece as it is built
};

// The keys both plugins take besides EMBER_DIST_CONFIG_KEYS (read by read_zero_options).
#define EMBER_ZERO_CONFIG_KEYS                                                                                                   \
  ember::key::Float("bucket_cap_mb", "25.0",                                                                                     \
                    "Parameters that belong to no unit of the model are reduce-scattered (and, when parameters are sharded or "  \
                    "offloaded, gathered) in groups of about this many megabytes.")                                              \
      .above(0.0),                                                                                                               \
      ember::key::Bool("prefetch", "true",                                                                                       \
                       "When parameters are sharded or offloaded: start fetching the next unit (in forward) or the previous "     \
                       "one (in backward) while the current one runs."),                                                         \
      ember::key::Int("auto_wrap_min_params", "0",                                                                               \
                      "A unit the model declares with fewer parameters than this is not fetched on its own: it joins the "       \
                      "parameters gathered for the whole step (FSDP's size-based auto-wrap policy, DeepSpeed's persistence "     \
                      "threshold).")                                                                                             \
          .at_least(0),                                                                                                          \
      ember::key::String("state_dict_type", "\"full\"",                                                                          \
                         "Checkpoints as one file gathered on rank 0 (full: what single_device writes and reads) or as a "        \
                         "directory with one part per rank (sharded: nothing is gathered; resumable on any number of ranks; "    \
                         "`engine checkpoint consolidate DIR OUT.ckpt` makes the full file).")                                   \
          .choices("full|sharded"),                                                                                              \
      ember::key::Bool("deferred_init", "true",                                                                                  \
                       "When parameters are sharded (stage 3) or offloaded: take each piece of the model as it is built and "     \
                       "keep only this rank's part (ember/deferred_init.h), so no rank ever holds the whole model. Every rank "    \
                       "builds the same values from the seed (checked once at set-up) instead of taking rank 0's."),              \
      ember::key::Bool("broadcast_buffers", "true",                                                                              \
                       "Every rank takes rank 0's buffers (batch-norm statistics) before each forward in training mode, and "     \
                       "once before evaluating after one (PyTorch DDP's broadcast_buffers), so all ranks evaluate with the same " \
                       "statistics.")

ZeroOptions read_zero_options(std::string name, const ember::IConfig& cfg);

ember::IStrategy* make_zero_strategy(ember::IHost& host, const ember::IConfig& cfg, ZeroOptions options);

}  // namespace ember_shard
