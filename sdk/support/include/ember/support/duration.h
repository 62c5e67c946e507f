// "DD:HH:MM:SS" -> seconds, Lightning's way of writing a time span (Timer(duration="00:12:00:00"),
// the timer's duration and trainer.max_time; the checkpoint callback's train_time_interval). The
// last field may have a fraction ("00:00:00:1.5"). Throws std::invalid_argument with what is wrong.
#pragma once
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace ember {

inline double parse_duration(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t colon = text.find(':', start);
    parts.push_back(text.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  if (parts.size() != 4) throw std::invalid_argument("expected DD:HH:MM:SS (4 fields), got " + std::to_string(parts.size()));
  static const double unit[4] = {86400.0, 3600.0, 60.0, 1.0};
  static const char* names[4] = {"days", "hours", "minutes", "seconds"};
  double total = 0;
  for (size_t i = 0; i < 4; ++i) {
    const std::string& p = parts[i];
    if (p.empty()) throw std::invalid_argument(std::string("the ") + names[i] + " field is empty");
    char* end = nullptr;
    const double v = std::strtod(p.c_str(), &end);
    const bool digits_only = p.find_first_not_of("0123456789") == std::string::npos;
    if (end != p.c_str() + p.size() || !std::isfinite(v) || v < 0 || (i < 3 && !digits_only))
      throw std::invalid_argument(std::string("the ") + names[i] + " field '" + p + "' is not a " +
                                  (i < 3 ? "whole number" : "number") + " >= 0");
    total += v * unit[i];
  }
  if (total <= 0) throw std::invalid_argument("the duration is zero");
  return total;
}

}  // namespace ember
