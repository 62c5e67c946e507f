// Training progress on stderr. On a terminal: one line updated in place (at most ~10 times a
// second). Otherwise (CI logs, files): a plain line every `lines_per_epoch`-th of an epoch and at
// most every 30 s, so redirected logs do not fill with bar redraws (Lightning #8975).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace ember::engine {

class Progress {
 public:
  using Values = std::vector<std::pair<std::string, double>>;
  Progress(bool enabled, bool tty);
  static bool stderr_is_tty();

  void start(const std::string& label, int64_t total);
  // Called after every batch. `values` is only invoked when something is printed (it reads
  // metrics back from the device).
  void update(int64_t done, const std::function<Values()>& values);
  void finish(const std::string& summary);
  bool tty() const { return tty_; }

 private:
  std::string line(int64_t done, const Values& values) const;
  bool enabled_, tty_;
  std::string label_;
  int64_t total_ = 0, next_plain_ = 0;
  std::chrono::steady_clock::time_point start_, last_print_;
  bool active_ = false;
};

std::string format_metrics(const std::vector<std::pair<std::string, double>>& values);

}  // namespace ember::engine
