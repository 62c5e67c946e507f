// Plugin "ema": an exponential moving average of the weights (Lightning's EMAWeightAveraging,
// AveragedModel with get_ema_multi_avg_fn): after every update_every_n_steps-th optimizer step,
// ema = ema + (1 - decay) * (w - ema), the first update copying w. Parameters and floating-point
// buffers (batch-norm statistics) are averaged (Lightning's use_buffers = True).
//
// Like Lightning, the averaged weights are what is validated, checkpointed and tested:
//   on_validation_start/end   swap the average in for the pass and back afterwards
//   on_save_checkpoint        swaps it in, so the checkpoint's state_dict holds the average; the
//                             model's own weights go into this plugin's state. The next hook this
//                             plugin receives (at the latest the next on_train_batch_start, before
//                             any forward) swaps them back.
//   on_train_end              the model keeps the average for good (test_ckpt = "current").
// On resume, on_load_checkpoint puts the model's own weights back and the average into the EMA.
// Until the first update there is no average: the model's own weights are used everywhere.
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include <ember/support/plugin_state.h>
#include <ember/support/weight_averaging.h>
#include <ember/support/weight_copies.h>

namespace {

using namespace ember::support;
using ember::support::StateReader;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::Float("decay", "0.999", "Weight of the old average at each update, in (0, 1).").above(0).below(1),
    ember::key::Int("update_every_n_steps", "1", "Update after every n-th optimizer step (step index % n == 0).").at_least(1),
    ember::key::Int("update_starting_at_step", "0", "First optimizer step index that updates the average.").at_least(0),
    ember::key::Int("update_starting_at_epoch", "0", "First epoch whose steps update the average.").at_least(0),
    ember::key::Bool("use_buffers", "true", "Average floating-point buffers (batch-norm statistics) too; false: they are taken from the model."),
};
// clang-format on

class Ema final : public ember::Callback {
 public:
  Ema(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        name_(cfg.section()),
        decay_(cfg.get_float("decay")),
        every_(cfg.get_int("update_every_n_steps")),
        start_step_(cfg.get_int("update_starting_at_step")),
        start_epoch_(cfg.get_int("update_starting_at_epoch")),
        use_buffers_(cfg.get_bool("use_buffers")) {}

  void on_hook(ember::Hook hook, ember::ITrainer& t) override {
    if (swapped_for_save_ && hook != ember::Hook::on_save_checkpoint) {
      swapped_for_save_ = false;
      swap_out(t);
    }
    ember::Callback::on_hook(hook, t);
  }

  void on_train_start(ember::ITrainer& t) override {
    auto tracked = tracked_tensors(t, use_buffers_);
    if (averaged_.empty()) return;
    if (averaged_.size() != tracked.size())
      throw ember::RunError(name_ + ": the checkpoint averages " + std::to_string(averaged_.size()) + " tensors, the model has " +
                            std::to_string(tracked.size()) + "; resume with the same model and use_buffers");
    for (size_t i = 0; i < tracked.size(); ++i) averaged_[i] = averaged_[i].to(tracked[i].device(), tracked[i].scalar_type());
  }

  void on_train_batch_end(ember::ITrainer& t) override {
    if (!t.optimizer_stepped() || swapped_) return;
    const int64_t step_idx = t.global_step() - 1;  // the step just taken
    if (t.global_step() <= latest_update_step_ || step_idx < start_step_ || step_idx % every_ != 0 ||
        t.current_epoch() < start_epoch_)
      return;
    auto tracked = tracked_tensors(t, use_buffers_);
    if (averaged_.empty()) averaged_ = clones(tracked);
    ema_update(averaged_, tracked, n_averaged_, decay_);
    ++n_averaged_;
    latest_update_step_ = t.global_step();
  }

  void on_validation_start(ember::ITrainer& t) override {
    if (!swapped_ && n_averaged_ > 0) swap_in(t);
  }
  void on_validation_end(ember::ITrainer& t) override {
    if (swapped_ && !final_) swap_out(t);
  }

  void on_save_checkpoint(ember::ITrainer& t) override {
    if (!swapped_ && n_averaged_ > 0) {
      swap_in(t);
      swapped_for_save_ = true;
    }
  }

  void on_train_end(ember::ITrainer& t) override {
    if (n_averaged_ == 0 || final_) return;
    if (!swapped_) swap_in(t);
    final_ = true;  // the model keeps the average; its own weights stay in stash_
    host_.log(ember::LogLevel::info, name_ + ": the model now holds the moving average (" + std::to_string(n_averaged_) + " updates)");
  }

  void on_load_checkpoint(ember::ITrainer& t) override {
    if (pending_model_.empty()) return;
    copy_into(tracked_tensors(t, use_buffers_), pending_model_);
    ember::trainer_service<ember::ITrainerWeights>(t, "ema").parameters_changed();
    pending_model_.clear();
  }

  c10::IValue state_dict() const override {
    auto d = ember::support::new_state();
    d.insert("n_averaged", n_averaged_);
    d.insert("latest_update_step", latest_update_step_);
    d.insert("use_buffers", use_buffers_);
    d.insert("averaged", ember::support::tensor_list(cpu_clones(averaged_)));
    // While the average is in the model (during a save), the model's own weights are here.
    d.insert("model", ember::support::tensor_list(cpu_clones(stash_)));
    return d;
  }

  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    StateReader r(state, name_);
    n_averaged_ = r.get_int("n_averaged");
    latest_update_step_ = r.get_int("latest_update_step");
    if (r.get_bool("use_buffers") != use_buffers_)
      throw ember::RunError(name_ + ": the checkpoint was written with use_buffers = " + (use_buffers_ ? "false" : "true") +
                            "; resume with the same setting");
    averaged_ = r.get_tensors("averaged");
    pending_model_ = r.get_tensors("model");
    swapped_ = swapped_for_save_ = final_ = false;
    stash_.clear();
  }

 private:
  void swap_in(ember::ITrainer& t) {
    auto tracked = tracked_tensors(t, use_buffers_);
    stash_ = clones(tracked);
    copy_into(tracked, averaged_);
    ember::trainer_service<ember::ITrainerWeights>(t, "ema").parameters_changed();
    swapped_ = true;
  }
  void swap_out(ember::ITrainer& t) {
    copy_into(tracked_tensors(t, use_buffers_), stash_);
    ember::trainer_service<ember::ITrainerWeights>(t, "ema").parameters_changed();
    stash_.clear();
    swapped_ = false;
  }

  ember::IHost& host_;
  std::string name_;
  double decay_;
  int64_t every_, start_step_, start_epoch_;
  bool use_buffers_;

  std::vector<at::Tensor> averaged_;
  std::vector<at::Tensor> stash_;          // while swapped_: the model's own weights
  std::vector<at::Tensor> pending_model_;  // the model's own weights, read from a checkpoint
  int64_t n_averaged_ = 0;
  int64_t latest_update_step_ = 0;
  bool swapped_ = false, swapped_for_save_ = false, final_ = false;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new Ema(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "ema", "0.1.0", "Apache-2.0",
             "Exponential moving average of the weights, used for validation, checkpoints and test (Lightning's EMAWeightAveraging).",
             EMBER_CONFIG_KEYS(kKeys), make)
