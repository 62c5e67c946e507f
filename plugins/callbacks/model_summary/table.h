// The text of a model summary, without a trainer: Lightning's ModelSummary table and its
// get_human_readable_count.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace ember_model_summary {

// Lightning's get_human_readable_count: 320 -> "320  ", 18496 -> "18.5 K", 401536 -> "401 K".
inline std::string human_count(int64_t number) {
  static const char* labels[] = {" ", "K", "M", "B", "T"};
  const int digits = number > 0 ? static_cast<int>(std::floor(std::log10(static_cast<double>(number)))) + 1 : 1;
  int groups = std::min((digits + 2) / 3, 5);
  const double value = static_cast<double>(number) * std::pow(10.0, -3.0 * (groups - 1));
  char buf[64];
  if (groups - 1 < 1 || value >= 100) std::snprintf(buf, sizeof buf, "%lld %s", static_cast<long long>(value), labels[groups - 1]);
  else std::snprintf(buf, sizeof buf, "%.1f %s", value, labels[groups - 1]);
  return buf;  // (Python's thousands separator only shows beyond 999 T)
}

struct Row {
  std::string name, type;
  int64_t params = 0;
  bool training = true;
};

struct Totals {
  int64_t trainable = 0, non_trainable = 0;
  double size_mb = 0;  // bytes of all parameters / 1e6
  int64_t modules_train = 0, modules_eval = 0;
};

inline std::string pad(const std::string& s, size_t w) { return s.size() >= w ? s : s + std::string(w - s.size(), ' '); }

// The table, one string per line, as Lightning prints it.
inline std::vector<std::string> format_table(const std::vector<Row>& rows, const Totals& t) {
  std::vector<std::string> out;
  if (!rows.empty()) {
    size_t wi = std::to_string(rows.size() - 1).size(), wn = 4, wt = 4, wp = 6, wm = 4;
    std::vector<std::string> counts;
    for (const auto& r : rows) {
      counts.push_back(human_count(r.params));
      wn = std::max(wn, r.name.size());
      wt = std::max(wt, r.type.size());
      wp = std::max(wp, counts.back().size());
      wm = std::max<size_t>(wm, 5);
    }
    const std::string header = pad("", wi) + " | " + pad("Name", wn) + " | " + pad("Type", wt) + " | " + pad("Params", wp) +
                               " | " + pad("Mode", wm);
    out.push_back(header);
    out.push_back(std::string(header.size(), '-'));
    for (size_t i = 0; i < rows.size(); ++i)
      out.push_back(pad(std::to_string(i), wi) + " | " + pad(rows[i].name, wn) + " | " + pad(rows[i].type, wt) + " | " +
                    pad(counts[i], wp) + " | " + pad(rows[i].training ? "train" : "eval", wm));
    out.push_back(std::string(header.size(), '-'));
  }
  char size[32];
  std::snprintf(size, sizeof size, "%.3f", t.size_mb);
  out.push_back(pad(human_count(t.trainable), 10) + "Trainable params");
  out.push_back(pad(human_count(t.non_trainable), 10) + "Non-trainable params");
  out.push_back(pad(human_count(t.trainable + t.non_trainable), 10) + "Total params");
  out.push_back(pad(size, 10) + "Total estimated model params size (MB)");
  out.push_back(pad(std::to_string(t.modules_train), 10) + "Modules in train mode");
  out.push_back(pad(std::to_string(t.modules_eval), 10) + "Modules in eval mode");
  return out;
}

// "torch::nn::Conv2dImpl" -> "Conv2d", "(anonymous namespace)::CnnNet" -> "CnnNet".
inline std::string short_type(std::string name) {
  const size_t colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

}  // namespace ember_model_summary
