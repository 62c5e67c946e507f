// How Ember writes a metric value as text (metrics.csv cells, checkpoint file names): the
// shortest text that reads back as the same number. Integral values print as integers ("12");
// values that came from float32 tensors (exactly representable as float, as most metrics are)
// print in float32's shortest form ("0.1", not "0.10000000149011612"); other doubles in double's.
// Non-finite values print as Python does: nan, inf, -inf.
#pragma once
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>

namespace ember {

inline std::string shortest_number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  if (v == std::trunc(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
    return buf;
  }
  std::to_chars_result r;
  const auto f = static_cast<float>(v);
  if (std::isfinite(f) && static_cast<double>(f) == v) {
    r = std::to_chars(buf, buf + sizeof buf, f);
  } else {
    r = std::to_chars(buf, buf + sizeof buf, v);
  }
  return std::string(buf, r.ptr);
}

}  // namespace ember
