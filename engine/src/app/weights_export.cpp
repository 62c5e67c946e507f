// `engine export CKPT --format safetensors OUT`: a checkpoint's model weights as a safetensors
// file (or a folder with model.safetensors and the files the model says another library needs).
// The model plugin is made from the checkpoint's own configuration only to learn the names it
// exports under (ember::IExportableModel) and to check that the checkpoint's state_dict is the
// module's; the weights written are the checkpoint's tensors, unchanged in value and dtype.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

#include <unistd.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ember/model.h>
#include <ember/callback.h>
#include <ember/model_adapters.h>
#include <ember/model_export.h>
#include <ember/support/safetensors.h>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/omitted_parameters.h"
#include "app/commands.h"
#include "registry/composition.h"
#include "common/log.h"
#include "app/scratch_dir.h"
#include "checkpoint/sharded_checkpoint.h"
#include "common/version.h"

namespace fs = std::filesystem;

namespace ember::engine {
namespace {

std::string size_text(size_t bytes) {
  if (bytes < 1000000) return c10::str(bytes / 1000.0, " kB");
  if (bytes < 1000000000) return c10::str(bytes / 1e6, " MB");
  return c10::str(bytes / 1e9, " GB");
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The module's parameters and buffers by name: what the checkpoint's state_dict must hold.
std::map<std::string, at::Tensor> module_tensors(torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) out.emplace(p.key(), p.value());
  for (const auto& b : module.named_buffers()) out.emplace(b.key(), b.value());
  return out;
}

// The checkpoint's `class_names` (empty in one written before they were kept, or of data that
// names no classes).
std::vector<std::string> class_names(const c10::impl::GenericDict& checkpoint, const std::string& ckpt) {
  std::vector<std::string> names;
  if (!checkpoint.contains("class_names")) return names;
  const c10::IValue& v = checkpoint.at("class_names");
  if (!v.isList()) throw UsageError(ckpt + ": class_names is not a list of strings (a damaged or foreign checkpoint)");
  for (const auto& e : v.toListRef()) {
    if (!e.isString()) throw UsageError(ckpt + ": class_names is not a list of strings (a damaged or foreign checkpoint)");
    names.push_back(e.toStringRef());
  }
  return names;
}

void complete_omitted(c10::Dict<std::string, at::Tensor>& state, const OmittedParameters& omitted, torch::nn::Module& module,
                      const std::string& where, const RunRequest& req, int depth);

// The values of what a checkpoint left out that its record says came from its run's
// init_checkpoint: read from that checkpoint (a sharded directory made one file first), itself
// completed where it left some out. A name it does not hold stays the model's own, as its run kept it.
std::map<std::string, at::Tensor> base_values(const OmittedParameters& omitted, torch::nn::Module& module, const std::string& where,
                                              const RunRequest& req, int depth) {
  std::map<std::string, at::Tensor> out;
  if (omitted.base.empty() || omitted.from_base.empty()) return out;
  if (const auto why = unreadable_base(where, omitted, depth); !why.empty()) throw UsageError(why);
  const std::string whose = from_base_text(where, omitted.from_base.size(), omitted.base);
  std::error_code ec;
  std::optional<ScratchDir> scratch;
  std::string file = omitted.base;
  if (!fs::is_regular_file(file, ec)) {
    if (!is_sharded_checkpoint(file)) throw UsageError(whose + ", which is neither a checkpoint file nor a sharded checkpoint folder");
    scratch.emplace("ember-export-base" + std::to_string(depth));
    file = (scratch->path() / "base.ckpt").string();
    if (consolidate_checkpoint(req, omitted.base, file, /*weights_only=*/true) != 0)
      throw UsageError(whose + ", a sharded folder that could not be made one file (see above)");
  }
  const auto ck = load_checkpoint_file(file);
  if (!ck.contains("state_dict") || !ck.at("state_dict").isGenericDict()) throw UsageError(whose + ", which holds no model weights");
  auto state = c10::impl::toTypedDict<std::string, at::Tensor>(ck.at("state_dict").toGenericDict());
  if (ck.contains("omitted_parameters"))
    complete_omitted(state, OmittedParameters::from_ivalue(ck.at("omitted_parameters"), omitted.base, omitted.base), module, omitted.base,
                     req, depth + 1);
  for (const auto& name : omitted.from_base)
    if (state.contains(name)) out.emplace(name, state.at(name));
  return out;
}

// `state` (a checkpoint's, which left `omitted` out) completed: from its base checkpoint what came
// from there, the rest from the model as built here; the fingerprint says whether they are the
// values it was trained with.
void complete_omitted(c10::Dict<std::string, at::Tensor>& state, const OmittedParameters& omitted, torch::nn::Module& module,
                      const std::string& where, const RunRequest& req, int depth) {
  const auto base = base_values(omitted, module, where, req, depth);
  const auto own = module.named_parameters();
  fill_omitted(state, omitted, [&](const std::string& name) -> std::optional<at::Tensor> {
    if (auto it = base.find(name); it != base.end()) return it->second;
    if (const auto* t = own.find(name)) return *t;
    return std::nullopt;
  }, where);
}

// `state` (a checkpoint's, which left `omitted` out) completed, in the module's order.
void fill_from_model(std::vector<std::pair<std::string, at::Tensor>>& state, const OmittedParameters& omitted, torch::nn::Module& module,
                     const std::string& ckpt, const RunRequest& req) {
  c10::Dict<std::string, at::Tensor> partial;
  for (const auto& [name, t] : state) partial.insert(name, t);
  complete_omitted(partial, omitted, module, ckpt, req, 0);
  const auto own = module.named_parameters();
  std::vector<std::pair<std::string, at::Tensor>> ordered;
  for (const auto& item : module.named_parameters())
    if (partial.contains(item.key())) ordered.emplace_back(item.key(), partial.at(item.key()));
  for (const auto& [name, t] : state)
    if (!own.contains(name)) ordered.emplace_back(name, t);  // buffers, in the checkpoint's order
  state = std::move(ordered);
}

// Exports `ckpt` (a single checkpoint file): the model's weights, or with `peft` only the adapters
// a transform added (IAdapterExport), in PEFT's folder format.
int export_file(const RunRequest& base, const std::string& ckpt, const std::string& out, bool peft) {
  const auto checkpoint = load_checkpoint_file(ckpt);  // checks every record's checksum
  if (!checkpoint.contains("state_dict") || !checkpoint.at("state_dict").isGenericDict())
    throw UsageError(ckpt + ": holds no model weights (state_dict): export a checkpoint that the checkpoint callback or ember::Fabric::save wrote with the model");
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& e : checkpoint.at("state_dict").toGenericDict()) {
    if (!e.value().isTensor()) throw UsageError(ckpt + ": state_dict entry '" + e.key().toStringRef() + "' is not a tensor");
    state.emplace_back(e.key().toStringRef(), e.value().toTensor());
  }
  std::optional<OmittedParameters> omitted;
  if (checkpoint.contains("omitted_parameters")) omitted = OmittedParameters::from_ivalue(checkpoint.at("omitted_parameters"), ckpt, ckpt);

  // The model, made from the configuration the checkpoint was trained with (--set may change it,
  // e.g. a model folder that moved). A checkpoint of a program's own loop has no model plugin.
  std::string model_name = "(module)";
  std::vector<std::pair<std::string, std::string>> files;
  std::string note = "torch: model.load_state_dict(safetensors.torch.load_file(path)) with the module's own names";
  EngineHost host;
  Named<IModel> model;
  const std::string config_text = checkpoint.contains("config") && checkpoint.at("config").isString()
                                      ? checkpoint.at("config").toStringRef() : std::string();
  if (!config_text.empty() && RawConfig::parse(config_text, ckpt).peek_string("model", "name")) {
    RunRequest req = base;
    req.config_path = ckpt + " (its config)";
    req.config_text = config_text;
    const Plan plan = make_plan(req);
    // A checkpoint that left the frozen weights out takes them from the model built here: built
    // from the training's seed, as its run built it.
    if (omitted) at::manual_seed(static_cast<uint64_t>(plan.config.section("trainer").get_int("seed")));
    make_plugin_object(model, *plan.model, host, plan.config.section("model"));
    model_name = model.name;
    // Plugins that changed the model for training (LoRA) change it again, so that the names match,
    // and fold what they added into the model's own weights below.
    std::vector<Named<ICallback>> transforms;
    // Only the callbacks that change the model matter here: one that cannot be made from the
    // checkpoint's configuration (a file it names moved, say) is left out; had it changed the
    // model, the name check below would say so.
    for (const auto* c : plan.callbacks) {
      Named<ICallback> n;
      try {
        make_plugin_object(n, *c, host, plan.config.section(c->name));
      } catch (const std::exception& e) {
        log::debug("export: callback '" + c->name + "' not made from the checkpoint's config (" + e.what() + ")");
        continue;
      }
      if (auto* t = static_cast<IModelTransform*>(n.object->query_interface(kModelTransformIid))) {
        t->transform_model(*model.object, model.name);
        transforms.push_back(std::move(n));
      }
    }
    if (peft) {
      // The adapters alone, under the names the exported model gives their layers.
      IAdapterExport* adapter = nullptr;
      for (auto& t : transforms)
        if (auto* a = static_cast<IAdapterExport*>(t.object->query_interface(kAdapterExportIid))) adapter = a;
      if (adapter == nullptr)
        throw UsageError(ckpt + ": --format peft exports the adapters of a plugin that adds them (lora), and this checkpoint's run had none");
      auto* named_export2 = static_cast<IExportableModel2*>(model.object->query_interface(kExportableModel2Iid));
      IExportableModel* named_export =
          named_export2 ? named_export2 : static_cast<IExportableModel*>(model.object->query_interface(kExportableModelIid));
      std::vector<NamedTensor> named;
      for (auto& [name, tensor] : state) named.push_back({name, tensor});
      auto adapters = adapter->export_adapters(named, [&](const std::string& n) { return named_export ? named_export->exported_name(n) : n; }, files);
      state.clear();
      for (auto& n : adapters) state.emplace_back(std::move(n.name), std::move(n.tensor));
      note = "peft: PeftModel.from_pretrained(base_model, folder), the base being the model the adapters were trained on";
    }
    if (omitted && !peft) fill_from_model(state, *omitted, model.object->module(), ckpt, base);
    // The checkpoint must be this module's: same names, same shapes (a changed config or model
    // folder would otherwise export names that do not fit the tensors).
    if (!peft) {
      const auto expected = module_tensors(model.object->module());
      std::map<std::string, bool> seen;
      for (const auto& [name, t] : state) {
        const auto it = expected.find(name);
        if (it == expected.end())
          throw UsageError(c10::str(ckpt, ": state_dict has '", name, "', which model '", model.name,
                                    "' built from the checkpoint's config does not have: the config or the model's files changed since it was saved"));
        if (it->second.sizes() != t.sizes())
          throw UsageError(c10::str(ckpt, ": state_dict '", name, "' has shape ", t.sizes(), ", model '", model.name,
                                    "' built from the checkpoint's config has ", it->second.sizes(), ": the config or the model's files changed"));
        seen[name] = true;
      }
      for (const auto& [name, t] : expected)
        if (!seen.count(name))
          throw UsageError(c10::str(ckpt, ": state_dict lacks '", name, "' of model '", model.name, "': not a checkpoint of this model"));
      for (auto& t : transforms) {
        std::vector<NamedTensor> named;
        for (auto& [name, tensor] : state) named.push_back({name, tensor});
        static_cast<IModelTransform*>(t.object->query_interface(kModelTransformIid))->fold_for_export(named);
        state.clear();
        for (auto& n : named) state.emplace_back(std::move(n.name), std::move(n.tensor));
      }
      auto* exportable2 = static_cast<IExportableModel2*>(model.object->query_interface(kExportableModel2Iid));
      auto* exportable = exportable2 ? exportable2 : static_cast<IExportableModel*>(model.object->query_interface(kExportableModelIid));
      if (exportable) {
        std::vector<std::pair<std::string, at::Tensor>> renamed;
        for (auto& [name, t] : state) {
          std::string to = exportable->exported_name(name);
          if (!to.empty()) renamed.emplace_back(std::move(to), t);
        }
        state = std::move(renamed);
        if (auto* extra = static_cast<IExportedExtraTensors*>(model.object->query_interface(kExportedExtraTensorsIid)))
          for (auto& t : extra->exported_extra_tensors()) {
            for (const auto& [name, _] : state)
              if (name == t.name)
                throw RunError("model '" + model.name + "' asks to export an extra tensor '" + t.name + "', which its weights hold already");
            state.emplace_back(t.name, t.tensor);
          }
        files = exportable2 ? exportable2->exported_files_with_classes(class_names(checkpoint, ckpt)) : exportable->exported_files();
        note = exportable->export_note();
      }
    }
  }

  if (omitted && model.object == nullptr)
    throw UsageError(ckpt + ": holds the trained parameters only (the frozen ones are left out) and names no model to take them from");
  if (peft && model.object == nullptr)
    throw UsageError(ckpt + ": --format peft exports the adapters of a plugin that adds them (lora), and this checkpoint names no model");
  const bool one_file = !peft && ends_with(out, ".safetensors");
  std::error_code ec;
  if (!one_file && fs::exists(out, ec) && !fs::is_directory(out, ec))
    throw UsageError(out + " exists and is not a folder: give a folder, or a file name ending in .safetensors");
  const fs::path weights = one_file ? fs::path(out) : fs::path(out) / (peft ? "adapter_model.safetensors" : "model.safetensors");
  if (!weights.parent_path().empty() && !fs::is_directory(weights.parent_path(), ec)) {
    if (one_file) throw UsageError(out + ": no folder " + weights.parent_path().string() + " to write it in");
    fs::create_directories(weights.parent_path(), ec);
    if (ec) throw UsageError(out + ": cannot create the folder: " + ec.message());
  }
  for (const auto& [name, _] : files)
    if (name.empty() || name.find('/') != std::string::npos || name == "model.safetensors")
      throw RunError("model '" + model_name + "' asks to export a file named '" + name + "': not a plain file name");

  size_t bytes = 0;
  for (const auto& [_, t] : state) bytes += static_cast<size_t>(t.numel()) * t.element_size();
  // "format": "pt" is what transformers and safetensors.torch look for.
  support::write_safetensors(weights.string(), state,
                             {{"format", "pt"}, {"ember_version", kEmberVersion}, {"ember_model", model_name},
                              {"ember_checkpoint", fs::path(ckpt).filename().string()}});
  if (!one_file)
    for (const auto& [name, text] : files) atomic_write(fs::path(out) / name, text.data(), text.size());
  std::string extra;
  if (!files.empty()) {
    if (one_file) {
      extra = c10::str("; ", files.size(), " file(s) the model exports beside the weights (", files.front().first,
                       "...) were not written: give a folder as OUT to get them");
    } else {
      extra = " with";
      for (const auto& [name, _] : files) extra += " " + name;
    }
  }
  log::info(c10::str("wrote ", weights.string(), " (", state.size(), " tensors, ", size_text(bytes), ") from ", ckpt, extra));
  log::info("load it with " + note);
  return 0;
}

}  // namespace

int export_weights(const RunRequest& base, const std::string& checkpoint, const std::string& format, const std::string& out) {
  if (format != "safetensors" && format != "peft")
    throw UsageError("--format " + format + ": not a format engine export writes (formats: safetensors, the model's weights; peft, the adapters "
                     "alone in PEFT's folder format)");
  const bool peft = format == "peft";
  if (peft && ends_with(out, ".safetensors"))
    throw UsageError("--format peft writes a folder (adapter_model.safetensors and adapter_config.json): give a folder as OUT, not " + out);
  if (out.empty()) throw UsageError("engine export needs the output: a folder, or a file name ending in .safetensors");
  std::error_code ec;
  if (fs::is_regular_file(checkpoint, ec)) return export_file(base, checkpoint, out, peft);
  if (!is_sharded_checkpoint(checkpoint)) throw UsageError(checkpoint + ": no such checkpoint file or sharded checkpoint folder");
  // A sharded checkpoint: one file of its weights first, in a scratch folder, as `engine checkpoint
  // consolidate --weights-only` makes it (the optimizer state, twice the weights under Adam, is
  // neither read nor written).
  const ScratchDir scratch("ember-export");
  const std::string whole = (scratch.path() / "consolidated.ckpt").string();
  if (const int code = consolidate_checkpoint(base, checkpoint, whole, /*weights_only=*/true); code != 0) return code;
  return export_file(base, whole, out, peft);
}

}  // namespace ember::engine
