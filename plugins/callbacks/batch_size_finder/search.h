// The batch size search without a trainer (Lightning's BatchSizeFinder: _run_power_scaling and
// _run_binary_scaling). `try_size(n)` runs a trial and says whether n fits.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace ember_batch_size {

enum class Mode { power, binsearch };
enum class Outcome {
  fits,
  too_big,     // out of memory, or over the memory budget
  data_limit,  // the training data has fewer samples than n: no full batch of that size exists
};

struct Settings {
  Mode mode = Mode::power;
  int64_t init_val = 2, max_trials = 25, max_val = 8192;
  double margin = 0.05;  // binsearch only: the result is reduced by this fraction
};

struct Trial {
  int64_t size;
  Outcome outcome;
};

struct Result {
  int64_t size = 0;  // 0: nothing fits, not even 1
  int64_t largest_fitting = 0;
  std::vector<Trial> trials;
};

inline Result search(const Settings& s, const std::function<Outcome(int64_t)>& try_size) {
  Result r;
  auto run = [&](int64_t n) {
    const Outcome o = try_size(n);
    r.trials.push_back({n, o});
    if (o == Outcome::fits) r.largest_fitting = std::max(r.largest_fitting, n);
    return o;
  };
  int64_t size = std::clamp<int64_t>(s.init_val, 1, s.max_val);
  if (s.mode == Mode::power) {
    // Double while it fits; the first failure ends the search at the last size that fitted.
    // When the very first size fails, halve until one fits.
    bool any = false;
    for (int64_t i = 0; i < s.max_trials; ++i) {
      const Outcome o = run(size);
      if (o == Outcome::fits) {
        any = true;
        const int64_t next = std::min(size * 2, s.max_val);
        if (next == size) break;
        size = next;
      } else {
        if (any || size == 1) break;
        size = std::max<int64_t>(1, size / 2);
      }
    }
    r.size = r.largest_fitting;
    return r;
  }
  // binsearch: double until a failure, then bisect between the last fit (low) and it (high).
  int64_t low = 1, high = 0, successes = 0;
  bool low_tested = false;
  for (int64_t guard = 0; guard < 64 + s.max_trials; ++guard) {
    const Outcome o = run(size);
    if (o == Outcome::fits) {
      low = size;
      low_tested = true;
      if (++successes >= s.max_trials) break;
      if (high > 0) {
        if (high - low <= 1) break;
        size = (high + low) / 2;
      } else {
        const int64_t next = std::min(size * 2, s.max_val);
        if (next == size) break;
        size = next;
      }
    } else {
      high = size;
      if (high - low <= 1) break;
      size = (high + low) / 2;
    }
  }
  // Lightning assumes 1 fits when everything failed; test it instead.
  if (!low_tested && high > 1 && run(1) == Outcome::fits) low_tested = true;
  if (!low_tested) return r;
  r.size = std::max<int64_t>(1, static_cast<int64_t>(std::floor(static_cast<double>(r.largest_fitting) * (1.0 - s.margin))));
  return r;
}

}  // namespace ember_batch_size
