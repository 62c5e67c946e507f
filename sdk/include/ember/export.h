// Visibility of SDK types. Plugins build with -fvisibility=hidden; the SDK's interfaces and
// exception types keep default visibility so their type_info matches across the engine and
// every plugin (exceptions thrown in a plugin are caught by type in the engine).
#pragma once
#define EMBER_SDK_API __attribute__((visibility("default")))
#define EMBER_PLUGIN_EXPORT extern "C" __attribute__((visibility("default")))
