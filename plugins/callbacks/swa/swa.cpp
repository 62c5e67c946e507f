// Plugin "swa": stochastic weight averaging (Lightning's StochasticWeightAveraging, built on the
// arithmetic of torch.optim.swa_utils).
//
// From epoch swa_start on:
//   on_train_epoch_start  SWA takes over the learning rate: SWALR anneals every param group from
//                         the rate it had then (lr0) to swa_lrs over annealing_epochs (cos|linear)
//   on_train_batch_start  writes that rate again, so a step scheduler (cyclic_lr, ...) that moved
//                         it in its on_train_batch_end never drives an SWA step; this holds in any
//                         plugin order, because every on_train_batch_start comes after the
//                         previous batch's on_train_batch_end (Lightning swaps the scheduler out)
//   on_train_epoch_end    adds the epoch's weights to the running mean (AveragedModel)
// At the end of the last epoch (max_epochs or max_steps reached), still in on_train_epoch_end
// and therefore before the checkpoint callback and the model's hook run, it swaps the averaged
// weights into the model, recomputes batch-norm statistics with a pass over the training split
// (update_bn), and validates again. The checkpoint saved at that epoch end (last.ckpt, and the
// top-k if the averaged weights rank there) therefore holds the averaged weights, its val_*
// metrics are those of the averaged model, and test_after_fit tests them (test_ckpt = "last" or
// "current"; "best" picks them when they validate best). A run that ends otherwise (early stop)
// swaps them in at on_train_end instead: then only the weights in memory are averaged.
//
// Resume: the state holds the running mean, n_averaged, lr0 and, once the averaged weights were
// swapped in, the model's own last weights; on_load_checkpoint puts those back, so a finished run
// resumed with a larger max_epochs goes on exactly as an uninterrupted run would.
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <torch/nn/module.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <ember/support/param_groups.h>
#include <ember/support/plugin_state.h>
#include <ember/support/weight_averaging.h>
#include <ember/support/weight_copies.h>

namespace {

using namespace ember::support;
using ember::support::StateReader;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::FloatList("swa_lrs", nullptr, "SWA learning rate (required): one value for every param group, or one per group, e.g. [0.01].").above(0),
    ember::key::Number("swa_epoch_start", "0.8", "First averaged epoch: an int is an epoch index (>= 1), a float in (0, 1] a fraction of max_epochs.").above(0),
    ember::key::Int("annealing_epochs", "10", "Epochs over which the learning rate moves from its value at swa_epoch_start to swa_lrs (0 = at once).").at_least(0),
    ember::key::String("annealing_strategy", "\"cos\"", "Shape of that move (SWALR's anneal_strategy).").choices("cos|linear"),
    ember::key::Elsewhere("avg_fn", "swa keeps the equal-weight mean of the weights; for an exponential moving average use the ema "
                                    "callback (--plugins ema)"),
};
// clang-format on

class Swa final : public ember::Callback {
 public:
  Swa(ember::IHost& host, const ember::IConfig& cfg) : host_(host), name_(cfg.section()) {
    if (!cfg.has("swa_lrs"))
      throw ember::ConfigError("[" + name_ + "] swa_lrs is required: set the SWA learning rate, e.g. swa_lrs = [0.01]");
    swa_lrs_ = cfg.get_float_list("swa_lrs");
    if (swa_lrs_.empty())
      throw ember::ConfigError("[" + name_ + "] swa_lrs (" + cfg.where("swa_lrs") + ") is empty: give one value, e.g. swa_lrs = [0.01]");
    start_is_epoch_ = cfg.is_integer("swa_epoch_start");
    start_value_ = cfg.get_float("swa_epoch_start");
    if (start_is_epoch_ ? start_value_ < 1 : start_value_ > 1.0)
      throw ember::ConfigError("[" + name_ + "] swa_epoch_start (" + cfg.where("swa_epoch_start") +
                               ") should be an integer >= 1 (an epoch) or a float in (0, 1] (a fraction of max_epochs)");
    annealing_epochs_ = cfg.get_int("annealing_epochs");
    strategy_ = cfg.get_string("annealing_strategy") == "linear" ? AnnealStrategy::linear : AnnealStrategy::cos;
  }

  void on_train_start(ember::ITrainer& t) override {
    if (start_is_epoch_) {
      swa_start_ = static_cast<int64_t>(start_value_);
    } else {
      if (t.max_epochs() < 0)
        throw ember::ConfigError("[" + name_ + "] swa_epoch_start is a fraction but trainer.max_epochs is unlimited: give an epoch (an integer) or set max_epochs");
      swa_start_ = static_cast<int64_t>(static_cast<double>(t.max_epochs()) * start_value_);  // Lightning: int(max_epochs * f)
    }
    const size_t groups = ember::support::num_groups(t.optimizer());
    if (swa_lrs_.size() != 1 && swa_lrs_.size() != groups)
      throw ember::ConfigError("[" + name_ + "] swa_lrs has " + std::to_string(swa_lrs_.size()) + " values but the optimizer has " +
                               std::to_string(groups) + " param groups: give one value, or one per group");
    if (t.max_epochs() >= 0 && swa_start_ > t.max_epochs() - 1)
      host_.log(ember::LogLevel::warn, name_ + ": swa_epoch_start resolves to epoch " + std::to_string(swa_start_) +
                                           ", after the last epoch (" + std::to_string(t.max_epochs() - 1) + "): no averaging will happen");
    auto params = tracked_tensors(t, false);
    if (!averaged_.empty()) {  // restored: move to the parameters' device and dtype
      if (averaged_.size() != params.size())
        throw ember::RunError(name_ + ": the checkpoint averages " + std::to_string(averaged_.size()) + " tensors, the model has " +
                              std::to_string(params.size()) + "; resume with the same model");
      for (size_t i = 0; i < params.size(); ++i) averaged_[i] = averaged_[i].to(params[i].device(), params[i].scalar_type());
    }
  }

  void on_train_epoch_start(ember::ITrainer& t) override {
    if (t.current_epoch() < swa_start_) return;
    if (!started_) {
      started_ = true;
      lr0_ = ember::support::get_lrs(t.optimizer());
      host_.log(ember::LogLevel::info, name_ + ": averaging from epoch " + std::to_string(t.current_epoch()) +
                                           "; the learning rate now follows SWALR");
    }
    write_lr(t);
  }

  void on_train_batch_start(ember::ITrainer& t) override {
    if (started_ && t.current_epoch() >= swa_start_) write_lr(t);
  }

  // trainer.batch_idx() is the validation batch's after a validation pass: remember the last
  // training batch instead.
  void on_train_batch_end(ember::ITrainer& t) override { last_train_batch_ = t.batch_idx(); }

  void on_train_epoch_end(ember::ITrainer& t) override {
    const int64_t e = t.current_epoch();
    if (!started_ || e < swa_start_ || transferred_) return;
    const bool finished = epoch_finished(t);
    const bool last = is_last_epoch(t);
    // An epoch cut short by an interrupt is averaged when the resumed run finishes it.
    if (e > latest_update_epoch_ && (finished || last)) {
      auto params = tracked_tensors(t, false);
      if (averaged_.empty()) averaged_ = clones(params);
      swa_update(averaged_, params, n_averaged_);
      ++n_averaged_;
      latest_update_epoch_ = e;
    }
    if (last) finalize(t);
  }

  void on_train_end(ember::ITrainer& t) override {
    // Stopped before the last epoch (early stopping): the weights in memory become the average;
    // not for an interrupt in mid-epoch, which is resumed later.
    const bool interrupted = t.stop_requested() && !epoch_finished(t);
    if (started_ && !transferred_ && n_averaged_ > 0 && !interrupted) finalize(t);
  }

  void on_load_checkpoint(ember::ITrainer& t) override {
    // The file's weights are the average; training goes on from the model's own weights.
    if (pending_params_.empty()) return;
    copy_into(tracked_tensors(t, false), pending_params_);
    copy_into(all_buffers(t.module()), pending_buffers_);
    ember::trainer_service<ember::ITrainerWeights>(t, "swa").parameters_changed();
    pending_params_.clear();
    pending_buffers_.clear();
    transferred_ = false;
  }

  c10::IValue state_dict() const override {
    auto d = ember::support::new_state();
    d.insert("n_averaged", n_averaged_);
    d.insert("latest_update_epoch", latest_update_epoch_);
    d.insert("started", started_);
    d.insert("lr0", ember::support::double_list(lr0_));
    d.insert("averaged", ember::support::tensor_list(cpu_clones(averaged_)));
    d.insert("transferred", transferred_);
    d.insert("model_params", ember::support::tensor_list(cpu_clones(raw_params_)));
    d.insert("model_buffers", ember::support::tensor_list(cpu_clones(raw_buffers_)));
    return d;
  }

  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    StateReader r(state, name_);
    n_averaged_ = r.get_int("n_averaged");
    latest_update_epoch_ = r.get_int("latest_update_epoch");
    started_ = r.get_bool("started");
    lr0_ = r.get_doubles("lr0");
    averaged_ = r.get_tensors("averaged");
    transferred_ = r.get_bool("transferred");
    pending_params_ = r.get_tensors("model_params");
    pending_buffers_ = r.get_tensors("model_buffers");
    if (transferred_ && pending_params_.empty()) r.fail("'transferred' without 'model_params'");
    raw_params_.clear();
    raw_buffers_.clear();
  }

 private:
  bool epoch_finished(const ember::ITrainer& t) const { return last_train_batch_ + 1 >= t.num_training_batches(); }

  bool is_last_epoch(const ember::ITrainer& t) const {
    return (t.max_epochs() >= 0 && t.current_epoch() + 1 >= t.max_epochs()) ||
           (t.max_steps() >= 0 && t.global_step() >= t.max_steps());
  }

  void write_lr(ember::ITrainer& t) {
    auto& opt = t.optimizer();
    const int64_t e = t.current_epoch() - swa_start_;
    for (size_t g = 0; g < ember::support::num_groups(opt); ++g) {
      const double swa_lr = swa_lrs_.size() == 1 ? swa_lrs_[0] : swa_lrs_[g];
      const double lr0 = g < lr0_.size() ? lr0_[g] : lr0_.back();
      ember::support::set_lr(opt, g, swalr(lr0, swa_lr, e, annealing_epochs_, strategy_));
    }
  }

  void finalize(ember::ITrainer& t) {
    if (n_averaged_ == 0) return;
    auto params = tracked_tensors(t, false);
    raw_params_ = clones(params);
    raw_buffers_ = clones(all_buffers(t.module()));
    copy_into(params, averaged_);
    ember::trainer_service<ember::ITrainerWeights>(t, "swa").parameters_changed();
    transferred_ = true;
    const int64_t bn = update_batch_norm(t);
    host_.log(ember::LogLevel::info, name_ + ": the model now holds the average of " + std::to_string(n_averaged_) + " epochs" +
                                         (bn > 0 ? " (batch-norm statistics recomputed on the training split)" : ""));
    ember::trainer_service<ember::ITrainerPasses>(t, "swa").run_validation();
  }

  ember::IHost& host_;
  std::string name_;
  std::vector<double> swa_lrs_;
  bool start_is_epoch_ = false;
  double start_value_ = 0.8;
  int64_t annealing_epochs_ = 10;
  AnnealStrategy strategy_ = AnnealStrategy::cos;

  int64_t swa_start_ = 0;
  int64_t last_train_batch_ = -1;
  bool started_ = false;
  std::vector<double> lr0_;
  std::vector<at::Tensor> averaged_;
  int64_t n_averaged_ = 0;
  int64_t latest_update_epoch_ = -1;
  bool transferred_ = false;
  std::vector<at::Tensor> raw_params_, raw_buffers_;          // the model's own weights, once averaged ones replaced them
  std::vector<at::Tensor> pending_params_, pending_buffers_;  // the same, read from a checkpoint
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new Swa(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "swa", "0.1.0", "Apache-2.0",
             "Stochastic weight averaging with SWALR annealing and a batch-norm pass (Lightning's StochasticWeightAveraging).",
             EMBER_CONFIG_KEYS(kKeys), make)
