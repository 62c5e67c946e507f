// Checkpoint files: a pickled c10::GenericDict (readable by Python's torch.load too), written
// atomically: temp file in the same folder, fsync, rename, fsync of the folder. A crash or error
// at any point leaves an earlier file with the same name untouched.
#pragma once
#include <ATen/core/ivalue.h>

#include <filesystem>
#include <string>
#include <vector>

namespace ember::engine {

// Writes `bytes` to `path` atomically. Throws std::runtime_error naming the path on failure.
void atomic_write(const std::filesystem::path& path, const char* data, size_t size);
void save_checkpoint_file(const std::filesystem::path& path, const c10::IValue& checkpoint);
// Throws std::runtime_error naming the path when it is missing, unreadable or not an Ember checkpoint.
c10::impl::GenericDict load_checkpoint_file(const std::filesystem::path& path);

inline constexpr const char* kCheckpointFormat = "ember-checkpoint";
inline constexpr int64_t kCheckpointFormatVersion = 1;

}  // namespace ember::engine
