// Host statistics of this process from /proc (Linux), free of Ember types.
#pragma once
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace ember_ds {

// VmRSS and VmHWM (peak) of /proc/self/status, in bytes; false when unreadable.
inline bool rss_bytes(double* rss, double* peak) {
  std::ifstream in("/proc/self/status");
  std::string line;
  bool got_rss = false, got_peak = false;
  while (std::getline(in, line)) {
    auto kb = [&](const char* key, double* out) {
      if (line.rfind(key, 0) != 0) return false;
      std::istringstream s(line.substr(std::string(key).size()));
      double v = 0;
      s >> v;
      *out = v * 1024.0;
      return true;
    };
    got_rss = kb("VmRSS:", rss) || got_rss;
    got_peak = kb("VmHWM:", peak) || got_peak;
  }
  return got_rss && got_peak;
}

// CPU seconds (user + system) this process used so far, all threads.
inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// Total physical memory of the machine, bytes.
inline double total_memory_bytes() {
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

}  // namespace ember_ds
