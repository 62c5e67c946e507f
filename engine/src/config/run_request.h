// What a run is asked to do: the config (a file or TOML text), plugin names, overrides, resume,
// and objects the program made itself. `engine` fills it from its command line; the library's
// ember::Run from RunOptions.
#pragma once
#include <ember/callback.h>
#include <ember/data.h>
#include <ember/logger.h>
#include <ember/model.h>

#include <memory>
#include <string>
#include <vector>

namespace ember::engine {

// Objects a program made itself, used in place of the plugins [model] name, [data] name and the
// callback/logger plugins would give. Their own settings come from the program, not the config.
struct ProvidedObjects {
  std::shared_ptr<IModel> model;
  std::shared_ptr<IDataModule> data;
  std::vector<std::shared_ptr<ICallback>> callbacks;
  std::vector<std::shared_ptr<ILogger>> loggers;
};

struct RunRequest {
  std::string config_path;                // the run.toml; with config_text, only its name in messages
  std::string config_text;                // TOML text in memory instead of reading config_path
  std::vector<std::string> plugins;       // --plugins (comma lists already split)
  std::vector<std::string> sets;          // --set section.key=value
  std::vector<std::string> plugin_paths;  // --plugin-path
  std::string resume;                     // --resume last|best|PATH
  std::vector<std::string> argv;          // the program's own command line (launchers re-run it)
  // `engine checkpoint consolidate`: restore `resume` (a sharded directory), write this file, stop;
  // with consolidate_weights_only, the model's weights alone (the optimizer is neither read nor
  // gathered).
  std::string consolidate_to;
  bool consolidate_weights_only = false;
  // `engine validate|test|predict|generate --ckpt`: the weights come from that checkpoint, so
  // [model] init_checkpoint is not read.
  bool weights_from_ckpt = false;
  ProvidedObjects provided;
  // Stop signals are process-wide: the `engine` command installs them, a library user opts in.
  bool stop_signal_handlers = true;
  // ember::Fabric: the program runs its own loop, so no model or data is planned (as if the
  // program provided both objects).
  bool program_loop = false;
};

}  // namespace ember::engine
