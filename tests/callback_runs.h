// What the callback plugins' run tests share (early_stopping_test.cpp, timer_test.cpp,
// grad_accum_schedule_test.cpp, model_summary_test.cpp, lr_find_test.cpp,
// batch_size_finder_test.cpp): real engine runs with the test plugins, and reading back their
// checkpoints, logs and metrics.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_io.h"
#include "support.h"

namespace ember::test::callback_runs {

namespace fs = std::filesystem;

inline c10::impl::GenericDict load(const fs::path& ckpt) { return ember::engine::load_checkpoint_file(ckpt); }

inline c10::impl::GenericDict callback_state(const fs::path& ckpt, const std::string& name) {
  return load(ckpt).at("callbacks").toGenericDict().at(name).toGenericDict();
}

inline size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

// Runs `engine <name>.toml` with the test plugins; returns the result.
inline ProcessResult run(const TempDir& dir, const std::string& name, const std::string& toml, std::vector<std::string> extra = {}) {
  write_file(dir / (name + ".toml"), toml);
  std::vector<std::string> args = {name + ".toml", "--plugin-path", test_plugin_dir("good").string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine(args, dir.path());
}

// The values of one metrics.csv column, in row order (rows that have it).
inline std::vector<double> column(const fs::path& run_dir, const std::string& name) {
  std::vector<double> out;
  for (const auto& row : read_csv(run_dir / "metrics.csv")) {
    auto it = row.find(name);
    if (it != row.end() && !it->second.empty()) out.push_back(std::stod(it->second));
  }
  return out;
}

}  // namespace ember::test::callback_runs
