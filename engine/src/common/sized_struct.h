// Plain structs a plugin filled (Batch, LogOptions: docs/abi.md) carry their size. The engine
// reads a field appended after SDK 2.0 only when ember::has_field says the plugin knew it, and
// refuses, in one line, a struct too small to hold even SDK 2.0's fields: one not made by its
// default initializer, or from a foreign binary.
#pragma once
#include <ember/error.h>
#include <ember/types.h>

#include <string>

namespace ember::engine {

// `last_field`: the last field the struct had in SDK 2.0 (the first layout with a size).
template <class T, class M>
void require_sdk2_fields(const T& object, M T::*last_field, const char* what) {
  if (!has_field(object, last_field))
    throw RunError(std::string(what) + " from a plugin has struct_size " + std::to_string(object.struct_size) +
                   ", too small for SDK 2.0's fields (build it with its default initializer, against this engine's SDK)");
}

}  // namespace ember::engine
