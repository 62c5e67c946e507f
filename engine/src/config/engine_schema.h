// The engine's own config sections: [trainer], [optimizer], and the keys every [model] and
// [data] table has before the plugin's own keys.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "config/run_config.h"

namespace torch::optim { class Optimizer; }

namespace ember::engine {

SectionSchema trainer_schema();
SectionSchema optimizer_schema();
SectionSchema parallelism_schema();
// [metrics]: what the engine computes from the model's predictions (loop/configured_metrics.h).
SectionSchema metrics_schema();
std::vector<KeySchema> model_base_keys();
std::vector<KeySchema> data_base_keys();

// Lightning's precision strings ("16-mixed", "bf16", ...) to precision plugin names. Returns the
// input unchanged when it is already a plugin name.
std::string precision_plugin_for(const std::string& precision);

// One parameter group the engine builds: its tensors (empty where a rank trains none of them),
// its learning rate as a fraction of [optimizer] lr, and whether it takes the weight decay.
struct ParamGroupPlan {
  std::vector<at::Tensor> params;
  double lr_scale = 1.0;
  bool weight_decay = true;
};

// Builds the optimizer of the [optimizer] section with these groups, in this order (every group
// kept, even empty, so that every rank's optimizer has the same groups). Throws UsageError when a
// key is set that the chosen optimizer does not use.
std::shared_ptr<torch::optim::Optimizer> make_optimizer(const Section& section, const std::vector<ParamGroupPlan>& groups);

// Builds the optimizer of the [optimizer] section over `params` in one parameter group, or, with
// `no_decay`, in two: `params` with the section's options, then `*no_decay` with weight_decay = 0
// (either may be empty where a rank trains part of the model). Throws UsageError when a key is
// set that the chosen optimizer does not use.
std::shared_ptr<torch::optim::Optimizer> make_optimizer(const Section& section, const std::vector<at::Tensor>& params,
                                                        const std::vector<at::Tensor>* no_decay = nullptr);

}  // namespace ember::engine
