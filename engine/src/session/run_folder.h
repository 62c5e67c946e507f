// The run folder, <default_root_dir>/<name>/version_<n> as Lightning's loggers make it, and which
// checkpoint a `--resume` continues from.
#pragma once
#include <ember/callback.h>
#include <ember/strategy.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "loop/training_loop.h"

namespace ember::engine {

struct RunFolder {
  std::filesystem::path dir;         // where this run writes
  std::filesystem::path checkpoint;  // what it restores first ("" for nothing)
  bool resume_in_place = false;      // it continues a run in that run's own folder
};

// `base` is <default_root_dir>/<name>; `version` is trainer.version when set; `resume` is
// --resume (last, best, a path, or ""). `--resume last|best` searches the newest version that
// has such a checkpoint (found through the callbacks that locate checkpoints); `--resume last`
// with none starts from scratch, as Lightning's ckpt_path="last". Every rank gets rank 0's folder.
// Rank 0 creates it.
RunFolder choose_run_folder(const std::filesystem::path& base, std::optional<int64_t> version, const std::string& resume,
                            const std::vector<Named<ICallback>>& callbacks, Runtime& runtime);

// The `alias` ("best" or "last") checkpoint of the newest version under `base` that has one, as
// --resume finds it ("" when none has).
std::filesystem::path find_checkpoint_in_runs(const std::filesystem::path& base, std::optional<int64_t> version,
                                              const std::string& alias, const std::vector<Named<ICallback>>& callbacks);

// True when one of `callbacks` locates checkpoints (ICheckpointLocator).
bool has_checkpoint_locator(const std::vector<Named<ICallback>>& callbacks);

// The next free version_<n> under `base` (or version_<version> when given).
std::filesystem::path next_version_dir(const std::filesystem::path& base, std::optional<int64_t> version);

}  // namespace ember::engine
