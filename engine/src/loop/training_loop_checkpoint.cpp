// Checkpoint assembly of the training loop: what a checkpoint holds besides the model's and the
// optimizer's state (the loops' position, RNG, plugin states; docs/checkpoint.md has the layout),
// saving it through the strategy's state contract, and restoring it.
#include "loop/training_loop.h"

#include <algorithm>
#include <functional>
#include <set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <ember/predict.h>
#include <ember/support/name_patterns.h>
#include <ember/tensor_parallel.h>

#include "checkpoint/checkpoint_document.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/sharded_checkpoint.h"
#include "config/engine_schema.h"
#include "common/log.h"
#include "loop/rank_states.h"

namespace ember::engine {

c10::IValue TrainingLoop::plugin_states() const {
  auto out = checkpoint_dict();
  auto put = [&](const std::string& key, const IPluginObject& o) {
    auto s = o.state_dict();
    if (!s.isNone()) out.insert(key, s);
  };
  put("strategy", runtime_->strategy_object());
  put("precision", runtime_->precision_object());
  put("model", *plugins_.model.object);
  put("data", *plugins_.data.object);
  return out;
}

// Everything a checkpoint holds but the model's and the optimizer's state (docs/checkpoint.md).
c10::impl::GenericDict TrainingLoop::checkpoint_meta(bool weights_only) const {
  auto ck = checkpoint_header(pos_.epoch, pos_.global_step, weights_only, config_.to_toml());
  c10::Dict<std::string, std::string> versions;
  auto add_version = [&](const std::string& n, const std::string& v) { versions.insert(n, v); };
  add_version(runtime_->strategy().name, runtime_->strategy().version);
  add_version(runtime_->precision().name, runtime_->precision().version);
  add_version(plugins_.model.name, plugins_.model.version);
  add_version(plugins_.data.name, plugins_.data.version);
  for (const auto& c : plugins_.callbacks) add_version(c.name, c.version);
  for (const auto& l : plugins_.loggers) add_version(l.name, l.version);
  ck.insert("plugin_versions", versions);
  // The data's class names, for `engine export` (a Hugging Face config's id2label) and whoever
  // reads the checkpoint later without the data.
  if (const auto* names = static_cast<IPredictionNames*>(plugins_.data.object->query_interface(kPredictionNamesIid))) {
    c10::List<std::string> classes;
    for (const auto& n : names->class_names()) classes.push_back(n);
    if (!classes.empty()) ck.insert("class_names", classes);
  }
  if (weights_only) return ck;
  ck.insert("loops", pos_.to_ivalue());
  ck.insert("rng", rng_state());
  ck.insert("plugins", plugin_states());
  // States that differ between ranks (rank_states.h), compared by the save that asked for this. Those
  // each rank writes into its part of a sharded directory are not repeated here when they hold
  // tensors: they are the rank's shards, which no other number of ranks can take.
  const auto& by_rank = rank_states_.record;
  std::vector<std::string> only_in_parts;
  if (states_in_parts(by_rank))
    for (const auto& name : by_rank.at("with_tensors").toList()) only_in_parts.push_back(c10::IValue(name).toStringRef());
  auto callbacks = checkpoint_dict();
  for (size_t i = 0; i < plugins_.callbacks.size(); ++i) {
    const auto& c = plugins_.callbacks[i];
    if (std::find(only_in_parts.begin(), only_in_parts.end(), c.name) != only_in_parts.end()) continue;
    auto s = i < taken_states_.size() ? taken_states_[i].second : c.object->state_dict();
    if (!s.isNone()) callbacks.insert(c.name, s);
  }
  ck.insert("callbacks", callbacks);
  if (!by_rank.empty()) ck.insert("callbacks_by_rank", by_rank);
  auto loggers = checkpoint_dict();
  for (const auto& l : plugins_.loggers) {
    auto s = l.object->state_dict();
    if (!s.isNone()) loggers.insert(l.name, s);
  }
  ck.insert("loggers", loggers);
  return ck;
}

// The saves a plugin asks for in on_exception (the checkpoint callback's save_on_exception): only
// of a state a resume can continue from exactly, and only in a one-process run.
void TrainingLoop::check_saving_after_failure() const {
  if (!failing_) return;
  if (runtime_->world_size() > 1)
    throw RunError("a failed run of " + std::to_string(runtime_->world_size()) +
                   " ranks is not saved: the other ranks may be waiting in a collective the save would need");
  if (!resumable_)
    throw RunError("the run failed inside an optimizer update or an accumulation window, where weights, optimizer and position "
                   "disagree, so it is not saved: the last checkpoint stands");
}

// Collective, after on_save_checkpoint (weight averaging swaps its states there): the callback
// states that differ between ranks, for checkpoint_meta on rank 0 and this rank's part.
void TrainingLoop::gather_rank_states(bool weights_only) {
  forget_rank_states();
  if (weights_only || runtime_->world_size() <= 1) return;
  // Only where the strategy trains shards (or slices) of the parameters rather than whole ones.
  bool trains_shards = false;
  const auto trained = runtime_->state().trained_parameters();
  const auto params = module().named_parameters();
  for (size_t i = 0; i < trained.size() && i < params.size(); ++i) trains_shards = trains_shards || trained[i].tensor.sizes() != params[i].value().sizes();
  if (!runtime_->any_rank(trains_shards || trained.size() != params.size())) return;  // rank 0's states stand for all (rank_states.h)
  for (const auto& c : plugins_.callbacks) taken_states_.emplace_back(c.name, c.object->state_dict());
  RankCollectives collectives;
  collectives.rank = runtime_->rank();
  collectives.world = runtime_->world_size();
  collectives.device = runtime_->root_device();
  collectives.reduce = [this](const at::Tensor& t, ReduceOp op) { return runtime_->reduce(t, op); };
  collectives.broadcast = [this](const at::Tensor& t, int64_t src) { return runtime_->broadcast(t, src); };
  collectives.layout = shard_layout();
  // The same condition as the runtime's choice of a directory (the model and optimizer both saved).
  const StatesGo go = runtime_->writes_sharded_checkpoints() ? StatesGo::into_own_part : StatesGo::to_rank0;
  rank_states_ = gather_differing_states(taken_states_, /*trains_shards=*/true, go, collectives);
}

// What this rank trains (names and shard shapes) and its place in the mesh, as one number below 2^31
// (exact through every reduction path, as the digests of rank_states.cpp).
int64_t TrainingLoop::shard_layout() {
  std::string text;
  for (const auto& t : runtime_->state().trained_parameters()) text += t.name + c10::str(t.tensor.sizes()) + ";";
  text += "dp " + std::to_string(runtime_->data_parallel_rank()) + "/" + std::to_string(runtime_->data_parallel_size());
  if (const auto* mesh = static_cast<IDeviceMesh*>(runtime_->strategy_object().query_interface(kDeviceMeshIid)))
    text += " tp " + std::to_string(mesh->tensor_parallel_rank()) + "/" + std::to_string(mesh->tensor_parallel_size());
  return static_cast<int64_t>(std::hash<std::string>{}(text) & 0x7fffffffu);
}

void TrainingLoop::forget_rank_states() {
  rank_states_ = RankStates{};
  taken_states_.clear();
}

c10::IValue TrainingLoop::own_rank_states() const {
  return rank_states_.own.empty() ? c10::IValue() : c10::IValue(rank_states_.own);
}

void TrainingLoop::save_checkpoint(const std::string& path, bool weights_only) {
  check_saving_after_failure();
  call_hook(Hook::on_save_checkpoint);
  gather_rank_states(weights_only);
  // A file gathered on rank 0, or one part per rank when the strategy's checkpoints are sharded.
  runtime_->save_checkpoint(path, /*with_model=*/true, /*with_optimizer=*/!weights_only, [&] { return checkpoint_meta(weights_only); },
                            own_rank_states());
  forget_rank_states();
}

void TrainingLoop::save_checkpoint_async(const std::vector<std::string>& paths, bool weights_only, std::function<void()> committed) {
  check_saving_after_failure();
  call_hook(Hook::on_save_checkpoint);
  gather_rank_states(weights_only);
  runtime_->save_checkpoint_async(paths, /*with_model=*/true, /*with_optimizer=*/!weights_only,
                                  [&] { return checkpoint_meta(weights_only); }, std::move(committed), own_rank_states());
  forget_rank_states();
}

void TrainingLoop::finish_checkpoints() { runtime_->finish_background_save(); }

void TrainingLoop::write_consolidated(const std::string& path, const std::filesystem::path& dir, bool weights_only) {
  const auto meta = read_sharded_meta(dir);
  auto model_state = runtime_->state().full_model_state(/*rank0_only=*/true);
  if (weights_only) {  // what save_weights_only writes: the header, the versions, the class names
    auto ck = checkpoint_header(meta.at("epoch").toInt(), meta.at("global_step").toInt(), /*weights_only=*/true,
                                meta.at("config").toStringRef());
    for (const char* key : {"plugin_versions", "class_names"})
      if (meta.contains(key)) ck.insert(key, meta.at(key));
    ck.insert("state_dict", model_state);
    save_checkpoint_file(path, ck);
    return;
  }
  const std::string optimizer_state = runtime_->state().full_optimizer_state(/*rank0_only=*/true);
  auto ck = checkpoint_dict();
  for (const auto& e : meta)
    if (e.key().toStringRef() != "sharded") ck.insert(e.key(), e.value());
  // Callback states the ranks wrote into their parts (rank_states.h) go into the file's record, as a
  // file holds them: one list per callback, a state per saving rank.
  if (ck.contains("callbacks_by_rank") && states_in_parts(ck.at("callbacks_by_rank").toGenericDict())) {
    auto by_rank = ck.at("callbacks_by_rank").toGenericDict().copy();
    const int64_t world = by_rank.at("world_size").toInt();
    auto states = checkpoint_dict();
    for (const auto& name : by_rank.at("in_parts").toList()) states.insert(c10::IValue(name).toStringRef(), c10::impl::GenericList(c10::AnyType::get()));
    for (int64_t k = 0; k < world; ++k) {
      const c10::IValue part = runtime_->part_callback_states(dir, k);
      for (const auto& e : states) {
        const std::string& name = e.key().toStringRef();
        if (!part.isGenericDict() || !part.toGenericDict().contains(name))
          throw RunError("checkpoint " + dir.string() + ": rank " + std::to_string(k) + "'s part holds no state of callback '" + name +
                         "' though meta.ckpt says each part does (parts of another save mixed in?)");
        e.value().toList().push_back(part.toGenericDict().at(name));
      }
    }
    (void)by_rank.erase("in_parts");
    by_rank.insert("states", states);
    ck.insert_or_assign("callbacks_by_rank", by_rank);
  }
  ck.insert("state_dict", model_state);
  ck.insert("optimizer", bytes_tensor(optimizer_state));
  save_checkpoint_file(path, ck);
}

void TrainingLoop::restore(const std::filesystem::path& file, bool weights_only) { restore(file, weights_only, true); }

void TrainingLoop::load_init_checkpoint() {
  const auto& m = config_.section("model");
  if (!m.has("init_checkpoint") || m.get_string("init_checkpoint").empty()) {
    if (!m.get_string_list("init_exclude").empty())
      throw UsageError(m.where("init_exclude") + ": model.init_exclude is set but model.init_checkpoint is not: set the checkpoint to start "
                       "from, or remove init_exclude");
    return;
  }
  const std::filesystem::path file = m.get_string("init_checkpoint");
  const std::string where = m.where("init_checkpoint") + ": model.init_checkpoint = \"" + file.string() + "\"";
  std::error_code ec;
  if (!std::filesystem::exists(file, ec))
    throw UsageError(where + ": no such file (give the path of a .ckpt an earlier run wrote, e.g. runs/NAME/version_0/checkpoints/last.ckpt)");
  const NamePatterns exclude(m.get_string_list("init_exclude"), NameRule::module);
  std::vector<std::string> names;
  for (const auto& p : module().named_parameters()) names.push_back(p.key());
  for (const auto& b : module().named_buffers()) names.push_back(b.key());
  for (size_t i = 0; i < exclude.size(); ++i)
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return exclude.matches(n, i); }))
      throw UsageError(m.where("init_exclude") + ": model.init_exclude entry \"" + exclude.entries()[i] + "\" names no module or tensor of model '" +
                       plugins_.model.name + "' (e.g. '" + (names.empty() ? std::string("none") : names.front()) +
                       "'): give a module's name (\"head\" takes head.*), or a regular expression matching whole names");
  std::vector<std::string> kept;
  for (const auto& name : names)
    if (exclude.matches(name)) kept.push_back(name);
  // What plugins added (LoRA's adapters) comes from the checkpoint where it holds it (a LoRA run's)
  // and keeps its own initial values where it does not (a pretraining run's).
  const std::set<std::string> added(added_by_transforms_.begin(), added_by_transforms_.end());
  std::function<InitialTensor(const std::string&)> pick;  // (none: every tensor from the checkpoint)
  if (exclude.size() > 0 || !added.empty())
    pick = [&](const std::string& name) {
      if (exclude.matches(name)) return InitialTensor::own;
      return added.count(name) ? InitialTensor::from_checkpoint_if_saved : InitialTensor::from_checkpoint;
    };
  std::vector<std::string> absent;
  runtime_->load_initial_weights(file, pick, &absent);
  if (rank() != 0) return;
  std::string line = "model: weights from " + file.string();
  if (!kept.empty())
    line += " except " + std::to_string(kept.size()) + " tensors that keep their initial values here (e.g. '" + kept.front() + "')";
  if (!absent.empty()) {
    std::string by;
    for (size_t i = 0; i < transforming_plugins_.size(); ++i) by += (i ? ", '" : "'") + transforming_plugins_[i] + "'";
    line += std::string(kept.empty() ? " except" : ", and") + " the " + std::to_string(absent.size()) + " tensors " + by +
            " added, which it does not hold (e.g. '" + absent.front() + "'): they keep their initial values";
  }
  log::info(line + "; the optimizer and the schedule start afresh");
}

namespace {

std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", " : "") + names[i];
  return names.size() > 8 ? out + ", ... (" + std::to_string(names.size()) + ")" : out;
}

}  // namespace

// A checkpoint's outputs are its classes in the order it was trained on (`class_names`). Data that
// names other classes, or the same in another order (a class folder added, a label file with a
// new label, another label order), would give those outputs the wrong names with no error, in
// predictions, metrics and a resumed run alike: refused in one line. Checkpoints written before
// the names were kept, and data without names, are not checked.
void TrainingLoop::check_class_names(const c10::impl::GenericDict& ck, const std::string& where) const {
  if (!ck.contains("class_names") || !ck.at("class_names").isList()) return;
  const auto* names = static_cast<IPredictionNames*>(plugins_.data.object->query_interface(kPredictionNamesIid));
  if (names == nullptr) return;
  const std::vector<std::string> data = names->class_names();
  if (data.empty()) return;
  std::vector<std::string> trained;
  for (const auto& v : ck.at("class_names").toList()) {
    const c10::IValue name = v;
    if (!name.isString()) return;  // not Ember's layout: `engine checkpoint verify` speaks for it
    trained.push_back(name.toStringRef());
  }
  if (trained == data) return;
  std::string differ;
  if (trained.size() == data.size())
    for (size_t i = 0; i < data.size(); ++i)
      if (trained[i] != data[i]) {
        differ = ": output " + std::to_string(i) + " is '" + trained[i] + "' there and '" + data[i] + "' here";
        break;
      }
  throw RunError(where + " was trained on " + std::to_string(trained.size()) + " classes (" + listed(trained) + ") and the " +
                 plugins_.data.name + " data names " + std::to_string(data.size()) + " (" + listed(data) + ")" + differ +
                 ": give the data the checkpoint's classes in its order (text_classification: [data] labels, image_folder: [data] "
                 "classes; `engine checkpoint info` lists them), or train anew");
}

void TrainingLoop::restore(const std::filesystem::path& file, bool weights_only, bool announce, bool loggers_too) {
  const std::string where = "checkpoint " + file.string();
  using Part = Runtime::Part;
  auto ck = runtime_->load_checkpoint(file, Part::required, weights_only ? Part::skip : Part::required);
  check_class_names(ck, where);
  if (weights_only) return;
  if (!ck.contains("loops")) throw RunError(where + " holds weights only (save_weights_only); it can be tested but not resumed");
  pos_ = TrainingState::from_ivalue(ck.at("loops").toGenericDict());
  resume_batch_ = pos_.resume_batch();
  // The position a resumed run starts from: the last finished batch of the epoch.
  batch_idx_ = pos_.last_batch_idx();
  restore_rng_state(ck.at("rng").toGenericDict());
  auto plugin_state = ck.at("plugins").toGenericDict();
  auto restore_one = [&](const std::string& key, IPluginObject& o) {
    if (plugin_state.contains(key)) o.load_state_dict(plugin_state.at(key));
  };
  restore_one("strategy", runtime_->strategy_object());
  restore_one("precision", runtime_->precision_object());
  restore_one("model", *plugins_.model.object);
  restore_one("data", *plugins_.data.object);
  auto callbacks = ck.at("callbacks").toGenericDict();
  const auto by_rank = ck.contains("callbacks_by_rank") ? ck.at("callbacks_by_rank").toGenericDict() : checkpoint_dict();
  // Shards cut for another mesh fit no rank's state (rank_states.h); collective.
  const bool other_cut = by_rank.contains("layouts") &&
                         shards_cut_otherwise(by_rank, runtime_->rank(), runtime_->world_size(), shard_layout(),
                                              [this](bool mine) { return runtime_->any_rank(mine); });
  // This rank's own states in its part of a sharded directory (rank_states.h), when the ranks match.
  c10::IValue own_part;
  if (states_in_parts(by_rank) && by_rank.at("world_size").toInt() == runtime_->world_size() && !other_cut)
    own_part = runtime_->part_callback_states(file, runtime_->rank());
  for (auto& c : plugins_.callbacks) {
    const c10::IValue shared = callbacks.contains(c.name) ? callbacks.at(c.name) : c10::IValue();
    const c10::IValue state =
        state_for_rank(c.name, shared, by_rank, own_part, runtime_->rank(), runtime_->world_size(), other_cut, where);
    if (!state.isNone()) c.object->load_state_dict(state);
  }
  auto loggers = ck.at("loggers").toGenericDict();
  for (auto& l : plugins_.loggers)
    if (loggers_too && loggers.contains(l.name)) l.object->load_state_dict(loggers.at(l.name));
  call_hook(Hook::on_load_checkpoint);
  if (announce)
    log::info("resumed from " + file.string() + " at epoch " + std::to_string(pos_.epoch) + ", step " + std::to_string(pos_.global_step) +
            (pos_.epoch_finished ? " (end of epoch)" : " (batch " + std::to_string(pos_.batches_done) + " of the epoch)"));
}

// ITrainerRecovery::rollback, after the hook that asked for it: the snapshot's state and position,
// this epoch's running metrics dropped (as a resume starts them), loggers untouched.
void TrainingLoop::roll_back() {
  const std::string path = std::move(rollback_path_);
  rollback_path_.clear();
  skip_requested_ = skipping_window_ = false;
  metrics_.discard_epoch(Stage::fit);
  configured_metrics_.discard(Split::train);
  restore(path, /*weights_only=*/false, /*announce=*/false, /*loggers=*/false);
  rolled_back_ = true;
  log::info("rolled back to " + path + ": epoch " + std::to_string(pos_.epoch) + ", step " + std::to_string(pos_.global_step) +
            (pos_.epoch_finished ? " (end of epoch)" : " (batch " + std::to_string(pos_.batches_done) + " of the epoch)"));
}

}  // namespace ember::engine
