// "Did you mean ...?" for a metric name that is not there. Header-only, no Ember types.
#pragma once
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace ember_checkpoint {

// Edit distance (insertions, deletions, substitutions), two-row dynamic programming.
inline size_t levenshtein(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// The candidate closest to `name`, or "" when none is close enough to be a likely typo
// (distance at most max(2, |name| / 3)). Ties go to the first candidate.
inline std::string closest_name(std::string_view name, const std::vector<std::string>& candidates) {
  const size_t limit = std::max<size_t>(2, name.size() / 3);
  std::string best;
  size_t best_d = limit + 1;
  for (const auto& c : candidates) {
    const size_t d = levenshtein(name, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

// " (did you mean 'val_loss'? available: epoch, step, val_loss)" for error messages.
inline std::string suggestion_suffix(std::string_view name, const std::vector<std::string>& candidates) {
  std::string list;
  for (const auto& c : candidates) list += (list.empty() ? "" : ", ") + c;
  if (list.empty()) list = "none yet";
  const std::string close = closest_name(name, candidates);
  if (close.empty()) return " (available: " + list + ")";
  return " (did you mean '" + close + "'? available: " + list + ")";
}

}  // namespace ember_checkpoint
