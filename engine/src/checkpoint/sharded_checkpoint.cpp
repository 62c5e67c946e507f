#include "checkpoint/sharded_checkpoint.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "checkpoint/checkpoint_io.h"

namespace fs = std::filesystem;

namespace ember::engine {
namespace {
constexpr const char* kMeta = "meta.ckpt";

fs::path part_file(const fs::path& dir, int64_t rank) { return dir / ("rank" + std::to_string(rank) + ".ckpt"); }

fs::path partial_dir(const fs::path& dir) {
  return dir.parent_path() / ("." + dir.filename().string() + ".partial");
}

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Swaps `from` into `to` atomically; the old `to` (if any) ends up at `from`. A symbolic link at
// `to` (checkpoint.save_last = "link"), even one whose target is gone, is what is swapped out,
// never the directory it points at.
void exchange(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(to, ec))) {
    if (::rename(from.c_str(), to.c_str()) != 0)
      throw std::runtime_error("cannot move " + from.string() + " to " + to.string() + " (" + std::strerror(errno) + ")");
    return;
  }
  if (::syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) != 0)
    throw std::runtime_error("cannot swap " + from.string() + " into " + to.string() + " (" + std::strerror(errno) + ")");
}
}  // namespace

bool is_sharded_checkpoint(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(path / kMeta, ec);
}

void remove_tree(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec) && !fs::is_symlink(path, ec)) {
    std::vector<fs::path> children;
    for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) children.push_back(it->path());
    for (const auto& c : children) remove_tree(c);
  }
  fs::remove(path, ec);
}

namespace {
// Throws on every rank when `error` is set on any rank.
void agree(const fs::path& dir, const std::string& error, const ShardedWrite& how, const char* stage) {
  const bool failed_here = !error.empty();
  if (how.max_over_ranks(failed_here ? 1.0 : 0.0) > 0.0)
    throw std::runtime_error("cannot write sharded checkpoint " + dir.string() + ": " +
                             (failed_here ? error : std::string("another rank failed while ") + stage));
}
}  // namespace

void prepare_sharded_checkpoint(const fs::path& dir, const ShardedWrite& how) {
  const fs::path tmp = partial_dir(dir);
  std::string error;
  if (how.rank == 0) {
    try {
      remove_tree(tmp);  // what a crashed save left
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      error = std::string("cannot create ") + tmp.string() + " (" + e.what() + ")";
    }
  }
  agree(dir, error, how, "preparing the directory");
}

void write_sharded_part(const fs::path& dir, int64_t rank, const c10::IValue& part, const c10::IValue& meta,
                        const c10::IValue& callback_states) {
  const fs::path tmp = partial_dir(dir);
  c10::impl::GenericDict wrapped(c10::StringType::get(), c10::AnyType::get());
  wrapped.insert("format", std::string(kCheckpointFormat));
  wrapped.insert("format_version", kCheckpointFormatVersion);
  wrapped.insert("part", part);
  if (!callback_states.isNone()) wrapped.insert("callbacks", callback_states);
  save_checkpoint_file(part_file(tmp, rank), wrapped);
  if (rank == 0) save_checkpoint_file(tmp / kMeta, meta);
}

void commit_sharded_checkpoint(const fs::path& dir, const std::string& part_error, const ShardedWrite& how) {
  agree(dir, part_error, how, "writing its part");
  std::string error;
  if (how.rank == 0) {
    const fs::path tmp = partial_dir(dir);
    try {
      fsync_dir(tmp);
      exchange(tmp, dir);
      fsync_dir(dir.parent_path().empty() ? fs::path(".") : dir.parent_path());
      remove_tree(tmp);  // the previous checkpoint, swapped out
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  agree(dir, error, how, "committing the checkpoint");
}

void write_sharded_checkpoint(const fs::path& dir, const c10::IValue& part, const c10::IValue& meta, const ShardedWrite& how,
                              const c10::IValue& callback_states) {
  prepare_sharded_checkpoint(dir, how);
  std::string error;
  try {
    write_sharded_part(dir, how.rank, part, meta, callback_states);
  } catch (const std::exception& e) {
    error = e.what();
  }
  commit_sharded_checkpoint(dir, error, how);
}

c10::impl::GenericDict read_sharded_meta(const fs::path& dir) {
  auto meta = load_checkpoint_file(dir / kMeta);
  if (!meta.contains("sharded"))
    throw std::runtime_error("checkpoint " + dir.string() + " has a meta.ckpt without the sharded layout (not an Ember sharded checkpoint)");
  return meta;
}

ShardedPartFile read_sharded_part_file(const fs::path& dir, int64_t rank) {
  const fs::path file = part_file(dir, rank);
  std::error_code ec;
  if (!fs::is_regular_file(file, ec))
    throw std::runtime_error("sharded checkpoint " + dir.string() + " lacks " + file.filename().string() + " (incomplete copy?)");
  auto d = load_checkpoint_file(file);
  if (!d.contains("part")) throw std::runtime_error("checkpoint part " + file.string() + " holds no part");
  return {d.at("part"), d.contains("callbacks") ? d.at("callbacks") : c10::IValue()};
}

c10::IValue read_sharded_part(const fs::path& dir, int64_t rank) { return read_sharded_part_file(dir, rank).part; }

}  // namespace ember::engine
