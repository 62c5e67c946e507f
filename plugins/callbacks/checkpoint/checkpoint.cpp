// Plugin "checkpoint": Lightning's ModelCheckpoint. Saves the k best checkpoints by a monitored
// metric (or the latest ones without a monitor) plus last.ckpt, and resolves `--resume last|best`.
//
// The pieces that need no trainer live beside this file: checkpoint_settings.h (the keys and the
// rules between them), filename_template.h (file names), topk.h (the top-k bookkeeping),
// checkpoint_state.h (reading back its state_dict), checkpoint_folder.h (the files of a checkpoint
// folder) and suggest.h ("did you mean"). This file is the glue: when to save, the file work, the
// state_dict and the checkpoint locator.
#include <ember/callback.h>
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint_folder.h"
#include "checkpoint_settings.h"
#include "checkpoint_state.h"
#include "filename_template.h"
#include "suggest.h"
#include "topk.h"

namespace {

namespace fs = std::filesystem;
namespace ck = ember_checkpoint;

using ck::CkptFile;
using ck::parse_state;
using ck::SavedState;
using ck::is_last_name;
using ck::list_checkpoints;
using ck::read_plugin_state;
using ck::remove_checkpoint;

using ck::absolute_dir;
using ck::kKeys;

bool file_exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

class ModelCheckpoint final : public ember::Callback, public ember::ICheckpointLocator, public ember::ICheckpointCandidates {
 public:
  ModelCheckpoint(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host), settings_(ck::read_settings(cfg)), topk_(settings_.mode, settings_.save_top_k) {}

  bool monitors_metrics() const override { return true; }

  void* query_interface(const char* iid) override {
    if (iid != nullptr && std::strcmp(iid, ember::kCheckpointLocatorIid) == 0) {
      return static_cast<ember::ICheckpointLocator*>(this);
    }
    if (iid != nullptr && std::strcmp(iid, ember::kCheckpointCandidatesIid) == 0) return static_cast<ember::ICheckpointCandidates*>(this);
    return ember::Callback::query_interface(iid);
  }

  // Layout (a dict str -> value, like Lightning's ModelCheckpoint.state_dict):
  //   dirpath, monitor, mode ("min"|"max"), best_model_path, kth_best_model_path,
  //   last_model_path: str;  best_model_score: float or None;  kth_value: float;
  //   best_k_models: Dict[str, float] (path -> score, in insertion order).
  c10::IValue state_dict() const override {
    const ck::TopKState& s = topk_.state();
    c10::Dict<std::string, double> best_k;
    for (const auto& [path, score] : s.best_k_models) best_k.insert(path, score);
    // A dict str -> Any. (c10::Dict<std::string, IValue> has no usable constructor in LibTorch
    // 2.11: both static_assert; GenericDict with the key and value types is the way.)
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert(std::string("dirpath"), dirpath_);
    d.insert(std::string("monitor"), settings_.monitor);
    d.insert(std::string("mode"), std::string(ck::mode_name(topk_.mode())));
    d.insert(std::string("best_model_path"), s.best_model_path);
    d.insert(std::string("best_model_score"), s.best_model_score ? c10::IValue(*s.best_model_score) : c10::IValue());
    d.insert(std::string("kth_best_model_path"), s.kth_best_model_path);
    d.insert(std::string("kth_value"), s.kth_value);
    d.insert(std::string("last_model_path"), s.last_model_path);
    d.insert(std::string("best_k_models"), c10::IValue(best_k));
    return c10::IValue(d);
  }

  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;  // nothing was saved (e.g. a checkpoint from before this plugin)
    // A state loaded while training is under way is a rollback (spike_guard) or a tuner going
    // back to where it began: the training state goes back, the files on disk do not, and this
    // bookkeeping describes the files. It stays as it is.
    if (training_) {
      info("state loaded while training (a rollback): the top-k bookkeeping stays with the files on disk");
      return;
    }
    SavedState saved = parse_state(state, topk_.mode());  // throws on a malformed state
    if (dirpath_.empty()) {
      pending_ = std::move(saved);  // setup() resolves the folder and applies it
    } else {
      apply(std::move(saved));
    }
  }

  std::string resolve_checkpoint(const std::string& alias, const std::string& run_dir) override {
    const auto candidates = checkpoint_candidates(alias, run_dir);
    return candidates.empty() ? "" : candidates.front();
  }

  // "last": the last*.ckpt files, then every other checkpoint, newest first (the engine resumes
  // from the first whole Ember checkpoint among them); "best": the one the newest state names.
  std::vector<std::string> checkpoint_candidates(const std::string& alias, const std::string& run_dir) override {
    const fs::path dir = settings_.dirpath.empty() ? fs::path(run_dir) / "checkpoints" : fs::path(settings_.dirpath);
    if (alias == "last") {
      std::vector<std::string> last, others;
      for (const auto& f : list_checkpoints(dir)) (is_last_name(f.path) ? last : others).push_back(f.path);
      last.insert(last.end(), others.begin(), others.end());
      return last;
    }
    const std::string best = alias == "best" ? best_checkpoint(dir) : "";
    return best.empty() ? std::vector<std::string>{} : std::vector<std::string>{best};
  }

  std::string best_checkpoint(const fs::path& dir) {
    const std::vector<CkptFile> files = list_checkpoints(dir);
    // The newest checkpoint that carries this plugin's state knows the best one.
    for (const auto& f : files) {
      std::string best;
      try {
        const std::optional<c10::IValue> state = read_plugin_state(f.path);
        if (!state) continue;
        best = parse_state(*state, topk_.mode()).topk.best_model_path;
      } catch (const std::exception& e) {
        host_.log(ember::LogLevel::warn, "checkpoint: skipping unreadable " + f.path + ": " + e.what());
        continue;
      }
      if (best.empty()) return "";
      if (file_exists(best)) return best;
      // The run folder was moved: the same file name in the folder being searched.
      const fs::path moved = dir / fs::path(best).filename();
      return file_exists(moved.string()) ? moved.string() : "";
    }
    return "";
  }

  void setup(ember::ITrainer& trainer) override {
    dirpath_ = settings_.dirpath.empty() ? absolute_dir((fs::path(trainer.run_dir()) / "checkpoints").string())
                                         : settings_.dirpath;
    if (pending_) {
      apply(std::move(*pending_));
      pending_.reset();
    }
  }

  void on_fit_start(ember::ITrainer& trainer) override {
    // Saving only after validation, in a run without validation and without a step or time
    // trigger, would save nothing at all: say so before training rather than after.
    if (settings_.save_on_train_epoch_end == false && trainer.num_batches(ember::Split::val) == 0 && settings_.every_n_train_steps == 0 &&
        settings_.train_time_interval <= 0 && (settings_.save_top_k != 0 || settings_.save_last != ck::SaveLast::off)) {
      throw ember::ConfigError(settings_.save_on_train_epoch_end_where +
                            ": false saves after each validation, and this run has no validation (no validation batches), so no "
                            "checkpoint would be saved; set it to true or leave it out, or give the data a validation split");
    }
    // Lightning warns here: files from another run may be mistaken for this run's (or deleted).
    std::error_code ec;
    if (!restored_ && settings_.save_top_k != 0 && trainer.is_global_zero() && fs::is_directory(dirpath_, ec) &&
        !fs::is_empty(dirpath_, ec)) {
      host_.log(ember::LogLevel::warn, "checkpoint: folder " + dirpath_ + " exists and is not empty");
    }
  }

  void on_train_start(ember::ITrainer& trainer) override {
    training_ = true;
    // Nothing to save before the first step; after a resume the current step is already on disk.
    last_global_step_saved_ = trainer.global_step();
    last_time_checked_step_ = trainer.global_step();
    last_time_save_ = Clock::now();  // train_time_interval counts from the start of training
    validation_has_run_ = false;
    warned_missing_monitor_ = false;
  }

  void on_train_end(ember::ITrainer&) override { training_ = false; }

  // save_on_exception (Lightning's ModelCheckpoint.save_on_exception, its OnExceptionCheckpoint's
  // file name): the state a failed training run reached, when it trained anything since the last
  // save. The engine refuses a state that would not resume exactly (inside an optimizer update or
  // an accumulation window) and a run of several ranks; the reason is logged, the run's own error
  // is what the run reports either way.
  void on_exception(ember::ITrainer& trainer) override {
    if (!settings_.save_on_exception || !training_) return;
    training_ = false;
    if (trainer.global_step() == last_global_step_saved_) {
      host_.log(ember::LogLevel::info, "checkpoint: nothing trained since the last checkpoint (step " + std::to_string(trainer.global_step()) +
                                           "), so none is saved on exception");
      return;
    }
    const std::string path = (fs::path(dirpath_) / "on_exception.ckpt").string();
    try {
      std::error_code ec;
      fs::create_directories(dirpath_, ec);
      ember::trainer_service<ember::ITrainerCheckpoints>(trainer, "checkpoint").save_checkpoint(path, settings_.save_weights_only);
      host_.log(ember::LogLevel::warn, "checkpoint: training failed at step " + std::to_string(trainer.global_step()) + "; its state is in " +
                                           path + " (--resume last continues from it)");
    } catch (const std::exception& e) {
      host_.log(ember::LogLevel::warn, std::string("checkpoint: save_on_exception: ") + e.what());
    }
  }

  // Saving by epoch, Lightning's rule (save_on_train_epoch_end unset): after each validation that
  // runs in mid-epoch (val_check_interval < 1) or every few epochs, then the monitored metric is
  // fresh; at the end of the epoch when validation runs right before it (then the epoch's
  // training metrics are there too) or when there is no validation. Never at the end of an epoch
  // whose validation was skipped (check_val_every_n_epoch > 1): its val_loss would be the
  // previous epoch's, ranked again as a new checkpoint. true / false force one of the two.
  void on_train_epoch_start(ember::ITrainer&) override {
    last_train_batch_ = -1;
    validated_at_epoch_end_ = false;
  }

  void on_validation_end(ember::ITrainer& trainer) override {
    if (trainer.sanity_checking()) return;
    validation_has_run_ = true;
    if (!training_ || settings_.save_on_train_epoch_end == true) return;  // engine validate, or saving at epoch ends only
    if (!settings_.save_on_train_epoch_end && last_train_batch_ + 1 == trainer.num_training_batches()) {
      validated_at_epoch_end_ = true;  // on_train_epoch_end follows and saves
      return;
    }
    save_by_epoch(trainer, true);
  }

  void on_train_batch_end(ember::ITrainer& trainer) override {
    last_train_batch_ = trainer.batch_idx();
    if (skip(trainer)) return;
    const bool by_steps = settings_.every_n_train_steps >= 1 && trainer.global_step() % settings_.every_n_train_steps == 0;
    if (!by_steps && !time_due(trainer)) return;
    begin_saves(trainer);
    save_topk(trainer);
    save_last(trainer);
    end_saves(trainer);
  }

  void on_train_epoch_end(ember::ITrainer& trainer) override {
    // Runs after the model's on_train_epoch_end, with this epoch's validation metrics in place.
    const bool validated = validated_at_epoch_end_;
    validated_at_epoch_end_ = false;
    if (settings_.save_on_train_epoch_end) {
      if (*settings_.save_on_train_epoch_end) save_by_epoch(trainer, true);
      return;
    }
    if (validated || trainer.num_batches(ember::Split::val) == 0) return save_by_epoch(trainer, true);
    // Training ends here without a validation right before (a stop asked for in mid-epoch, a
    // signal, the last epoch of check_val_every_n_epoch > 1): its end is still saved, so that
    // `--resume last` continues from it, but a monitored value would be an older validation's and
    // is not ranked again. Without a monitor the top-k files are the latest ones: this is one.
    if (ends_training(trainer)) save_by_epoch(trainer, settings_.monitor.empty());
  }

 private:
  static bool ends_training(const ember::ITrainer& trainer) {
    return trainer.stop_requested() || (trainer.max_steps() > 0 && trainer.global_step() >= trainer.max_steps()) ||
           (trainer.max_epochs() > 0 && trainer.current_epoch() + 1 >= trainer.max_epochs());
  }

  // The saves by epoch: top-k every every_n_epochs epochs (when `rank` allows it), last.ckpt every
  // time (Lightning: every_n_epochs does not throttle last.ckpt).
  void save_by_epoch(ember::ITrainer& trainer, bool rank) {
    if (skip(trainer)) return;
    const bool topk = rank && settings_.every_n_epochs >= 1 && (trainer.current_epoch() + 1) % settings_.every_n_epochs == 0;
    if (!topk && settings_.save_last == ck::SaveLast::off) return;
    begin_saves(trainer);
    if (topk) save_topk(trainer);
    save_last(trainer);
    end_saves(trainer);
  }

  // Never while sanity checking, and never twice for the same optimizer step (the epoch end
  // right after a step-triggered save, or micro-batches of one accumulated step).
  // train_time_interval: whether this batch, the first after an optimizer step (a save between
  // the batches of an accumulation would not resume exactly), ends the interval. Ranks' clocks
  // differ and a save may be collective (sharded), so rank 0's clock decides for every rank.
  bool time_due(ember::ITrainer& trainer) {
    if (settings_.train_time_interval <= 0 || trainer.global_step() == last_time_checked_step_) return false;
    last_time_checked_step_ = trainer.global_step();
    const auto now = Clock::now();
    const bool mine = trainer.is_global_zero() && std::chrono::duration<double>(now - last_time_save_).count() >= settings_.train_time_interval;
    const bool due = trainer.world_size() == 1
                         ? mine
                         : ember::trainer_service<ember::ITrainerCollectives>(trainer, "checkpoint (train_time_interval)").any_rank(mine);
    if (due) last_time_save_ = now;
    return due;
  }

  bool skip(const ember::ITrainer& trainer) const {
    return trainer.sanity_checking() || last_global_step_saved_ == trainer.global_step();
  }

  // epoch and step come from the loop; everything else from the logged metrics.
  static std::optional<double> lookup(const ember::ITrainer& trainer, const std::string& name) {
    if (name == "epoch") return static_cast<double>(trainer.current_epoch());
    if (name == "step") return static_cast<double>(trainer.global_step());
    double v = 0;
    if (trainer.metric(name, &v)) return v;
    return std::nullopt;
  }
  static std::vector<std::string> candidate_names(const ember::ITrainer& trainer) {
    std::vector<std::string> names = trainer.metric_names();
    for (const char* n : {"epoch", "step"}) {
      if (std::find(names.begin(), names.end(), n) == names.end()) names.emplace_back(n);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string format_stem(const ember::ITrainer& trainer) const {
    try {
      return settings_.filename.format([&](const std::string& n) { return lookup(trainer, n); },
                                       settings_.auto_insert_metric_name);
    } catch (const ck::UnknownName& e) {
      throw ember::RunError("checkpoint: filename '" + settings_.filename.text() + "' uses '" + e.name() +
                            "', which is not a logged metric" +
                            ck::suggestion_suffix(e.name(), candidate_names(trainer)));
    }
  }

  // enable_version_counter = false: the name as it is, overwriting a file that has it.
  std::string versioned(const std::string& stem, const std::string& replacing) const {
    if (!settings_.enable_version_counter) return ck::checkpoint_path(dirpath_, stem);
    return ck::versioned_checkpoint_path(dirpath_, stem, file_exists, replacing);
  }

  void info(const std::string& message) {
    if (settings_.verbose) host_.log(ember::LogLevel::info, "checkpoint: " + message);
  }
  static std::string where(const ember::ITrainer& trainer) {
    return "Epoch " + std::to_string(trainer.current_epoch()) + ", global step " +
           std::to_string(trainer.global_step());
  }

  void save_topk(ember::ITrainer& trainer) {
    if (settings_.save_top_k == 0) return;
    if (settings_.monitor.empty()) return save_none_monitor(trainer);
    const std::optional<double> current = lookup(trainer, settings_.monitor);
    if (!current) {
      const std::string msg = "checkpoint: monitor '" + settings_.monitor + "' not found in logged metrics" +
                              ck::suggestion_suffix(settings_.monitor, candidate_names(trainer));
      // Lightning: an error once validation has run (the name is wrong); before that only a
      // warning, as a validation metric cannot exist yet (step-based saves in the first epoch,
      // validation every few epochs).
      if (validation_has_run_) throw ember::RunError(msg);
      if (!warned_missing_monitor_) {
        host_.log(ember::LogLevel::warn, msg + "; no top-k checkpoint until it is logged");
        warned_missing_monitor_ = true;
      }
      return;
    }
    save_monitor(trainer, *current);
  }

  void save_monitor(ember::ITrainer& trainer, double current) {
    const double score = topk_.score_of(current);
    if (!topk_.should_save(score)) {
      info(where(trainer) + ": '" + settings_.monitor + "' was not in top " + std::to_string(settings_.save_top_k));
      return;
    }
    const std::string stem = format_stem(trainer);  // may throw: before anything changes
    const ck::TopKState before = topk_.state();
    const auto added = topk_.add(score, [&](const std::string& dropped) { return versioned(stem, dropped); });
    std::string message;
    if (settings_.verbose) {
      const auto& s = topk_.state();
      char line[96];
      std::snprintf(line, sizeof line, "reached %.5f (best %.5f)", current,
                    s.best_model_score ? *s.best_model_score : std::nan(""));
      message = where(trainer) + ": '" + settings_.monitor + "' " + line + ", saved '" + added.path + "' as top " +
                (settings_.save_top_k == -1 ? std::string("all") : std::to_string(settings_.save_top_k));
    }
    write(added.path, before, [this, &trainer, message, dropped = added.dropped, path = added.path] {
      info(message);
      remove_if_unused(trainer, dropped, path);
    });
  }

  // No monitor: the newest checkpoint is "the best"; with save_top_k = 1 the previous one goes.
  void save_none_monitor(ember::ITrainer& trainer) {
    const std::string stem = format_stem(trainer);
    const ck::TopKState before = topk_.state();
    const std::string previous = before.best_model_path;
    // Only with save_top_k = 1 is the previous file being replaced (it goes anyway); when all
    // are kept, a repeated name gets a version suffix instead of overwriting a kept file.
    const std::string path = versioned(stem, settings_.save_top_k == 1 ? previous : std::string());
    topk_.state().best_model_path = path;
    write(path, before, [this, &trainer, previous, path, message = where(trainer) + ": saved '" + path + "'"] {
      info(message);
      if (settings_.save_top_k == 1) remove_if_unused(trainer, previous, path);
    });
  }

  void save_last(ember::ITrainer& trainer) {
    if (settings_.save_last == ck::SaveLast::off) return;
    const ck::TopKState before = topk_.state();
    const std::string previous = before.last_model_path;
    const std::string path = versioned(ck::kNameLast, previous);
    topk_.state().last_model_path = path;
    // save_last = "link": the top-k file of this save holds the same state, so last.ckpt becomes
    // a link to it rather than a second copy. A save that keeps no top-k file writes it in full.
    if (settings_.save_last == ck::SaveLast::link && !step_saves_.empty()) {
      link_ = [this, &trainer, previous, path, target = step_saves_.back().path] {
        if (!trainer.is_global_zero()) return;
        if (const std::string error = ck::link_checkpoint(path, target); !error.empty()) {
          // A stale last.ckpt would resume an older state: without it, `--resume last` takes the
          // newest checkpoint, which is `target`.
          std::error_code ec;
          remove_checkpoint(path, ec);
          host_.log(ember::LogLevel::warn, "checkpoint: " + error + "; " + path + " is removed, so `--resume last` takes " + target +
                                               " (set save_last = true to write it in full)");
          return;
        }
        info("linked '" + path + "' to '" + target + "'");
        remove_if_unused(trainer, previous, path);
      };
      return;
    }
    write(path, before, [this, &trainer, previous, path, message = where(trainer) + ": saved '" + path + "'"] {
      info(message);
      remove_if_unused(trainer, previous, path);
    });
  }

  // The saves of one step are decided first (the bookkeeping of all of them in place, so each
  // file holds the state that names it and last.ckpt), then written together by end_saves(): at
  // once, or asynchronously (async = true) as one copy of the state written to each file. Before
  // deciding anything, a write still in flight is finished (committed, and what it replaced
  // deleted), so the bookkeeping and the file names are those of synchronous saves. Collective
  // like the saves: every rank reaches a save's trigger at the same step.
  struct StepSave {
    std::string path;
    ck::TopKState before;
    std::function<void()> on_disk;
  };
  void begin_saves(ember::ITrainer& trainer) {
    step_saves_.clear();
    link_ = nullptr;
    if (settings_.async) ember::trainer_service<ember::ITrainerAsyncCheckpoints>(trainer, "checkpoint (async = true)").finish_checkpoints();
  }

  // Writes this step's files. Once they are durable (at once after a synchronous write; when the
  // trainer commits an asynchronous one), last.ckpt is linked, then what they replace is deleted:
  // never before, so a failed write (which stops the run) leaves every earlier file in place, and
  // last.ckpt never points at a deleted file. A failed write puts the bookkeeping back to what
  // it was before that file, so the previous best is never lost.
  void end_saves(ember::ITrainer& trainer) {
    if (step_saves_.empty()) return;
    std::vector<StepSave> saves = std::move(step_saves_);
    step_saves_.clear();
    std::vector<std::function<void()>> on_disk;
    if (link_) on_disk.push_back(std::move(link_));
    link_ = nullptr;
    for (auto& s : saves) on_disk.push_back(std::move(s.on_disk));
    // The folder is created here when it can be; when it cannot, the save fails on rank 0 with the
    // reason, and every rank learns it there (a throw here would leave the other ranks waiting in
    // the save's collectives).
    if (trainer.is_global_zero()) {
      std::error_code ec;
      fs::create_directories(fs::path(saves.front().path).parent_path(), ec);
    }
    if (settings_.async) {
      std::vector<std::string> paths;
      for (const auto& s : saves) paths.push_back(s.path);
      try {
        ember::trainer_service<ember::ITrainerAsyncCheckpoints>(trainer, "checkpoint (async = true)")
            .save_checkpoint_async(paths, settings_.save_weights_only, [on_disk = std::move(on_disk)] {
              for (const auto& f : on_disk) f();
            });
      } catch (...) {
        topk_.state() = saves.front().before;
        throw;
      }
      last_global_step_saved_ = trainer.global_step();
      return;
    }
    auto& checkpoints = ember::trainer_service<ember::ITrainerCheckpoints>(trainer, "checkpoint");
    for (const auto& s : saves) {
      try {
        checkpoints.save_checkpoint(s.path, settings_.save_weights_only);
      } catch (...) {
        topk_.state() = s.before;
        throw;
      }
    }
    last_global_step_saved_ = trainer.global_step();
    for (const auto& f : on_disk) f();
  }

  // A file of this step, its bookkeeping already in place (`before` is what it replaced);
  // `on_disk` runs once the step's files are durable.
  void write(const std::string& path, const ck::TopKState& before, std::function<void()> on_disk) {
    step_saves_.push_back({path, before, std::move(on_disk)});
  }

  // Deletes a file that left the top k (or an older last/latest one). Rank 0 only, and only
  // after the new file was written.
  void remove_if_unused(const ember::ITrainer& trainer, const std::string& previous, const std::string& current) {
    if (!trainer.is_global_zero() || !ck::should_remove_checkpoint(topk_.state(), previous, current, dirpath_)) {
      return;
    }
    std::error_code ec;
    remove_checkpoint(previous, ec);
    if (ec) {
      host_.log(ember::LogLevel::warn, "checkpoint: could not delete " + previous + ": " + ec.message());
    } else {
      info("deleted '" + previous + "'");
    }
  }

  // Lightning's load_state_dict: everything when the folder is the same, else only
  // best_model_path; nothing when the ranking changed (Lightning keys the state by monitor and
  // mode, so a different ranking finds no state).
  void apply(SavedState saved) {
    restored_ = true;
    if (saved.monitor != settings_.monitor || saved.mode != ck::mode_name(topk_.mode())) {
      host_.log(ember::LogLevel::warn,
                "checkpoint: the checkpoint ranked by monitor '" + saved.monitor + "' (" + saved.mode +
                    "), this run by '" + settings_.monitor + "' (" + ck::mode_name(topk_.mode()) +
                    "): top-k bookkeeping starts afresh");
      return;
    }
    if (saved.dirpath == dirpath_) {
      topk_.state() = std::move(saved.topk);
      return;
    }
    host_.log(ember::LogLevel::warn, "checkpoint: dirpath changed from '" + saved.dirpath + "' to '" + dirpath_ +
                                         "': only best_model_path is restored");
    topk_.state().best_model_path = saved.topk.best_model_path;
  }

  ember::IHost& host_;
  const ck::Settings settings_;

  std::string dirpath_;  // the folder in use, known from setup() on
  ck::TopK topk_;
  int64_t last_global_step_saved_ = 0;
  bool validation_has_run_ = false;
  bool warned_missing_monitor_ = false;
  bool restored_ = false;
  bool training_ = false;  // between on_train_start and on_train_end
  int64_t last_train_batch_ = -1;        // this epoch's latest training batch (-1: none yet)
  bool validated_at_epoch_end_ = false;  // the validation after the epoch's last batch ran: save at its end
  using Clock = std::chrono::steady_clock;
  Clock::time_point last_time_save_{};
  int64_t last_time_checked_step_ = -1;
  std::optional<SavedState> pending_;  // state loaded before setup()
  std::vector<StepSave> step_saves_;   // this step's saves, written together by end_saves()
  std::function<void()> link_;         // save_last = "link": points last.ckpt at this step's top-k file
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new ModelCheckpoint(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "checkpoint", "0.2.0", "Apache-2.0",
             "Saves the best checkpoints by a monitored metric and last.ckpt (Lightning's ModelCheckpoint).",
             EMBER_CONFIG_KEYS(kKeys), make)
