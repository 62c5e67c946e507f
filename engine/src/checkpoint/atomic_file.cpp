#include "checkpoint/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fs = std::filesystem;

namespace ember::engine {
namespace {
[[noreturn]] void fail(const fs::path& p, const std::string& what, int err) {
  throw std::runtime_error("cannot write checkpoint " + p.string() + ": " + what + " (" + std::strerror(err) + ")");
}
}  // namespace

FileBytes read_whole_file(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot read checkpoint " + path.string() + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error("cannot read checkpoint " + path.string() + ": " + (err ? std::strerror(err) : "not a regular file"));
  }
  FileBytes out;
  out.size = static_cast<size_t>(st.st_size);
  out.data.reset(new char[std::max<size_t>(out.size, 1)]);
  size_t done = 0;
  while (done < out.size) {
    ssize_t n = ::read(fd, out.data.get() + done, out.size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      ::close(fd);
      throw std::runtime_error("cannot read checkpoint " + path.string() + ": " +
                               (err ? std::strerror(err) : "the file shrank while it was read"));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return out;
}

void atomic_write(const fs::path& path, const std::function<void(const ByteSink&)>& fill) {
  fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::error_code ec;
  fs::create_directories(dir, ec);
  std::string tmp_name = ".";  // (built step by step: GCC 12 warns falsely on "lit" + string&&)
  tmp_name += path.filename().string();
  tmp_name += ".tmp.";
  tmp_name += std::to_string(getpid());
  fs::path tmp = dir / tmp_name;
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, "cannot create " + tmp.string(), errno);
  // The sink never throws (it may be called from inside LibTorch's zip writer, whose destructor
  // would otherwise throw during unwinding): it keeps the first error and drops the rest.
  int write_error = 0;
  const ByteSink sink = [&](const char* data, size_t size) {
    size_t written = 0;
    while (write_error == 0 && written < size) {
      ssize_t n = ::write(fd, data + written, size - written);
      if (n < 0) {
        if (errno == EINTR) continue;
        write_error = errno;
        break;
      }
      written += static_cast<size_t>(n);
    }
  };
  try {
    fill(sink);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (write_error != 0) {
    ::close(fd);
    ::unlink(tmp.c_str());
    fail(path, "write failed", write_error);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, "fsync failed", err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, "rename failed", err);
  }
  // Make the rename itself durable.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void atomic_write(const fs::path& path, const char* data, size_t size) {
  atomic_write(path, [&](const ByteSink& sink) { sink(data, size); });
}

}  // namespace ember::engine
