// Shared by the simple_profiler, throughput and device_stats tests: a small synthetic run and
// readers of what it leaves behind.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support.h"

namespace ember::test {

namespace fs = std::filesystem;


// 96 samples in batches of 16: 6 training batches per epoch; 32 validation samples: 2 batches.
inline const char* const kMlp = R"(
[trainer]
max_epochs = 2
log_every_n_steps = 1
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [16]
[data]
name = "synthetic"
shape = [8]
num_train = 96
num_val = 32
batch_size = 16
)";

inline ProcessResult engine_ok(const TempDir& dir, std::vector<std::string> args) {
  args.insert(args.begin(), {"run.toml", "--plugin-path", test_plugin_dir("good").string()});
  auto r = run_engine(args, dir.path(), {{"OMP_NUM_THREADS", "1"}});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r;
}

struct Row {
  double mean = 0, total = 0, pct = 0;
  int64_t calls = 0;
};

// The rows of the first table of a simple_profiler report, by action.
inline std::map<std::string, Row> fit_table(const std::string& text) {
  std::map<std::string, Row> rows;
  std::istringstream in(text);
  std::string line;
  int tables = 0;
  while (std::getline(in, line)) {
    if (line.rfind("Profiler report:", 0) == 0 && ++tables > 1) break;
    if (line.rfind("| ", 0) != 0 || line.find("Mean duration") != std::string::npos) continue;
    std::vector<std::string> cells;
    std::istringstream ls(line.substr(1));
    std::string cell;
    while (std::getline(ls, cell, '|')) {
      const auto b = cell.find_first_not_of(' '), e = cell.find_last_not_of(' ');
      cells.push_back(b == std::string::npos ? "" : cell.substr(b, e - b + 1));
    }
    if (cells.size() < 5) continue;
    rows[cells[0]] = Row{std::stod(cells[1]), std::stod(cells[3]), std::stod(cells[4]), std::stoll(cells[2])};
  }
  return rows;
}

// The last logged value of a metric column in metrics.csv, and how many rows have it.
inline double last_value(const std::vector<std::map<std::string, std::string>>& rows, const std::string& key, int* count) {
  double v = NAN;
  *count = 0;
  for (const auto& r : rows) {
    auto it = r.find(key);
    if (it != r.end() && !it->second.empty()) {
      v = std::stod(it->second);
      ++*count;
    }
  }
  return v;
}

}  // namespace ember::test
