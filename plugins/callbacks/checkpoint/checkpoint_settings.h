// The checkpoint callback's keys, and the settings they make once every rule between them is
// checked (Lightning's mutually exclusive triggers, save_top_k without a monitor, the file name
// template): checkpoint.cpp only ever sees settings that make sense.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include <ember/config.h>
#include <ember/error.h>
#include <ember/plugin.h>
#include <ember/support/duration.h>

#include "filename_template.h"
#include "topk.h"

namespace ember_checkpoint {

// clang-format off
inline constexpr EmberConfigKey kKeys[] = {
    ember::key::String("dirpath", "\"\"",
        "Folder for the checkpoint files; empty = <run_dir>/checkpoints."),
    ember::key::String("filename", "\"{epoch}-{step}\"",
        "File name template without .ckpt: {name} or {name:FORMAT} (.Nf, 0Nd, .Ne, .Ng) of epoch, step or a logged metric."),
    ember::key::String("monitor", "\"\"",
        "Logged metric that ranks checkpoints (e.g. \"val_loss\"); empty = keep the latest ones."),
    ember::key::String("mode", "\"min\"",
        "Whether a lower (min) or higher (max) monitored value is better.").choices("min|max"),
    ember::key::Int("save_top_k", "1",
        "How many of the best checkpoints to keep: -1 = all, 0 = none (last.ckpt is still written).").at_least(-1),
    ember::key::String("save_last", "true",
        "Also write last.ckpt at every save; true by default (Lightning: off) so `--resume last` works out of the box. \"link\" "
        "(Lightning's): last.ckpt is a link to the checkpoint saved at the same step instead of a second copy of it, and is "
        "written in full at a save that keeps no other file.").choices("true|false|link"),
    ember::key::Int("every_n_epochs", nullptr,
        "Save top-k every N training epochs (0 = never by epoch); unset = 1, or 0 when every_n_train_steps > 0.").at_least(0),
    ember::key::Int("every_n_train_steps", "0",
        "Save top-k every N optimizer steps (0 = off); excludes an explicitly set every_n_epochs, like Lightning.").at_least(0),
    ember::key::String("train_time_interval", nullptr,
        "Save top-k every this much training time, \"DD:HH:MM:SS\" (e.g. \"00:00:30:00\"), right after an optimizer step; "
        "rank 0's clock decides. Excludes every_n_epochs and every_n_train_steps, like Lightning."),
    ember::key::Bool("save_on_train_epoch_end", nullptr,
        "Save by epoch at the end of each training epoch (true) or after each validation (false); unset = Lightning's choice: "
        "after each validation that runs in mid-epoch or every few epochs, at the epoch's end when validation runs there or not at all."),
    ember::key::Bool("enable_version_counter", "true",
        "Give a file whose name is taken a -v1, -v2 ... suffix (true) or overwrite it (false)."),
    ember::key::Bool("save_weights_only", "false",
        "Write only the model weights (no optimizer, loop or callback state: such a file cannot resume a run)."),
    ember::key::Bool("auto_insert_metric_name", "true",
        "Write {val_loss} as val_loss=0.25 in file names; turn off for metric names that contain '/'."),
    ember::key::Bool("verbose", "false",
        "Log every save, deletion and top-k decision."),
    ember::key::Bool("async", "false",
        "Write checkpoints in the background: the state is copied to the host and training goes on while a thread writes it "
        "(one write at a time; files that leave the top k are deleted only once the new one is on disk; a failed write stops the run)."),
    ember::key::Bool("save_on_exception", "false",
        "When training fails with an error (a bad file in the data, running out of memory), save the state it had reached to "
        "on_exception.ckpt in dirpath, from which --resume last continues: only in a one-process run, and only where weights, "
        "optimizer and position agree (not inside an optimizer update or an accumulation window); otherwise the log says why not."),
    // Lightning's names of earlier releases, and what they are now.
    ember::key::Elsewhere("period", "Lightning 1.x's period is every_n_epochs"),
    ember::key::Elsewhere("every_n_val_epochs", "Lightning 1.4's every_n_val_epochs is every_n_epochs"),
    ember::key::Elsewhere("filepath", "Lightning 1.x's filepath is two keys: dirpath (the folder) and filename (the name without "
                                      ".ckpt, e.g. \"{epoch}-{val_loss:.3f}\")"),
    ember::key::Elsewhere("prefix", "Lightning 1.x's prefix is gone: write it at the start of filename"),
};
// clang-format on

[[noreturn]] inline void config_error(const ember::IConfig& cfg, std::string_view key,
                               const std::string& problem, const std::string& fix) {
  throw ember::ConfigError(cfg.section() + "." + std::string(key) + " (" + cfg.where(key) +
                           "): " + problem + "; " + fix);
}

// "~/x" -> "$HOME/x", then absolute and normalized without a trailing '/' (Lightning resolves
// dirpath with realpath(expanduser(...)); symlinks are kept here).
inline std::string absolute_dir(std::string p) {
  if (!p.empty() && p[0] == '~' && (p.size() == 1 || p[1] == '/')) {
    if (const char* home = std::getenv("HOME")) p = std::string(home) + p.substr(1);
  }
  fs::path out = fs::absolute(fs::path(p)).lexically_normal();
  if (!out.has_filename() && out.has_parent_path() && out != out.root_path()) out = out.parent_path();
  return out.string();
}

inline FilenameTemplate parse_filename(const ember::IConfig& cfg) {
  std::string text = cfg.get_string("filename");
  if (text.empty()) text = std::string("{epoch}") + kJoinChar + "{step}";  // Lightning's default
  if (text.size() >= 5 && text.compare(text.size() - 5, 5, kExtension) == 0) {
    config_error(cfg, "filename", "'" + text + "' would be saved as '" + text + kExtension + "'",
                 "leave out the .ckpt extension");
  }
  try {
    return FilenameTemplate(text);
  } catch (const std::invalid_argument& e) {
    config_error(cfg, "filename", "bad template '" + text + "': " + e.what(),
                 "write fields as {name}, {name:.4f} or {name:03d}");
  }
}

inline Mode parse_mode(const ember::IConfig& cfg) {
  const std::string m = cfg.get_string("mode");
  if (m == "min") return Mode::min;
  if (m == "max") return Mode::max;
  config_error(cfg, "mode", "'" + m + "' is not a mode", "use \"min\" or \"max\"");
}

// last.ckpt: none, a full copy at every save, or a link to the file the same save wrote.
enum class SaveLast { off, full, link };

// What the keys ask for, checked.
struct Settings {
  FilenameTemplate filename;
  std::string monitor;  // "" = keep the latest checkpoints
  Mode mode = Mode::min;
  int64_t save_top_k = 1;
  SaveLast save_last = SaveLast::full;
  int64_t every_n_epochs = 1;  // 0 = never by epoch
  int64_t every_n_train_steps = 0;
  double train_time_interval = 0;  // seconds; 0 = no time trigger
  std::optional<bool> save_on_train_epoch_end;  // unset: Lightning's rule (after each validation)
  std::string save_on_train_epoch_end_where;    // "checkpoint.save_on_train_epoch_end (run.toml:7:1)"
  std::string dirpath;  // the configured folder, absolute; "" = <run_dir>/checkpoints
  bool save_weights_only = false;
  bool auto_insert_metric_name = true;
  bool verbose = false;
  bool async = false;
  bool enable_version_counter = true;
  bool save_on_exception = false;
};

inline Settings read_settings(const ember::IConfig& cfg) {
  Settings s{parse_filename(cfg)};
  s.monitor = cfg.get_string("monitor");
  s.mode = parse_mode(cfg);
  s.save_top_k = cfg.get_int("save_top_k");
  const std::string last = cfg.get_string("save_last");
  s.save_last = last == "link" ? SaveLast::link : last == "true" ? SaveLast::full : SaveLast::off;
  s.every_n_epochs = cfg.has("every_n_epochs") ? cfg.get_int("every_n_epochs") : 1;
  s.every_n_train_steps = cfg.get_int("every_n_train_steps");
  s.save_weights_only = cfg.get_bool("save_weights_only");
  s.auto_insert_metric_name = cfg.get_bool("auto_insert_metric_name");
  s.verbose = cfg.get_bool("verbose");
  s.async = cfg.get_bool("async");
  s.enable_version_counter = cfg.get_bool("enable_version_counter");
  s.save_on_exception = cfg.get_bool("save_on_exception");
  if (cfg.has("save_on_train_epoch_end")) {
    s.save_on_train_epoch_end = cfg.get_bool("save_on_train_epoch_end");
    s.save_on_train_epoch_end_where = cfg.section() + ".save_on_train_epoch_end (" + cfg.where("save_on_train_epoch_end") + ")";
  }
  const std::string dir = cfg.get_string("dirpath");
  if (!dir.empty()) s.dirpath = absolute_dir(dir);

  // Without a monitor there is nothing to rank: only "all", "none" or "the latest" make sense.
  if (s.monitor.empty() && s.save_top_k != -1 && s.save_top_k != 0 && s.save_top_k != 1) {
    config_error(cfg, "save_top_k", "save_top_k = " + std::to_string(s.save_top_k) + " needs a monitor to rank checkpoints",
                 "set " + cfg.section() + ".monitor (e.g. \"val_loss\") or use save_top_k = -1 (all), 0 or 1 (the latest)");
  }
  // Lightning quietly writes every last.ckpt in full then; here the choice is the user's.
  if (s.save_last == SaveLast::link && s.save_top_k == 0) {
    config_error(cfg, "save_last", "\"link\" points last.ckpt at the checkpoint saved at the same step, and save_top_k = 0 saves none",
                 "set save_last = true to write last.ckpt in full, or save_top_k to 1 or more");
  }
  // Lightning's time trigger excludes the other two and, given alone, turns saving by epoch off.
  if (cfg.has("train_time_interval")) {
    const std::string text = cfg.get_string("train_time_interval");
    try {
      s.train_time_interval = ember::parse_duration(text);
    } catch (const std::invalid_argument& e) {
      config_error(cfg, "train_time_interval", "train_time_interval = \"" + text + "\": " + e.what(),
                   "write it as \"DD:HH:MM:SS\", e.g. \"00:00:30:00\" for 30 minutes");
    }
    const char* other = s.every_n_train_steps > 0                                  ? "every_n_train_steps"
                        : cfg.has("every_n_epochs") && s.every_n_epochs > 0 ? "every_n_epochs"
                                                                                 : nullptr;
    if (other)
      config_error(cfg, "train_time_interval", std::string("train_time_interval and ") + other + " are mutually exclusive",
                   "remove one of them (train_time_interval alone turns saving by epoch off)");
    s.every_n_epochs = 0;
  }
  // Lightning: the step and epoch triggers are mutually exclusive; giving only the step trigger
  // turns the epoch trigger off (its default of 1 applies only when it is alone).
  if (s.every_n_train_steps > 0) {
    // Only a value the user gave conflicts: left unset, the epoch trigger is off here (and a
    // resolved configuration, which writes every key that has a value, does not state it).
    if (cfg.has("every_n_epochs") && s.every_n_epochs > 0) {
      config_error(cfg, "every_n_epochs",
                   "every_n_epochs = " + std::to_string(s.every_n_epochs) + " and every_n_train_steps = " +
                       std::to_string(s.every_n_train_steps) + " are mutually exclusive",
                   "remove one of them (every_n_train_steps alone turns saving by epoch off)");
    }
    s.every_n_epochs = 0;
  }
  return s;
}

}  // namespace ember_checkpoint
