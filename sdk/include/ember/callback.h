// ember::ICallback: code that reacts to the loop (Lightning's Callback). Implemented by callback
// plugins. The engine calls on_hook for every hook in Lightning's order (docs/hooks.md); a
// plugin built against an older SDK never receives hooks appended later. Derive from
// ember::Callback (callback_base.h) to get one virtual function per hook instead.
#pragma once
#include <string>

#include "ember/trainer.h"
#include "ember/types.h"

namespace ember {

class EMBER_SDK_API ICallback : public IPluginObject {
 public:
  virtual void on_hook(Hook hook, ITrainer& trainer) = 0;
  // Monitoring callbacks (checkpointing, early stopping) run after the model in
  // on_train_epoch_end and after every other callback elsewhere (Lightning's exception 1).
  virtual bool monitors_metrics() const { return false; }
};

// Extension interface (query_interface(kCheckpointLocatorIid)): a callback that stores
// checkpoints and can resolve `--resume last|best` to a file.
inline constexpr const char* kCheckpointLocatorIid = "ember.ICheckpointLocator/1";
class EMBER_SDK_API ICheckpointLocator {
 public:
  virtual ~ICheckpointLocator() = default;
  // `alias` is "last" or "best"; `run_dir` the run folder being resumed. Returns the checkpoint
  // file, or "" when this callback has none for that alias.
  virtual std::string resolve_checkpoint(const std::string& alias, const std::string& run_dir) = 0;
};

// SDK 2.10, beside ICheckpointLocator (query_interface(kCheckpointCandidatesIid)): every checkpoint
// the locator would answer `alias` with, most preferred first ("last": the last*.ckpt files, then
// the others, newest first). `--resume last` takes the first one that is a whole Ember checkpoint
// (not weights-only, not another program's file), so what to fall back to is decided here and the
// engine only checks each file; resolve_checkpoint answers the first of them. One exception (the
// engine's, docs/checkpoint.md): a whole candidate that holds a later global_step and was written
// after that first one is taken instead (a save cut short before it updated last.ckpt).
inline constexpr const char* kCheckpointCandidatesIid = "ember.ICheckpointCandidates/1";
class EMBER_SDK_API ICheckpointCandidates {
 public:
  virtual ~ICheckpointCandidates() = default;
  virtual std::vector<std::string> checkpoint_candidates(const std::string& alias, const std::string& run_dir) = 0;
};

}  // namespace ember
