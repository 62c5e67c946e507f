// Extension interfaces for `engine predict` (Lightning's trainer.predict): what a model outputs
// for each sample, and what a data module calls its samples and classes. Both are optional and
// found through IPluginObject::query_interface; a model without IPredictingModel cannot predict
// (the engine says so), a data module without IPredictionNames gets sample indices as ids and
// class indices as labels.
#pragma once
#include <string>
#include <vector>

#include "ember/types.h"

namespace ember {

// IModel::query_interface(kPredictingModelIid). predict_step runs under no-grad with the module
// in eval mode, inside the same precision/strategy forward region as validation_step, on a batch
// of the predict split (its targets, if any, may be present and must be ignored). It returns one
// row per sample, [N, K]: a classifier returns class probabilities (rows sum to 1), which the
// engine writes as prob_<class> columns and whose argmax is the predicted label; any other model
// returns its K outputs per sample, written as out_<k> columns.
inline constexpr const char* kPredictingModelIid = "ember.IPredictingModel/1";
class EMBER_SDK_API IPredictingModel {
 public:
  virtual ~IPredictingModel() = default;
  virtual at::Tensor predict_step(const Batch& batch) = 0;
  // True when predict_step's rows are class probabilities.
  virtual bool predicts_classes() const = 0;
};

// IDataModule::query_interface(kPredictionNamesIid): the names predictions are written with.
inline constexpr const char* kPredictionNamesIid = "ember.IPredictionNames/1";
class EMBER_SDK_API IPredictionNames {
 public:
  virtual ~IPredictionNames() = default;
  // Class names in class-index order (empty: the indices are the names).
  virtual std::vector<std::string> class_names() const = 0;
  // The id of sample `index` of `split` (e.g. the input file's id column; "" = the index).
  virtual std::string sample_id(Split split, int64_t index) const = 0;
};

}  // namespace ember
