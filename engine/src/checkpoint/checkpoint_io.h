// Checkpoint files (docs/checkpoint.md): a zip archive in torch.save's layout (`data.pkl` plus one
// `data/<n>` record per tensor storage), so Python's torch.load reads it, plus Ember's own
// records: `ember/manifest` holds a CRC32C and the size of every payload record and is checked on
// every load, so a damaged file is refused instead of training on from damaged weights.
// Files are written atomically (atomic_file.h): a crash or error at any point leaves an earlier
// file with the same name untouched. The parts: archive.* (zip layout in memory, the manifest),
// <ember/support/checkpoint_read.h> (checks around LibTorch's unpickler, shared with plugins),
// container_types.* (static container types), nested_archive.* (torch::save archives inside one),
// crc32c.*.
#pragma once
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/atomic_file.h"  // atomic_write, read_whole_file
#include "checkpoint/crc32c.h"

namespace ember::engine {

void save_checkpoint_file(const std::filesystem::path& path, const c10::IValue& checkpoint);
// Throws std::runtime_error naming the path when it is missing, unreadable, damaged (a record
// fails its checksum) or not an Ember checkpoint.
c10::impl::GenericDict load_checkpoint_file(const std::filesystem::path& path);
// The same for a file's bytes already in memory; `where` names it in errors.
c10::impl::GenericDict load_checkpoint_bytes(const char* data, size_t size, const std::string& where);

// The archive `bytes` with its manifest rewritten to fit its records as they are now: what a file
// damaged or crafted with its checksums made right looks like (fuzzing and tests: the reader must
// still fail cleanly). Throws when `bytes` is not a readable archive.
std::string reseal_checkpoint_bytes(std::string_view bytes);

// What a file is, found cheaply (the manifest only, no tensor data) for files of format 2 and
// later; older files are loaded whole. Never throws.
struct CheckpointProbe {
  bool ember = false;         // an Ember checkpoint this engine can read
  bool weights_only = false;  // saved with save_weights_only: it can be tested, not resumed
  std::optional<int64_t> global_step;  // the optimizer steps it holds, when the file says
  std::string why;            // when not `ember`: what is wrong, for a message
};
CheckpointProbe probe_checkpoint_file(const std::filesystem::path& path);

// `engine checkpoint verify`: every record of the file against its manifest's CRC32C and size,
// read in chunks (a few MB of memory whatever the file's size), then its pickle read without
// tensor data, then the pickles of the torch::save archives it holds (check_nested_archive_in_file). Throws std::runtime_error, one line naming the path, when it is damaged, has no
// manifest (format 1, another program's file), or is not an Ember checkpoint.
struct VerifiedCheckpoint {
  int64_t format_version = 0;
  bool weights_only = false;
  size_t records = 0;          // payload records checked
  uint64_t payload_bytes = 0;  // their bytes
  size_t archives = 0;         // torch::save archives within (optimizer states), their pickles checked
  c10::IValue skeleton;        // its object, every tensor a meta tensor (read_checkpoint_skeleton)
};
VerifiedCheckpoint verify_checkpoint_file(const std::filesystem::path& path);

inline constexpr const char* kCheckpointFormat = "ember-checkpoint";
// 1: pickle_save's archive, no checksums. 2: + ember/manifest with CRC32C of every record.
inline constexpr int64_t kCheckpointFormatVersion = 2;
inline constexpr const char* kManifestRecord = "ember/manifest";
inline constexpr const char* kTypesRecord = "ember/types";
// "global_step <n>\nepoch <n>\n": the loop position, readable without unpickling anything, so
// `--resume last` can rank a folder's checkpoints by the state they hold. Absent from files
// without a global_step (Fabric's) and from files written before it (engines that predate it
// read it as one more checked record and ignore it).
inline constexpr const char* kPositionRecord = "ember/position";

}  // namespace ember::engine
