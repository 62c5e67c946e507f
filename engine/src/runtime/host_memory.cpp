#include "runtime/host_memory.h"

#include <fstream>
#include <string>

namespace ember::engine {
namespace {

// A "<key>:   123 kB" line of /proc/self/status, in bytes.
std::optional<int64_t> status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) != 0) continue;
    try {
      return static_cast<int64_t>(std::stoll(line.substr(key.size() + 1))) * 1024;
    } catch (...) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

}  // namespace

HostMemoryPeak::HostMemoryPeak() {
  std::ofstream reset("/proc/self/clear_refs");
  reset << "5";  // "5": reset the peak resident set size (Linux 4.0)
  reset.flush();
  if (!reset) return;
  start_ = status_bytes("VmRSS");
}

std::optional<int64_t> HostMemoryPeak::growth() const {
  if (!start_) return std::nullopt;
  const auto peak = status_bytes("VmHWM");
  if (!peak) return std::nullopt;
  return *peak > *start_ ? *peak - *start_ : 0;
}

}  // namespace ember::engine
