// The composition root: from a config and plugin names to the plugins a run uses, its validated
// configuration (Plan), and the plugin objects made from them. The `engine` commands start here.
#pragma once
#include <ember/host.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "registry/plugin_registry.h"
#include "config/run_config.h"
#include "registry/named.h"

namespace ember::engine {

struct RunRequest;

// The IHost plugins talk to: the engine's log and versions, and while the model is built the
// strategy's deferred initialisation (ember/deferred_init.h).
class EngineHost final : public IHost {
 public:
  void log(LogLevel level, std::string_view message) override;
  std::string engine_version() const override;
  int sdk_abi_minor() const override;
  void* query_interface(const char* iid) override;
  // Offered from here until it is set back to nullptr.
  void offer_deferred_init(void* deferred_init) { deferred_init_ = deferred_init; }

 private:
  void* deferred_init_ = nullptr;
};

// Everything decided before any plugin object exists: which plugins, and the validated config.
struct Plan {
  RawConfig raw;
  std::unique_ptr<PluginRegistry> registry;
  const PluginInfo* strategy = nullptr;
  const PluginInfo* precision = nullptr;
  const PluginInfo* model = nullptr;  // null when the program provides the model object
  const PluginInfo* data = nullptr;   // null when the program provides the data object
  std::vector<const PluginInfo*> callbacks, loggers;
  ResolvedConfig config;
  std::string auto_precision_note;  // what trainer.precision = "auto" chose and why ("" otherwise)
};

// Loads the config (file and --set overrides) and the plugins it and --plugins name, applies
// Lightning's implicit callbacks and loggers, and validates everything against the schemas.
// Throws UsageError (with file:line) for anything wrong.
Plan make_plan(const RunRequest& request);

// One plugin object of `info`, configured from `section`, in `slot`.
template <class T>
void make_plugin_object(Named<T>& slot, const PluginInfo& info, IHost& host, const IConfig& section) {
  slot.name = info.name;
  slot.version = info.descriptor->version ? info.descriptor->version : "";
  slot.object = create_plugin_object<T>(info, host, section);
}

}  // namespace ember::engine
