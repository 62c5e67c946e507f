// Finds plugin files, checks their descriptors against this engine's ABI and build fingerprint,
// loads them (RTLD_NOW, never unloaded) and creates their objects.
#pragma once
#include <ember/abi.h>
#include <ember/config.h>
#include <ember/host.h>
#include <ember/library.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ember::engine {

const char* kind_name(uint32_t kind);

// Plugins this build left out for want of an optional dependency (cmake/EmberOptionalDeps.cmake),
// each with the reason and the fix: (name, why).
std::vector<std::pair<std::string, std::string>> not_built_plugins();
std::optional<std::string> why_not_built(const std::string& name);

// This engine's fingerprint (the same macro a plugin uses, evaluated in the engine).
EmberBuildFingerprint engine_fingerprint();
// "CUDA 13.0", "no device runtime (CPU-only LibTorch)": a fingerprint's device runtime in words.
std::string device_runtime_string(uint32_t runtime, uint32_t version);

struct PluginInfo {
  std::string name;
  std::filesystem::path file;
  const EmberPluginDescriptor* descriptor = nullptr;  // valid for the life of the process
};

class PluginRegistry {
 public:
  // Search order: explicit paths (--plugin-path), EMBER_PLUGIN_PATH, the installed folder next to
  // libember.so (or next to the executable that links the engine statically), the build tree.
  // The first file named lib<name>.so wins.
  explicit PluginRegistry(std::vector<std::filesystem::path> search_paths);

  static std::vector<std::filesystem::path> default_search_paths(const std::vector<std::string>& explicit_paths);

  // Names of every lib*.so found, without loading them.
  std::vector<std::string> available() const;
  std::optional<std::filesystem::path> find_file(const std::string& name) const;

  // Loads and checks a plugin named by the user. Throws UsageError (unknown name, with a
  // suggestion among `suggestions`, else among every plugin found) or PluginError (refused: one
  // line naming file, field, both values and the fix).
  const PluginInfo& load(const std::string& name, const std::vector<std::string>& suggestions = {});
  // Loads every plugin found; refused ones are reported through `warn` and skipped.
  std::vector<const PluginInfo*> load_all(const std::function<void(const std::string&)>& warn);

  const std::vector<std::filesystem::path>& search_paths() const { return paths_; }

 private:
  std::vector<std::filesystem::path> paths_;
  std::map<std::string, std::filesystem::path> files_;
  std::map<std::string, std::unique_ptr<PluginInfo>> loaded_;
};

class EMBER_API PluginError : public std::runtime_error {  // exported: `engine` catches it by type
 public:
  using std::runtime_error::runtime_error;
};

// Loads `file` and checks its descriptor; exposed for tests. Throws PluginError.
const EmberPluginDescriptor* load_descriptor(const std::filesystem::path& file, const std::string& expected_name);

// An object created by a plugin, destroyed by that plugin's destroy().
template <class T>
std::shared_ptr<T> create_plugin_object(const PluginInfo& info, IHost& host, const IConfig& config) {
  void* out = nullptr;
  char error[1024] = {0};
  int rc = info.descriptor->create(&host, &config, &out, error, sizeof(error));
  if (rc != 0 || out == nullptr)
    throw PluginError("plugin '" + info.name + "': " + (error[0] ? std::string(error) : std::string("create failed")));
  auto destroy = info.descriptor->destroy;
  return std::shared_ptr<T>(static_cast<T*>(out), [destroy](T* p) { destroy(p); });
}

}  // namespace ember::engine
