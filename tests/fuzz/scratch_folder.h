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

#include <ember/error.h>

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

  // Runs `read` (a harness reading the file it wrote here): true when the file is accepted, false
  // for a clean error (its message in *error when given): ember::RunError or ConfigError, one line,
  // naming the file. Anything else is a Finding.
  template <class Read>
  bool judge(Read read, std::string* error) const {
    try {
      read();
    } catch (const Finding&) {
      throw;
    } catch (const ember::RunError& e) {
      return clean(e.what(), error);
    } catch (const ember::ConfigError& e) {
      return clean(e.what(), error);
    } catch (const std::exception& e) {
      throw Finding(std::string("unexpected exception (not a one-line error naming the file): ") + e.what());
    }
    return true;
  }

  // The file harnesses' entry: the input's first byte picks one of `readers` (byte % their
  // count, so a corpus keeps its meaning while the list does not change), the rest is the file's
  // bytes, judged as above. An empty input is refused without a finding.
  template <class... Readers>
  bool judge_by_first_byte(std::string_view input, std::string* error, Readers... readers) const {
    if (input.empty()) return false;
    const size_t pick = static_cast<unsigned char>(input[0]) % sizeof...(Readers);
    input.remove_prefix(1);
    return judge(
        [&] {
          size_t i = 0;
          // Calls the picked reader only: the fold stops at the first index that matches.
          (void)((i++ == pick ? (readers(input), true) : false) || ...);
        },
        error);
  }

 private:
  bool clean(const std::string& what, std::string* error) const {
    if (what.empty()) throw Finding("an error with an empty message");
    if (what.find('\n') != std::string::npos) throw Finding("an error spans several lines: " + what);
    if (what.find(path_.string()) == std::string::npos) throw Finding("the error does not name the file: " + what);
    if (error) *error = what;
    return false;
  }

  std::filesystem::path path_;
};

}  // namespace ember::fuzz
