// The plugins the engine chooses by itself, as Lightning's Trainer does (strategy "auto",
// logger=True adds a logger, enable_checkpointing=True a ModelCheckpoint, enable_model_summary a
// ModelSummary, max_time a Timer). This table is the one place outside the plugin files where the
// engine names plugins: everything else asks plugins what they can do (query_interface,
// capabilities), never who they are.
#pragma once
#include <cstdint>

namespace ember::engine::defaults {

inline constexpr const char* kStrategy = "single_device";        // trainer.strategy "auto" (the default) with one rank
inline constexpr const char* kMultiRankStrategy = "ddp";         // "auto" with more than one rank
inline constexpr const char* kPrecision = "fp32";                // trainer.precision unset
inline constexpr const char* kLogger = "csv";                    // trainer.logger = true and no logger named
inline constexpr const char* kCheckpointCallback = "checkpoint";  // trainer.enable_checkpointing = true
inline constexpr const char* kSummaryCallback = "model_summary";  // trainer.enable_model_summary = true
inline constexpr const char* kTimerCallback = "timer";            // trainer.max_time

// trainer.strategy = "auto": one rank trains with kStrategy, several with kMultiRankStrategy.
inline const char* auto_strategy(int64_t ranks) { return ranks > 1 ? kMultiRankStrategy : kStrategy; }

}  // namespace ember::engine::defaults
