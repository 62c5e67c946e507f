// Files written atomically (temp file in the same folder, fsync, rename, fsync of the folder: a
// crash or an error at any point leaves an earlier file of the same name untouched), and files
// read whole into memory.
#pragma once
#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>

namespace ember::engine {

// Writes `data` to `path` atomically. Throws std::runtime_error naming the path on failure.
void atomic_write(const std::filesystem::path& path, const char* data, size_t size);
// The same, with the content produced by `fill`, which passes it piece by piece to the sink it
// is given (nothing is held in memory as a whole).
using ByteSink = std::function<void(const char* data, size_t size)>;
void atomic_write(const std::filesystem::path& path, const std::function<void(const ByteSink&)>& fill);

// The whole file in memory, read with plain read(2) (no per-byte stream iterators).
struct FileBytes {
  std::unique_ptr<char[]> data;
  size_t size = 0;
};
// Throws std::runtime_error naming the path ("cannot read checkpoint ...") when it is missing,
// not a regular file, or shrinks while it is read.
FileBytes read_whole_file(const std::filesystem::path& path);

}  // namespace ember::engine
