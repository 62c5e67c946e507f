#include "checkpoint_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include <torch/csrc/jit/serialization/pickle.h>

namespace fs = std::filesystem;

namespace ember::engine {
namespace {
[[noreturn]] void fail(const fs::path& p, const std::string& what) {
  throw std::runtime_error("cannot write checkpoint " + p.string() + ": " + what + " (" + std::strerror(errno) + ")");
}
}  // namespace

void atomic_write(const fs::path& path, const char* data, size_t size) {
  fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::error_code ec;
  fs::create_directories(dir, ec);
  std::string tmp_name = ".";  // (built step by step: GCC 12 warns falsely on "lit" + string&&)
  tmp_name += path.filename().string();
  tmp_name += ".tmp.";
  tmp_name += std::to_string(getpid());
  fs::path tmp = dir / tmp_name;
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, "cannot create " + tmp.string());
  size_t written = 0;
  while (written < size) {
    ssize_t n = ::write(fd, data + written, size - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail(path, "write failed");
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    fail(path, "fsync failed");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    fail(path, "rename failed");
  }
  // Make the rename itself durable.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void save_checkpoint_file(const fs::path& path, const c10::IValue& checkpoint) {
  std::vector<char> bytes = torch::jit::pickle_save(checkpoint);
  atomic_write(path, bytes.data(), bytes.size());
}

c10::impl::GenericDict load_checkpoint_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read checkpoint " + path.string() + ": " + std::strerror(errno));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw std::runtime_error("checkpoint " + path.string() + " is corrupt or not a checkpoint (" +
                             std::string(e.what()).substr(0, 200) + ")");
  }
  if (!value.isGenericDict()) throw std::runtime_error("checkpoint " + path.string() + " is not an Ember checkpoint");
  auto dict = value.toGenericDict();
  if (!dict.contains("format") || !dict.at("format").isString() || dict.at("format").toStringRef() != kCheckpointFormat)
    throw std::runtime_error("checkpoint " + path.string() + " is not an Ember checkpoint (no format tag)");
  int64_t version = dict.contains("format_version") ? dict.at("format_version").toInt() : -1;
  if (version > kCheckpointFormatVersion)
    throw std::runtime_error("checkpoint " + path.string() + " has format version " + std::to_string(version) +
                             ", newer than this engine's " + std::to_string(kCheckpointFormatVersion) + " (upgrade the engine)");
  return dict;
}

}  // namespace ember::engine
