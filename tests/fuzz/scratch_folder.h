// Where the harnesses that read files (model_file_inputs, data_file_inputs) write the file under
// test: a folder of this process's own under $TMPDIR (or /tmp), one file at a time, removed when
// the process ends.
#pragma once
#include <ftw.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "fuzz_inputs.h"

namespace ember::fuzz {

class ScratchFolder {
 public:
  explicit ScratchFolder(const std::string& harness) {
    const char* tmp = std::getenv("TMPDIR");
    path_ = std::filesystem::path(tmp && *tmp ? tmp : "/tmp") / ("ember-fuzz-" + harness + "-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path_);
  }
  // With POSIX calls: at exit, std::filesystem::remove_all resolved to libtorch's own copy, which
  // crashed there (a null call while the process's statics were being destroyed).
  ~ScratchFolder() {
    ::nftw(
        path_.c_str(), [](const char* file, const struct stat*, int, struct FTW*) { return ::remove(file); }, 16, FTW_DEPTH | FTW_PHYS);
  }
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;

  const std::filesystem::path& path() const { return path_; }

  std::filesystem::path write(const std::string& name, std::string_view bytes) const {
    const std::filesystem::path file = path_ / name;
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return file;
  }

  // A clean error of a reader: one line that names the file it read (a path in this folder).
  void check_clean_error(const std::string& what) const {
    if (what.empty()) throw Finding("an error with an empty message");
    if (what.find('\n') != std::string::npos) throw Finding("an error spans several lines: " + what);
    if (what.find(path_.string()) == std::string::npos) throw Finding("the error does not name the file: " + what);
  }

 private:
  std::filesystem::path path_;
};

}  // namespace ember::fuzz
