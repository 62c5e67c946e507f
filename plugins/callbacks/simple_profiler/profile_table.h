// The simple profiler's bookkeeping, free of Ember types so unit tests include it: a timeline cut
// into consecutive actions (each moment of the run belongs to exactly one action, so the totals
// add up to the run), and Lightning's SimpleProfiler table.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace ember_prof {

struct Stat {
  int64_t count = 0;
  double total = 0;  // seconds
};

class Timeline {
 public:
  // Ends the current action at `t` (seconds, monotonic) and starts `next` ("" = none: idle time
  // is not recorded, e.g. between fit and test).
  void switch_to(const std::string& next, double t) {
    if (!current_.empty()) {
      auto& s = stats_[current_];
      s.count += 1;
      s.total += t - since_;
    }
    current_ = next;
    since_ = t;
  }
  const std::string& current() const { return current_; }
  const std::map<std::string, Stat>& stats() const { return stats_; }
  // Seconds recorded: the sum over the actions.
  double recorded() const {
    double sum = 0;
    for (const auto& [_, s] : stats_) sum += s.total;
    return sum;
  }

 private:
  std::string current_;
  double since_ = 0;
  std::map<std::string, Stat> stats_;
};

inline std::string format_row(const std::string& action, double mean, int64_t n, double total, double pct) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), "| %-52s | %16.6g | %10lld | %14.6g | %10.3f |\n", action.c_str(), mean,
                static_cast<long long>(n), total, pct);
  return buf;
}

// Lightning's layout: Action | Mean duration (s) | Num calls | Total time (s) | Percentage %,
// sorted by total time, with the run's total first.
inline std::string table(const std::string& title, const std::map<std::string, Stat>& stats, double run_total) {
  std::vector<std::pair<std::string, Stat>> rows(stats.begin(), stats.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.total > b.second.total; });
  char head[512];
  std::snprintf(head, sizeof(head), "| %-52s | %16s | %10s | %14s | %10s |\n", "Action", "Mean duration (s)", "Num calls",
                "Total time (s)", "Percentage %");
  const std::string rule(std::string(head).size() - 1, '-');
  std::string out = title + "\n" + rule + "\n" + head + rule + "\n";
  out += format_row("Total", run_total, 1, run_total, 100.0);
  out += rule + "\n";
  for (const auto& [name, s] : rows)
    out += format_row(name, s.count ? s.total / static_cast<double>(s.count) : 0.0, s.count, s.total,
                      run_total > 0 ? 100.0 * s.total / run_total : 0.0);
  out += rule + "\n";
  return out;
}

}  // namespace ember_prof
