// Plugin "spike_guard": Lightning's SpikeDetection for the engine's loop. After every training
// batch it checks the batch's loss: a non-finite loss, or one that moved away from the running
// mean of the last `window` losses by at least `rtol` times that mean (and `atol`, when set) in the
// worse direction, is a spike. Every rank votes (a spike on one rank is a spike for all), so every
// rank stops at the same batch: the run ends non-zero with one line naming the batch, the step and
// the loss, and rank 0 appends the event to <run folder>/spike_guard.jsonl. Without it a NaN loss
// trains on to the end and exits 0.
//
// Cost: one read of the loss to the host per training batch, and, with several ranks, one
// all-reduce of a flag (what Lightning's SpikeDetection costs too).
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/support/callback_base.h>
#include <ember/support/number_text.h>
#include <ember/support/plugin_state.h>
#include <ember/trainer.h>

#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("window", "10", "Losses in the running mean a loss is compared with (Lightning's window).").at_least(1),
    ember::key::Int("warmup", "1", "Training batches before spikes are looked for (a non-finite loss counts from the first).").at_least(0),
    ember::key::Float("rtol", "2.0", "A spike moves at least rtol x |running mean| away from it in the worse direction; 0 = no relative test.").at_least(0.0),
    ember::key::Float("atol", "0.0", "... and at least atol away (both must hold when both are set); 0 = no absolute test.").at_least(0.0),
    ember::key::String("mode", "\"min\"", "Whether a lower loss is better (min) or a higher one (max); a move in the better direction is never a spike.").choices("min|max"),
};
// clang-format on

class SpikeGuard final : public ember::Callback {
 public:
  SpikeGuard(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        window_(static_cast<size_t>(cfg.get_int("window"))),
        warmup_(cfg.get_int("warmup")),
        rtol_(cfg.get_float("rtol")),
        atol_(cfg.get_float("atol")),
        minimize_(cfg.get_string("mode") == "min") {}

  void on_train_batch_end(ember::ITrainer& t) override {
    const at::Tensor loss = t.current_loss();
    if (!loss.defined()) return;
    const double value = loss.item<double>();
    std::string why = judge(value);
    // Every rank learns whether any rank saw a spike, and all stop at this batch together.
    const bool local = !why.empty();
    const bool any = t.world_size() > 1 ? ember::trainer_service<ember::ITrainerCollectives>(t, "spike_guard").any_rank(local) : local;
    ++seen_;
    if (!any) {
      losses_.push_back(value);
      if (losses_.size() > window_) losses_.pop_front();
      return;
    }
    if (!local) why = "another rank's training loss spiked or was not finite";
    const std::string where = "training batch " + std::to_string(t.batch_idx()) + " of epoch " + std::to_string(t.current_epoch()) +
                              " (global step " + std::to_string(t.global_step()) + ")";
    if (t.is_global_zero()) record(t, where, value, why);
    throw ember::RunError("spike_guard: " + why + " at " + where +
                          "; stopped (resume from the last checkpoint, and find the batch's samples with the same seed)");
  }

  c10::IValue state_dict() const override {
    auto d = ember::support::new_state();
    d.insert("losses", ember::support::double_list(std::vector<double>(losses_.begin(), losses_.end())));
    d.insert("seen", seen_);
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    ember::support::StateReader r(state, "spike_guard");
    const auto losses = r.get_doubles("losses");
    losses_.assign(losses.begin(), losses.end());
    seen_ = r.get_int("seen");
  }

 private:
  // Why `value` is a spike, or "" when it is not (Lightning's SpikeDetection._is_spike).
  std::string judge(double value) const {
    if (!std::isfinite(value)) return "non-finite training loss (" + ember::shortest_number(value) + ")";
    if (seen_ < warmup_ || losses_.empty() || (rtol_ == 0 && atol_ == 0)) return "";
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

  // One JSON object per line (JSON Lines) in <run folder>/spike_guard.jsonl, appended: a resumed run adds to it.
  void record(ember::ITrainer& t, const std::string& where, double value, const std::string& why) const {
    const auto file = std::filesystem::path(t.run_dir()) / "spike_guard.jsonl";
    std::error_code ec;
    std::filesystem::create_directories(file.parent_path(), ec);
    std::ofstream out(file, std::ios::app);
    auto quoted = [](const std::string& s) {
      std::string q = "\"";
      for (char c : s) q += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
      return q + "\"";
    };
    const std::string loss = std::isfinite(value) ? ember::shortest_number(value) : quoted(ember::shortest_number(value));
    out << "{\"epoch\": " << t.current_epoch() << ", \"batch\": " << t.batch_idx() << ", \"global_step\": " << t.global_step()
        << ", \"loss\": " << loss << ", \"action\": \"stop\", \"why\": " << quoted(why) << "}\n";
    if (!out) host_.log(ember::LogLevel::warn, "spike_guard: could not write " + file.string() + " (" + where + ")");
  }

  ember::IHost& host_;
  size_t window_;
  int64_t warmup_;
  double rtol_, atol_;
  bool minimize_;
  std::deque<double> losses_;
  int64_t seen_ = 0;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new SpikeGuard(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "spike_guard", "0.1.0", "Apache-2.0",
             "Stops the run, on every rank at once, at a non-finite or spiking training loss (Lightning's SpikeDetection).",
             EMBER_CONFIG_KEYS(kKeys), make)
