// ember::IHost: what the engine offers every plugin from create() on. Implemented by the engine.
#pragma once
#include <string>
#include <string_view>

#include "ember/export.h"

namespace ember {

enum class LogLevel : int { debug = 0, info = 1, warn = 2, error = 3 };

class EMBER_SDK_API IHost {
 public:
  virtual ~IHost() = default;
  // Writes one line through the engine's logger (rank-aware, same format as the engine's own).
  virtual void log(LogLevel level, std::string_view message) = 0;
  // The engine's version string ("0.1.0") and SDK ABI, for plugins that adapt to their host.
  virtual std::string engine_version() const = 0;
  virtual int sdk_abi_minor() const = 0;
  // SDK 2.10 (appended): what the engine offers a plugin beyond the above, by id, or nullptr.
  // While a model is built, "ember.IDeferredInit/1" (ember/deferred_init.h); models reach it
  // through ember::parameters_initialised rather than directly.
  virtual void* query_interface(const char* /*iid*/) { return nullptr; }
};

}  // namespace ember
