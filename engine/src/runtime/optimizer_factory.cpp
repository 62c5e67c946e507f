#include "runtime/optimizer_factory.h"

#include <ember/error.h>
#include <ember/support/name_patterns.h>

#include <c10/util/StringUtil.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <set>
#include <unordered_map>

#include "config/engine_schema.h"

namespace ember::engine {

namespace {

std::string decayed_weight(const Section& s) {
  if (s.has("weight_decay")) return c10::str(s.get_float("weight_decay"));
  return s.get_string("name") == "adamw" ? "0.01 (adamw's default)" : "0";
}

}  // namespace

OptimizerFactory::OptimizerFactory(IModel& model, std::string model_name, const Section& optimizer_section)
    : model_(model), model_name_(std::move(model_name)), section_(optimizer_section) {
  // First: a backbone frozen for the whole run leaves the optimizer, and no_weight_decay then
  // names only what trains.
  resolve_backbone();
  resolve_weight_decay();
}

namespace {

std::string first_names(const std::vector<std::string>& names) {
  std::string e;
  for (size_t i = 0; i < names.size() && i < 4; ++i) e += (i ? "', '" : "'") + names[i];
  return e.empty() ? std::string("none") : e + "'" + (names.size() > 4 ? ", ..." : "");
}

}  // namespace

void OptimizerFactory::resolve_backbone() {
  const std::vector<std::string> entries = section_.get_string_list("backbone");
  // By value, not by where a key was set: a run folder's config.toml lists every default.
  constexpr double kDefaultScale = 0.1;
  const bool scale_set = section_.get_float("backbone_lr_scale") != kDefaultScale;
  unfreeze_at_ = section_.get_int("backbone_unfreeze_at_epoch");
  if (entries.empty()) {
    for (const auto& [key, set] : {std::pair<const char*, bool>{"backbone_lr_scale", scale_set}, {"backbone_unfreeze_at_epoch", unfreeze_at_ != 0},
                                   {"backbone_train_bn", !section_.get_bool("backbone_train_bn")}})
      if (set)
        throw UsageError(section_.where(key) + ": optimizer." + key +
                         " is set but optimizer.backbone names no parameters: list the backbone's modules, e.g. backbone = "
                         "[\"encoder\"], or remove optimizer." + key);
    unfreeze_at_ = 0;
    return;
  }
  const std::string where = section_.where("backbone") + ": optimizer.backbone";
  const NamePatterns patterns(entries, NameRule::module);
  std::vector<bool> matched(entries.size(), false);
  std::vector<std::string> trained, backbone;
  int64_t elements = 0;
  for (const auto& p : model_.module().named_parameters()) {
    if (!p.value().requires_grad()) continue;  // frozen by the model or a plugin (lora): not trained anyway
    trained.push_back(p.key());
    bool in = false;
    for (size_t i = 0; i < entries.size(); ++i)
      if (patterns.matches(p.key(), i)) in = matched[i] = true;
    if (!in) continue;
    backbone.push_back(p.key());
    elements += p.value().numel();
  }
  for (size_t i = 0; i < entries.size(); ++i)
    if (!matched[i])
      throw UsageError(where + " entry \"" + entries[i] + "\" names no module or parameter among model '" + model_name_ + "''s " +
                       std::to_string(trained.size()) + " trained parameters (" + first_names(trained) +
                       "): give a module's name (\"encoder\" takes encoder.*), or a regular expression matching whole names");
  if (backbone.size() == trained.size())
    throw UsageError(where + " takes every one of model '" + model_name_ + "''s " + std::to_string(trained.size()) +
                     " trained parameters, leaving no head to train: name only the pretrained part" +
                     (unfreeze_at_ == -1 ? std::string() : ", or scale optimizer.lr instead"));
  if (unfreeze_at_ == -1 && scale_set)
    throw UsageError(section_.where("backbone_lr_scale") +
                     ": optimizer.backbone_lr_scale is set but the backbone is frozen for the whole run (backbone_unfreeze_at_epoch = "
                     "-1), so it has no learning rate: remove one of them");
  backbone_.insert(backbone.begin(), backbone.end());
  scale_ = section_.get_float("backbone_lr_scale");
  const std::string what = "optimizer: backbone of " + std::to_string(backbone.size()) + " parameters (" + std::to_string(elements) +
                           " elements, e.g. '" + backbone.front() + "')";
  if (unfreeze_at_ == -1) {
    // Linear probing: not trained, so no strategy holds, reduces or shards it.
    for (auto& p : model_.module().named_parameters())
      if (backbone_.count(p.key())) p.value().set_requires_grad(false);
    backbone_summary_ = what + " frozen for the whole run; the other " + std::to_string(trained.size() - backbone.size()) + " train";
    return;
  }
  backbone_summary_ = what + " trains at lr x " + c10::str(scale_) +
                      (unfreeze_at_ > 0 ? ", frozen until epoch " + std::to_string(unfreeze_at_) : std::string()) + "; the other " +
                      std::to_string(trained.size() - backbone.size()) + " at lr";
}

void OptimizerFactory::resolve_weight_decay() {
  const std::vector<std::string> entries = section_.get_string_list("no_weight_decay");
  const bool by_dimensions = section_.get_bool("no_weight_decay_1d");
  if (entries.empty() && !by_dimensions) return;
  const std::string key = entries.empty() ? "no_weight_decay_1d" : "no_weight_decay";
  where_ = section_.where(key);
  const std::string where = where_ + ": optimizer." + key;
  const bool default_decay = section_.get_string("name") == "adamw";
  if (section_.has("weight_decay") ? section_.get_float("weight_decay") == 0.0 : !default_decay)
    throw UsageError(where + " sets which parameters take no weight decay, but optimizer.weight_decay is " + decayed_weight(section_) +
                     ": set optimizer.weight_decay for the others (e.g. 0.1), or remove optimizer." + key);
  const NamePatterns patterns(entries);
  std::vector<bool> matched(entries.size(), false);
  std::vector<std::string> names;
  int64_t decayed_elements = 0, undecayed_elements = 0, frozen_1d = 0;
  for (const auto& p : model_.module().named_parameters()) {
    if (!p.value().requires_grad()) {  // frozen (lora): not trained, not in the optimizer
      frozen_1d += p.value().dim() < 2 ? 1 : 0;
      continue;
    }
    names.push_back(p.key());
    bool out = by_dimensions && p.value().dim() < 2;
    for (size_t i = 0; i < entries.size(); ++i)
      if (patterns.matches(p.key(), i)) out = matched[i] = true;
    if (out) no_decay_.insert(p.key());
    (out ? undecayed_elements : decayed_elements) += p.value().numel();
  }
  auto examples = [&] { return first_names(names); };
  for (size_t i = 0; i < entries.size(); ++i)
    if (!matched[i])
      throw UsageError(section_.where("no_weight_decay") + ": optimizer.no_weight_decay entry \"" + entries[i] + "\" matches none of model '" +
                       model_name_ + "''s " + std::to_string(names.size()) + " trained parameters (" + examples() +
                       "): give the end of a name after a '.', or a regular expression matching whole names");
  if (no_decay_.empty() && entries.empty() && frozen_1d > 0) {
    // The model has such parameters, but a plugin froze them (lora: only the adapter matrices
    // train): the key holds for the model and is simply moot for this run.
    summary_ = "optimizer: weight decay " + decayed_weight(section_) + " on all " + std::to_string(names.size()) +
               " trained parameters (no_weight_decay_1d: the model's " + std::to_string(frozen_1d) +
               " parameters with fewer than 2 dimensions are frozen here)";
    return;
  }
  if (no_decay_.empty())
    throw UsageError(where + ": model '" + model_name_ + "' trains no parameter with fewer than 2 dimensions (" + examples() +
                     "), so every one keeps its weight decay: remove optimizer.no_weight_decay_1d");
  if (no_decay_.size() == names.size())
    throw UsageError(where + " leaves every one of model '" + model_name_ + "''s " + std::to_string(names.size()) +
                     " trained parameters without weight decay: set optimizer.weight_decay = 0 instead");
  split_ = true;
  summary_ = "optimizer: weight decay " + decayed_weight(section_) + " on " + std::to_string(names.size() - no_decay_.size()) +
             " parameters (" + std::to_string(decayed_elements) + " elements), none on " + std::to_string(no_decay_.size()) + " (" +
             std::to_string(undecayed_elements) + " elements, e.g. '" + *no_decay_.begin() + "')";
}

std::shared_ptr<torch::optim::Optimizer> OptimizerFactory::build(const std::vector<NamedTensor>& params) {
  std::unordered_map<std::string, at::Tensor> by_name;
  for (const auto& p : params)
    if (!by_name.emplace(p.name, p.tensor).second)
      throw RunError("the strategy named parameter '" + p.name + "' twice when building the optimizer (a strategy bug)");
  auto optimizer = model_.configure_optimizers();
  if (!optimizer) {
    // The head (or the whole model) first, then the backbone; each split by weight decay when
    // some parameters take none. Every rank builds every group, empty or not.
    const bool backbone_groups = !backbone_.empty() && unfreeze_at_ != -1;
    std::vector<ParamGroupPlan> plan;
    for (const bool backbone : {false, true}) {
      if (backbone && !backbone_groups) continue;
      const double scale = backbone ? scale_ : 1.0;
      plan.push_back({{}, scale, true});
      if (split_) plan.push_back({{}, scale, false});
    }
    const size_t per_part = split_ ? 2 : 1;
    for (const auto& p : params) {
      const size_t g = (backbone_groups && backbone_.count(p.name) ? per_part : 0) + (no_decay_.count(p.name) ? 1 : 0);
      plan[g].params.push_back(p.tensor);
    }
    return make_optimizer(section_, plan);
  }
  if (!backbone_.empty())
    throw UsageError(section_.where("backbone") + ": optimizer.backbone: model '" + model_name_ +
                     "' builds its own optimizer (configure_optimizers), whose parameter groups set the learning rates: remove "
                     "optimizer.backbone and its keys");
  if (split_)
    throw UsageError(where_ + ": model '" + model_name_ +
                     "' builds its own optimizer (configure_optimizers), whose parameter groups set the weight decay: remove "
                     "optimizer.no_weight_decay and no_weight_decay_1d");
  if (!optimizer->state().empty())
    throw RunError("model '" + model_name_ + "': configure_optimizers returned an optimizer that already has state; build it fresh");
  // The model's optimizer was built over its module's parameters: find each one's name.
  std::unordered_map<const void*, std::string> name_of;
  for (const auto& p : model_.module().named_parameters()) name_of.emplace(p.value().unsafeGetTensorImpl(), p.key());
  std::set<std::string> used;
  for (auto& group : optimizer->param_groups())
    for (auto& tensor : group.params()) {
      auto n = name_of.find(tensor.unsafeGetTensorImpl());
      if (n == name_of.end())
        throw RunError("model '" + model_name_ + "': configure_optimizers returned an optimizer over a tensor that is not a "
                       "parameter of module() (build it over module()->parameters() or named_parameters())");
      auto t = by_name.find(n->second);
      if (t == by_name.end())
        throw RunError("model '" + model_name_ + "': the strategy does not train parameter '" + n->second +
                       "' that configure_optimizers uses");
      if (!used.insert(n->second).second)
        throw RunError("model '" + model_name_ + "': configure_optimizers puts parameter '" + n->second + "' in two groups");
      tensor = t->second;
    }
  return optimizer;
}

}  // namespace ember::engine
