// The engine's commands, callable from main() and from tests.
#pragma once
#include <ostream>
#include <string>
#include <vector>

namespace ember::engine {

struct RunRequest {
  std::string config_path;
  std::vector<std::string> plugins;       // --plugins (comma lists already split)
  std::vector<std::string> sets;          // --set section.key=value
  std::vector<std::string> plugin_paths;  // --plugin-path
  std::string resume;                     // --resume last|best|PATH
  std::vector<std::string> argv;          // the engine's own command line (for launchers)
  // `engine checkpoint consolidate`: restore `resume` (a sharded directory), write this file, stop.
  std::string consolidate_to;
};

// `engine run.toml`: fit, then test when the config asks. Returns the exit code.
int run_training(const RunRequest& request);
// `engine checkpoint consolidate DIR OUT.ckpt`: the single-file checkpoint of a sharded checkpoint
// directory (what single_device and Python read), made by restoring DIR into the run's own
// configuration on one process.
int consolidate_checkpoint(const RunRequest& request, const std::string& dir, const std::string& out);
// `engine config run.toml`: prints the resolved configuration.
int print_config(const RunRequest& request, std::ostream& out);
// `engine plugins list` / `engine plugins info NAME`.
int list_plugins(const std::vector<std::string>& plugin_paths, std::ostream& out);
int plugin_info(const std::string& name, const std::vector<std::string>& plugin_paths, std::ostream& out);

}  // namespace ember::engine
