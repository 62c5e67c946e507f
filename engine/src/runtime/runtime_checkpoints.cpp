// The runtime's checkpoints (runtime.h): saving the model's and optimizer's state whole or as a
// sharded directory, in the foreground or in the background, and loading them back (a resume,
// --ckpt, [model] init_checkpoint). The step and the collectives are in runtime.cpp.
#include "runtime/runtime.h"

#include <ember/config.h>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <set>

#include "checkpoint/checkpoint_document.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/background_write.h"
#include "checkpoint/omitted_parameters.h"
#include "checkpoint/sharded_checkpoint.h"
#include "common/log.h"

namespace ember::engine {

void Runtime::save_full(bool with_model, bool with_optimizer, const FullStateWriter& write, const std::string& what) {
  // Every rank takes part in the gathers; only rank 0 writes.
  c10::Dict<std::string, at::Tensor> model_state;
  if (with_model) model_state = strategy_.object->full_model_state(/*rank0_only=*/true);
  const std::string optimizer_state = with_optimizer ? strategy_.object->full_optimizer_state(/*rank0_only=*/true) : std::string();
  std::exception_ptr error;
  if (rank() == 0) {
    try {
      write(model_state, optimizer_state);
    } catch (...) {
      error = std::current_exception();
    }
  }
  // Rank 0's failure (read-only folder, full disk) ends every rank now, with that reason on rank 0,
  // instead of leaving the others to time out in the next collective.
  if (any_rank(error != nullptr) && !error)
    throw RunError("rank 0 could not write " + what + " (its log says why); stopping with it");
  if (error) std::rethrow_exception(error);
}

// A sharded directory's meta.ckpt: the run's document plus the layout its parts were written in.
c10::impl::GenericDict Runtime::sharded_meta(const CheckpointMeta& meta) {
  auto ck = meta();
  auto layout = checkpoint_dict();
  layout.insert("world_size", world_size());
  layout.insert("strategy", strategy_.name);
  // The model's tensor names: a load checks that the parts hold no other model's (the parts'
  // layouts are the strategy's own).
  c10::List<std::string> names;
  for (const auto& name : model_tensors_) names.push_back(name);
  layout.insert("model_tensors", names);
  ck.insert("sharded", layout);
  return ck;
}

void Runtime::refuse_foreign_tensors(const c10::impl::GenericDict& sharded_meta, const std::string& where) const {
  const auto layout = sharded_meta.at("sharded").toGenericDict();
  if (!layout.contains("model_tensors") || !layout.at("model_tensors").isList()) return;  // (a directory written before the names were kept)
  std::vector<std::string> names;
  for (const auto& name : layout.at("model_tensors").toListRef())
    if (name.isString()) names.push_back(name.toStringRef());
  refuse_foreign_tensors(names, where);
}

ShardedWrite Runtime::sharded_write() {
  ShardedWrite how;
  how.rank = rank();
  how.world = world_size();
  how.max_over_ranks = [this](double v) { return reduce(at::scalar_tensor(v, at::kDouble), ReduceOp::max).item<double>(); };
  return how;
}

void Runtime::save_checkpoint(const std::string& path, bool with_model, bool with_optimizer, const CheckpointMeta& meta,
                              const c10::IValue& own_states) {
  finish_background_save();  // at most one write in flight, and in order
  if (writes_sharded_checkpoints() && with_model && with_optimizer) {
    // One part per rank, nothing gathered (sharded_checkpoint.h has the layout and the commit).
    const c10::IValue part = strategy_.object->sharded_state();
    const c10::IValue doc = rank() == 0 ? c10::IValue(sharded_meta(meta)) : c10::IValue();
    write_sharded_checkpoint(path, part, doc, sharded_write(), own_states);
    return;
  }
  save_full(with_model, with_optimizer, [&](const c10::Dict<std::string, at::Tensor>& model, const std::string& optimizer) {
    auto ck = meta();
    if (with_model) ck.insert("state_dict", saved_model_state(model, ck, {path}));
    if (with_optimizer) ck.insert("optimizer", bytes_tensor(optimizer));
    save_checkpoint_file(path, ck);
  }, "checkpoint " + path);
}

c10::Dict<std::string, at::Tensor> Runtime::saved_model_state(const c10::Dict<std::string, at::Tensor>& state, c10::impl::GenericDict& ck,
                                                              const std::vector<std::string>& paths) {
  if (omitted_.empty()) return state;
  OmittedParameters record;
  auto kept = without_omitted(state, omitted_, omitted_fingerprint_, record);
  record.base = omitted_base_;
  record.from_base = omitted_from_base_;
  record.base_relative = base_relative_to(omitted_base_, paths);
  ck.insert("omitted_parameters", record.to_ivalue());
  return kept;
}

c10::Dict<std::string, at::Tensor> Runtime::model_state_of(const c10::impl::GenericDict& ck, const std::filesystem::path& path,
                                                           std::optional<OmittedParameters>* record) {
  const std::string where = "checkpoint " + path.string();
  auto state = c10::impl::toTypedDict<std::string, at::Tensor>(ck.at("state_dict").toGenericDict());
  if (ck.contains("omitted_parameters")) {
    // Left out when it was saved (frozen: LoRA's base): this run's own values, gathered.
    const auto omitted = OmittedParameters::from_ivalue(ck.at("omitted_parameters"), where, path);
    if (record != nullptr) *record = omitted;
    if (!omitted.base.empty() && !omitted.from_base.empty()) load_omitted_from_base(omitted, where);
    const auto own = strategy_.object->full_model_state(/*rank0_only=*/false);
    fill_omitted(state, omitted, [&](const std::string& name) -> std::optional<at::Tensor> {
      if (!own.contains(name)) return std::nullopt;
      return own.at(name);
    }, where);
  }
  return state;
}

void Runtime::refuse_foreign_tensors(const c10::Dict<std::string, at::Tensor>& state, const std::string& where) const {
  std::vector<std::string> names;
  for (const auto& e : state) names.push_back(e.key());
  refuse_foreign_tensors(names, where);
}

void Runtime::refuse_foreign_tensors(const std::vector<std::string>& names, const std::string& where) const {
  if (model_tensors_.empty()) return;  // (before setup: nothing to compare with)
  std::vector<std::string> foreign;
  for (const auto& name : names)
    if (!model_tensors_.count(name)) foreign.push_back(name);
  if (foreign.empty()) return;
  throw RunError((where.empty() ? "" : where + " ") + "holds " + std::to_string(foreign.size()) + " tensor" + (foreign.size() == 1 ? "" : "s") +
                 " this model does not have, e.g. '" + foreign.front() + "': it was saved from another model (other [model] settings, "
                 "or a plugin that changed the model, such as lora): load it with the settings and plugins it was trained with");
}

// The frozen values a checkpoint left out because they came from its run's init_checkpoint: that
// checkpoint (file or sharded directory) is read into the model, those tensors alone (any it left
// out in turn come from its own base), before they are taken from the model and fingerprinted.
void Runtime::load_omitted_from_base(const OmittedParameters& omitted, const std::string& where) {
  if (const auto why = unreadable_base(where, omitted, base_depth_); !why.empty()) throw RunError(why);
  const std::string whose = from_base_text(where, omitted.from_base.size(), omitted.base);
  if (omitted.moved && rank() == 0)
    log::info(where + ": its base is no longer where it was recorded; read from " + omitted.base +
              ", where it lies relative to this checkpoint as it did (the folders moved together)");
  const std::set<std::string> from(omitted.from_base.begin(), omitted.from_base.end());
  ++base_depth_;
  try {
    load_initial_weights(omitted.base, [&](const std::string& name) {
      return from.count(name) ? InitialTensor::from_checkpoint_if_saved : InitialTensor::own;
    });
  } catch (const RunError& e) {
    --base_depth_;
    throw RunError(whose + ": " + e.what());
  }
  --base_depth_;
}

c10::IValue Runtime::part_callback_states(const std::filesystem::path& dir, int64_t k) {
  if (dir == states_dir_)
    if (auto it = part_callback_states_.find(k); it != part_callback_states_.end()) {
      c10::IValue states = std::move(it->second);  // asked for once: not kept beside the callbacks' copies
      part_callback_states_.erase(it);
      return states;
    }
  try {
    return read_sharded_part_file(dir, k).callback_states;
  } catch (const std::exception& e) {
    throw RunError(e.what());
  }
}

c10::impl::GenericDict Runtime::load_initial_weights(const std::filesystem::path& path, const std::function<InitialTensor(const std::string&)>& pick,
                                                     std::vector<std::string>* kept_absent) {
  const std::string where = "checkpoint " + path.string();
  auto source = [&](const std::string& name) { return pick ? pick(name) : InitialTensor::from_checkpoint; };
  if (is_sharded_checkpoint(path)) {
    // Each rank reads the parts holding its own shards of the weights; the optimizer stays fresh.
    auto* model_parts = static_cast<IShardedModelState*>(strategy_.object->query_interface(kShardedModelStateIid));
    auto* selective = static_cast<IShardedModelStateSelective*>(strategy_.object->query_interface(kShardedModelStateSelectiveIid));
    if (model_parts == nullptr && selective == nullptr)
      throw RunError(where + " is a sharded checkpoint directory, which strategy '" + strategy_.name +
                     "' cannot start from: start under one that can (--plugins sharded or offload), or make one file of it first "
                     "(engine checkpoint consolidate " + path.string() + " OUT.ckpt) and start from that file");
    if (pick && selective == nullptr)  // (built against SDK 2.23)
      throw RunError(where + " is a sharded checkpoint directory, from which strategy '" + strategy_.name +
                     "' cannot leave out tensors ([model] init_exclude, or what a plugin added to the model): make one file of it "
                     "first (engine checkpoint consolidate " + path.string() +
                     " OUT.ckpt) and start from that file, or rebuild the strategy against Ember SDK 2.24");
    c10::impl::GenericDict ck = checkpoint_dict();
    try {
      ck = read_sharded_meta(path);
      refuse_foreign_tensors(ck, "");  // (the catch below names the directory)
      const int64_t saved_world = ck.at("sharded").toGenericDict().at("world_size").toInt();
      auto read_part = [&](int64_t k) { return read_sharded_part(path, k); };
      if (selective != nullptr)
        selective->load_sharded_model_state_selective(saved_world, read_part, source);
      else
        model_parts->load_sharded_model_state(saved_world, read_part);
    } catch (const RunError& e) {
      // A tensor the parts lack or hold in another shape: the model's new parts, if it has some.
      const std::string what = e.what();
      const bool model_differs = what.find("' has shape ") != std::string::npos || what.find("lacks ") != std::string::npos;
      throw RunError(where + ": " + what +
                     (model_differs ? "; list what this model has anew (a head for other classes) in [model] init_exclude to keep its own "
                                      "initial values, or start from a checkpoint of this model"
                                    : ""));
    } catch (const c10::Error& e) {
      throw RunError(where + ": its weights do not fit this model (" + std::string(e.what_without_backtrace()).substr(0, 160) +
                     "); start from a checkpoint of this model");
    } catch (const std::runtime_error& e) {
      throw RunError(e.what());
    }
    return ck;
  }
  auto ck = load_checkpoint_file(path);
  if (!ck.contains("state_dict")) throw RunError(where + " has no state_dict");
  auto saved = model_state_of(ck, path);
  refuse_foreign_tensors(saved, where);
  // Every rank takes the same whole state; the strategy keeps its part of it.
  const auto own = strategy_.object->full_model_state(/*rank0_only=*/false);
  c10::Dict<std::string, at::Tensor> state;
  for (const auto& e : own) {
    const std::string& name = e.key();
    const InitialTensor from = source(name);
    auto it = saved.find(name);
    if (from == InitialTensor::own || (from == InitialTensor::from_checkpoint_if_saved && it == saved.end())) {
      if (from != InitialTensor::own && kept_absent != nullptr) kept_absent->push_back(name);
      state.insert(name, e.value());
      continue;
    }
    if (it == saved.end()) continue;  // reported below, with every other one
    if (it->value().sizes() != e.value().sizes())
      throw RunError(where + ": '" + name + "' has shape " + c10::str(it->value().sizes()) + " there and " + c10::str(e.value().sizes()) +
                     " in this model: list what changed (a new head for other classes) in [model] init_exclude to keep its own initial "
                     "values, or start from a checkpoint of this model");
    state.insert(name, it->value());
  }
  std::vector<std::string> missing;
  for (const auto& e : own)
    if (!state.contains(e.key())) missing.push_back(e.key());
  if (!missing.empty())
    throw RunError(where + " lacks " + std::to_string(missing.size()) + " of this model's tensors, e.g. '" + missing.front() +
                   "': list the model's new parts in [model] init_exclude to keep their own initial values, or start from a checkpoint of "
                   "this model");
  try {
    strategy_.object->load_full_model_state(state);
  } catch (const RunError& e) {
    throw RunError(where + ": " + e.what());
  }
  return ck;
}

c10::impl::GenericDict Runtime::load_checkpoint(const std::filesystem::path& path, Part model, Part optimizer,
                                                const std::string& optimizer_fix) {
  finish_background_save();  // the file being written may be the one asked for
  const std::string where = "checkpoint " + path.string();
  if (is_sharded_checkpoint(path)) {
    auto ck = read_sharded_meta(path);
    refuse_foreign_tensors(ck, where);
    auto layout = ck.at("sharded").toGenericDict();
    const int64_t saved_world = layout.at("world_size").toInt();
    if (!sharded_)
      throw RunError(where + " is a sharded checkpoint directory (" + std::to_string(saved_world) + " parts, written by '" +
                     layout.at("strategy").toStringRef() + "'); resume it with that strategy, or make one file of it first: engine checkpoint consolidate " +
                     path.string() + " OUT.ckpt");
    // Weights only (validate, test, predict, generate, a weights-only consolidation): the parts'
    // optimizer state is not read, where the strategy can leave it out (IShardedModelState).
    auto* model_alone = optimizer == Part::skip ? static_cast<IShardedModelState*>(strategy_.object->query_interface(kShardedModelStateIid))
                                                : nullptr;
    try {
      states_dir_ = path;
      part_callback_states_.clear();
      auto read_part = [&](int64_t k) {
        auto file = read_sharded_part_file(path, k);
        part_callback_states_[k] = file.callback_states;
        return file.part;
      };
      if (model_alone != nullptr)
        model_alone->load_sharded_model_state(saved_world, read_part);
      else
        strategy_.object->load_sharded_state(saved_world, read_part);
    } catch (const RunError& e) {
      throw RunError(where + ": " + e.what());
    } catch (const c10::Error& e) {
      throw RunError(where + ": its state does not fit this run (" + std::string(e.what_without_backtrace()).substr(0, 160) +
                     "); resume with the same model and [optimizer] settings");
    }
    return ck;
  }
  auto ck = load_checkpoint_file(path);
  if (model != Part::skip && ck.contains("state_dict")) {
    std::optional<OmittedParameters> record;
    auto state = model_state_of(ck, path, &record);
    refuse_foreign_tensors(state, where);
    // A resume's checkpoints go on leaving out what this one left out, from where it took them
    // (where it lies now, if the folders moved).
    if (!omitted_.empty() && record &&
        std::set<std::string>(record->names.begin(), record->names.end()) == std::set<std::string>(omitted_.begin(), omitted_.end())) {
      omitted_base_ = std::move(record->base);
      omitted_from_base_ = std::move(record->from_base);
    }
    try {
      strategy_.object->load_full_model_state(state);
    } catch (const RunError& e) {
      throw RunError(where + ": " + e.what());
    }
  } else if (model == Part::required) {
    throw RunError(where + " has no state_dict");
  }
  if (optimizer != Part::skip && ck.contains("optimizer")) {
    const auto& entry = ck.at("optimizer");
    if (!entry.isTensor() || entry.toTensor().scalar_type() != at::kByte)
      throw RunError(where + " is not a valid checkpoint: its optimizer entry is not the byte tensor Ember writes");
    try {  // its archive's pickles were checked when the file was loaded (check_nested_archive)
      strategy_.object->load_full_optimizer_state(tensor_bytes(entry.toTensor()));
    } catch (const c10::Error& e) {
      throw RunError(where + ": optimizer state does not fit this optimizer (" + std::string(e.what_without_backtrace()).substr(0, 160) +
                     "); " + optimizer_fix);
    }
  } else if (optimizer == Part::required) {
    throw RunError(where + " holds weights only (save_weights_only); it can be tested but not resumed");
  }
  return ck;
}

void Runtime::save_checkpoint_async(const std::vector<std::string>& paths, bool with_model, bool with_optimizer,
                                    const CheckpointMeta& meta, std::function<void()> committed, const c10::IValue& own_states) {
  finish_background_save();
  if (paths.empty()) return;
  const auto started = std::chrono::steady_clock::now();
  if (!writer_) writer_ = std::make_unique<BackgroundWrite>();
  auto pending = std::make_unique<PendingSave>();
  pending->paths = paths;
  pending->committed = std::move(committed);
  pending->sharded = writes_sharded_checkpoints() && with_model && with_optimizer;
  const std::string what = "checkpoint " + paths.front() + (paths.size() > 1 ? " (and " + std::to_string(paths.size() - 1) + " more)" : "");
  // What this rank takes before the writer starts may throw (a plugin's state_dict, memory for the
  // copy): every rank learns it here, so none is left waiting in a later collective.
  std::exception_ptr error;
  auto agree = [&](const std::string& who) {
    if (any_rank(error != nullptr) && !error) throw RunError(who + " could not take its part of " + what + " (its log says why); stopping with it");
    if (error) std::rethrow_exception(error);
  };
  IDeviceModelState* live = nullptr;
  int64_t taken_bytes = 0;  // of the strategy's own host copies, handed to the writer without another
  if (pending->sharded) {
    c10::IValue part, doc, states;
    try {
      part = take_host_snapshot(strategy_.object->sharded_state(), &taken_bytes);
      if (!own_states.isNone()) states = host_snapshot(own_states);
      if (rank() == 0) doc = host_snapshot(c10::IValue(sharded_meta(meta)));
    } catch (...) {
      error = std::current_exception();
    }
    agree("another rank");
    for (const auto& path : paths) prepare_sharded_checkpoint(path, sharded_write());
    writer_->start([paths, r = rank(), part = std::move(part), doc = std::move(doc), states = std::move(states)] {
      for (const auto& path : paths) write_sharded_part(path, r, part, doc, states);
    });
  } else {
    // The gathers are collective; rank 0 alone copies and writes. A strategy whose rank 0 holds the
    // whole model hands over its live tensors, which host_snapshot copies once (from a GPU into
    // pinned memory); full_model_state's host copies (sharded, tensor parallel) go to the writer as
    // they are (take_host_snapshot).
    live = rank() == 0 ? static_cast<IDeviceModelState*>(strategy_.object->query_interface(kDeviceModelStateIid)) : nullptr;
    c10::Dict<std::string, at::Tensor> model_state;
    if (with_model) model_state = live != nullptr ? live->device_model_state() : strategy_.object->full_model_state(/*rank0_only=*/true);
    const std::string optimizer_state = with_optimizer ? strategy_.object->full_optimizer_state(/*rank0_only=*/true) : std::string();
    if (rank() == 0) {
      try {
        auto ck = host_snapshot(c10::IValue(meta())).toGenericDict();
        if (with_model) {
          c10::IValue state(saved_model_state(model_state, ck, paths));
          model_state = c10::Dict<std::string, at::Tensor>();  // `state` alone holds the gathered copies now
          ck.insert("state_dict", live != nullptr ? host_snapshot(state) : take_host_snapshot(std::move(state), &taken_bytes));
        }
        if (with_optimizer) ck.insert("optimizer", bytes_tensor(optimizer_state));
        writer_->start([paths, ck = std::move(ck)] {
          for (const auto& path : paths) save_checkpoint_file(path, ck);
        });
      } catch (...) {
        error = std::current_exception();
      }
    }
    agree("rank 0");
  }
  pending_save_ = std::move(pending);
  // What the training waited for (the gathers and the copy); the write goes on behind it.
  log::debug("checkpoint " + paths.front() + ": the state was copied for a background write in " +
             std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count()) + " ms" +
             (live != nullptr ? " (from the model's own tensors)" : "") +
             (taken_bytes > 0 ? " (" + std::to_string((taken_bytes + 1023) / 1024) + " KiB of the " + (pending_save_->sharded ? "part" : "model") +
                                    " as the strategy copied it, not copied again)"
                              : ""));
}

double Runtime::background_save_vote() {
  if (!pending_save_) return 0;
  auto& p = *pending_save_;
  if (!p.written_here && writer_ && writer_->busy()) {
    if (!writer_->done()) return 1;
    p.error = writer_->wait();
  }
  p.written_here = true;
  return p.error.empty() ? 0 : 2;
}

void Runtime::settle_background_save(double worst_vote) {
  if (!pending_save_ || worst_vote == 1) return;
  // This rank's writer has ended too (a rank that failed may have voted before the others ended).
  if (writer_ && writer_->busy()) pending_save_->error = writer_->wait();
  pending_save_->written_here = true;
  std::unique_ptr<PendingSave> p = std::move(pending_save_);
  const std::string where = "checkpoint " + p->paths.front() + " (written in the background)";
  if (p->sharded) {
    try {
      // Agrees; throws on every rank when one failed.
      for (const auto& path : p->paths) commit_sharded_checkpoint(path, p->error, sharded_write());
    } catch (const std::exception& e) {
      throw RunError(e.what());
    }
  } else if (worst_vote >= 2) {
    if (!p->error.empty()) throw RunError(p->error);
    throw RunError("rank 0 could not write " + where + " (its log says why); stopping with it");
  }
  if (p->committed) p->committed();
}

void Runtime::finish_background_save() {
  if (!pending_save_) return;
  if (writer_ && writer_->busy() && !pending_save_->written_here) {
    pending_save_->error = writer_->wait();
    pending_save_->written_here = true;
  }
  const double mine = background_save_vote();
  settle_background_save(world_size() > 1 ? reduce(at::scalar_tensor(mine, at::kDouble), ReduceOp::max).item<double>() : mine);
}

void Runtime::abandon_background_save() {
  if (!pending_save_) return;
  std::unique_ptr<PendingSave> p = std::move(pending_save_);
  const std::string error = writer_ && writer_->busy() ? writer_->wait() : p->error;
  const std::string path = p->paths.front();
  if (!error.empty())
    log::warn("the checkpoint being written in the background was not written (" + error + "); the previous " + path + " stays");
  else if (p->sharded)
    log::warn("the sharded checkpoint " + path + " being written in the background was not committed (the run failed first); the previous one stays");
  else if (rank() == 0)
    log::info("the checkpoint " + path + " being written in the background was finished before the run ended");
}

}  // namespace ember::engine
