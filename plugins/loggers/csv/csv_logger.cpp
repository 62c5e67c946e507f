// Plugin "csv": Lightning's CSVLogger. Writes <run_dir>/metrics.csv (one row per log call: the
// metrics plus "step"; the header is the sorted union of every key seen, missing values are empty
// cells) and <run_dir>/hparams.toml.
//
// Like Lightning, buffered rows are appended to the file (here with fsync, so a flush is durable;
// its cost is that of the new rows, not of the file). When new columns appear, the file is
// rewritten under the new header and replaced atomically (temporary file + rename). Unlike
// Lightning, a resumed run drops the rows logged after its checkpoint instead of logging those
// steps twice, and a last row a crash cut short.
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/logger.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "metrics_csv.h"

namespace {

namespace fs = std::filesystem;

// clang-format off
// Lightning's save_dir, name and version: one run folder for every logger, set in [trainer].
constexpr const char* kRunFolderAdvice =
    "every logger writes into the run folder <trainer.default_root_dir>/<trainer.name>/version_<trainer.version>: set "
    "those [trainer] keys";
constexpr EmberConfigKey kKeys[] = {
    ember::key::String("filename", "\"metrics.csv\"",
        "Name of the metrics file inside the run folder."),
    ember::key::Int("flush_logs_every_n_steps", "100",
        "Write buffered rows to disk every N log calls (and always on flush and at the end).").at_least(1),
    ember::key::Elsewhere("save_dir", kRunFolderAdvice),
    ember::key::Elsewhere("name", kRunFolderAdvice),
    ember::key::Elsewhere("version", kRunFolderAdvice),
};
// clang-format on

constexpr const char* kHparamsFile = "hparams.toml";

[[noreturn]] void config_error(const ember::IConfig& cfg, std::string_view key, const std::string& problem,
                               const std::string& fix) {
  throw ember::ConfigError(cfg.section() + "." + std::string(key) + " (" + cfg.where(key) + "): " + problem +
                           "; " + fix);
}

std::string checked_filename(const ember::IConfig& cfg) {
  const std::string name = cfg.get_string("filename");
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    config_error(cfg, "filename", "'" + name + "' is not a plain file name",
                 "give a name like \"metrics.csv\" (the file always goes into the run folder)");
  }
  if (name == kHparamsFile) {
    config_error(cfg, "filename", "'" + name + "' is where the hyperparameters go", "choose another name");
  }
  return name;
}

// The value of a row's step cell, or false when it has none that parses.
bool row_step(const ember_csv::Row& row, double* step) {
  auto it = row.find("step");
  if (it == row.end() || it->second.empty()) return false;
  char* end = nullptr;
  *step = std::strtod(it->second.c_str(), &end);
  return end != it->second.c_str() && *end == '\0';
}

class CsvLogger final : public ember::ILogger {
 public:
  CsvLogger(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host), filename_(checked_filename(cfg)), flush_every_(cfg.get_int("flush_logs_every_n_steps")) {}

  // Best effort: rows still buffered when the engine tears down without finalize() (an error
  // path) are worth keeping. A destructor must not throw.
  ~CsvLogger() override {
    try {
      write_pending();
    } catch (...) {
    }
  }

  void setup(ember::ITrainer& trainer, bool resuming, int64_t resume_step) override {
    dir_ = trainer.run_dir();
    path_ = dir_ / filename_;
    guarded("create the folder", [&] { fs::create_directories(dir_); });
    std::error_code ec;
    if (!fs::exists(path_, ec)) return;
    if (!resuming) {
      // Lightning deletes it too: rows of another run would mix with this one's.
      host_.log(ember::LogLevel::warn, "csv: " + path_.string() + " exists and this run does not resume; starting it afresh");
      guarded("delete the old file", [&] { fs::remove(path_); });
      return;
    }
    guarded("resume", [&] { resume(resume_step); });
  }

  void log_hyperparams(const std::string& resolved_config_toml) override {
    require_setup("log_hyperparams");
    guarded("write hparams", [&] { ember_csv::write_atomic(dir_ / kHparamsFile, resolved_config_toml); });
  }

  void log_metrics(const std::vector<std::pair<std::string, double>>& metrics, int64_t step) override {
    require_setup("log_metrics");
    ember_csv::Row row;
    for (const auto& [name, value] : metrics) row[name] = ember_csv::format_number(value);
    row["step"] = std::to_string(step);  // like Lightning, the step wins over a metric named "step"
    for (const auto& kv : row) columns_.insert(kv.first);
    pending_.push_back(std::move(row));
    // Counted in calls (Lightning tests (step + 1) % n, which never fires when steps are logged
    // at other strides).
    if (++calls_ % flush_every_ == 0) flush();
  }

  void flush() override {
    guarded("write", [&] { write_pending(); });
  }

  void finalize(const std::string& /*status*/) override { flush(); }

 private:
  void require_setup(const char* call) const {
    if (dir_.empty()) throw ember::RunError(std::string("csv: ") + call + " was called before setup");
  }

  template <class Fn>
  void guarded(const char* what, Fn&& fn) {
    try {
      fn();
    } catch (const ember::RunError&) {
      throw;
    } catch (const std::exception& e) {
      throw ember::RunError(std::string("csv: cannot ") + what + " (" + path_.string() + "): " + e.what());
    }
  }

  // Continues the file of the run being resumed. Rows after resume_step were logged after the
  // checkpoint; the resumed run logs those steps again, so they go.
  void resume(int64_t resume_step) {
    const std::string text_on_disk = ember_csv::read_file(path_);
    const size_t complete = ember_csv::complete_records(text_on_disk);
    const bool torn = complete != text_on_disk.size();
    if (torn)
      host_.log(ember::LogLevel::warn, "csv: " + path_.string() + " ends in a row the previous run did not finish writing; dropped it");
    ember_csv::Table t = ember_csv::parse_table(std::string_view(text_on_disk).substr(0, complete));
    const size_t before = t.rows.size();
    std::erase_if(t.rows, [&](const ember_csv::Row& r) {
      double step = 0;
      return row_step(r, &step) && step > static_cast<double>(resume_step);  // unknown steps stay
    });
    columns_.insert(t.header.begin(), t.header.end());
    const std::vector<std::string> header(columns_.begin(), columns_.end());
    if (torn || t.rows.size() != before || header != t.header) {
      std::string text = ember_csv::join_line(header);
      for (const auto& r : t.rows) text += ember_csv::row_line(header, r);
      ember_csv::write_atomic(path_, text);
    }
    file_header_ = header;
    if (t.rows.size() != before) {
      host_.log(ember::LogLevel::info, "csv: resuming " + path_.string() + " at step " + std::to_string(resume_step) +
                                           ", dropped " + std::to_string(before - t.rows.size()) +
                                           " rows logged after the checkpoint");
    }
  }

  // Writes the buffered rows. When new columns appeared, the rows already on disk are rewritten
  // under the new header (Lightning's _rewrite_with_new_header) and the file is replaced
  // atomically; otherwise the new rows are appended in place (durable, linear in the new rows).
  // On failure the rows stay buffered for the next attempt (a partial append is cut off).
  void write_pending() {
    if (pending_.empty() || dir_.empty()) return;
    const std::vector<std::string> header(columns_.begin(), columns_.end());
    std::string rows;
    for (const auto& r : pending_) rows += ember_csv::row_line(header, r);
    std::error_code ec;
    const bool on_disk = !file_header_.empty() && fs::exists(path_, ec);
    if (on_disk && header == file_header_) {
      ember_csv::append_durable(path_, rows);
    } else {
      std::string text = ember_csv::join_line(header);
      if (on_disk) {
        for (const auto& r : ember_csv::read_table(path_).rows) text += ember_csv::row_line(header, r);
      }
      ember_csv::write_atomic(path_, text + rows);
    }
    file_header_ = header;
    pending_.clear();
  }

  ember::IHost& host_;
  const std::string filename_;
  const int64_t flush_every_;

  fs::path dir_, path_;
  std::set<std::string> columns_;          // every key seen, sorted: the header
  std::vector<std::string> file_header_;   // the header of the file on disk; empty = none yet
  std::vector<ember_csv::Row> pending_;    // rows not on disk yet
  int64_t calls_ = 0;
};

ember::ILogger* make(ember::IHost& host, const ember::IConfig& cfg) { return new CsvLogger(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ILogger, "csv", "0.1.0", "Apache-2.0",
             "Writes metrics.csv and hparams.toml into the run folder (Lightning's CSVLogger layout).",
             EMBER_CONFIG_KEYS(kKeys), make)
