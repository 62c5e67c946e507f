// Adapting a model before it is set up (SDK 2.4): a model that lists its linear layers
// (ILinearLayers) lets a plugin add a trainable branch to any of them (ILinearAdapter: LoRA), and
// a callback plugin that changes the model (IModelTransform) is called by the engine before the
// precision handler converts the model, the strategy places or shards it and the optimizer is
// built, so what it adds is converted, sharded, trained and checkpointed like the rest. Both are
// optional and found through IPluginObject::query_interface.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ember/export.h"
#include "ember/types.h"

namespace torch::nn { class Module; }

namespace ember {

class IModel;

// A branch added to a linear layer's output: y = layer(x) + adapter.forward(x).
class EMBER_SDK_API ILinearAdapter {
 public:
  virtual ~ILinearAdapter() = default;
  // x [.., in_features] -> [.., out_features]: what is added to the layer's output.
  virtual at::Tensor forward(const at::Tensor& x) = 0;
};

struct LinearLayer {
  uint32_t struct_size = sizeof(LinearLayer);
  std::string name;                    // the module's path in module(), e.g. "transformer.h.0.attn.c_attn"
  int64_t in_features = 0, out_features = 0;
  torch::nn::Module* module = nullptr; // the layer's module: an adapter registers its parameters here
  bool weight_in_out = false;          // its "weight" is stored [in, out] (GPT-2's Conv1D), else [out, in]
};

// IModel::query_interface(kLinearLayersIid).
inline constexpr const char* kLinearLayersIid = "ember.ILinearLayers/1";
class EMBER_SDK_API ILinearLayers {
 public:
  virtual ~ILinearLayers() = default;
  virtual std::vector<LinearLayer> linear_layers() = 0;
  // Ensures: every forward of layer `name` adds adapter->forward(x) to its output (nullptr
  // removes it). Throws ember::RunError for a name linear_layers() does not list.
  virtual void set_linear_adapter(const std::string& name, std::shared_ptr<ILinearAdapter> adapter) = 0;
};

// ICallback::query_interface(kModelTransformIid): a callback plugin that changes the model.
inline constexpr const char* kModelTransformIid = "ember.IModelTransform/1";
class EMBER_SDK_API IModelTransform {
 public:
  virtual ~IModelTransform() = default;
  // Called once, after the model is made and before it is set up (for training, evaluation,
  // generation and `engine export`). Throws ember::ConfigError when the model cannot be
  // transformed as configured.
  virtual void transform_model(IModel& model, const std::string& model_name) = 0;
  // `engine export`: `state` holds the transformed model's tensors by name; on return it holds
  // the plain model's (what transform_model added folded into the model's own weights), so that
  // the export loads where the plain model does.
  virtual void fold_for_export(std::vector<NamedTensor>& state) = 0;
};

// ICallback::query_interface(kFrozenParametersIid) (SDK 2.10): a transform that froze the model's
// own parameters (LoRA) says whether checkpoint files keep them. When not, a file holds what is
// trained and every buffer, plus the names, dtypes and one fingerprint of the frozen parameters it
// leaves out; loading it (resume, test, generate, export) takes those from the model as that run
// builds it (its model_dir weights, or its seeded initialisation) and refuses, in one line, a
// model whose frozen values differ from the ones it was trained on.
inline constexpr const char* kFrozenParametersIid = "ember.IFrozenParameters/1";
class EMBER_SDK_API IFrozenParameters {
 public:
  virtual ~IFrozenParameters() = default;
  virtual bool checkpoints_keep_frozen() const = 0;
};

// ICallback::query_interface(kAdapterExportIid) (SDK 2.10): a transform whose additions can be
// exported on their own, for `engine export CKPT --format peft OUT` (PEFT's adapter folder).
inline constexpr const char* kAdapterExportIid = "ember.IAdapterExport/1";
class EMBER_SDK_API IAdapterExport {
 public:
  virtual ~IAdapterExport() = default;
  // `state` holds the transformed model's tensors by name (what the checkpoint holds);
  // `exported_name` maps a model tensor's name to the one the exported model uses ("" when it is
  // not exported). Returns the adapter's tensors under the names its format wants, and adds the
  // files written beside them to `files` (name, content). Throws ember::RunError when the
  // checkpoint is not one of this transform's.
  virtual std::vector<NamedTensor> export_adapters(const std::vector<NamedTensor>& state,
                                                   const std::function<std::string(const std::string&)>& exported_name,
                                                   std::vector<std::pair<std::string, std::string>>& files) = 0;
};

}  // namespace ember
