// Extension interface for `engine export CKPT --format safetensors OUT`: a model whose weights
// another library loads under other names (e.g. Hugging Face transformers) says which names, and
// which files that library needs beside the weights. Optional, found through
// IPluginObject::query_interface; without it the export keeps the module's own state_dict names
// (what torch.nn.Module.load_state_dict takes) and writes no other file.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "ember/export.h"
#include "ember/types.h"

namespace ember {

// IModel::query_interface(kExportableModelIid). The engine calls it on a model made from the
// checkpoint's own configuration, before any training: it may read its configuration and its
// asset files, not the weights (the engine takes those from the checkpoint).
inline constexpr const char* kExportableModelIid = "ember.IExportableModel/1";
class EMBER_SDK_API IExportableModel {
 public:
  virtual ~IExportableModel() = default;
  // The name the other library loads the module's state_dict entry `name` under ("" leaves the
  // entry out of the export, e.g. a buffer the other library recomputes).
  virtual std::string exported_name(const std::string& name) const = 0;
  // Files the other library needs beside the weights, as (file name, contents) pairs: written
  // into the output folder (e.g. config.json, the tokenizer's files). Names are plain file names.
  virtual std::vector<std::pair<std::string, std::string>> exported_files() const = 0;
  // One line for the log saying what loads the export and how, e.g. "transformers:
  // AutoModelForSequenceClassification.from_pretrained(folder) gives the same logits".
  virtual std::string export_note() const = 0;
};

// IModel::query_interface(kExportableModel2Iid): IExportableModel whose files may say what the
// classes are called. The engine asks for it first and falls back to IExportableModel/1.
inline constexpr const char* kExportableModel2Iid = "ember.IExportableModel/2";
class EMBER_SDK_API IExportableModel2 : public IExportableModel {
 public:
  // exported_files() given the training data's class names in class-index order (the data
  // module's IPredictionNames::class_names(), which checkpoints keep as `class_names`); empty
  // when the data named none or the checkpoint predates them.
  virtual std::vector<std::pair<std::string, std::string>> exported_files_with_classes(
      const std::vector<std::string>& class_names) const = 0;
};

// IModel::query_interface(kExportedExtraTensorsIid) (SDK 2.24): tensors the other library's layout
// has and this model does not, written into the export after the model's own, under the names
// given: zero biases for a GPT-2 built without them (nanoGPT's bias = False), which
// GPT2LMHeadModel always has; zeros give the same logits. A name the export already holds is
// refused by the engine in one line.
inline constexpr const char* kExportedExtraTensorsIid = "ember.IExportedExtraTensors/1";
class EMBER_SDK_API IExportedExtraTensors {
 public:
  virtual ~IExportedExtraTensors() = default;
  virtual std::vector<NamedTensor> exported_extra_tensors() const = 0;
};

}  // namespace ember
