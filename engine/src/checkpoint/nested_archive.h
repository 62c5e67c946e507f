// A torch::save archive held inside a checkpoint as a byte tensor (an optimizer's state, whole or
// in a sharded part or a pipeline stage's), which a strategy later reads with torch::load. LibTorch's
// unpickler trusts what such an archive's pickles claim as much as the checkpoint's own, so they are
// checked the same way first: each pickle's size claims, then its tensors against storages sized by
// their records (torch::load would size them by the pickle's claims); and torch::load compiles the
// archive's TorchScript and runs a class's __setstate__ while it loads, so its code may only
// declare classes of attributes, as torch::save writes them.
#pragma once
#include <cstdint>
#include <string_view>

namespace ember::engine {

// The archive in `bytes`, as a checkpoint load holds it (load_checkpoint_file does this for every
// 1-D byte tensor that starts with a zip header). false when `bytes` is not a readable archive
// (torch::load's own error then says so); throws std::invalid_argument naming the archive's record
// and what is wrong.
bool check_nested_archive(std::string_view bytes);

// The same for an archive lying at bytes [offset, offset + size) of the open file `fd` (`engine
// checkpoint verify`): only its directory and its pickles are read, never its tensor data, so a
// multi-GB optimizer state is checked in the memory its pickles take.
bool check_nested_archive_in_file(int fd, uint64_t offset, uint64_t size);

}  // namespace ember::engine
