// A temporary folder of this process, removed with everything in it when the object goes out
// of scope (also when a command fails): `engine checkpoint consolidate` and `engine export`.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <string>

#include "checkpoint/sharded_checkpoint.h"

namespace ember::engine {

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix)
      : path_(std::filesystem::temp_directory_path() / (prefix + "-" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { remove_tree(path_); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace ember::engine
