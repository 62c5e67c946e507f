// Defining a plugin: the descriptor, the config schema and the exception-safe C entry points.
//
//   #include <ember/plugin.h>
//   static constexpr EmberConfigKey kKeys[] = {
//       ember::key::Float("lr", "0.01", "Learning rate.").above(0.0),
//       ember::key::String("mode", "\"min\"", "Whether lower or higher is better.").choices("min|max"),
//       ember::key::Elsewhere("period", "Lightning 1.x's period is every_n_epochs"),  // not a key
//   };
//   static ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new My(host, cfg); }
//   EMBER_PLUGIN(ember::ICallback, "my_callback", "1.0.0", "MIT", "What it does, in one line.",
//                EMBER_CONFIG_KEYS(kKeys), make)
//
// The macro exports the one C symbol `ember_plugin_descriptor`. create() catches every exception
// and turns it into the one-line error the engine prints; destroy() deletes through the kind's
// interface inside this library (objects are always destroyed by the plugin that made them).
#pragma once
#include <cstdio>
#include <cstring>
#include <exception>

#include <torch/headeronly/version.h>

#include "ember/abi.h"
#include "ember/config.h"
#include "ember/export.h"
#include "ember/host.h"

namespace ember {

class IStrategy;
class IPrecision;
class ICallback;
class ILogger;
class IModel;
class IDataModule;

template <class Interface> struct kind_of;
template <> struct kind_of<IStrategy> { static constexpr uint32_t value = EMBER_KIND_STRATEGY; };
template <> struct kind_of<IPrecision> { static constexpr uint32_t value = EMBER_KIND_PRECISION; };
template <> struct kind_of<ICallback> { static constexpr uint32_t value = EMBER_KIND_CALLBACK; };
template <> struct kind_of<ILogger> { static constexpr uint32_t value = EMBER_KIND_LOGGER; };
template <> struct kind_of<IModel> { static constexpr uint32_t value = EMBER_KIND_MODEL; };
template <> struct kind_of<IDataModule> { static constexpr uint32_t value = EMBER_KIND_DATA; };

// Builders for EmberConfigKey entries, usable in constant expressions.
namespace key {
struct Spec {
  EmberConfigKey k;
  constexpr Spec at_least(double v) const { Spec s = *this; s.k.flags |= EMBER_KEY_HAS_MIN; s.k.min_value = v; return s; }
  constexpr Spec above(double v) const { Spec s = at_least(v); s.k.flags |= EMBER_KEY_MIN_EXCLUSIVE; return s; }
  constexpr Spec at_most(double v) const { Spec s = *this; s.k.flags |= EMBER_KEY_HAS_MAX; s.k.max_value = v; return s; }
  constexpr Spec below(double v) const { Spec s = at_most(v); s.k.flags |= EMBER_KEY_MAX_EXCLUSIVE; return s; }
  constexpr Spec choices(const char* c) const { Spec s = *this; s.k.choices = c; return s; }
  constexpr operator EmberConfigKey() const { return k; }  // NOLINT: implicit by design
};
constexpr Spec make(const char* name, uint32_t type, const char* def, const char* help) {
  return Spec{EmberConfigKey{name, type, 0u, def, help, nullptr, 0.0, 0.0}};
}
constexpr Spec Bool(const char* n, const char* d, const char* h) { return make(n, EMBER_TYPE_BOOL, d, h); }
constexpr Spec Int(const char* n, const char* d, const char* h) { return make(n, EMBER_TYPE_INT, d, h); }
constexpr Spec Float(const char* n, const char* d, const char* h) { return make(n, EMBER_TYPE_FLOAT, d, h); }
constexpr Spec Number(const char* n, const char* d, const char* h) { return make(n, EMBER_TYPE_NUMBER, d, h); }
constexpr Spec String(const char* n, const char* d, const char* h) { return make(n, EMBER_TYPE_STRING, d, h); }
constexpr Spec IntList(const char* n, const char* d, const char* h) { return make(n, EMBER_TYPE_INT_LIST, d, h); }
constexpr Spec FloatList(const char* n, const char* d, const char* h) { return make(n, EMBER_TYPE_FLOAT_LIST, d, h); }
constexpr Spec StringList(const char* n, const char* d, const char* h) { return make(n, EMBER_TYPE_STRING_LIST, d, h); }
// Another tool's name for something this plugin takes another way (SDK 2.19): setting it is an
// error that ends with `instead`, e.g. Elsewhere("period", "Lightning 1.x's period is every_n_epochs").
constexpr Spec Elsewhere(const char* n, const char* instead) {
  Spec s = make(n, EMBER_TYPE_STRING, nullptr, instead);
  s.k.flags = EMBER_KEY_ELSEWHERE;
  return s;
}
}  // namespace key

namespace detail {
inline void copy_error(char* out, size_t size, const char* text) {
  if (out == nullptr || size == 0) return;
  std::snprintf(out, size, "%s", text ? text : "unknown error");
}
}  // namespace detail

}  // namespace ember

// The build fingerprint of this translation unit. The build (ember_add_plugin) defines
// EMBER_CUDA_VERSION; the EMBER_FINGERPRINT_* overrides exist for the ABI refusal tests only.
#ifndef EMBER_CUDA_VERSION
#error "EMBER_CUDA_VERSION is not defined: build plugins with ember_add_plugin() from the EmberSDK CMake package"
#endif
#ifndef EMBER_FINGERPRINT_TORCH_MINOR
#define EMBER_FINGERPRINT_TORCH_MINOR TORCH_VERSION_MINOR
#endif
#ifndef EMBER_FINGERPRINT_SDK_MAJOR
#define EMBER_FINGERPRINT_SDK_MAJOR EMBER_SDK_ABI_MAJOR
#endif
#ifndef EMBER_FINGERPRINT_SDK_MINOR
#define EMBER_FINGERPRINT_SDK_MINOR EMBER_SDK_ABI_MINOR
#endif
// The device runtime: CUDA when the LibTorch build has it (EMBER_CUDA_VERSION != 0), else none.
#define EMBER_DEVICE_RUNTIME (EMBER_CUDA_VERSION != 0 ? EMBER_DEVICE_RUNTIME_CUDA : EMBER_DEVICE_RUNTIME_NONE)
#define EMBER_BUILD_FINGERPRINT                                                                 \
  EmberBuildFingerprint {                                                                       \
    TORCH_VERSION_MAJOR, EMBER_FINGERPRINT_TORCH_MINOR, TORCH_VERSION_PATCH,                    \
        _GLIBCXX_USE_CXX11_ABI, EMBER_DEVICE_RUNTIME, EMBER_CUDA_VERSION, _GLIBCXX_RELEASE       \
  }

#define EMBER_CONFIG_KEYS(array) array, static_cast<uint32_t>(sizeof(array) / sizeof((array)[0]))
#define EMBER_NO_CONFIG_KEYS nullptr, 0u

// Defines the plugin. INTERFACE is the kind's interface (ember::IModel, ember::ICallback, ...);
// FACTORY is `INTERFACE* (ember::IHost&, const ember::IConfig&)`.
#define EMBER_PLUGIN(INTERFACE, NAME, VERSION, LICENSE, DESCRIPTION, KEYS, FACTORY)            \
  namespace {                                                                                  \
  int ember_plugin_create_(void* host, const void* config, void** out, char* error,            \
                           size_t error_size) noexcept {                                       \
    try {                                                                                      \
      INTERFACE* object = FACTORY(*static_cast<ember::IHost*>(host),                           \
                                  *static_cast<const ember::IConfig*>(config));                \
      *out = static_cast<void*>(object);                                                       \
      return object ? 0 : (ember::detail::copy_error(error, error_size, "factory returned null"), 1); \
    } catch (const std::exception& e) {                                                        \
      ember::detail::copy_error(error, error_size, e.what());                                  \
    } catch (...) {                                                                            \
      ember::detail::copy_error(error, error_size, "unknown exception");                      \
    }                                                                                          \
    return 1;                                                                                  \
  }                                                                                            \
  void ember_plugin_destroy_(void* object) noexcept {                                          \
    try { delete static_cast<INTERFACE*>(object); } catch (...) {}                             \
  }                                                                                            \
  }                                                                                            \
  EMBER_PLUGIN_EXPORT const EmberPluginDescriptor* ember_plugin_descriptor(void) {             \
    static const EmberPluginDescriptor descriptor = {                                          \
        sizeof(EmberPluginDescriptor), EMBER_PLUGIN_MAGIC, EMBER_FINGERPRINT_SDK_MAJOR,        \
        EMBER_FINGERPRINT_SDK_MINOR, EMBER_BUILD_FINGERPRINT, NAME, VERSION, LICENSE,           \
        ember::kind_of<INTERFACE>::value, DESCRIPTION, KEYS, sizeof(EmberConfigKey),            \
        &ember_plugin_create_, &ember_plugin_destroy_, {}};                                    \
    return &descriptor;                                                                        \
  }
