#include "runtime/optimizer_factory.h"

#include <ember/error.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <set>
#include <unordered_map>

#include "config/engine_schema.h"

namespace ember::engine {

std::shared_ptr<torch::optim::Optimizer> OptimizerFactory::build(const std::vector<NamedTensor>& params) {
  std::unordered_map<std::string, at::Tensor> by_name;
  for (const auto& p : params)
    if (!by_name.emplace(p.name, p.tensor).second)
      throw RunError("the strategy named parameter '" + p.name + "' twice when building the optimizer (a strategy bug)");
  auto optimizer = model_.configure_optimizers();
  if (!optimizer) {
    std::vector<at::Tensor> tensors;
    tensors.reserve(params.size());
    for (const auto& p : params) tensors.push_back(p.tensor);
    return make_optimizer(section_, tensors);
  }
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
