// Helpers shared by precision handlers: casting a batch and checking, once at start-up, that the
// device can run the dtype a mode asks for (so a run stops before training with one line, rather
// than failing mid-epoch or silently running in another precision).
#pragma once
#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <string>
#include <string_view>
#include <utility>

#include <torch/nn/module.h>

#include "ember/support/autocast.h"
#include "ember/error.h"
#include "ember/precision.h"
#include "ember/types.h"

namespace ember {

// Casts every floating-point tensor of the batch to `dtype` (integer labels stay as they are).
inline Batch cast_floating(Batch batch, c10::ScalarType dtype) {
  for (auto& t : batch.tensors)
    if (t.defined() && t.is_floating_point() && t.scalar_type() != dtype) t = t.to(dtype);
  return batch;
}

// Runs a small linear layer forward and backward on `device` in `dtype` (under autocast when
// `autocast` is set) and throws RunError naming `mode` when that fails or autocast does not
// actually produce `dtype`. No random numbers are drawn, so the run's RNG stream is untouched.
inline void check_precision_supported(const std::string& mode, const c10::Device& device, c10::ScalarType dtype,
                                      bool autocast, const std::string& alternative) {
  const std::string what = c10::str(mode, ": ", autocast ? "autocast to " : "", c10::toString(dtype), " on ", device.str());
  if (autocast && !at::autocast::is_autocast_available(device.type()))
    throw RunError(c10::str(what, " is not available (LibTorch has no autocast for this device type); ", alternative));
  try {
    auto opts = at::TensorOptions().device(device);
    at::Tensor x = at::linspace(-1.0, 1.0, 32, opts.dtype(autocast ? at::kFloat : dtype)).reshape({4, 8});
    at::Tensor w = at::linspace(-0.5, 0.5, 64, opts.dtype(autocast ? at::kFloat : dtype)).reshape({8, 8}).requires_grad_();
    at::Tensor y;
    if (autocast) {
      AutocastRegion region(device.type(), dtype);
      y = at::linear(x, w);
    } else {
      y = at::linear(x, w);
    }
    if (y.scalar_type() != dtype)
      throw RunError(c10::str(what, ": a linear layer ran in ", c10::toString(y.scalar_type()), " instead; ", alternative));
    y.to(at::kFloat).sum().backward();
    if (!w.grad().defined() || w.grad().scalar_type() != w.scalar_type())
      throw RunError(c10::str(what, ": backward did not produce ", c10::toString(w.scalar_type()), " gradients; ", alternative));
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    throw RunError(c10::str(what, " is not supported here (", msg, "); ", alternative));
  }
}

// A handler whose parameters, inputs and math all share one dtype (fp64, "16-true", "bf16-true"):
// no autocast, no loss scaling, every step taken. The module is converted once and every batch is
// cast; the process's default dtype is left alone. (Lightning's DoublePrecision/HalfPrecision set
// it around each forward, but it is one global: data-loader threads and anything else running at
// that moment would create tensors in the wrong dtype.) A model that creates tensors in its step
// takes the dtype from its input or its parameters (`x.options()`), as the bundled models do.
class UniformPrecision : public IPrecision, public IParameterDtype {
 public:
  UniformPrecision(std::string mode, c10::ScalarType dtype, std::string alternative)
      : mode_(std::move(mode)), dtype_(dtype), alternative_(std::move(alternative)) {}
  void setup(torch::nn::Module& module, const c10::Device& device) override {
    check_precision_supported(mode_, device, dtype_, /*autocast=*/false, alternative_);
    module.to(dtype_);
  }
  Batch convert_input(Batch batch) override { return cast_floating(std::move(batch), dtype_); }
  c10::ScalarType parameter_dtype() const override { return dtype_; }
  void* query_interface(const char* iid) override {
    return std::string_view(iid) == kParameterDtypeIid ? static_cast<IParameterDtype*>(this) : nullptr;
  }
  void forward_begin() override {}
  void forward_end() override {}
  void backward(const at::Tensor& loss) override { loss.backward(); }
  bool optimizer_step(IOptimizerStep& step) override {
    step.closure();
    step.before_step();
    step.step();
    return true;
  }

 private:
  std::string mode_;
  c10::ScalarType dtype_;
  std::string alternative_;
};

}  // namespace ember
