// The host memory a phase of start-up takes at its peak (Linux: the resident set's high-water
// mark, reset at the start of the phase), for the set-up line that shows what deferred
// initialisation saves.
#pragma once
#include <cstdint>
#include <optional>

namespace ember::engine {

class HostMemoryPeak {
 public:
  // Resets the process's high-water mark to what it holds now (/proc/self/clear_refs) and
  // remembers that; without /proc (or the right to reset) the measure is off.
  HostMemoryPeak();
  // Bytes above the start at the peak since then; nothing when it cannot be measured.
  std::optional<int64_t> growth() const;

 private:
  std::optional<int64_t> start_;
};

}  // namespace ember::engine
