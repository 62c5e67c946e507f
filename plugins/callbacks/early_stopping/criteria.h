// The early-stopping decision without a trainer (Lightning's
// EarlyStopping._evaluate_stopping_criteria), so unit tests can drive it with scripted values.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <utility>

namespace ember_early_stopping {

enum class Mode { min, max };

struct Settings {
  std::string monitor;
  Mode mode = Mode::min;
  double min_delta = 0.0;  // >= 0; the direction comes from the mode
  int64_t patience = 3;
  bool check_finite = true;
  std::optional<double> stopping_threshold, divergence_threshold;
};

// What survives a resume (Lightning's state_dict: wait_count, stopped_epoch, best_score).
struct State {
  int64_t wait_count = 0;
  int64_t stopped_epoch = 0;
  double best_score = 0.0;
};

struct Decision {
  bool stop = false;
  bool improved = false;
  std::string reason;  // why it stopped, or the improvement; empty when nothing happened
};

inline std::string fmt3(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

class Criteria {
 public:
  explicit Criteria(Settings s) : s_(std::move(s)) { reset(); }

  void reset() {
    state_ = State{};
    state_.best_score = s_.mode == Mode::min ? std::numeric_limits<double>::infinity()
                                             : -std::numeric_limits<double>::infinity();
  }
  const Settings& settings() const { return s_; }
  const State& state() const { return state_; }
  State& state() { return state_; }

  // Lightning's monitor_op: strictly better.
  bool better(double a, double b) const { return s_.mode == Mode::min ? a < b : a > b; }

  // One check with the monitored value `current`, in Lightning's order: non-finite, stopping
  // threshold, divergence threshold, improvement by more than min_delta, else patience.
  Decision evaluate(double current) {
    Decision d;
    const std::string& m = s_.monitor;
    if (s_.check_finite && !std::isfinite(current)) {
      d.stop = true;
      d.reason = "monitored metric " + m + " = " + num(current) + " is not finite; previous best value was " +
                 fmt3(state_.best_score);
    } else if (s_.stopping_threshold && better(current, *s_.stopping_threshold)) {
      d.stop = true;
      d.reason = "stopping threshold reached: " + m + " = " + num(current) + " " + op() + " " +
                 num(*s_.stopping_threshold);
    } else if (s_.divergence_threshold && better(-current, -*s_.divergence_threshold)) {
      d.stop = true;
      d.reason = "divergence threshold reached: " + m + " = " + num(current) + " " + anti_op() + " " +
                 num(*s_.divergence_threshold);
    } else if (better(s_.mode == Mode::min ? current + s_.min_delta : current - s_.min_delta, state_.best_score)) {
      d.improved = true;
      if (std::isfinite(state_.best_score))
        d.reason = "metric " + m + " improved by " + fmt3(std::abs(state_.best_score - current)) + " >= min_delta = " +
                   fmt3(s_.min_delta) + "; new best score: " + fmt3(current);
      else
        d.reason = "metric " + m + " improved; new best score: " + fmt3(current);
      state_.best_score = current;
      state_.wait_count = 0;
    } else {
      ++state_.wait_count;
      if (state_.wait_count >= s_.patience) {
        d.stop = true;
        d.reason = "monitored metric " + m + " did not improve in the last " + std::to_string(state_.wait_count) +
                   " records; best score: " + fmt3(state_.best_score);
      }
    }
    return d;
  }

 private:
  static std::string num(double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    return buf;
  }
  const char* op() const { return s_.mode == Mode::min ? "<" : ">"; }
  const char* anti_op() const { return s_.mode == Mode::min ? ">" : "<"; }

  Settings s_;
  State state_;
};

}  // namespace ember_early_stopping
