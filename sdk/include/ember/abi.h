// Ember plugin ABI: the one C-level contract between the engine and a plugin `.so`.
//
// A plugin exports exactly one symbol, `ember_plugin_descriptor`, returning a pointer to a
// constant, plain-data EmberPluginDescriptor. The engine reads and checks every field below
// BEFORE it calls anything else in the plugin. Behind the descriptor sit the pure-virtual C++
// interfaces of <ember/*.h>; their compatibility is what the build fingerprint guards.
//
// Versioning (docs/abi.md has the full rules):
//   - EMBER_SDK_ABI_MAJOR changes when anything released changes incompatibly (a field or a
//     virtual function moves, changes type or disappears). The engine requires it to be equal.
//   - EMBER_SDK_ABI_MINOR changes when something is only appended (a descriptor field at the end,
//     a hook or kind enum value, a virtual at the end of a host-implemented interface, a new
//     interface). The engine requires plugin minor <= engine minor.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define EMBER_SDK_ABI_MAJOR 2
#define EMBER_SDK_ABI_MINOR 24
#define EMBER_PLUGIN_MAGIC 0x454D4252u /* "EMBR" */
#define EMBER_PLUGIN_ENTRY_SYMBOL "ember_plugin_descriptor"

#ifdef __cplusplus
extern "C" {
#endif

// Plugin kinds. Values are stable; new kinds are appended (minor bump).
typedef enum EmberPluginKind {
  EMBER_KIND_STRATEGY = 1,
  EMBER_KIND_PRECISION = 2,
  EMBER_KIND_CALLBACK = 3,
  EMBER_KIND_LOGGER = 4,
  EMBER_KIND_MODEL = 5,
  EMBER_KIND_DATA = 6,
  // Reserved for the next kinds, so their numbers are known now: scheduler, profiler, tuner.
  EMBER_KIND_SCHEDULER = 7,
  EMBER_KIND_PROFILER = 8,
  EMBER_KIND_TUNER = 9
} EmberPluginKind;

// Types a config key may have. NUMBER is "int or float": an int means a count, a float a fraction
// (Lightning's limit_train_batches / val_check_interval convention).
typedef enum EmberConfigType {
  EMBER_TYPE_BOOL = 1,
  EMBER_TYPE_INT = 2,
  EMBER_TYPE_FLOAT = 3,
  EMBER_TYPE_STRING = 4,
  EMBER_TYPE_NUMBER = 5,
  EMBER_TYPE_INT_LIST = 6,
  EMBER_TYPE_FLOAT_LIST = 7,
  EMBER_TYPE_STRING_LIST = 8
} EmberConfigType;

// Flags of a config key.
#define EMBER_KEY_HAS_MIN 1u   // value >= min_value (numbers, and every element of a list)
#define EMBER_KEY_HAS_MAX 2u   // value <= max_value
#define EMBER_KEY_MIN_EXCLUSIVE 4u  // value > min_value instead of >=
#define EMBER_KEY_MAX_EXCLUSIVE 8u  // value < max_value instead of <=
// Not a key (SDK 2.19): a name users bring from another tool (a Lightning argument) that this
// plugin takes another way. Setting it is the "unknown key" error with `help` appended, which
// says what to write instead; type, default and range are ignored. The engine refuses one whose
// help is empty or whose name is also a real key of the plugin.
#define EMBER_KEY_ELSEWHERE 16u

// One key of a plugin's config table. `default_toml` is a TOML literal ("0.1", "true",
// "\"min\"", "[0.9, 0.999]"), or NULL for "unset" (the key is optional and has no default).
// `choices`, when not NULL, lists the allowed strings separated by '|'.
typedef struct EmberConfigKey {
  const char* key;
  uint32_t type;  // EmberConfigType
  uint32_t flags;
  const char* default_toml;
  const char* help;
  const char* choices;
  double min_value;
  double max_value;
} EmberConfigKey;

// The device runtime a LibTorch build (and so a plugin built against it) was compiled for.
// Values are stable; new runtimes are appended.
typedef enum EmberDeviceRuntime {
  EMBER_DEVICE_RUNTIME_NONE = 0,  // a CPU-only LibTorch
  EMBER_DEVICE_RUNTIME_CUDA = 1,  // version: CUDA_VERSION style (13000 = 13.0)
  EMBER_DEVICE_RUNTIME_ROCM = 2   // version: HIP_VERSION style
} EmberDeviceRuntime;

// What the plugin was compiled against. Every field must equal the engine's, except
// glibcxx_release, which must be <= the engine's (a newer libstdc++ is backward compatible).
typedef struct EmberBuildFingerprint {
  uint32_t torch_major;
  uint32_t torch_minor;
  uint32_t torch_patch;
  uint32_t cxx11_abi;               // _GLIBCXX_USE_CXX11_ABI
  uint32_t device_runtime;          // EmberDeviceRuntime
  uint32_t device_runtime_version;  // 0 for EMBER_DEVICE_RUNTIME_NONE
  uint32_t glibcxx_release;         // _GLIBCXX_RELEASE (the GCC major of the libstdc++ headers)
} EmberBuildFingerprint;

// Creates the plugin's object. `host` is an ember::IHost*, `config` an ember::IConfig* holding
// the plugin's own table, already validated against `config_keys` with defaults filled in.
// On success writes the object (a pointer to the kind's interface, e.g. ember::IStrategy*) to
// *out and returns 0. On failure returns non-zero and writes a one-line message to `error`
// (at most error_size bytes, NUL-terminated). Never throws.
typedef int (*EmberCreateFn)(void* host, const void* config, void** out, char* error,
                             size_t error_size);
// Destroys an object made by this plugin's create. Never throws.
typedef void (*EmberDestroyFn)(void* object);

typedef struct EmberPluginDescriptor {
  uint32_t struct_size;  // sizeof(EmberPluginDescriptor) as the plugin saw it
  uint32_t magic;        // EMBER_PLUGIN_MAGIC
  uint32_t sdk_abi_major;
  uint32_t sdk_abi_minor;
  EmberBuildFingerprint fingerprint;
  const char* name;         // unique plugin name, [a-z0-9_]+, equal to the file's lib<name>.so
  const char* version;      // the plugin's own version, e.g. "1.2.0"
  const char* license;      // SPDX identifier
  uint32_t kind;            // EmberPluginKind
  const char* description;  // one line
  const EmberConfigKey* config_keys;
  uint32_t num_config_keys;
  uint32_t config_key_size;  // sizeof(EmberConfigKey) as the plugin saw it
  EmberCreateFn create;
  EmberDestroyFn destroy;
  void* reserved[8];  // zero; room to grow without moving anything
} EmberPluginDescriptor;

typedef const EmberPluginDescriptor* (*EmberDescriptorFn)(void);

#ifdef __cplusplus
}
#endif
