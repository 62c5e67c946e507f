#include "loop/training_loop.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/headeronly/version.h>
#include <torch/serialize.h>

#include <atomic>
#include <functional>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <sstream>

#include "checkpoint/checkpoint_io.h"
#include "runtime/accelerator.h"
#include "data/device_feed.h"
#include "checkpoint/sharded_checkpoint.h"
#include "config/engine_schema.h"
#include "common/log.h"
#include "common/sized_struct.h"
#include "session/stop_signals.h"
#include "common/version.h"

namespace ember::engine {

namespace {

std::string epoch_label(int64_t epoch, int64_t max_epochs) {
  return "Epoch " + std::to_string(epoch) + (max_epochs >= 0 ? "/" + std::to_string(max_epochs - 1) : "");
}
}  // namespace

TrainingLoop::TrainingLoop(IHost& host, const ResolvedConfig& config, std::unique_ptr<Runtime> runtime, RunPlugins plugins,
                           std::filesystem::path run_dir)
    : host_(host),
      config_(config),
      runtime_(std::move(runtime)),
      plugins_(std::move(plugins)),
      run_dir_(std::move(run_dir)),
      settings_(TrainerSettings::from(config.section("trainer"))),
      configured_metrics_(config.section("metrics")),
      progress_(settings_.enable_progress_bar && runtime_->rank() == 0, Progress::stderr_is_tty()),
      steps_(std::make_unique<StepRunner>(*runtime_, plugins_.model, metrics_, configured_metrics_, settings_, [this](Hook h) { call_hook(h); })) {}

TrainingLoop::~TrainingLoop() { attach_plugins(nullptr); }

void* TrainingLoop::query_interface(const char* iid) {
  const std::string_view id(iid);
  if (id == ITrainerCheckpoints::kIid) return static_cast<ITrainerCheckpoints*>(this);
  if (id == ITrainerAsyncCheckpoints::kIid) return static_cast<ITrainerAsyncCheckpoints*>(this);
  if (id == ITrainerRecovery::kIid) return static_cast<ITrainerRecovery*>(this);
  if (id == ITrainerSettings::kIid) return static_cast<ITrainerSettings*>(this);
  if (id == ITrainerPasses::kIid) return static_cast<ITrainerPasses*>(this);
  if (id == ITrainerWeights::kIid) return static_cast<ITrainerWeights*>(this);
  if (id == ITrainerCollectives::kIid) return static_cast<ITrainerCollectives*>(this);
  return nullptr;
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
  if (fitting_ && !cadence_.minimum_trained(pos_, pos_.epoch_finished)) {
    deferred_stop_ = reason;
    log::info(c10::str("stop asked (", reason, ") before trainer.min_epochs = ", settings_.min_epochs, " and min_steps = ",
                       settings_.min_steps, " were trained (", pos_.epoch + (pos_.epoch_finished ? 1 : 0), " epoch(s), ", pos_.global_step,
                       " step(s) so far): training goes on until they are"));
    return;
  }
  stop(reason);
}

void TrainingLoop::stop(std::string_view reason) {
  if (!stop_requested_) log::info("stopping: " + std::string(reason));
  stop_requested_ = true;
}

void TrainingLoop::stop_if_minimum_trained(bool epoch_done) {
  if (deferred_stop_.empty() || stop_requested_ || !cadence_.minimum_trained(pos_, epoch_done)) return;
  stop(deferred_stop_ + " (after trainer.min_epochs/min_steps)");
}

void TrainingLoop::log_metric(std::string_view name, double value) {
  metrics_.set(std::string(name), value);
  publish({{std::string(name), value}});
}

// Collective: the [metrics] table's values of `split`'s epoch, reduced over every rank, into the
// callback metrics (monitors see val_f1) and `values` (the loggers' row); the confusion matrix
// into the run folder (rank 0).
void TrainingLoop::add_configured_metrics(Split split, std::vector<std::pair<std::string, double>>& values, bool ran_batches) {
  auto& rt = *runtime_;
  if (!configured_metrics_.active(split)) return;
  MetricRanks ranks;
  ranks.reduce = [&](const at::Tensor& t, ReduceOp op) { return rt.reduce(t, op); };
  ranks.broadcast = [&](const at::Tensor& t, int64_t src) { return rt.broadcast(t, src); };
  ranks.rank = rt.rank();
  ranks.world_size = rt.world_size();
  ranks.data_parallel_rank = rt.data_parallel_rank();
  ranks.data_parallel_size = rt.data_parallel_size();
  auto epoch = configured_metrics_.finish(split, ranks, ran_batches);
  for (auto& [name, v] : epoch.values) {
    metrics_.set(name, v);
    values.emplace_back(name, v);
  }
  if (epoch.confusion_matrix.defined() && is_global_zero()) {
    std::filesystem::create_directories(run_dir_);
    const std::string name = split == Split::train ? "train" : split == Split::val ? "val" : "test";
    const auto image = write_confusion_matrix(epoch.confusion_matrix, run_dir_, name);
    // Loggers that take images (tensorboard) get it at the step the row is logged at.
    const int64_t step = std::max<int64_t>(pos_.global_step - 1, 0);
    for (auto& l : plugins_.loggers)
      if (auto* images = static_cast<ILoggerImages*>(l.object->query_interface(kLoggerImagesIid)); images && !image.png.empty())
        images->log_image(name + "_confusion_matrix", image.png, image.width, image.height, step);
  }
}

void TrainingLoop::publish(const std::vector<std::pair<std::string, double>>& values) {
  if (values.empty() || plugins_.loggers.empty()) return;
  auto row = values;
  row.emplace_back("epoch", static_cast<double>(pos_.epoch));
  // Lightning logs at the index of the last finished step.
  int64_t step = std::max<int64_t>(pos_.global_step - 1, 0);
  for (auto& l : plugins_.loggers) l.object->log_metrics(row, step);
}

// Lightning's order: callbacks (non-monitoring, then monitoring), then the model; except in
// on_train_epoch_end, where the model runs between the two groups (docs/hooks.md).
void TrainingLoop::call_hook(Hook hook) {
  if (hook == Hook::on_before_optimizer_step) resumable_ = false;  // the update begins
  if (steps_->quiet()) return;
  struct Current {
    Hook& slot;
    Hook before;
    Current(Hook& s, Hook h) : slot(s), before(s) { slot = h; }
    ~Current() { slot = before; }
  } current(current_hook_, hook);
  // A rollback asked for in on_train_batch_end ends the batch there: nobody after sees it.
  auto go_on = [&] { return rollback_path_.empty(); };
  for (auto& c : plugins_.callbacks)
    if (go_on() && !c.object->monitors_metrics()) c.object->on_hook(hook, *this);
  if (go_on() && hook == Hook::on_train_epoch_end) plugins_.model.object->on_hook(hook, *this);
  for (auto& c : plugins_.callbacks)
    if (go_on() && c.object->monitors_metrics()) c.object->on_hook(hook, *this);
  if (go_on() && hook != Hook::on_train_epoch_end) plugins_.model.object->on_hook(hook, *this);
}

bool TrainingLoop::validation_enabled() const { return plan_->validates(); }

// After each optimizer step (never inside an accumulation window: a partly accumulated gradient is
// not part of a checkpoint), every decision that ends the loop is agreed by all ranks at the same
// step (Lightning's reduce_boolean_decision, "any rank"): a signal one rank received, or a stop a
// callback asked for on one rank only. A rank that stopped alone would leave the others waiting in
// a collective. One small all-reduce carries both, and the state of a checkpoint being written in
// the background (checkpoint.async): once it is on disk everywhere it is committed here, at the
// same step on every rank, and a failed write stops every rank.
void TrainingLoop::validate_during_fit() {
  evaluate(Split::val, Stage::validate, plan_->num_batches(Split::val));
  stage_ = Stage::fit;
}

void TrainingLoop::agree_after_step() {
  auto& rt = *runtime_;
  int sig = stop_requested_ ? 0 : stop_signal();
  if (rt.world_size() > 1) {
    const at::Tensor votes = rt.reduce(
        at::tensor({static_cast<double>(sig), stop_requested_ ? 1.0 : 0.0, rt.background_save_vote()}, at::kDouble), ReduceOp::max);
    sig = stop_requested_ ? 0 : static_cast<int>(votes[0].item<double>());
    if (!stop_requested_ && sig == 0 && votes[1].item<double>() > 0) stop("another rank asked to stop");
    rt.settle_background_save(votes[2].item<double>());
  } else {
    rt.settle_background_save(rt.background_save_vote());
  }
  if (sig != 0) {
    agreed_stop_signal_ = sig;
    stop(stop_signal_name(sig) + (sig == stop_signal() ? " received" : " received by another rank") +
         ": finishing this step, saving, then exiting (send it again to quit at once)");
  }
}

void TrainingLoop::train_epoch() {
  auto& rt = *runtime_;
  const int64_t n = plan_->num_batches(Split::train);
  const int64_t start = std::min(resume_batch_, n);
  resume_batch_ = 0;
  const int64_t val_every = cadence_.val_every(n);
  stage_ = Stage::fit;
  pos_.batches_done = start;
  pos_.epoch_finished = false;
  module().train();
  if (const std::string change = backbone_freeze_.apply(pos_.epoch); !change.empty() && rank() == 0) log::info(change);
  progress_.start(epoch_label(pos_.epoch, settings_.max_epochs), n);
  call_hook(Hook::on_train_epoch_start);
  // Read after on_train_epoch_start: an accumulation schedule sets the factor there.
  const int64_t accum = settings_.accumulate_grad_batches;
  steps_->set_accumulation(accum);
  bool validated_last = false;
  if (pos_.validation_pending && validation_enabled()) {
    // Resumed from a checkpoint saved between a batch and the validation due after it (the
    // checkpoint callback's every_n_train_steps saves in on_train_batch_end): run it now, as the
    // uninterrupted run did, so its metrics and what monitors decide from them are not lost.
    validate_during_fit();
    validated_last = true;
    if (rt.any_rank(stop_requested_) && !stop_requested_) stop("another rank asked to stop");
  }
  pos_.validation_pending = false;
  const int64_t first = stop_requested_ ? n : start;
  auto pass = plan_->loader(Split::train)->pass(pos_.epoch, first, n - first);
  DeviceFeed feed(*pass, rt, feed_options_);
  Batch batch;
  for (int64_t b = first; b < n; ++b) {
    if (!feed.next(batch)) break;
    batch_idx_ = b;
    current_batch_ = std::move(batch);
    if (!skipping_window_) call_hook(Hook::on_train_batch_start);
    if (skip_requested_ || skipping_window_) {
      // ITrainerRecovery::skip_batch: this batch and the rest of its window are passed over (no
      // hook sees the rest).
      skip_requested_ = false;
      skipping_window_ = !Cadence::steps_after(b, n, accum);
      ++batches_skipped_;
      pos_.batches_done = b + 1;
      ++pos_.total_batch_idx;
      resumable_ = !skipping_window_;
      continue;
    }
    const bool do_step = Cadence::steps_after(b, n, accum);
    const bool first_in_window = Cadence::opens_window(b, start, accum);
    step_taken_ = do_step;
    step_skipped_ = false;
    // Nothing accumulated yet at a window's first batch: the state is the last step's until the
    // update begins (on_before_optimizer_step).
    resumable_ = first_in_window;
    if (do_step) {
      step_skipped_ = !steps_->optimizer_step(current_batch_, b, first_in_window);
      ++pos_.global_step;
    } else {
      steps_->micro_batch(current_batch_, b, first_in_window, /*sync=*/false);
    }
    pos_.batches_done = b + 1;
    ++pos_.total_batch_idx;
    resumable_ = do_step;  // a closed window: this batch's step and position agree
    // Decided before on_train_batch_end: a checkpoint saved there records that this batch's
    // validation is still to run, and a resume from it runs that validation first.
    pos_.validation_pending = cadence_.validates_after_batch(pos_, val_every, validation_enabled());
    call_hook(Hook::on_train_batch_end);
    if (!rollback_path_.empty()) return roll_back();
    if (do_step && cadence_.logs_at(pos_.global_step)) {
      auto values = metrics_.take_step_values();
      for (auto& v : configured_metrics_.take_step_values()) values.push_back(std::move(v));
      publish(values);
    }
    progress_.update(b + 1, [&] { return metrics_.progress_values(); });
    validated_last = false;
    if (pos_.validation_pending) {
      validate_during_fit();
      validated_last = true;
    }
    if (do_step) {
      stop_if_minimum_trained(false);
      agree_after_step();
    }
    if (cadence_.validates_at_max_steps(pos_, validated_last, validation_enabled())) validate_during_fit();
    if (cadence_.max_steps_reached(pos_) || stop_requested_) break;
  }
  auto reducer = [&](const at::Tensor& t, ReduceOp op) { return rt.reduce(t, op); };
  auto epoch_values = metrics_.finish_epoch(Stage::fit, reducer);
  add_configured_metrics(Split::train, epoch_values, /*ran_batches=*/first < n);
  publish(epoch_values);
  // A stop in mid-epoch (max_steps, early stop) leaves the epoch unfinished: a resume continues
  // it at the next batch.
  pos_.epoch_finished = pos_.batches_done >= n;
  call_hook(Hook::on_train_epoch_end);
  for (auto& l : plugins_.loggers) l.object->flush();
  std::vector<std::pair<std::string, double>> summary;
  for (const auto& [k, v] : metrics_.callback_metrics())
    if (k.ends_with("_epoch") || k.starts_with("val_")) summary.emplace_back(k, v);
  progress_.finish(format_metrics(summary));
}

void TrainingLoop::evaluate(Split split, Stage stage, int64_t max_batches) {
  auto& rt = *runtime_;
  auto& model = *plugins_.model.object;
  const bool test = split == Split::test;
  const bool sanity = stage == Stage::sanity_check;
  auto* loader = plan_->loader(split);
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
    DeviceFeed feed(*pass, rt, feed_options_);
    Batch batch;
    int64_t b = 0;
    while (feed.next(batch)) {
      batch_idx_ = b;
      current_batch_ = std::move(batch);
      call_hook(test ? Hook::on_test_batch_start : Hook::on_validation_batch_start);
      {
        auto ctx = steps_->context(stage, b, current_batch_.size);
        auto region = rt.forward(/*grad_enabled=*/false);
        if (rt.pipeline()) rt.pipeline_evaluate_batch(current_batch_, model, ctx);  // the stages run the model's steps
        else if (test) model.test_step(current_batch_, ctx);
        else model.validation_step(current_batch_, ctx);
      }
      call_hook(test ? Hook::on_test_batch_end : Hook::on_validation_batch_end);
      progress.update(++b, [] { return Progress::Values{}; });
    }
  }
  call_hook(test ? Hook::on_test_epoch_end : Hook::on_validation_epoch_end);
  if (sanity) {
    metrics_.discard_epoch(stage);
    configured_metrics_.discard(split);
  } else {
    auto values = metrics_.finish_epoch(stage, [&](const at::Tensor& t, ReduceOp op) { return rt.reduce(t, op); });
    add_configured_metrics(split, values, /*ran_batches=*/true);
    publish(values);
    progress.finish(format_metrics(values));
    // Published: a checkpoint saved from here on does not ask its resume to validate again.
    if (stage == Stage::validate) pos_.validation_pending = false;
  }
  call_hook(test ? Hook::on_test_end : Hook::on_validation_end);
  if (was_training) module().train();
}

void TrainingLoop::fit() {
  if (plan_->num_batches(Split::train) == 0)
    throw RunError("data '" + plugins_.data.name + "' has no training batches (train split empty, or limit_train_batches = 0)");
  stage_ = Stage::fit;
  fitting_ = true;
  call_hook(Hook::setup);
  call_hook(Hook::on_fit_start);
  if (validation_enabled() && settings_.num_sanity_val_steps != 0) {
    const int64_t val_batches = plan_->num_batches(Split::val);
    int64_t n = settings_.num_sanity_val_steps < 0 ? val_batches : std::min(settings_.num_sanity_val_steps, val_batches);
    call_hook(Hook::on_sanity_check_start);
    evaluate(Split::val, Stage::sanity_check, n);
    call_hook(Hook::on_sanity_check_end);
    stage_ = Stage::fit;
  }
  call_hook(Hook::on_train_start);
  if (pos_.epoch_finished) {  // resumed from the end of an epoch: go on with the next one
    ++pos_.epoch;
    pos_.epoch_finished = false;
  }
  while (!stop_requested_) {
    if (cadence_.max_epochs_reached(pos_.epoch) || cadence_.max_steps_reached(pos_)) break;
    train_epoch();
    if (rolled_back_) {  // the position is the snapshot's now: go on from there
      rolled_back_ = false;
      if (pos_.epoch_finished) {
        ++pos_.epoch;
        pos_.epoch_finished = false;
      }
      continue;
    }
    stop_if_minimum_trained(pos_.epoch_finished);
    // Every rank stops together: any rank's stop is every rank's.
    if (runtime_->any_rank(stop_requested_) && !stop_requested_) stop("another rank asked to stop");
    if (cadence_.max_steps_reached(pos_)) break;
    if (stop_requested_) break;
    ++pos_.epoch;
    pos_.epoch_finished = false;
  }
  stage_ = Stage::fit;
  const auto device = runtime_->root_device();
  if (const auto peak = accelerator_for(device.type()).peak_allocated(device)) {
    // What the precision benchmark compares on a GPU (and what users ask first about AMP).
    std::ostringstream msg;
    msg << "peak " << accelerator_for(device.type()).name() << " memory " << std::fixed << std::setprecision(1)
        << static_cast<double>(*peak) / (1 << 20) << " MB allocated on " << device.str();
    log::info(msg.str());
  }
  if (const StepGraph* graph = steps_->cuda_graph(); graph && rank() == 0)
    host_.log(LogLevel::info, "cuda_graph: " + std::string(graph->captured() ? "the step was captured after " : "nothing captured: ") +
                                  std::to_string(settings_.cuda_graph_warmup_steps) + " warm-up steps; " +
                                  std::to_string(graph->replays()) + " steps replayed, " + std::to_string(graph->eager_steps()) +
                                  " run as usual (warm-up and batches of other shapes)");
  if (batches_skipped_ > 0)
    log::info("skipped " + std::to_string(batches_skipped_) + " training batch(es) without training on them (ITrainerRecovery::skip_batch)");
  runtime_->finish_background_save();  // the last checkpoint is on disk before anything reads it
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

// Why `split` (test or validation) has no batches, with what to change: the trainer's limit where
// it is 0 or a fraction that rounds to none; else the data's own keys that name that split (a data
// plugin that holds none out by default: text_lm's test_fraction), with their values and places.
std::string TrainingLoop::no_batches_error(Split split) const {
  const bool test = split == Split::test;
  const std::string what = test ? "test" : "validation", limit = test ? "limit_test_batches" : "limit_val_batches";
  const auto& t = config_.section("trainer");
  const double fraction = t.get_float(limit);
  const std::string head = "data '" + plugins_.data.name + "' has no " + what + " batches";
  if (fraction == 0.0) return t.where(limit) + ": trainer." + limit + " = 0 leaves no " + what + " batches: remove it, or give a count or fraction above 0";
  std::string keys;
  for (const auto& [key, entry] : config_.section("data").entries()) {
    if (key.find(test ? "test" : "val") == std::string::npos || !entry.value) continue;
    std::ostringstream value;
    entry.value->visit([&](const auto& v) { value << v; });
    keys += (keys.empty() ? "" : ", ") + ("data." + key) + " = " + value.str() + " (" + entry.where + ")";
  }
  const std::string split_empty = keys.empty() ? ": its " + what + " split is empty (docs/plugins.md has the data's keys)"
                                               : ": its " + what + " split is empty; hold one out with " + keys;
  if (!t.is_integer(limit) && fraction < 1.0)
    return head + split_empty + ", or trainer." + limit + " = " + std::to_string(fraction) + " (" + t.where(limit) + ") rounds it to none";
  return head + split_empty;
}

// One pass over `split` on its own (engine test / validate), returning the metrics it published.
std::vector<std::pair<std::string, double>> TrainingLoop::evaluate_split(Split split) {
  const bool test = split == Split::test;
  const int64_t batches = plan_->num_batches(split);
  if (batches == 0) throw RunError(no_batches_error(split));
  evaluate(split, test ? Stage::test : Stage::validate, batches);
  const std::string prefix = test ? "test" : "val";
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [k, v] : metrics_.callback_metrics())
    if (k.starts_with(prefix)) out.emplace_back(k, v);
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

std::vector<std::string> checkpoint_candidates(const std::vector<Named<ICallback>>& callbacks, const std::string& alias,
                                               const std::string& run_dir) {
  std::vector<std::string> out;
  for (const auto& c : callbacks) {
    if (auto* many = static_cast<ICheckpointCandidates*>(c.object->query_interface(kCheckpointCandidatesIid))) {
      for (auto& path : many->checkpoint_candidates(alias, run_dir)) out.push_back(std::move(path));
    } else if (auto* locator = static_cast<ICheckpointLocator*>(c.object->query_interface(kCheckpointLocatorIid))) {
      if (auto path = locator->resolve_checkpoint(alias, run_dir); !path.empty()) out.push_back(std::move(path));
    }
  }
  return out;
}

std::string TrainingLoop::locate_checkpoint(const std::string& alias) const {
  return engine::locate_checkpoint(plugins_.callbacks, alias, run_dir_.string());
}

}  // namespace ember::engine
