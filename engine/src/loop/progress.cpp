#include "loop/progress.h"

#include <unistd.h>

#include <cstdio>
#include <sstream>

namespace ember::engine {

std::string format_metrics(const std::vector<std::pair<std::string, double>>& values) {
  std::ostringstream out;
  for (size_t i = 0; i < values.size(); ++i) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.4g", values[i].second);
    out << (i ? " " : "") << values[i].first << "=" << buf;
  }
  return out.str();
}

Progress::Progress(bool enabled, bool tty) : enabled_(enabled), tty_(tty) {}

bool Progress::stderr_is_tty() { return isatty(STDERR_FILENO) == 1; }

void Progress::start(const std::string& label, int64_t total) {
  label_ = label;
  total_ = total;
  start_ = last_print_ = std::chrono::steady_clock::now();
  next_plain_ = std::max<int64_t>(1, total / 10);
  active_ = enabled_;
}

std::string Progress::line(int64_t done, const Values& values) const {
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  double rate = secs > 0 ? static_cast<double>(done) / secs : 0.0;
  std::ostringstream out;
  out << label_ << " ";
  if (tty_) {
    const int width = 20;
    int filled = total_ > 0 ? static_cast<int>(width * done / total_) : 0;
    out << "[" << std::string(filled, '#') << std::string(width - filled, ' ') << "] ";
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%lld/%lld %.1fit/s", static_cast<long long>(done), static_cast<long long>(total_), rate);
  out << buf;
  auto m = format_metrics(values);
  if (!m.empty()) out << " " << m;
  return out.str();
}

void Progress::update(int64_t done, const std::function<Values()>& values) {
  if (!active_) return;
  auto now = std::chrono::steady_clock::now();
  if (tty_) {
    if (done < total_ && now - last_print_ < std::chrono::milliseconds(100)) return;
    std::fprintf(stderr, "\r\033[K%s", line(done, values()).c_str());
    std::fflush(stderr);
  } else {
    // A line at each 10% of the epoch but at most every 5 s, and at least every 30 s: short epochs
    // print only their summary, long ones a handful of lines.
    const auto since = now - last_print_;
    bool due = (done >= next_plain_ && since >= std::chrono::seconds(5)) || since >= std::chrono::seconds(30);
    if (!due || done >= total_) return;  // the last line is finish()'s summary
    while (next_plain_ <= done) next_plain_ += std::max<int64_t>(1, total_ / 10);
    std::fprintf(stderr, "%s\n", line(done, values()).c_str());
  }
  last_print_ = now;
}

void Progress::finish(const std::string& summary) {
  if (!active_) return;
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (tty_) std::fprintf(stderr, "\r\033[K");
  std::fprintf(stderr, "%s %s (%.3fs)\n", label_.c_str(), summary.c_str(), secs);
  std::fflush(stderr);
  active_ = false;
}

}  // namespace ember::engine
