// ember::IPrecision: numeric precision of a run (Lightning's Precision plugin). Owns the dtype of
// parameters and inputs, the autocast region around forward and loss, loss scaling around
// backward, and whether the optimizer step runs (skipped on non-finite gradients).
#pragma once
#include <c10/core/Device.h>

#include "ember/trainer.h"
#include "ember/types.h"

namespace torch::nn { class Module; }
namespace torch::optim { class Optimizer; }

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

// Extension interface (IPrecision::query_interface(kGradientUnscalerIid)) of a precision handler
// that scales the loss: Lightning's Precision.unscale_gradients, for a program that clips or reads
// gradients between backward and the optimizer step (ember::Fabric::clip_gradients). The next
// optimizer_step does not unscale again; it still checks the gradients for inf/NaN then (another
// rank or the strategy may have marked them since). Handlers that do not scale need not have it.
inline constexpr const char* kGradientUnscalerIid = "ember.IGradientUnscaler/1";
class EMBER_SDK_API IGradientUnscaler {
 public:
  virtual ~IGradientUnscaler() = default;
  // Divides the gradients of `optimizer` by the loss scale, in place; once per optimizer step
  // (a second call before the step does nothing).
  virtual void unscale_gradients(torch::optim::Optimizer& optimizer) = 0;
};

// Extension interface (IPrecision::query_interface(kParameterDtypeIid); SDK 2.10): the dtype
// setup() gives the module's floating-point parameters (float32 for the mixed modes, the mode's
// own for the "true" ones). Deferred initialisation (ember/deferred_init.h) converts each part a
// rank keeps to it as the model is built, so setup() finds nothing left to convert; a handler
// without it makes the model be built whole.
inline constexpr const char* kParameterDtypeIid = "ember.IParameterDtype/1";
class EMBER_SDK_API IParameterDtype {
 public:
  virtual ~IParameterDtype() = default;
  virtual c10::ScalarType parameter_dtype() const = 0;
};

}  // namespace ember
