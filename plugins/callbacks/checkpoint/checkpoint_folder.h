// The files of a checkpoint folder as the checkpoint callback sees them: which entries are
// checkpoints (files, and the directories a sharding strategy writes), newest first; which one is
// "last"; deleting one; linking last.ckpt to one; and reading this plugin's own state out of one
// (for --resume best).
#pragma once
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <fcntl.h>   // AT_FDCWD, open
#include <unistd.h>  // fsync, close

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>  // rename, renameat2 (glibc), RENAME_EXCHANGE
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <ember/error.h>
#include <ember/support/checkpoint_read.h>

#include "filename_template.h"

namespace ember_checkpoint {

namespace fs = std::filesystem;

// The plugin's name: its state's key among the callbacks of a checkpoint.
inline constexpr const char* kPluginName = "checkpoint";

// A *.ckpt file of a checkpoint folder.
struct CkptFile {
  std::string path;
  fs::file_time_type mtime;
};

// *.ckpt files in `dir`, newest first: regular files, and the directories a sharding strategy
// writes (docs/checkpoint.md: a directory holding meta.ckpt).
inline bool is_checkpoint_entry(const fs::directory_entry& e) {
  std::error_code ec;
  if (e.path().extension() != kExtension) return false;
  if (e.is_regular_file(ec)) return true;
  return e.is_directory(ec) && fs::is_regular_file(e.path() / "meta.ckpt", ec);
}

// Deletes a checkpoint file or directory (LibTorch's wheel breaks std::filesystem::remove_all).
inline void remove_checkpoint(const fs::path& p, std::error_code& ec) {
  if (fs::is_directory(p, ec) && !fs::is_symlink(p, ec)) {
    std::vector<fs::path> children;
    for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) children.push_back(it->path());
    for (const auto& c : children) fs::remove(c, ec);
  }
  fs::remove(p, ec);
}

// Points `link` at `target`, a checkpoint of the same folder, atomically (save_last = "link"): a
// new relative symlink (the folder can move) renamed over `link`. A real directory there (a
// sharded checkpoint written in full) cannot be renamed over: the two are swapped, then the
// directory is deleted. Returns what failed, or "".
inline std::string link_checkpoint(const fs::path& link, const fs::path& target) {
  const fs::path tmp = link.parent_path() / ("." + link.filename().string() + ".link");
  std::error_code ec;
  remove_checkpoint(tmp, ec);  // what a crash left: a link, or a swapped-out directory
  ec.clear();
  fs::create_symlink(target.parent_path() == link.parent_path() ? target.filename() : target, tmp, ec);
  if (ec) return "cannot make the link " + tmp.string() + " to " + target.string() + ": " + ec.message();
  const bool was_directory = fs::is_directory(fs::symlink_status(link, ec));
  const int moved = was_directory ? ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, link.c_str(), RENAME_EXCHANGE)
                                  : ::rename(tmp.c_str(), link.c_str());
  if (moved != 0) {
    const std::string why = std::strerror(errno);
    fs::remove(tmp, ec);
    return "cannot move the link " + tmp.string() + " to " + link.string() + ": " + why;
  }
  if (was_directory) remove_checkpoint(tmp, ec);
  // The rename itself durable, like a checkpoint's.
  if (const int fd = ::open(link.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  return "";
}

inline std::vector<CkptFile> list_checkpoints(const fs::path& dir) {
  std::vector<CkptFile> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code e2;
    if (!is_checkpoint_entry(*it)) continue;
    const auto t = it->last_write_time(e2);
    if (!e2) out.push_back({it->path().string(), t});
  }
  std::stable_sort(out.begin(), out.end(), [](const CkptFile& a, const CkptFile& b) {
    return a.mtime != b.mtime ? a.mtime > b.mtime : a.path > b.path;
  });
  return out;
}

// "last.ckpt", or "last-v<N>.ckpt" that the version counter makes when last.ckpt was someone
// else's.
inline bool is_last_name(const fs::path& p) {
  const std::string stem = p.stem().string();
  const std::string base = kNameLast;
  if (stem == base) return true;
  const std::string prefix = base + kJoinChar + "v";
  if (stem.size() <= prefix.size() || stem.compare(0, prefix.size(), prefix) != 0) return false;
  return std::all_of(stem.begin() + static_cast<std::ptrdiff_t>(prefix.size()), stem.end(),
                     [](char c) { return c >= '0' && c <= '9'; });
}

// This plugin's state inside an engine checkpoint: the file is a pickled dict whose "callbacks"
// entry maps plugin names to their state_dict. nullopt when the file has none (weights only). A
// sharded checkpoint directory keeps it in its meta.ckpt (the parts hold only tensors).
// Only the pickle is read, through the SDK's guards (ember::support::read_checkpoint_skeleton: its
// claims checked before it is unpickled, every tensor a meta tensor), so finding the best file of
// a folder of 90 GB checkpoints (`--resume best`) reads kilobytes, not the whole newest file (and
// twice its size in memory, as torch::pickle_load needs), and a damaged pickle is one line.
inline std::optional<c10::IValue> read_plugin_state(const std::string& checkpoint) {
  std::error_code ec;
  const std::string path = fs::is_directory(checkpoint, ec) ? (fs::path(checkpoint) / "meta.ckpt").string() : checkpoint;
  if (!fs::is_regular_file(path, ec)) throw ember::RunError("cannot open " + path);
  c10::IValue root;
  try {
    root = ember::support::read_checkpoint_skeleton(path);
  } catch (const std::exception& e) {
    throw ember::RunError(e.what());
  }
  if (!root.isGenericDict()) return std::nullopt;
  const auto top = root.toGenericDict();
  auto cbs = top.find(c10::IValue(std::string("callbacks")));
  if (cbs == top.end() || !cbs->value().isGenericDict()) return std::nullopt;
  const auto callbacks = cbs->value().toGenericDict();
  auto mine = callbacks.find(c10::IValue(std::string(kPluginName)));
  if (mine == callbacks.end() || mine->value().isNone()) return std::nullopt;
  return mine->value();
}

}  // namespace ember_checkpoint
