// The loop's set-up and its end: the loaders, the model through the runtime in Lightning's order
// (transforms, frozen parameters, activation checkpointing, the optimizer, placement), the data
// on the device, the CUDA graph, the plugins handed the trainer; the loggers started; the run's
// end reported to loggers and the runtime torn down.
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <ember/support/name_patterns.h>

#include "common/log.h"
#include "loop/training_loop.h"
#include "runtime/accelerator.h"
#include "runtime/optimizer_factory.h"

namespace ember::engine {

// Hands the trainer to plugins that asked for it (ITrainerAware), or takes it back (nullptr).
void TrainingLoop::attach_plugins(ITrainer* trainer) {
  if (trainer == nullptr && !attached_) return;
  attached_ = trainer != nullptr;
  auto attach = [&](IPluginObject& o) {
    if (auto* aware = static_cast<ITrainerAware*>(o.query_interface(kTrainerAwareIid))) aware->attach_trainer(trainer);
  };
  attach(runtime_->strategy_object());
  attach(runtime_->precision_object());
  attach(*plugins_.model.object);
  attach(*plugins_.data.object);
  for (auto& c : plugins_.callbacks) attach(*c.object);
  for (auto& l : plugins_.loggers) attach(*l.object);
}

void TrainingLoop::setup() {
  auto& rt = *runtime_;
  const auto& d = config_.section("data");
  plan_ = std::make_unique<DataPlan>(*plugins_.data.object, plugins_.data.name, d, config_.section("trainer"), settings_, rt.data_parallel_rank(),
                                     rt.data_parallel_size());
  feed_options_.pin_memory = d.get_bool("pin_memory");
  feed_options_.channels_last = config_.section("trainer").get_bool("channels_last");

  // The runtime sets the model up in Lightning's order (docs/strategy.md).
  auto& model = *plugins_.model.object;
  // Before the precision handler and the strategy: their dtype casts and placement keep the
  // memory format.
  if (feed_options_.channels_last) to_channels_last(model.module());
  // Plugins that change the model (LoRA) do it before anything converts, places or shards it.
  auto tensor_names = [&] {
    std::set<std::string> names;
    for (const auto& p : model.module().named_parameters()) names.insert(p.key());
    for (const auto& b : model.module().named_buffers()) names.insert(b.key());
    return names;
  };
  std::set<std::string> before = tensor_names();
  for (auto& c : plugins_.callbacks)
    if (auto* transform = static_cast<IModelTransform*>(c.object->query_interface(kModelTransformIid))) {
      transform->transform_model(model, plugins_.model.name);
      std::set<std::string> after = tensor_names();
      size_t added = 0;
      for (const auto& name : after)
        if (!before.count(name)) {
          added_by_transforms_.push_back(name);
          ++added;
        }
      if (added > 0) transforming_plugins_.push_back(c.name);
      before = std::move(after);
    }
  omit_frozen_from_checkpoints(model);
  // A language model must know every token id its data makes (else the first batch fails deep
  // inside an embedding lookup).
  check_vocabularies(model, plugins_.model.name, *plugins_.data.object, plugins_.data.name);
  apply_activation_checkpointing(model);
  OptimizerFactory factory(model, plugins_.model.name, config_.section("optimizer"));
  if (rank() == 0 && !factory.weight_decay_summary().empty()) log::info(factory.weight_decay_summary());
  if (rank() == 0 && !factory.backbone_summary().empty()) log::info(factory.backbone_summary());
  rt.setup(model, factory);
  const auto& optimizer = config_.section("optimizer");
  backbone_freeze_.setup(model.module(), rt.optimizer(), factory.backbone(), factory.backbone_unfreeze_at_epoch(),
                         optimizer.get_float("backbone_lr_scale"), optimizer.get_bool("backbone_train_bn"),
                         optimizer.where("backbone_unfreeze_at_epoch"), rt.strategy().name);
  if (backbone_freeze_.active() && settings_.cuda_graph)
    throw UsageError(config_.section("trainer").where("cuda_graph") +
                     ": trainer.cuda_graph = true: a captured step keeps the gradients it was captured with, and "
                     "optimizer.backbone_unfreeze_at_epoch changes which parameters get one: drop one of them");
  place_data(d);
  if (settings_.cuda_graph) setup_cuda_graph();
  attach_plugins(this);
}

// A transform that froze the model's weights (LoRA) may let checkpoint files leave them out
// (ember::IFrozenParameters): they then hold what trains, a fraction of the size. Kept when any
// such plugin asks to keep them.
void TrainingLoop::omit_frozen_from_checkpoints(IModel& model) {
  std::string asked;
  bool keep = false;
  for (auto& c : plugins_.callbacks)
    if (auto* frozen = static_cast<IFrozenParameters*>(c.object->query_interface(kFrozenParametersIid))) {
      asked = c.name;
      keep = keep || frozen->checkpoints_keep_frozen();
    }
  if (asked.empty() || keep) return;
  std::vector<std::string> names;
  int64_t elements = 0;
  for (const auto& item : model.module().named_parameters())
    if (!item.value().requires_grad()) {
      names.push_back(item.key());
      elements += item.value().numel();
    }
  if (names.empty()) return;
  // Weights from [model] init_checkpoint are not how the model is built: loading a checkpoint
  // reads them from that checkpoint (recorded), except those init_exclude kept as built.
  const auto& m = config_.section("model");
  const std::string base = m.has("init_checkpoint") ? m.get_string("init_checkpoint") : std::string();
  if (base.empty()) {
    if (rank() == 0)
      log::info("checkpoints leave out the " + std::to_string(names.size()) + " frozen parameters (" + std::to_string(elements) +
                " elements), as '" + asked + "' asks: loading one takes them from the model as it is built");
    runtime_->omit_from_checkpoints(std::move(names));
    return;
  }
  const NamePatterns exclude(m.get_string_list("init_exclude"), NameRule::module);
  std::vector<std::string> from_base;
  for (const auto& name : names)
    if (!exclude.matches(name)) from_base.push_back(name);
  std::error_code ec;
  std::filesystem::path where = std::filesystem::absolute(base, ec);
  if (ec) where = base;
  if (rank() == 0)
    log::info("checkpoints leave out the " + std::to_string(names.size()) + " frozen parameters (" + std::to_string(elements) +
              " elements), as '" + asked + "' asks: loading one reads " +
              (from_base.size() == names.size() ? std::string("them") : std::to_string(from_base.size()) + " of them") +
              " from model.init_checkpoint (" + where.lexically_normal().string() + "), which must stay there (or move together with these checkpoints)" +
              (from_base.size() == names.size() ? "" : ", and the others (init_exclude) from the model as it is built"));
  runtime_->omit_from_checkpoints(std::move(names), where.lexically_normal().string(), std::move(from_base));
}

// trainer.activation_checkpointing: handed to the model's units before the first forward; a model
// without units, or without the mode asked for, is refused in one line.
void TrainingLoop::apply_activation_checkpointing(IModel& model) {
  const auto& t = config_.section("trainer");
  const std::string mode = t.get_string("activation_checkpointing");
  if (mode == "none") return;
  const std::string where = t.where("activation_checkpointing") + ": trainer.activation_checkpointing = \"" + mode + "\": model '" +
                            plugins_.model.name + "' ";
  auto* units = static_cast<IUnitModel*>(model.query_interface(kUnitModelIid));
  auto* checkpointing = static_cast<IActivationCheckpointing*>(model.query_interface(kActivationCheckpointingIid));
  if (units == nullptr || units->num_units() == 0)
    throw UsageError(where + "declares no units to recompute (ember::UnitModel, sdk/include/ember/model_units.h): set it to \"none\"");
  if (checkpointing == nullptr)
    throw UsageError(where + "does not offer activation checkpointing (built against an SDK before 2.3?): rebuild it, or set \"none\"");
  const auto m = mode == "full" ? ActivationCheckpointing::full : ActivationCheckpointing::selective;
  if (!checkpointing->set_activation_checkpointing(m))
    throw UsageError(where + "offers no selective checkpointing (what to keep inside a unit is the model's choice): use \"full\"");
  if (rank() == 0)
    log::info("activation checkpointing: " + mode + " (" + std::to_string(units->num_units()) + " units recomputed in backward" +
              (mode == "selective" ? ", in part" : "") + ")");
}

// trainer.cuda_graph: what cannot be captured is refused here, in one line, before training.
void TrainingLoop::setup_cuda_graph() {
  const auto& t = config_.section("trainer");
  const std::string where = t.where("cuda_graph") + ": trainer.cuda_graph = true: ";
  // A capability the strategy declares (ember.capability.CapturableStep/1), never its name.
  if (runtime_->strategy_object().query_interface(kCapturableStepIid) == nullptr)
    throw UsageError(where + "strategy '" + runtime_->strategy().name +
                     "' does not declare a capturable step (its collectives or host work run inside the step): use single_device, "
                     "or drop cuda_graph");
  const c10::Device device = runtime_->root_device();
  if (!device.is_cuda())
    throw UsageError(where + "CUDA graphs need a CUDA device and this run trains on " + device.str() +
                     " (set trainer.accelerator = \"cuda\" on a machine with a GPU, or drop cuda_graph)");
  if (settings_.accumulate_grad_batches > 1)
    throw UsageError(where + "gradient accumulation (trainer.accumulate_grad_batches = " +
                     std::to_string(settings_.accumulate_grad_batches) + ") cannot be captured: set it to 1");
  steps_->use_cuda_graph(std::make_unique<StepGraph>(device, settings_.cuda_graph_warmup_steps));
}

// data.on_device: a data set that fits is moved to the training GPU once, so batches are gathered
// (and augmented) there. Nothing to do on the CPU, where the data already is.
void TrainingLoop::place_data(const Section& d) {
  const std::string mode = d.get_string("on_device");
  const c10::Device device = runtime_->root_device();
  if (mode == "false" || device.is_cpu()) return;
  auto* placeable = static_cast<IDeviceData*>(plugins_.data.object->query_interface(kDeviceDataIid));
  if (placeable == nullptr) {
    if (mode == "true")
      throw UsageError(d.where("on_device") + ": data.on_device = true, but data plugin '" + plugins_.data.name +
                       "' cannot keep its samples on a device (it does not implement ember::IDeviceData); use auto or false");
    return;
  }
  const int64_t bytes = placeable->device_bytes();
  const int64_t total = accelerator_for(device.type()).total_memory(device).value_or(0);
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

void TrainingLoop::setup_loggers(bool resuming) {
  const std::string toml = config_.to_toml();
  const std::filesystem::path config_file = run_dir_ / "config.toml";  // written by the session before this
  for (auto& l : plugins_.loggers) {
    l.object->setup(*this, resuming, pos_.global_step);
    l.object->log_hyperparams(toml);
    if (auto* artifacts = static_cast<ILoggerArtifacts*>(l.object->query_interface(kLoggerArtifactsIid)); artifacts && std::filesystem::exists(config_file))
      artifacts->log_artifact(config_file.string(), "config");
  }
}

void TrainingLoop::notify_exception() {
  failing_ = true;
  try {
    call_hook(Hook::on_exception);
  } catch (const std::exception& e) {
    log::warn(std::string("a plugin failed in on_exception: ") + e.what());
  }
}

void TrainingLoop::finalize(const std::string& status) {
  for (auto& l : plugins_.loggers) {
    try {
      // The best checkpoint, for loggers that keep artifacts (a tracker records where it is).
      if (auto* artifacts = static_cast<ILoggerArtifacts*>(l.object->query_interface(kLoggerArtifactsIid))) {
        const std::string best = locate_checkpoint("best");
        if (!best.empty()) artifacts->log_artifact(best, "best_checkpoint");
      }
      l.object->finalize(status);
    } catch (const std::exception& e) {
      log::warn("logger '" + l.name + "' failed to finalize: " + e.what());
    }
  }
  runtime_->teardown();
}

}  // namespace ember::engine
