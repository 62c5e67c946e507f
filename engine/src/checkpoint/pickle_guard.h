// Guards around LibTorch's unpickler, which trusts what a pickle claims: check_pickle_claims
// walks the pickle's opcodes before it is unpickled (sizes and memo indices against the pickle's
// own size), check_loaded_value checks every tensor of the result against its storage. Both throw
// std::invalid_argument saying what is wrong. Found necessary by fuzzing (docs/build.md).
#pragma once
#include <ATen/core/ivalue.h>

#include <string_view>

namespace ember::engine {

void check_pickle_claims(std::string_view pickle);
void check_loaded_value(const c10::IValue& root);

}  // namespace ember::engine
