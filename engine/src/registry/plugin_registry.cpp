#include "registry/plugin_registry.h"

#include <ember/plugin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include <boost/dll/shared_library.hpp>
#include <boost/dll/runtime_symbol_info.hpp>
#include <c10/util/Logging.h>  // FLAGS_caffe2_use_fatal_for_enforce
#include <dlfcn.h>

#include <mutex>

#include "config/engine_schema.h"
#include "config/run_config.h"
#include "not_built_plugins.h"

#ifndef EMBER_BUILD_PLUGIN_DIR
#define EMBER_BUILD_PLUGIN_DIR ""
#endif
#ifndef EMBER_LIBRARY_PLUGIN_RELDIR
#define EMBER_LIBRARY_PLUGIN_RELDIR "ember/plugins"
#endif
#ifndef EMBER_INSTALL_PLUGIN_RELDIR
#define EMBER_INSTALL_PLUGIN_RELDIR "../lib/ember/plugins"
#endif

namespace fs = std::filesystem;

namespace ember::engine {

std::vector<std::pair<std::string, std::string>> not_built_plugins() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const char* const* e = kNotBuiltPlugins; *e != nullptr; ++e) {
    const std::string entry(*e);
    const auto eq = entry.find('=');
    out.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return out;
}

std::optional<std::string> why_not_built(const std::string& name) {
  for (auto& [n, why] : not_built_plugins())
    if (n == name) return why;
  return std::nullopt;
}

namespace {

// Loaded libraries are never unloaded (LLVM, GStreamer and OBS do the same): objects, vtables,
// type_info and static registrations of a plugin stay valid until the process exits.
std::vector<boost::dll::shared_library*>& keep_loaded() {
  static auto* libs = new std::vector<boost::dll::shared_library*>();
  return *libs;
}

// A library a plugin depends on may export a data symbol of the same name as one of LibTorch's,
// already loaded: the library's own references then bind to LibTorch's object, and its static
// constructors write over it. Debian's libsentencepiece (text_lm) defines absl-style flags, among
// them a 32-byte `FLAGS_minloglevel`, and libc10 a 4-byte one: bound to c10's, sentencepiece's
// constructor overwrote c10's neighbouring flags, `caffe2_use_fatal_for_enforce` among them, so
// every LibTorch enforce failure (an allocation that fails) aborted the process instead of
// throwing. Loaded first, on their own, with RTLD_DEEPBIND, such libraries bind to their own
// symbols (they call no malloc directly: their operator new is libstdc++'s, over the process's
// allocator). A library that is not installed is skipped.
//
// Not under a sanitizer: its runtime refuses RTLD_DEEPBIND (it would bypass the interceptors) and
// ends the process, so sanitizer builds load such libraries unisolated and without the check below.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define EMBER_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define EMBER_UNDER_SANITIZER 1
#endif
#endif
#ifdef EMBER_UNDER_SANITIZER
constexpr bool kIsolateLibraries = false;
#else
constexpr bool kIsolateLibraries = true;
#endif

// LibTorch's flag read as its byte: where nothing isolates a clashing library (sanitizer builds)
// the byte it left need not be a valid bool, and loading it as one is undefined (UBSan said so).
unsigned char fatal_enforce_flag_byte() {
  unsigned char byte = 0;
  std::memcpy(&byte, &FLAGS_caffe2_use_fatal_for_enforce, 1);
  return byte;
}

void isolate_clashing_libraries() {
  if (!kIsolateLibraries) return;
  static std::once_flag once;
  std::call_once(once, [] {
    for (const char* name : {"libsentencepiece.so.0", "libsentencepiece_train.so.0"})
      (void)dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);  // kept for the process's life
  });
}

std::string hint_for_load_error(const std::string& what) {
  if (what.find("__cxx11") != std::string::npos)
    return " (a std::string/std::list symbol of the other C++ ABI: rebuild the plugin with the same "
           "_GLIBCXX_USE_CXX11_ABI as the engine, i.e. against the same LibTorch)";
  if (what.find("undefined symbol") != std::string::npos)
    return " (the plugin needs a symbol this engine and its LibTorch do not provide: rebuild it against "
           "this engine's SDK and LibTorch 2.11)";
  if (what.find("cannot open shared object") != std::string::npos)
    return " (a library the plugin depends on was not found: check LD_LIBRARY_PATH or the plugin's RPATH)";
  if (what.find("Cannot initialize CUDA without ATen_cuda") != std::string::npos)
    return " (link the plugin with -Wl,--no-as-needed against torch_cuda)";
  return "";
}

std::string version3(uint32_t a, uint32_t b, uint32_t c) {
  return std::to_string(a) + "." + std::to_string(b) + "." + std::to_string(c);
}

// Plugins an engine release removed, with where their users go (docs/decisions.md).
std::optional<std::string> why_retired(const std::string& name) {
  if (name == "dp")
    return std::string("was retired in Ember 2.0, as Lightning 2.0 retired DataParallel: use --plugins ddp "
                       "(one process per device, on GPUs and CPUs, and faster than dp's module replicas)");
  return std::nullopt;
}

}  // namespace

std::string device_runtime_string(uint32_t runtime, uint32_t version) {
  const std::string v = std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
  switch (runtime) {
    case EMBER_DEVICE_RUNTIME_NONE: return "no device runtime (CPU-only LibTorch)";
    case EMBER_DEVICE_RUNTIME_CUDA: return "CUDA " + v;
    case EMBER_DEVICE_RUNTIME_ROCM: return "ROCm (HIP " + std::to_string(version) + ")";
    default: return "device runtime #" + std::to_string(runtime) + " version " + std::to_string(version);
  }
}

const char* kind_name(uint32_t kind) {
  switch (kind) {
    case EMBER_KIND_STRATEGY: return "strategy";
    case EMBER_KIND_PRECISION: return "precision";
    case EMBER_KIND_CALLBACK: return "callback";
    case EMBER_KIND_LOGGER: return "logger";
    case EMBER_KIND_MODEL: return "model";
    case EMBER_KIND_DATA: return "data";
    case EMBER_KIND_SCHEDULER: return "scheduler";
    case EMBER_KIND_PROFILER: return "profiler";
    case EMBER_KIND_TUNER: return "tuner";
    default: return "unknown";
  }
}

EmberBuildFingerprint engine_fingerprint() {
  return EmberBuildFingerprint{TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, _GLIBCXX_USE_CXX11_ABI,
                               EMBER_DEVICE_RUNTIME, EMBER_CUDA_VERSION, _GLIBCXX_RELEASE};
}

const EmberPluginDescriptor* load_descriptor(const fs::path& file, const std::string& expected_name) {
  const std::string where = "plugin '" + expected_name + "' (" + file.string() + ")";
  isolate_clashing_libraries();
  const unsigned char fatal_enforce_before = fatal_enforce_flag_byte();
  auto* lib = new boost::dll::shared_library();
  boost::dll::fs::error_code ec;
  lib->load(file, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local, ec);
  if (ec) {
    std::string what = ec.message();
    if (const char* e = dlerror()) what = e;
    // Boost reports a generic message; dlopen's own text says what is missing.
    void* h = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) what = dlerror();
    delete lib;
    throw PluginError(where + " failed to load: " + what + hint_for_load_error(what));
  }
  keep_loaded().push_back(lib);
  // The clash above, with a library not yet known to clash: refused rather than run with
  // LibTorch's memory overwritten.
  if (kIsolateLibraries && fatal_enforce_flag_byte() != fatal_enforce_before)
    throw PluginError(where + " loaded a library whose static constructors overwrote LibTorch's own flags (an exported symbol of "
                      "the same name as one of libc10's, such as FLAGS_minloglevel): add it to isolate_clashing_libraries() in "
                      "engine/src/registry/plugin_registry.cpp, or link the plugin against a build of it that hides its symbols");
  if (!lib->has(EMBER_PLUGIN_ENTRY_SYMBOL))
    throw PluginError(where + " is not an Ember plugin: it does not export '" EMBER_PLUGIN_ENTRY_SYMBOL
                      "' (build it with ember_add_plugin() and the EMBER_PLUGIN macro)");
  auto fn = lib->get<const EmberPluginDescriptor*()>(EMBER_PLUGIN_ENTRY_SYMBOL);
  const EmberPluginDescriptor* d = fn();
  if (!d) throw PluginError(where + " returned no descriptor");
  // The first four fields are fixed forever: check them before reading anything else.
  if (d->magic != EMBER_PLUGIN_MAGIC)
    throw PluginError(where + " rejected: descriptor magic 0x" + [&] { char b[16]; std::snprintf(b, sizeof b, "%08x", d->magic); return std::string(b); }() +
                      " is not Ember's 0x454d4252 (not an Ember plugin, or a corrupt file)");
  // Only the first four fields are read for a plugin of another major: the rest of its descriptor
  // (the fingerprint, from 2.0 on) may be laid out differently.
  if (d->sdk_abi_major != EMBER_SDK_ABI_MAJOR)
    throw PluginError(where + " rejected: built against Ember SDK " + std::to_string(d->sdk_abi_major) + "." +
                      std::to_string(d->sdk_abi_minor) + ", this engine speaks SDK " + std::to_string(EMBER_SDK_ABI_MAJOR) + "." +
                      std::to_string(EMBER_SDK_ABI_MINOR) + " (SDK ABI major " + std::to_string(d->sdk_abi_major) + " != engine " +
                      std::to_string(EMBER_SDK_ABI_MAJOR) + "; rebuild the plugin against Ember SDK " + std::to_string(EMBER_SDK_ABI_MAJOR) +
                      "." + std::to_string(EMBER_SDK_ABI_MINOR) + (d->sdk_abi_major < EMBER_SDK_ABI_MAJOR ? ": docs/abi.md says what changed)" : ")"));
  if (d->sdk_abi_minor > EMBER_SDK_ABI_MINOR)
    throw PluginError(where + " rejected: SDK ABI minor " + std::to_string(d->sdk_abi_minor) + " > engine " +
                      std::to_string(EMBER_SDK_ABI_MINOR) + " (the plugin needs a newer engine: upgrade the engine, or "
                      "rebuild the plugin against SDK " + std::to_string(EMBER_SDK_ABI_MAJOR) + "." +
                      std::to_string(EMBER_SDK_ABI_MINOR) + ")");
  if (d->struct_size < offsetof(EmberPluginDescriptor, reserved))
    throw PluginError(where + " rejected: descriptor struct_size " + std::to_string(d->struct_size) + " < " +
                      std::to_string(offsetof(EmberPluginDescriptor, reserved)) + " (corrupt or foreign descriptor)");
  const auto& p = d->fingerprint;
  const auto e = engine_fingerprint();
  const std::string fix = " (rebuild the plugin against this engine's LibTorch " +
                          version3(e.torch_major, e.torch_minor, e.torch_patch) + ", " +
                          device_runtime_string(e.device_runtime, e.device_runtime_version) + ")";
  if (p.torch_major != e.torch_major || p.torch_minor != e.torch_minor || p.torch_patch != e.torch_patch)
    throw PluginError(where + " rejected: LibTorch " + version3(p.torch_major, p.torch_minor, p.torch_patch) +
                      " != engine " + version3(e.torch_major, e.torch_minor, e.torch_patch) + fix);
  if (p.cxx11_abi != e.cxx11_abi)
    throw PluginError(where + " rejected: _GLIBCXX_USE_CXX11_ABI " + std::to_string(p.cxx11_abi) + " != engine " +
                      std::to_string(e.cxx11_abi) + fix);
  if (p.device_runtime != e.device_runtime || p.device_runtime_version != e.device_runtime_version)
    throw PluginError(where + " rejected: built for " + device_runtime_string(p.device_runtime, p.device_runtime_version) +
                      ", the engine for " + device_runtime_string(e.device_runtime, e.device_runtime_version) + fix);
  if (p.glibcxx_release > e.glibcxx_release)
    throw PluginError(where + " rejected: built with libstdc++ " + std::to_string(p.glibcxx_release) +
                      " > engine " + std::to_string(e.glibcxx_release) +
                      " (rebuild the plugin with the engine's compiler, GCC " + std::to_string(e.glibcxx_release) + ")");
  if (!d->name || expected_name != d->name)
    throw PluginError(where + " rejected: descriptor name '" + std::string(d->name ? d->name : "") +
                      "' does not match the file name (rename the file to lib" + std::string(d->name ? d->name : "?") + ".so)");
  if (d->kind < EMBER_KIND_STRATEGY || d->kind > EMBER_KIND_DATA)
    throw PluginError(where + " rejected: kind " + std::to_string(d->kind) + " (" + kind_name(d->kind) +
                      ") is not supported by this engine (upgrade the engine)");
  if (!d->create || !d->destroy)
    throw PluginError(where + " rejected: descriptor has no create/destroy function");
  if (d->num_config_keys > 0 && (!d->config_keys || d->config_key_size != sizeof(EmberConfigKey)))
    throw PluginError(where + " rejected: config_key_size " + std::to_string(d->config_key_size) + " != engine " +
                      std::to_string(sizeof(EmberConfigKey)) + " (rebuild the plugin against this SDK)");
  for (uint32_t i = 0; i < d->num_config_keys; ++i)
    if (!d->config_keys[i].key || d->config_keys[i].type < EMBER_TYPE_BOOL || d->config_keys[i].type > EMBER_TYPE_STRING_LIST)
      throw PluginError(where + " rejected: config key #" + std::to_string(i) + " has no name or an unknown type");
  // A name flagged "elsewhere" is advice, not a key: it must say something and not hide a real key.
  for (uint32_t i = 0; i < d->num_config_keys; ++i) {
    const auto& k = d->config_keys[i];
    if (!(k.flags & EMBER_KEY_ELSEWHERE)) continue;
    if (!k.help || !*k.help)
      throw PluginError(where + " rejected: config name '" + k.key + "' is flagged EMBER_KEY_ELSEWHERE but its help is empty " +
                        "(write what to set instead: ember::key::Elsewhere(name, instead))");
    for (uint32_t j = 0; j < d->num_config_keys; ++j)
      if (j != i && !(d->config_keys[j].flags & EMBER_KEY_ELSEWHERE) && std::string_view(d->config_keys[j].key) == k.key)
        throw PluginError(where + " rejected: config name '" + k.key + "' is both a key and flagged EMBER_KEY_ELSEWHERE " +
                          "(drop one of the two)");
  }
  // A model's or data module's keys share [model] / [data] with the engine's own keys there: a
  // name the engine defines is the engine's, so the plugin's key (or advice) would never be read.
  if (d->kind == EMBER_KIND_MODEL || d->kind == EMBER_KIND_DATA) {
    const char* section = d->kind == EMBER_KIND_MODEL ? "model" : "data";
    const auto base = d->kind == EMBER_KIND_MODEL ? model_base_keys() : data_base_keys();
    for (uint32_t i = 0; i < d->num_config_keys; ++i) {
      const std::string_view name = d->config_keys[i].key;
      if (std::none_of(base.begin(), base.end(), [&](const KeySchema& b) { return b.key == name; })) continue;
      if (d->config_keys[i].flags & EMBER_KEY_ELSEWHERE)
        throw PluginError(where + " rejected: config name '" + std::string(name) + "' is flagged EMBER_KEY_ELSEWHERE, but " + section +
                          "." + std::string(name) + " is the engine's key, so its advice would never be shown (drop the flag)");
      throw PluginError(where + " rejected: config key '" + std::string(name) + "' is already the engine's key " + section + "." +
                        std::string(name) + " (rename it in the plugin)");
    }
  }
  return d;
}

PluginRegistry::PluginRegistry(std::vector<fs::path> search_paths) : paths_(std::move(search_paths)) {
  for (const auto& dir : paths_) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<fs::path> found;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const auto& p = entry.path();
      auto fname = p.filename().string();
      if (fname.size() > 6 && fname.starts_with("lib") && fname.ends_with(".so")) found.push_back(p);
    }
    std::sort(found.begin(), found.end());
    for (const auto& p : found) {
      auto fname = p.filename().string();
      files_.emplace(fname.substr(3, fname.size() - 6), p);  // first path wins
    }
  }
}

std::vector<fs::path> PluginRegistry::default_search_paths(const std::vector<std::string>& explicit_paths) {
  std::vector<fs::path> paths;
  auto add_list = [&](const std::string& list) {
    size_t start = 0;
    while (start <= list.size()) {
      auto end = list.find(':', start);
      auto item = list.substr(start, end == std::string::npos ? std::string::npos : end - start);
      if (!item.empty()) paths.emplace_back(item);
      if (end == std::string::npos) break;
      start = end + 1;
    }
  };
  for (const auto& p : explicit_paths) add_list(p);
  if (const char* env = std::getenv("EMBER_PLUGIN_PATH")) add_list(env);
  // The installed folder, found from the module that holds this code (dladdr): libember.so in
  // <prefix>/lib finds <prefix>/lib/ember/plugins whichever program loaded it; then from the
  // executable (<prefix>/bin/../lib/ember/plugins), for programs that link the engine statically.
  auto add_unique = [&](const fs::path& p) {
    if (std::find(paths.begin(), paths.end(), p) == paths.end()) paths.push_back(p);
  };
  std::error_code ec;
  auto lib_dir = boost::dll::this_line_location(ec).parent_path();
  if (!ec) add_unique(fs::weakly_canonical(lib_dir / EMBER_LIBRARY_PLUGIN_RELDIR, ec));
  ec.clear();
  auto exe_dir = boost::dll::program_location(ec).parent_path();
  if (!ec) add_unique(fs::weakly_canonical(exe_dir / EMBER_INSTALL_PLUGIN_RELDIR, ec));
  if (std::strlen(EMBER_BUILD_PLUGIN_DIR) > 0) paths.emplace_back(EMBER_BUILD_PLUGIN_DIR);
  return paths;
}

std::vector<std::string> PluginRegistry::available() const {
  std::vector<std::string> names;
  for (const auto& [name, _] : files_) names.push_back(name);
  return names;
}

std::optional<fs::path> PluginRegistry::find_file(const std::string& name) const {
  auto it = files_.find(name);
  if (it == files_.end()) return std::nullopt;
  return it->second;
}

const PluginInfo& PluginRegistry::load(const std::string& name, const std::vector<std::string>& suggestions) {
  if (auto it = loaded_.find(name); it != loaded_.end()) return *it->second;
  auto file = find_file(name);
  if (!file) {
    if (auto why = why_retired(name)) throw UsageError("plugin '" + name + "' " + *why);
    if (auto why = why_not_built(name)) throw UsageError("plugin '" + name + "' is not part of this build: " + *why);
    std::string searched;
    for (const auto& p : paths_) {
      if (!searched.empty()) searched += ':';
      searched += p.string();
    }
    throw UsageError("unknown plugin '" + name + "'" + did_you_mean(name, suggestions.empty() ? available() : suggestions) +
                     "; searched " + (searched.empty() ? "nothing" : searched) +
                     " (`engine plugins list` shows what is installed; add folders with --plugin-path or EMBER_PLUGIN_PATH)");
  }
  auto info = std::make_unique<PluginInfo>();
  info->name = name;
  info->file = *file;
  info->descriptor = load_descriptor(*file, name);
  auto& ref = *info;
  loaded_.emplace(name, std::move(info));
  return ref;
}

std::vector<const PluginInfo*> PluginRegistry::load_all(const std::function<void(const std::string&)>& warn) {
  std::vector<const PluginInfo*> out;
  for (const auto& name : available()) {
    try {
      out.push_back(&load(name));
    } catch (const std::exception& e) {
      warn(std::string(e.what()) + "; skipped");
    }
  }
  return out;
}

}  // namespace ember::engine
