// The LR range test curve as a PNG (cairo).
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace ember_lr_find {

struct PlotData {
  std::vector<double> lrs, losses, smoothed;
  std::optional<size_t> suggested;  // index into lrs
  bool log_x = true;
  std::string title;
};

// Writes a width x height PNG to `path`; throws std::runtime_error when cairo fails.
void write_plot(const std::string& path, const PlotData& data, int width = 900, int height = 600);

}  // namespace ember_lr_find
