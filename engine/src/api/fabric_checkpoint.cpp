// Fabric::save / Fabric::load: the program's state in the engine's checkpoint format
// (docs/checkpoint.md), so `engine --resume` reads the model and optimizer of a Fabric checkpoint,
// and Fabric::load reads the engine's. The program's own values go under the key `fabric`.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include "api/fabric_impl.h"
#include "checkpoint/checkpoint_document.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/sharded_checkpoint.h"
#include "loop/training_state.h"

namespace ember {

c10::Dict<std::string, at::Tensor> Fabric::full_model_state(bool rank0_only) {
  impl_->require_setup("full_model_state");
  return impl_->runtime->state().full_model_state(rank0_only);
}

// Everything a Fabric checkpoint holds but the model's and the optimizer's state, built on rank 0
// (while save or save_async runs: it reads `state` and the plugins then).
engine::Runtime::CheckpointMeta Fabric::Impl::checkpoint_meta(const FabricState& state) {
  return [this, &state] {
    auto& rt = *runtime;
    auto ck = engine::checkpoint_header(state.epoch, state.global_step, !state.optimizer, plan.config.to_toml());
    c10::Dict<std::string, std::string> versions;
    versions.insert(rt.strategy().name, rt.strategy().version);
    if (rt.has_precision()) versions.insert(rt.precision().name, rt.precision().version);
    ck.insert("plugin_versions", versions);
    // The engine's loop position: the end of epoch `epoch`, so a resume goes on with the next.
    ck.insert("loops", engine::TrainingState::end_of_epoch(state.epoch, state.global_step).to_ivalue());
    ck.insert("rng", engine::rng_state());
    auto plugins = engine::checkpoint_dict();
    if (auto s = rt.strategy_object().state_dict(); !s.isNone()) plugins.insert("strategy", s);
    if (rt.has_precision())
      if (auto s = rt.precision_object().state_dict(); !s.isNone()) plugins.insert("precision", s);
    ck.insert("plugins", plugins);
    ck.insert("callbacks", engine::checkpoint_dict());
    ck.insert("loggers", engine::checkpoint_dict());
    auto values = engine::checkpoint_dict();
    for (const auto& [k, v] : state.values) values.insert(k, v);
    ck.insert("fabric", values);
    return ck;
  };
}

void Fabric::Impl::require_model_for(const FabricState& state, const char* call) {
  ensure_launched();
  if ((state.model || state.optimizer) && !runtime->is_setup())
    throw RunError(std::string("ember::Fabric::") + call + ": call setup(module, optimizer factory) first, or save with model = optimizer = false");
}

void Fabric::save(const std::string& path, const FabricState& state) {
  auto& d = *impl_;
  d.require_model_for(state, "save");
  // Collective, through the same runtime as the engine's loop: a file gathered on rank 0, or a
  // directory of one part per rank under a strategy whose checkpoints are sharded (the model and
  // the optimizer saved); rank 0's failure ends every rank.
  d.runtime->save_checkpoint(path, state.model, state.optimizer, d.checkpoint_meta(state));
}

void Fabric::save_async(const std::string& path, const FabricState& state) {
  auto& d = *impl_;
  d.require_model_for(state, "save_async");
  // The runtime's background save, which the engine's checkpoint callback uses too; it is settled
  // by the next save, save_async or load, by finish_saves, or when launch's function returns.
  d.runtime->save_checkpoint_async({path}, state.model, state.optimizer, d.checkpoint_meta(state), nullptr);
}

void Fabric::finish_saves() {
  impl_->ensure_launched();
  impl_->runtime->finish_background_save();
}

FabricState Fabric::load(const std::string& path) {
  auto& d = *impl_;
  d.ensure_launched();
  // A sharded directory carries the model and the optimizer; a file what it was saved with.
  const bool sharded = engine::is_sharded_checkpoint(path);
  auto needs_setup = [&] {
    return RunError("ember::Fabric::load: checkpoint " + path + " holds a model; call setup(module, optimizer factory) before load");
  };
  using Part = engine::Runtime::Part;
  c10::impl::GenericDict ck = engine::checkpoint_dict();
  if (d.runtime->is_setup()) {
    ck = d.runtime->load_checkpoint(path, Part::if_present, Part::if_present, "build the same optimizer in setup()");
  } else {
    if (sharded) throw needs_setup();
    ck = engine::load_checkpoint_file(path);  // checks every record's CRC32C
    if (ck.contains("state_dict") || ck.contains("optimizer")) throw needs_setup();
  }
  FabricState out;
  out.model = sharded || ck.contains("state_dict");
  out.optimizer = sharded || ck.contains("optimizer");
  if (ck.contains("plugins")) {
    auto plugins = ck.at("plugins").toGenericDict();
    if (plugins.contains("strategy")) d.runtime->strategy_object().load_state_dict(plugins.at("strategy"));
    if (plugins.contains("precision") && d.runtime->has_precision()) d.runtime->precision_object().load_state_dict(plugins.at("precision"));
  }
  if (ck.contains("loops")) {
    const auto position = engine::TrainingState::from_ivalue(ck.at("loops").toGenericDict());
    out.global_step = position.global_step;
    out.epoch = position.epoch;
  }
  if (ck.contains("fabric"))
    for (const auto& e : ck.at("fabric").toGenericDict()) out.values.emplace(e.key().toStringRef(), e.value());
  return out;
}

}  // namespace ember
