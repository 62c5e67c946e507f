// Reading torch.save files (Ember's checkpoints among them) safely (SDK 2.20; Ember::checkpoint_read,
// a static helper library the engine links too).
//
// LibTorch's unpickler trusts what a pickle claims. check_pickle_claims walks the pickle's
// opcodes before it is unpickled (sizes and memo indices against the pickle's own size);
// check_loaded_value checks every tensor of the result against its storage. Both throw
// std::invalid_argument saying what is wrong. Found necessary by fuzzing (docs/build.md).
//
// read_checkpoint_skeleton reads a file's object without reading any tensor data: for a plugin
// that needs a checkpoint's small entries (a callback's state, its global_step) from a file that
// may be far larger than memory.
#pragma once
#include <ATen/core/ivalue.h>

#include <string>
#include <string_view>

namespace ember::support {

void check_pickle_claims(std::string_view pickle);
void check_loaded_value(const c10::IValue& root);

// The object a torch.save file (`file`: a .ckpt, .pt, or a sharded checkpoint's meta.ckpt) holds,
// with every tensor a meta tensor of its shape and dtype: only data.pkl is read, its claims
// checked first, and the result has no tensor data to read past. Throws std::runtime_error, one
// line naming the file, for a file that is missing, not a torch.save archive, or whose pickle is
// damaged.
c10::IValue read_checkpoint_skeleton(const std::string& file);

}  // namespace ember::support
