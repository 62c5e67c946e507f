// ember::IPrecision: numeric precision of a run (Lightning's Precision plugin). Owns the dtype of
// parameters and inputs, the autocast region around forward and loss, loss scaling around
// backward, and whether the optimizer step runs (skipped on non-finite gradients).
#pragma once
#include <c10/core/Device.h>

#include "ember/trainer.h"
#include "ember/types.h"

namespace torch::nn { class Module; }

namespace ember {

class EMBER_SDK_API IPrecision : public IPluginObject {
 public:
  // Called once at start-up, after the strategy placed the module on `device`. Converts
  // parameter dtypes if the mode says so. Throws ember::RunError when the device cannot do what
  // was asked (said once, before training; never a silent fallback).
  virtual void setup(torch::nn::Module& module, const c10::Device& device) = 0;
  // Casts the floating-point tensors of an input batch if the mode needs it (fp64, true half).
  virtual Batch convert_input(Batch batch) = 0;
  // Open and close the autocast region around forward + loss. Always called in pairs.
  virtual void forward_begin() = 0;
  virtual void forward_end() = 0;
  // Backward of the loss (scaled if the mode scales).
  virtual void backward(const at::Tensor& loss) = 0;
  // Runs step.closure(), unscales, step.before_step() (hooks + clipping), then step.step() when
  // the gradients allow it. Returns false when the step was skipped (inf/NaN gradients).
  virtual bool optimizer_step(IOptimizerStep& step) = 0;
};

}  // namespace ember
