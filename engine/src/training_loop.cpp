#include "training_loop.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/headeronly/version.h>
#include <torch/serialize.h>

#include <atomic>
#include <functional>
#include <csignal>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "checkpoint_io.h"
#include "device_feed.h"
#include "forward_region.h"
#include "optimizer_factory.h"
#include "sharded_checkpoint.h"
#include "engine_schema.h"
#include "log.h"
#include "stop_signals.h"
#include "version.h"

namespace ember::engine {

// ---------------------------------------------------------------------------------------------
// What a model's step sees: self.log(...) goes to the metric store, tagged with the stage.
class StepContextImpl final : public IStepContext {
 public:
  StepContextImpl(TrainingLoop& t, Stage stage, int64_t batch_idx, int64_t batch_size)
      : t_(t), stage_(stage), batch_idx_(batch_idx), batch_size_(batch_size) {}
  void log(std::string_view name, const at::Tensor& value, const LogOptions& o) override {
    if (!t_.quiet_) t_.log_from_step(std::string(name), value, o, stage_, batch_size_);
  }
  void log(std::string_view name, double value, const LogOptions& o) override {
    if (t_.quiet_) return;
    if (t_.recording_logs_) t_.log_from_step(std::string(name), at::scalar_tensor(value, at::kDouble), o, stage_, batch_size_);
    else t_.metrics_.log(std::string(name), value, o, stage_, batch_size_);
  }
  Stage stage() const override { return stage_; }
  int64_t batch_idx() const override { return batch_idx_; }

 private:
  TrainingLoop& t_;
  Stage stage_;
  int64_t batch_idx_, batch_size_;
};

// The optimizer step the strategy and precision handler drive (docs/step.md).
class OptimizerStepImpl final : public IOptimizerStep {
 public:
  OptimizerStepImpl(TrainingLoop& t, const Batch& batch, bool first_in_window)
      : t_(t), batch_(batch), first_(first_in_window) {}
  at::Tensor closure() override {
    t_.closure_ran_ = true;
    if (run_closure) return run_closure();
    return t_.run_micro_batch(batch_, first_, /*sync=*/true);
  }
  std::function<at::Tensor()> run_closure;  // set: the closure runs this instead (a CUDA graph's replay)
  void before_step() override {
    t_.call_hook(Hook::on_before_optimizer_step);
    if (t_.settings_.gradient_clip_val > 0)
      t_.plugins_.strategy.object->clip_gradients(*t_.optimizer_, t_.settings_.gradient_clip_val,
                                                  t_.settings_.gradient_clip_algorithm);
  }
  void step() override { t_.optimizer_->step(); }
  torch::optim::Optimizer& optimizer() override { return *t_.optimizer_; }

 private:
  TrainingLoop& t_;
  const Batch& batch_;
  bool first_;
};

namespace {

std::string epoch_label(int64_t epoch, int64_t max_epochs) {
  return "Epoch " + std::to_string(epoch) + (max_epochs >= 0 ? "/" + std::to_string(max_epochs - 1) : "");
}
}  // namespace

TrainerSettings TrainerSettings::from(const Section& t) {
  TrainerSettings s;
  s.max_steps = t.get_int("max_steps");
  s.max_epochs = t.has("max_epochs") ? t.get_int("max_epochs") : (s.max_steps == -1 ? 1000 : -1);
  s.min_epochs = t.get_int("min_epochs");
  s.min_steps = t.get_int("min_steps");
  // Lightning lets the maximum win silently; a minimum above it is a mistake worth one line.
  if (s.max_epochs >= 0 && s.min_epochs > s.max_epochs)
    throw UsageError(t.where("min_epochs") + ": trainer.min_epochs = " + std::to_string(s.min_epochs) + " exceeds max_epochs = " +
                     std::to_string(s.max_epochs) + ": lower min_epochs or raise max_epochs");
  if (s.max_steps >= 0 && s.min_steps > s.max_steps)
    throw UsageError(t.where("min_steps") + ": trainer.min_steps = " + std::to_string(s.min_steps) + " exceeds max_steps = " +
                     std::to_string(s.max_steps) + ": lower min_steps or raise max_steps");
  s.limit_train = t.get_float("limit_train_batches");
  s.limit_train_is_count = t.is_integer("limit_train_batches");
  s.limit_val = t.get_float("limit_val_batches");
  s.limit_val_is_count = t.is_integer("limit_val_batches");
  s.limit_test = t.get_float("limit_test_batches");
  s.limit_test_is_count = t.is_integer("limit_test_batches");
  auto fraction_ok = [&](const char* key, double v, bool count) {
    if (!count && v > 1.0)
      throw UsageError(t.where(key) + ": trainer." + key + ": a float is a fraction and must be <= 1.0, got " +
                       std::to_string(v) + " (write an integer for a number of batches)");
  };
  fraction_ok("limit_train_batches", s.limit_train, s.limit_train_is_count);
  fraction_ok("limit_val_batches", s.limit_val, s.limit_val_is_count);
  fraction_ok("limit_test_batches", s.limit_test, s.limit_test_is_count);
  // Lightning's overfit_batches: the same first batches of training and validation every epoch.
  if ((s.overfit_batches = t.get_float("overfit_batches")) > 0) {
    fraction_ok("overfit_batches", s.overfit_batches, t.is_integer("overfit_batches"));
    s.limit_train = s.limit_val = s.overfit_batches;
    s.limit_train_is_count = s.limit_val_is_count = t.is_integer("overfit_batches");
  }
  s.limit_predict = t.get_float("limit_predict_batches");
  s.limit_predict_is_count = t.is_integer("limit_predict_batches");
  fraction_ok("limit_predict_batches", s.limit_predict, s.limit_predict_is_count);
  s.val_check_interval = t.get_float("val_check_interval");
  s.val_check_is_count = t.is_integer("val_check_interval");
  fraction_ok("val_check_interval", s.val_check_interval, s.val_check_is_count);
  s.check_val_every_n_epoch = t.get_int("check_val_every_n_epoch");
  if (s.check_val_every_n_epoch == 0 && !s.val_check_is_count)
    throw UsageError(t.where("check_val_every_n_epoch") +
                     ": trainer.check_val_every_n_epoch = 0 needs an integer val_check_interval (validate every n batches)");
  s.num_sanity_val_steps = t.get_int("num_sanity_val_steps");
  s.accumulate_grad_batches = t.get_int("accumulate_grad_batches");
  s.gradient_clip_val = t.has("gradient_clip_val") ? t.get_float("gradient_clip_val") : 0.0;
  s.gradient_clip_algorithm = t.get_string("gradient_clip_algorithm") == "value" ? ClipAlgorithm::value : ClipAlgorithm::norm;
  s.log_every_n_steps = t.get_int("log_every_n_steps");
  s.seed = static_cast<uint64_t>(t.get_int("seed"));
  s.enable_progress_bar = t.get_bool("enable_progress_bar");
  s.cuda_graph = t.get_bool("cuda_graph");
  s.cuda_graph_warmup_steps = t.get_int("cuda_graph_warmup_steps");
  // Lightning's fast_dev_run = N: N batches of each loop in one epoch, validation after them, no
  // sanity check, every step logged. (RunSession removes the run folder afterwards.)
  if ((s.fast_dev_run = t.get_int("fast_dev_run")) > 0) {
    const auto n = static_cast<double>(s.fast_dev_run);
    s.max_steps = s.fast_dev_run;
    s.max_epochs = 1;
    s.min_epochs = s.min_steps = 0;
    s.limit_train = s.limit_val = s.limit_test = s.limit_predict = n;
    s.limit_train_is_count = s.limit_val_is_count = s.limit_test_is_count = s.limit_predict_is_count = true;
    s.val_check_interval = 1.0;
    s.val_check_is_count = false;
    s.check_val_every_n_epoch = 1;
    s.num_sanity_val_steps = 0;
    s.log_every_n_steps = 1;
  }
  return s;
}

TrainingLoop::TrainingLoop(IHost& host, const ResolvedConfig& config, RunPlugins plugins, std::filesystem::path run_dir)
    : host_(host),
      config_(config),
      plugins_(std::move(plugins)),
      run_dir_(std::move(run_dir)),
      settings_(TrainerSettings::from(config.section("trainer"))),
      progress_(settings_.enable_progress_bar && plugins_.strategy.object->rank() == 0, Progress::stderr_is_tty()) {}

TrainingLoop::~TrainingLoop() { attach_plugins(nullptr); }

// Hands the trainer to plugins that asked for it (ITrainerAware), or takes it back (nullptr).
void TrainingLoop::attach_plugins(ITrainer* trainer) {
  if (trainer == nullptr && !attached_) return;
  attached_ = trainer != nullptr;
  auto attach = [&](IPluginObject& o) {
    if (auto* aware = static_cast<ITrainerAware*>(o.query_interface(kTrainerAwareIid))) aware->attach_trainer(trainer);
  };
  attach(*plugins_.strategy.object);
  attach(*plugins_.precision.object);
  attach(*plugins_.model.object);
  attach(*plugins_.data.object);
  for (auto& c : plugins_.callbacks) attach(*c.object);
  for (auto& l : plugins_.loggers) attach(*l.object);
}

int64_t TrainingLoop::limit_batches(int64_t available, double limit, bool is_count) const {
  if (is_count) return std::min<int64_t>(available, static_cast<int64_t>(limit));
  return static_cast<int64_t>(static_cast<double>(available) * limit);
}

void TrainingLoop::setup() {
  auto& strategy = *plugins_.strategy.object;
  const auto& d = config_.section("data");
  train_opts_.batch_size = d.get_int("batch_size");
  train_opts_.shuffle = d.get_bool("shuffle");
  train_opts_.drop_last = d.get_bool("drop_last");
  train_opts_.num_workers = d.get_int("num_workers");
  train_opts_.prefetch_factor = d.get_int("prefetch_factor");
  train_opts_.seed = settings_.seed;
  train_opts_.rank = strategy.rank();
  train_opts_.world_size = strategy.world_size();
  train_opts_.group_by_length = d.get_bool("group_by_length");
  if (train_opts_.group_by_length) {
    sample_lengths_ = static_cast<const ISampleLengths*>(plugins_.data.object->query_interface(kSampleLengthsIid));
    if (sample_lengths_ == nullptr)
      throw UsageError(d.where("group_by_length") + ": data.group_by_length = true, but data plugin '" + plugins_.data.name +
                       "' does not report sample lengths (ember.ISampleLengths/1): remove the key, or use a data plugin "
                       "with samples of different lengths (e.g. text_classification)");
  }
  if (settings_.overfit_batches > 0) {
    // The first batches in the split's order, the same ones every epoch (Lightning's sequential
    // sampler for overfit_batches).
    train_opts_.shuffle = false;
    train_opts_.group_by_length = false;
    const std::string first = config_.section("trainer").is_integer("overfit_batches")
                                  ? c10::str(static_cast<int64_t>(settings_.overfit_batches), " batch(es)")
                                  : c10::str(settings_.overfit_batches * 100, "% of the batches");
    if (strategy.rank() == 0)
      log::info("overfit_batches: training and validating on the first " + first +
                " of each split, the same ones every epoch (no shuffling)");
  }
  eval_opts_ = train_opts_;
  eval_opts_.shuffle = false;
  eval_opts_.drop_last = false;
  eval_opts_.group_by_length = false;  // evaluation keeps the split's order
  eval_batch_size_set_ = d.has("eval_batch_size");
  if (eval_batch_size_set_) eval_opts_.batch_size = d.get_int("eval_batch_size");
  build_loaders();
  feed_options_.pin_memory = d.get_bool("pin_memory");
  feed_options_.channels_last = config_.section("trainer").get_bool("channels_last");

  // Lightning's order (docs/strategy.md): the precision handler converts the module, the strategy
  // places/wraps/shards it, then the strategy builds the optimizer over what it trains. A
  // contract-1 strategy gets its old order through the adapter.
  auto& model = *plugins_.model.object;
  // Before the precision handler and the strategy: their dtype casts and placement keep the
  // memory format.
  if (feed_options_.channels_last) to_channels_last(model.module());
  OptimizerFactory factory(model, plugins_.model.name, config_.section("optimizer"));
  state_ = static_cast<IModelStateStrategy*>(strategy.query_interface(kModelStateStrategyIid));
  if (state_ != nullptr) {
    plugins_.precision.object->setup(model.module(), strategy.root_device());
  } else {
    contract1_ = std::make_unique<Contract1StrategyState>(strategy, *plugins_.precision.object);
    state_ = contract1_.get();
  }
  state_->setup_module(model);
  optimizer_ = state_->setup_optimizer(factory);
  if (!optimizer_) throw RunError("strategy '" + plugins_.strategy.name + "' built no optimizer (a plugin bug)");
  place_data(d);
  if (settings_.cuda_graph) setup_cuda_graph();
  attach_plugins(this);
}

// trainer.cuda_graph: what cannot be captured is refused here, in one line, before training.
void TrainingLoop::setup_cuda_graph() {
  const auto& t = config_.section("trainer");
  const std::string where = t.where("cuda_graph") + ": trainer.cuda_graph = true: ";
  const c10::Device device = plugins_.strategy.object->root_device();
  if (!device.is_cuda())
    throw UsageError(where + "CUDA graphs need a CUDA device and this run trains on " + device.str() +
                     " (set trainer.accelerator = \"cuda\" on a machine with a GPU, or drop cuda_graph)");
  if (plugins_.strategy.name != "single_device" || plugins_.strategy.object->world_size() > 1)
    throw UsageError(where + "only single_device steps are captured, and this run uses strategy '" + plugins_.strategy.name +
                     "' (its collectives and host work run inside the step)");
  if (settings_.accumulate_grad_batches > 1)
    throw UsageError(where + "gradient accumulation (trainer.accumulate_grad_batches = " +
                     std::to_string(settings_.accumulate_grad_batches) + ") cannot be captured: set it to 1");
  graph_ = std::make_unique<StepGraph>(device, settings_.cuda_graph_warmup_steps);
}

// data.on_device: a data set that fits is moved to the training GPU once, so batches are gathered
// (and augmented) there. Nothing to do on the CPU, where the data already is.
void TrainingLoop::place_data(const Section& d) {
  const std::string mode = d.get_string("on_device");
  const c10::Device device = plugins_.strategy.object->root_device();
  if (mode == "false" || !device.is_cuda()) return;
  auto* placeable = static_cast<IDeviceData*>(plugins_.data.object->query_interface(kDeviceDataIid));
  if (placeable == nullptr) {
    if (mode == "true")
      throw UsageError(d.where("on_device") + ": data.on_device = true, but data plugin '" + plugins_.data.name +
                       "' cannot keep its samples on a device (it does not implement ember::IDeviceData); use auto or false");
    return;
  }
  const int64_t bytes = placeable->device_bytes();
  const int64_t total = static_cast<int64_t>(at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
  const bool fits = bytes <= total / 4;
  const std::string size = std::to_string(bytes >> 20) + " MB";
  if (mode == "auto" && !fits) {
    log::info("data.on_device = auto: " + size + " of data is more than a quarter of " + device.str() +
              "'s memory; batches are copied from the host");
    return;
  }
  placeable->move_to(device);
  log::info("data: " + size + " kept on " + device.str() + " (data.on_device = " + mode + ")");
}

// (Re)builds the loaders from train_opts_/eval_opts_ (at setup, and when a tuner changes the
// batch size) and the per-epoch batch counts after limit_*_batches.
void TrainingLoop::build_loaders() {
  auto& data = *plugins_.data.object;
  train_loader_.reset();
  val_loader_.reset();
  test_loader_.reset();
  if (data.size(Split::train) > 0) train_loader_ = std::make_unique<DataLoader>(data, Split::train, train_opts_, sample_lengths_);
  if (data.size(Split::val) > 0) val_loader_ = std::make_unique<DataLoader>(data, Split::val, eval_opts_);
  if (data.size(Split::test) > 0) test_loader_ = std::make_unique<DataLoader>(data, Split::test, eval_opts_);
  num_train_batches_ = train_loader_ ? limit_batches(train_loader_->num_batches(), settings_.limit_train, settings_.limit_train_is_count) : 0;
  num_val_batches_ = val_loader_ ? limit_batches(val_loader_->num_batches(), settings_.limit_val, settings_.limit_val_is_count) : 0;
  num_test_batches_ = test_loader_ ? limit_batches(test_loader_->num_batches(), settings_.limit_test, settings_.limit_test_is_count) : 0;
  if (settings_.val_check_is_count && settings_.check_val_every_n_epoch > 0 && validation_enabled() &&
      static_cast<int64_t>(settings_.val_check_interval) > num_train_batches_)
    throw UsageError(config_.section("trainer").where("val_check_interval") + ": trainer.val_check_interval (" +
                     std::to_string(static_cast<int64_t>(settings_.val_check_interval)) +
                     ") is more than the training batches per epoch (" + std::to_string(num_train_batches_) +
                     "); lower it, or set check_val_every_n_epoch = 0 to count batches across epochs");
}

bool TrainingLoop::metric(std::string_view name, double* value) const {
  auto v = metrics_.get(std::string(name));
  if (!v) return false;
  if (value) *value = *v;
  return true;
}

// A callback's stop (early_stopping, timer) waits for trainer.min_epochs and min_steps, as
// Lightning's loops do (_can_stop_early): training goes on, and the loop ends at the first step
// or epoch end where both are met.
void TrainingLoop::request_stop(std::string_view reason) {
  if (stop_requested_ || !deferred_stop_.empty()) return;
  if (fitting_ && !minimum_trained(epoch_finished_)) {
    deferred_stop_ = reason;
    log::info(c10::str("stop asked (", reason, ") before trainer.min_epochs = ", settings_.min_epochs, " and min_steps = ",
                       settings_.min_steps, " were trained (", epoch_ + (epoch_finished_ ? 1 : 0), " epoch(s), ", global_step_,
                       " step(s) so far): training goes on until they are"));
    return;
  }
  stop(reason);
}

void TrainingLoop::stop(std::string_view reason) {
  if (!stop_requested_) log::info("stopping: " + std::string(reason));
  stop_requested_ = true;
}

bool TrainingLoop::minimum_trained(bool epoch_done) const {
  const int64_t epochs_done = epoch_ + (epoch_done ? 1 : 0);
  return epochs_done >= settings_.min_epochs && global_step_ >= settings_.min_steps;
}

void TrainingLoop::stop_if_minimum_trained(bool epoch_done) {
  if (deferred_stop_.empty() || stop_requested_ || !minimum_trained(epoch_done)) return;
  stop(deferred_stop_ + " (after trainer.min_epochs/min_steps)");
}

void TrainingLoop::log_metric(std::string_view name, double value) {
  metrics_.set(std::string(name), value);
  publish({{std::string(name), value}});
}

void TrainingLoop::publish(const std::vector<std::pair<std::string, double>>& values) {
  if (values.empty() || plugins_.loggers.empty()) return;
  auto row = values;
  row.emplace_back("epoch", static_cast<double>(epoch_));
  // Lightning logs at the index of the last finished step.
  int64_t step = std::max<int64_t>(global_step_ - 1, 0);
  for (auto& l : plugins_.loggers) l.object->log_metrics(row, step);
}

// Lightning's order: callbacks (non-monitoring, then monitoring), then the model; except in
// on_train_epoch_end, where the model runs between the two groups (docs/hooks.md).
void TrainingLoop::call_hook(Hook hook) {
  if (quiet_) return;
  for (auto& c : plugins_.callbacks)
    if (!c.object->monitors_metrics()) c.object->on_hook(hook, *this);
  if (hook == Hook::on_train_epoch_end) plugins_.model.object->on_hook(hook, *this);
  for (auto& c : plugins_.callbacks)
    if (c.object->monitors_metrics()) c.object->on_hook(hook, *this);
  if (hook != Hook::on_train_epoch_end) plugins_.model.object->on_hook(hook, *this);
}

bool TrainingLoop::validation_enabled() const { return val_loader_ && num_val_batches_ > 0; }

bool TrainingLoop::epoch_validates() const {
  return settings_.check_val_every_n_epoch == 0 || (epoch_ + 1) % settings_.check_val_every_n_epoch == 0;
}

at::Tensor TrainingLoop::run_micro_batch(const Batch& batch, bool first_in_window, bool sync, bool hooks) {
  auto& precision = *plugins_.precision.object;
  at::Tensor loss;
  {
    StepContextImpl ctx(*this, Stage::fit, batch_idx_, batch.size);
    ForwardRegion region(*state_, precision, /*grad_enabled=*/true);
    loss = plugins_.model.object->training_step(batch, ctx);
  }
  if (!loss.defined() || loss.numel() != 1)
    throw RunError("model '" + plugins_.model.name + "': training_step must return a scalar loss");
  if (!loss.requires_grad())
    throw RunError("model '" + plugins_.model.name + "': the loss does not require grad (was it computed under no_grad, or detached?)");
  if (first_in_window) {
    if (hooks) call_hook(Hook::on_before_zero_grad);
    state_->zero_grad();
  }
  current_loss_ = loss.detach();
  at::Tensor to_backward = window_accum_ > 1 ? loss / static_cast<double>(window_accum_) : loss;
  if (hooks) call_hook(Hook::on_before_backward);
  plugins_.strategy.object->backward(to_backward, precision, sync);
  if (hooks) call_hook(Hook::on_after_backward);
  return current_loss_;
}

void TrainingLoop::log_from_step(const std::string& name, const at::Tensor& value, const LogOptions& o, Stage stage,
                                 int64_t batch_size) {
  if (!recording_logs_) {
    metrics_.log(name, value, o, stage, batch_size);
    return;
  }
  // Inside a capture nothing may run on the host's behalf (the metric store's sums are device
  // work): the value's tensor is kept, and logged after every replay has refreshed it.
  MetricStore::require_scalar(name, value);
  graph_logs_.push_back({name, value.detach(), o, stage, batch_size});
}

bool TrainingLoop::optimizer_step(const Batch& batch, bool first_in_window, std::function<at::Tensor()> closure) {
  OptimizerStepImpl step(*this, batch, first_in_window);
  step.run_closure = std::move(closure);
  closure_ran_ = false;
  const bool stepped = plugins_.strategy.object->optimizer_step(step, *plugins_.precision.object);
  if (!closure_ran_)
    throw RunError("strategy '" + plugins_.strategy.name + "' / precision '" + plugins_.precision.name +
                   "' did not run the step's closure (a plugin bug)");
  return stepped;
}

// The closure (forward, loss, zero_grad, backward) is what the graph holds; the optimizer step,
// clipping, the loss scaler's decision and the hooks around them run as usual after it, so
// schedulers that change momentum or betas every step keep working.
bool TrainingLoop::graphed_optimizer_step(bool first_in_window) {
  if (window_accum_ > 1)
    throw RunError("trainer.cuda_graph: gradient accumulation (" + std::to_string(window_accum_) +
                   " batches, set by a callback) cannot be captured: drop the accumulation schedule or cuda_graph");
  const StepGraph::Mode mode = graph_->mode_for(current_batch_);
  if (mode == StepGraph::Mode::eager) {
    graph_->count_eager();
    return optimizer_step(current_batch_, first_in_window);
  }
  graph_->load(current_batch_);
  const Batch& batch = graph_->batch();
  return optimizer_step(batch, first_in_window, [&, mode] {
    call_hook(Hook::on_before_zero_grad);
    call_hook(Hook::on_before_backward);
    if (mode == StepGraph::Mode::capture) {
      graph_logs_.clear();
      recording_logs_ = true;
      try {
        graph_->capture([&] { run_micro_batch(batch, first_in_window, /*sync=*/true, /*hooks=*/false); });
      } catch (...) {
        recording_logs_ = false;
        throw;
      }
      recording_logs_ = false;
      graph_loss_ = current_loss_;
      graph_grads_.clear();
      for (auto& group : optimizer_->param_groups())
        for (auto& p : group.params())
          if (p.grad().defined()) graph_grads_.emplace_back(p, p.grad());
    }
    graph_->replay();
    // An eager step in between (a smaller last batch) left its own gradients and loss: the
    // optimizer must read the ones the graph writes.
    for (auto& [p, g] : graph_grads_) p.mutable_grad() = g;
    current_loss_ = graph_loss_;
    for (const auto& r : graph_logs_) metrics_.log(r.name, r.value, r.options, r.stage, r.batch_size);
    call_hook(Hook::on_after_backward);
    return current_loss_;
  });
}

void TrainingLoop::train_epoch() {
  auto& strategy = *plugins_.strategy.object;
  auto& precision = *plugins_.precision.object;
  const int64_t n = num_train_batches_;
  const int64_t start = std::min(resume_batch_, n);
  resume_batch_ = 0;
  int64_t val_every = settings_.val_check_is_count
                          ? static_cast<int64_t>(settings_.val_check_interval)
                          : std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(n) * settings_.val_check_interval));
  stage_ = Stage::fit;
  batches_done_ = start;
  epoch_finished_ = false;
  module().train();
  progress_.start(epoch_label(epoch_, settings_.max_epochs), n);
  call_hook(Hook::on_train_epoch_start);
  // Read after on_train_epoch_start: an accumulation schedule sets the factor there.
  const int64_t accum = settings_.accumulate_grad_batches;
  window_accum_ = accum;
  bool validated_last = false;
  if (validation_pending_ && validation_enabled()) {
    // Resumed from a checkpoint saved between a batch and the validation due after it (the
    // checkpoint callback's every_n_train_steps saves in on_train_batch_end): run it now, as the
    // uninterrupted run did, so its metrics and what monitors decide from them are not lost.
    evaluate(Split::val, Stage::validate, num_val_batches_);
    validated_last = true;
    stage_ = Stage::fit;
    if (strategy.world_size() > 1 &&
        strategy.reduce(at::scalar_tensor(stop_requested_ ? 1.0 : 0.0, at::kDouble), ReduceOp::max).item<double>() > 0 &&
        !stop_requested_)
      stop("another rank asked to stop");
  }
  validation_pending_ = false;
  const int64_t first = stop_requested_ ? n : start;
  auto pass = train_loader_->pass(epoch_, first, n - first);
  DeviceFeed feed(*pass, strategy, precision, feed_options_);
  Batch batch;
  for (int64_t b = first; b < n; ++b) {
    if (!feed.next(batch)) break;
    batch_idx_ = b;
    current_batch_ = std::move(batch);
    call_hook(Hook::on_train_batch_start);
    const bool is_last = b + 1 == n;
    const bool do_step = (b + 1) % accum == 0 || is_last;
    const bool first_in_window = b % accum == 0 || b == start;
    step_taken_ = do_step;
    step_skipped_ = false;
    if (do_step) {
      step_skipped_ = !(graph_ ? graphed_optimizer_step(first_in_window) : optimizer_step(current_batch_, first_in_window));
      ++global_step_;
    } else {
      run_micro_batch(current_batch_, first_in_window, /*sync=*/false);
    }
    batches_done_ = b + 1;
    ++total_batch_idx_;
    // Decided before on_train_batch_end: a checkpoint saved there records that this batch's
    // validation is still to run, and a resume from it runs that validation first.
    const int64_t counter = settings_.check_val_every_n_epoch == 0 ? total_batch_idx_ : b + 1;
    validation_pending_ = validation_enabled() && epoch_validates() && counter % val_every == 0;
    call_hook(Hook::on_train_batch_end);
    if (do_step && global_step_ % settings_.log_every_n_steps == 0) publish(metrics_.take_step_values());
    progress_.update(b + 1, [&] { return metrics_.progress_values(); });
    validated_last = false;
    if (validation_pending_) {
      evaluate(Split::val, Stage::validate, num_val_batches_);
      validated_last = true;
      stage_ = Stage::fit;
    }
    if (do_step) stop_if_minimum_trained(false);
    // Only after an optimizer step: a partly accumulated gradient is not part of a checkpoint.
    int sig = do_step && !stop_requested_ ? stop_signal() : 0;
    // Every decision that ends the loop is agreed by all ranks at the same optimizer step
    // (Lightning's reduce_boolean_decision, "any rank"): a signal one rank received, or a stop a
    // callback asked for on one rank only. A rank that stopped alone would leave the others
    // waiting in a collective. One small all-reduce per optimizer step carries both.
    if (do_step && strategy.world_size() > 1) {
      const at::Tensor votes =
          strategy.reduce(at::tensor({static_cast<double>(sig), stop_requested_ ? 1.0 : 0.0}, at::kDouble), ReduceOp::max);
      sig = stop_requested_ ? 0 : static_cast<int>(votes[0].item<double>());
      if (!stop_requested_ && sig == 0 && votes[1].item<double>() > 0) stop("another rank asked to stop");
    }
    if (sig != 0)
      stop(stop_signal_name(sig) + " received: finishing this step, saving, then exiting (send it again to quit at once)");
    const bool max_steps_hit = settings_.max_steps >= 0 && global_step_ >= settings_.max_steps;
    if (max_steps_hit || stop_requested_) {
      // Stopping early: validate once more so monitors see the state being stopped at.
      if (!validated_last && max_steps_hit && validation_enabled() && epoch_validates()) {
        evaluate(Split::val, Stage::validate, num_val_batches_);
        stage_ = Stage::fit;
      }
      break;
    }
  }
  auto reducer = [&](const at::Tensor& t, ReduceOp op) { return strategy.reduce(t, op); };
  auto epoch_values = metrics_.finish_epoch(Stage::fit, reducer);
  publish(epoch_values);
  // A stop in mid-epoch (max_steps, early stop) leaves the epoch unfinished: a resume continues
  // it at the next batch.
  epoch_finished_ = batches_done_ >= n;
  call_hook(Hook::on_train_epoch_end);
  for (auto& l : plugins_.loggers) l.object->flush();
  std::vector<std::pair<std::string, double>> summary;
  for (const auto& [k, v] : metrics_.callback_metrics())
    if (k.ends_with("_epoch") || k.starts_with("val_")) summary.emplace_back(k, v);
  progress_.finish(format_metrics(summary));
}

void TrainingLoop::evaluate(Split split, Stage stage, int64_t max_batches) {
  auto& strategy = *plugins_.strategy.object;
  auto& precision = *plugins_.precision.object;
  auto& model = *plugins_.model.object;
  const bool test = split == Split::test;
  const bool sanity = stage == Stage::sanity_check;
  auto* loader = test ? test_loader_.get() : val_loader_.get();
  if (!loader || max_batches <= 0) return;
  // A validation pass inside a training epoch hands the training position back as it found it,
  // also when a hook throws: callbacks read batch_idx() and current_batch() in
  // on_train_epoch_end, after the epoch's last validation.
  struct TrainingPosition {
    TrainingLoop& t;
    Stage stage;
    int64_t batch_idx;
    Batch batch;
    explicit TrainingPosition(TrainingLoop& trainer)
        : t(trainer), stage(trainer.stage_), batch_idx(trainer.batch_idx_), batch(std::move(trainer.current_batch_)) {}
    ~TrainingPosition() {
      t.stage_ = stage;
      t.batch_idx_ = batch_idx;
      t.current_batch_ = std::move(batch);
    }
  } position(*this);
  stage_ = stage;
  const bool was_training = module().is_training();
  call_hook(test ? Hook::on_test_start : Hook::on_validation_start);
  module().eval();
  Progress progress(settings_.enable_progress_bar && is_global_zero() && !sanity && progress_.tty(), progress_.tty());
  progress.start(test ? "Testing" : "Validation", max_batches);
  call_hook(test ? Hook::on_test_epoch_start : Hook::on_validation_epoch_start);
  {
    torch::NoGradGuard no_grad;
    auto pass = loader->pass(0, 0, max_batches);
    DeviceFeed feed(*pass, strategy, precision, feed_options_);
    Batch batch;
    int64_t b = 0;
    while (feed.next(batch)) {
      batch_idx_ = b;
      current_batch_ = std::move(batch);
      call_hook(test ? Hook::on_test_batch_start : Hook::on_validation_batch_start);
      {
        StepContextImpl ctx(*this, stage, b, current_batch_.size);
        ForwardRegion region(*state_, precision, /*grad_enabled=*/false);
        if (test) model.test_step(current_batch_, ctx);
        else model.validation_step(current_batch_, ctx);
      }
      call_hook(test ? Hook::on_test_batch_end : Hook::on_validation_batch_end);
      progress.update(++b, [] { return Progress::Values{}; });
    }
  }
  call_hook(test ? Hook::on_test_epoch_end : Hook::on_validation_epoch_end);
  if (sanity) {
    metrics_.discard_epoch(stage);
  } else {
    auto values = metrics_.finish_epoch(stage, [&](const at::Tensor& t, ReduceOp op) { return strategy.reduce(t, op); });
    publish(values);
    progress.finish(format_metrics(values));
    // Published: a checkpoint saved from here on does not ask its resume to validate again.
    if (stage == Stage::validate) validation_pending_ = false;
  }
  call_hook(test ? Hook::on_test_end : Hook::on_validation_end);
  if (was_training) module().train();
}

void TrainingLoop::fit() {
  if (!train_loader_ || num_train_batches_ == 0)
    throw RunError("data '" + plugins_.data.name + "' has no training batches (train split empty, or limit_train_batches = 0)");
  stage_ = Stage::fit;
  fitting_ = true;
  call_hook(Hook::setup);
  call_hook(Hook::on_fit_start);
  if (validation_enabled() && settings_.num_sanity_val_steps != 0) {
    int64_t n = settings_.num_sanity_val_steps < 0 ? num_val_batches_ : std::min(settings_.num_sanity_val_steps, num_val_batches_);
    call_hook(Hook::on_sanity_check_start);
    evaluate(Split::val, Stage::sanity_check, n);
    call_hook(Hook::on_sanity_check_end);
    stage_ = Stage::fit;
  }
  call_hook(Hook::on_train_start);
  if (epoch_finished_) {  // resumed from the end of an epoch: go on with the next one
    ++epoch_;
    epoch_finished_ = false;
  }
  while (!stop_requested_) {
    if (settings_.max_epochs >= 0 && epoch_ >= settings_.max_epochs) break;
    if (settings_.max_steps >= 0 && global_step_ >= settings_.max_steps) break;
    train_epoch();
    stop_if_minimum_trained(epoch_finished_);
    // Every rank stops together, on rank 0's decision.
    if (plugins_.strategy.object->world_size() > 1) {
      const bool any = plugins_.strategy.object->reduce(at::scalar_tensor(stop_requested_ ? 1.0 : 0.0, at::kDouble), ReduceOp::max)
                           .item<double>() > 0;
      if (any && !stop_requested_) stop("another rank asked to stop");
    }
    if (settings_.max_steps >= 0 && global_step_ >= settings_.max_steps) break;
    if (stop_requested_) break;
    ++epoch_;
    epoch_finished_ = false;
  }
  stage_ = Stage::fit;
  if (const auto device = plugins_.strategy.object->root_device(); device.is_cuda()) {
    // What the precision benchmark compares on a GPU (and what users ask first about AMP).
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto& peak = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
    std::ostringstream msg;
    msg << "peak cuda memory " << std::fixed << std::setprecision(1) << static_cast<double>(peak) / (1 << 20) << " MB allocated on "
        << device.str();
    log::info(msg.str());
  }
  if (graph_ && rank() == 0)
    host_.log(LogLevel::info, "cuda_graph: " + std::string(graph_->captured() ? "the step was captured after " : "nothing captured: ") +
                                  std::to_string(settings_.cuda_graph_warmup_steps) + " warm-up steps; " +
                                  std::to_string(graph_->replays()) + " steps replayed, " + std::to_string(graph_->eager_steps()) +
                                  " run as usual (warm-up and batches of other shapes)");
  call_hook(Hook::on_train_end);
  call_hook(Hook::on_fit_end);
  call_hook(Hook::teardown);
  stage_ = Stage::none;
  fitting_ = false;
}

void TrainingLoop::begin_stage(Stage stage) {
  stage_ = stage;
  call_hook(Hook::setup);
}

void TrainingLoop::end_stage() {
  call_hook(Hook::teardown);
  stage_ = Stage::none;
}

std::vector<std::pair<std::string, double>> TrainingLoop::test() {
  if (!test_loader_ || num_test_batches_ == 0)
    throw RunError("data '" + plugins_.data.name + "' has no test batches (test split empty, or limit_test_batches = 0)");
  evaluate(Split::test, Stage::test, num_test_batches_);
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [k, v] : metrics_.callback_metrics())
    if (k.starts_with("test")) out.emplace_back(k, v);
  return out;
}

std::vector<std::pair<std::string, double>> TrainingLoop::validate() {
  if (!val_loader_ || num_val_batches_ == 0)
    throw RunError("data '" + plugins_.data.name + "' has no validation batches (validation split empty, or limit_val_batches = 0)");
  evaluate(Split::val, Stage::validate, num_val_batches_);
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [k, v] : metrics_.callback_metrics())
    if (k.starts_with("val")) out.emplace_back(k, v);
  return out;
}

std::string locate_checkpoint(const std::vector<Named<ICallback>>& callbacks, const std::string& alias,
                              const std::string& run_dir) {
  for (const auto& c : callbacks) {
    auto* locator = static_cast<ICheckpointLocator*>(c.object->query_interface(kCheckpointLocatorIid));
    if (!locator) continue;
    auto path = locator->resolve_checkpoint(alias, run_dir);
    if (!path.empty()) return path;
  }
  return "";
}

std::string TrainingLoop::locate_checkpoint(const std::string& alias) const {
  return engine::locate_checkpoint(plugins_.callbacks, alias, run_dir_.string());
}

void TrainingLoop::setup_loggers(bool resuming) {
  const std::string toml = config_.to_toml();
  for (auto& l : plugins_.loggers) {
    l.object->setup(*this, resuming, global_step_);
    l.object->log_hyperparams(toml);
  }
}

void TrainingLoop::notify_exception() {
  try {
    call_hook(Hook::on_exception);
  } catch (const std::exception& e) {
    log::warn(std::string("a plugin failed in on_exception: ") + e.what());
  }
}

void TrainingLoop::finalize(const std::string& status) {
  for (auto& l : plugins_.loggers) {
    try {
      l.object->finalize(status);
    } catch (const std::exception& e) {
      log::warn("logger '" + l.name + "' failed to finalize: " + e.what());
    }
  }
  try {
    plugins_.strategy.object->teardown();
  } catch (const std::exception& e) {
    log::warn("strategy teardown failed: " + std::string(e.what()));
  }
}

// Tuner work (SDK 1.1): one training step or forward pass with no hooks and nothing logged.
namespace {
// Sets a value for the lifetime of a scope and restores the old one (exceptions included).
template <class T>
struct ValueScope {
  T& ref;
  T old;
  ValueScope(T& r, T value) : ref(r), old(r) { ref = value; }
  ~ValueScope() { ref = old; }
};
}  // namespace

at::Tensor TrainingLoop::run_trial_step(const Batch& batch, bool* skipped) {
  ValueScope<bool> quiet(quiet_, true);
  ValueScope<int64_t> accum(window_accum_, 1);
  module().train();
  OptimizerStepImpl step(*this, batch, /*first_in_window=*/true);
  closure_ran_ = false;
  const bool stepped = plugins_.strategy.object->optimizer_step(step, *plugins_.precision.object);
  if (!closure_ran_)
    throw RunError("strategy '" + plugins_.strategy.name + "' / precision '" + plugins_.precision.name +
                   "' did not run the step's closure (a plugin bug)");
  if (skipped) *skipped = !stepped;
  return current_loss_;
}

at::Tensor TrainingLoop::run_forward(const Batch& batch) {
  ValueScope<bool> quiet(quiet_, true);
  torch::NoGradGuard no_grad;
  StepContextImpl ctx(*this, Stage::fit, batch_idx_, batch.size);
  ForwardRegion region(*state_, *plugins_.precision.object, /*grad_enabled=*/false);
  at::Tensor loss = plugins_.model.object->training_step(batch, ctx);
  return loss.defined() ? loss.detach() : loss;
}

}  // namespace ember::engine
