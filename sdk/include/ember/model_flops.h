// The FLOPs of a training step, as a model reports them, for FLOP/s and model FLOPs utilisation
// (MFU) in the throughput callback. An optional extension interface that the
// engine never requires (IModel::query_interface(kModelFlopsIid) returns nullptr when a model
// does not implement it).
//
// Count a multiply-add as 2 FLOPs and include the backward pass: for a linear layer of a
// batch of n rows, forward 2*n*in*out, backward 2*n*in*out for the weight's gradient plus the
// same again for the input's gradient unless the input needs none (the model's first layer).
// Elementwise work (activations, norms, the loss, the optimizer) is left out, as in PyTorch's
// FLOP counter and in Lightning's measure_flops.
#pragma once
#include "ember/export.h"
#include "ember/types.h"

namespace ember {

inline constexpr const char* kModelFlopsIid = "ember.IModelFlops/1";

class EMBER_SDK_API IModelFlops {
 public:
  virtual ~IModelFlops() = default;
  // Forward + backward FLOPs of one training step on `batch` (the batch as the model gets it).
  virtual double training_flops(const Batch& batch) const = 0;
};

}  // namespace ember
