// Plugin "spike_guard": Lightning's SpikeDetection for the engine's loop, and the rollback Lightning
// leaves to a person. After every training batch it checks the batch's loss: a non-finite loss, or
// one that moved away from the running mean of the last `window` losses by at least `rtol` times
// that mean (and `atol`, when set) in the worse direction, is a spike. Every rank votes (a spike on
// one rank is a spike for all), so every rank acts at the same batch:
//   action = "stop"      the run ends non-zero with one line naming the batch, the step and the loss.
//   action = "rollback"  at the end of the offending optimizer step (its accumulation window), the
//                        trainer restores the newest snapshot (ITrainerRecovery::rollback), the
//                        window's batches are skipped from then on, and training goes on; the
//                        learning rate may be lowered for a while (lr_factor, lr_steps). After
//                        max_rollbacks rollbacks the next spike stops the run.
// Snapshots: the whole training state (what a checkpoint holds) when training starts and every
// snapshot_every_n_steps optimizer steps whose losses were all fine, copied to the host and written
// in the background (ITrainerAsyncCheckpoints) to <run folder>/spike_guard/snapshot.ckpt.
// Every event goes to the log and, from rank 0, to <run folder>/spike_guard.jsonl; the skipped
// batches to <run folder>/skipped_batches.json, whose "skip_batches" list, given to this plugin's
// skip_batches key, makes a run that skips them from the start: it ends with the same weights, bit
// for bit, as the run that rolled back.
//
// Cost: one read of the loss to the host per training batch, and, with several ranks, one
// all-reduce of a flag (what Lightning's SpikeDetection costs too); with rollback, the snapshots.
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/support/callback_base.h>
#include <ember/support/number_text.h>
#include <ember/support/param_groups.h>
#include <ember/support/plugin_state.h>
#include <ember/trainer.h>

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("window", "10", "Losses in the running mean a loss is compared with (Lightning's window).").at_least(1),
    ember::key::Int("warmup", "1", "Training batches before spikes are looked for (a non-finite loss counts from the first).").at_least(0),
    ember::key::Float("rtol", "2.0", "A spike moves at least rtol x |running mean| away from it in the worse direction; 0 = no relative test.").at_least(0.0),
    ember::key::Float("atol", "0.0", "... and at least atol away (both must hold when both are set); 0 = no absolute test.").at_least(0.0),
    ember::key::String("mode", "\"min\"", "Whether a lower loss is better (min) or a higher one (max); a move in the better direction is never a spike.").choices("min|max"),
    ember::key::Bool("finite_only", "false", "Only non-finite losses are spikes (Lightning's finite_only)."),
    ember::key::Bool("check_gradients", "false",
        "Also a spike: a non-finite gradient at an optimizer step (a step the precision handler skips, as 16-mixed loss scaling does, is not one). One pass over the gradients per step."),
    ember::key::String("action", "\"stop\"",
        "stop: end the run non-zero at the spike; rollback: restore the newest snapshot, skip the offending step's batches and go on.").choices("stop|rollback"),
    ember::key::Int("snapshot_every_n_steps", "10",
        "rollback: optimizer steps between snapshots of the training state (one more when training starts); written in the background.").at_least(1),
    ember::key::Int("max_rollbacks", "3", "rollback: after this many rollbacks in a run, the next spike stops it.").at_least(1),
    ember::key::Float("lr_factor", "1.0", "rollback: the learning rate is multiplied by this for lr_steps optimizer steps after a rollback (1 = unchanged).").above(0.0),
    ember::key::Int("lr_steps", "0", "rollback: how many optimizer steps lr_factor applies for.").at_least(0),
    ember::key::StringList("skip_batches", "[]",
        "Training batches never trained on, as \"EPOCH:BATCH\" (what a rolled-back run's skipped_batches.json lists under skip_batches)."),
};
// clang-format on

using BatchId = std::pair<int64_t, int64_t>;  // (epoch, batch index in the epoch)

std::string batch_text(const BatchId& b) { return std::to_string(b.first) + ":" + std::to_string(b.second); }

BatchId parse_batch(const ember::IConfig& cfg, const std::string& text) {
  const auto colon = text.find(':');
  try {
    size_t used_e = 0, used_b = 0;
    if (colon == std::string::npos) throw std::invalid_argument("no colon");
    const int64_t e = std::stoll(text.substr(0, colon), &used_e);
    const int64_t b = std::stoll(text.substr(colon + 1), &used_b);
    if (used_e != colon || used_b != text.size() - colon - 1 || e < 0 || b < 0) throw std::invalid_argument("trailing");
    return {e, b};
  } catch (const std::exception&) {
    throw ember::ConfigError(cfg.section() + ".skip_batches (" + cfg.where("skip_batches") + "): '" + text +
                             "' is not a batch; write \"EPOCH:BATCH\" (e.g. \"1:3\": epoch 1, batch 3), as skipped_batches.json lists them");
  }
}

std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) q += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return q + "\"";
}

// A text file written whole or not at all (temporary file, then rename).
void write_atomically(const fs::path& file, const std::string& text) {
  std::error_code ec;
  fs::create_directories(file.parent_path(), ec);
  const fs::path tmp = file.parent_path() / ("." + file.filename().string() + ".tmp");
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    if (!out) throw ember::RunError("spike_guard: cannot write " + tmp.string());
  }
  fs::rename(tmp, file, ec);
  if (ec) throw ember::RunError("spike_guard: cannot write " + file.string() + " (" + ec.message() + ")");
}

class SpikeGuard final : public ember::Callback {
 public:
  SpikeGuard(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        window_(static_cast<size_t>(cfg.get_int("window"))),
        warmup_(cfg.get_int("warmup")),
        rtol_(cfg.get_float("rtol")),
        atol_(cfg.get_float("atol")),
        minimize_(cfg.get_string("mode") == "min"),
        finite_only_(cfg.get_bool("finite_only")),
        check_gradients_(cfg.get_bool("check_gradients")),
        rollback_(cfg.get_string("action") == "rollback"),
        snapshot_every_(cfg.get_int("snapshot_every_n_steps")),
        max_rollbacks_(cfg.get_int("max_rollbacks")),
        lr_factor_(cfg.get_float("lr_factor")),
        lr_steps_(cfg.get_int("lr_steps")) {
    for (const auto& s : cfg.get_string_list("skip_batches")) skip_.insert(parse_batch(cfg, s));
  }

  void on_train_start(ember::ITrainer& t) override {
    window_batches_.clear();
    bad_.clear();
    // The state training starts from (or resumes at) is the first one to go back to.
    if (rollback_) take_snapshot(t);
  }

  void on_train_batch_start(ember::ITrainer& t) override {
    if (skip_.count({t.current_epoch(), t.batch_idx()}) == 0) return;
    ember::trainer_service<ember::ITrainerRecovery>(t, "spike_guard").skip_batch();
    host_.log(ember::LogLevel::info, "spike_guard: skipping training batch " + batch_text({t.current_epoch(), t.batch_idx()}) +
                                         " (epoch:batch, and the rest of its optimizer step)");
    window_batches_.clear();
  }

  void on_before_optimizer_step(ember::ITrainer& t) override {
    if (check_gradients_) {
      // The tensors the optimizer trains (this rank's shards under a sharding strategy): one flag
      // for all of them, read once.
      at::Tensor bad;
      for (const auto& p : ember::trainer_service<ember::ITrainerWeights>(t, "spike_guard (check_gradients)").trained_parameters()) {
        const at::Tensor& g = p.tensor.grad();
        if (!g.defined()) continue;
        const at::Tensor here = at::isfinite(g).logical_not().any();
        bad = bad.defined() ? bad.logical_or(here) : here;
      }
      gradients_bad_ = bad.defined() && bad.item<bool>();
    }
    if (cooldown_left_ <= 0 || lr_factor_ == 1.0) return;
    auto& opt = t.optimizer();
    lowered_.clear();
    for (size_t g = 0; g < ember::support::num_groups(opt); ++g) {
      const double lr = ember::support::get_lr(opt, g);
      ember::support::set_lr(opt, g, lr * lr_factor_);
      lowered_.emplace_back(lr, lr * lr_factor_);
    }
  }

  void on_train_batch_end(ember::ITrainer& t) override {
    restore_lr(t);
    const at::Tensor loss = t.current_loss();
    if (!loss.defined()) return;
    const double value = loss.item<double>();
    std::string why = judge(value);
    // A step the precision handler skipped for inf/NaN gradients (loss scaling) changed nothing.
    if (why.empty() && gradients_bad_ && t.optimizer_stepped() && !t.optimizer_step_skipped())
      why = "non-finite gradient (training loss " + ember::shortest_number(value) + ")";
    if (t.optimizer_stepped()) gradients_bad_ = false;
    // Every rank learns whether any rank saw a spike, and all act at this batch together.
    const bool local = !why.empty();
    const bool any = t.world_size() > 1 ? ember::trainer_service<ember::ITrainerCollectives>(t, "spike_guard").any_rank(local) : local;
    ++seen_;
    window_batches_.push_back(t.batch_idx());
    if (any) {
      if (!local) why = "another rank's training loss spiked or was not finite";
      const std::string where = "training batch " + std::to_string(t.batch_idx()) + " of epoch " + std::to_string(t.current_epoch()) +
                                " (global step " + std::to_string(t.global_step()) + ")";
      if (!rollback_ || rollbacks_ >= max_rollbacks_) {
        if (t.is_global_zero()) record(t, value, why, "stop");
        throw ember::RunError("spike_guard: " + why + " at " + where +
                              (rollback_ ? "; stopped after " + std::to_string(rollbacks_) + " rollback(s) (spike_guard.max_rollbacks = " +
                                               std::to_string(max_rollbacks_) + ")"
                                         : "; stopped (resume from the last checkpoint, and find the batch's samples with the same seed)"));
      }
      if (bad_.empty()) {  // the first spike of this optimizer step is the one reported
        bad_value_ = value;
        bad_why_ = why;
      }
      bad_.push_back(t.batch_idx());
    } else if (bad_.empty()) {
      losses_.push_back(value);
      if (losses_.size() > window_) losses_.pop_front();
    }
    if (!t.optimizer_stepped()) return;  // the rest of the accumulation window comes first
    if (!bad_.empty()) return roll_back(t);
    window_batches_.clear();
    if (cooldown_left_ > 0) --cooldown_left_;
    if (rollback_ && t.global_step() % snapshot_every_ == 0) take_snapshot(t);
  }

  c10::IValue state_dict() const override {
    auto d = ember::support::new_state();
    d.insert("losses", ember::support::double_list(std::vector<double>(losses_.begin(), losses_.end())));
    d.insert("seen", seen_);
    c10::List<int64_t> skip;
    for (const auto& [e, b] : skip_) {
      skip.push_back(e);
      skip.push_back(b);
    }
    d.insert("skip", skip);
    d.insert("rollbacks", rollbacks_);
    d.insert("cooldown", cooldown_left_);
    return d;
  }
  // A rollback loads the snapshot's state into this plugin too: the skipped batches, the rollback
  // count and the learning-rate cooldown decided since then are kept (the union, the larger).
  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    ember::support::StateReader r(state, "spike_guard");
    const auto losses = r.get_doubles("losses");
    losses_.assign(losses.begin(), losses.end());
    seen_ = r.get_int("seen");
    if (r.has("skip")) {
      const c10::IValue v = r.get("skip");
      if (!v.isIntList() || v.toIntVector().size() % 2 != 0) r.fail("'skip' is not a list of (epoch, batch) pairs");
      const auto flat = v.toIntVector();
      for (size_t i = 0; i + 1 < flat.size(); i += 2) skip_.insert({flat[i], flat[i + 1]});
    }
    if (r.has("rollbacks")) rollbacks_ = std::max(rollbacks_, r.get_int("rollbacks"));
    if (r.has("cooldown")) cooldown_left_ = std::max(cooldown_left_, r.get_int("cooldown"));
  }

 private:
  // Why `value` is a spike, or "" when it is not (Lightning's SpikeDetection._is_spike).
  std::string judge(double value) const {
    if (!std::isfinite(value)) return "non-finite training loss (" + ember::shortest_number(value) + ")";
    if (finite_only_ || seen_ < warmup_ || losses_.empty() || (rtol_ == 0 && atol_ == 0)) return "";
    double mean = 0;
    for (double v : losses_) mean += v;
    mean /= static_cast<double>(losses_.size());
    const double diff = value - mean;
    if (minimize_ ? diff <= 0 : diff >= 0) return "";
    if (atol_ > 0 && std::abs(diff) < atol_) return "";
    if (rtol_ > 0 && std::abs(diff) < rtol_ * std::abs(mean)) return "";
    return "training loss " + ember::shortest_number(value) + " spiked (running mean of the last " + std::to_string(losses_.size()) +
           ": " + ember::shortest_number(mean) + ")";
  }

  fs::path snapshot_path(const ember::ITrainer& t) const { return fs::path(t.run_dir()) / "spike_guard" / "snapshot.ckpt"; }

  void take_snapshot(ember::ITrainer& t) {
    ember::trainer_service<ember::ITrainerAsyncCheckpoints>(t, "spike_guard (action = \"rollback\")")
        .save_checkpoint_async({snapshot_path(t).string()}, /*weights_only=*/false, [] {});
    snapshot_step_ = t.global_step();
  }

  // The end of an optimizer step that had a spike: every batch of its window is skipped from now
  // on, and the trainer goes back to the snapshot once this hook returns.
  void roll_back(ember::ITrainer& t) {
    ++rollbacks_;
    for (int64_t b : window_batches_) {
      skip_.insert({t.current_epoch(), b});
      skipped_.push_back({t.current_epoch(), b});
    }
    if (lr_factor_ != 1.0) cooldown_left_ = lr_steps_;
    const std::string what = "spike_guard: " + bad_why_ + " at training batch " + batch_text({t.current_epoch(), bad_.front()}) +
                             " (epoch:batch, global step " + std::to_string(t.global_step()) + "); rolling back to the snapshot of step " +
                             std::to_string(snapshot_step_) + " and skipping the batches of that optimizer step (" +
                             std::to_string(window_batches_.size()) + "), rollback " + std::to_string(rollbacks_) + " of at most " +
                             std::to_string(max_rollbacks_);
    host_.log(ember::LogLevel::warn, what);
    if (t.is_global_zero()) {
      record(t, bad_value_, bad_why_, "rollback");
      write_skipped(t);
    }
    window_batches_.clear();
    bad_.clear();
    ember::trainer_service<ember::ITrainerRecovery>(t, "spike_guard").rollback(snapshot_path(t).string());
  }

  // One JSON object per line (JSON Lines) in <run folder>/spike_guard.jsonl, appended: a resumed
  // run adds to it.
  void record(ember::ITrainer& t, double value, const std::string& why, const char* action) const {
    const auto file = fs::path(t.run_dir()) / "spike_guard.jsonl";
    std::error_code ec;
    fs::create_directories(file.parent_path(), ec);
    std::ofstream out(file, std::ios::app);
    const std::string loss = std::isfinite(value) ? ember::shortest_number(value) : quoted(ember::shortest_number(value));
    out << "{\"epoch\": " << t.current_epoch() << ", \"batch\": " << t.batch_idx() << ", \"global_step\": " << t.global_step()
        << ", \"loss\": " << loss << ", \"action\": \"" << action << "\", \"why\": " << quoted(why) << "}\n";
    if (!out) host_.log(ember::LogLevel::warn, "spike_guard: could not write " + file.string());
  }

  // <run folder>/skipped_batches.json: what this run skipped, and the list that makes another run
  // skip them from the start.
  void write_skipped(ember::ITrainer& t) const {
    std::string list;
    for (const auto& b : skip_) list += std::string(list.empty() ? "" : ", ") + quoted(batch_text(b));
    std::string text = "{\n  \"skip_batches\": [" + list + "],\n  \"rolled_back\": [";
    for (size_t i = 0; i < skipped_.size(); ++i)
      text += std::string(i ? ", " : "") + "{\"epoch\": " + std::to_string(skipped_[i].first) + ", \"batch\": " + std::to_string(skipped_[i].second) + "}";
    text += "],\n  \"how\": " + quoted("--set 'spike_guard.skip_batches=[" + list + "]' skips them from the start") + "\n}\n";
    try {
      write_atomically(fs::path(t.run_dir()) / "skipped_batches.json", text);
    } catch (const std::exception& e) {
      host_.log(ember::LogLevel::warn, e.what());
    }
  }

  // lr_factor applies to the optimizer step only: the rates go back to what they were unless a
  // scheduler set new ones since.
  void restore_lr(ember::ITrainer& t) {
    if (lowered_.empty()) return;
    auto& opt = t.optimizer();
    for (size_t g = 0; g < lowered_.size() && g < ember::support::num_groups(opt); ++g)
      if (ember::support::get_lr(opt, g) == lowered_[g].second) ember::support::set_lr(opt, g, lowered_[g].first);
    lowered_.clear();
  }

  ember::IHost& host_;
  size_t window_;
  int64_t warmup_;
  double rtol_, atol_;
  bool minimize_, finite_only_, check_gradients_, rollback_;
  bool gradients_bad_ = false;  // this step's gradients had an inf or NaN (check_gradients)
  int64_t snapshot_every_, max_rollbacks_;
  double lr_factor_;
  int64_t lr_steps_;
  std::deque<double> losses_;
  int64_t seen_ = 0;
  std::set<BatchId> skip_;                // never trained on (config, and every rollback's)
  std::vector<BatchId> skipped_;          // what this process rolled back, in order
  std::vector<int64_t> window_batches_;   // the batches of the optimizer step under way
  std::vector<int64_t> bad_;              // those of them that spiked
  double bad_value_ = 0;
  std::string bad_why_;
  int64_t rollbacks_ = 0, cooldown_left_ = 0, snapshot_step_ = 0;
  std::vector<std::pair<double, double>> lowered_;  // per group: the rate before lr_factor, and after
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new SpikeGuard(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "spike_guard", "0.2.0", "Apache-2.0",
             "Stops the run, or rolls it back to a snapshot and skips the batches, at a non-finite or spiking training loss "
             "(Lightning's SpikeDetection, and the restart it leaves to a person).",
             EMBER_CONFIG_KEYS(kKeys), make)
