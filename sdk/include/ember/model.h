// ember::IModel: the research code (Lightning's LightningModule). Implemented by model plugins.
#pragma once
#include <c10/core/Device.h>

#include <memory>
#include <vector>

#include "ember/trainer.h"
#include "ember/types.h"

namespace torch::nn { class Module; }
namespace torch::optim { class Optimizer; }

namespace ember {

class EMBER_SDK_API IModel : public IPluginObject {
 public:
  // The network. The engine moves it (through the strategy and precision), trains it, saves its
  // parameters and buffers. Must stay the same object for the model's lifetime.
  virtual torch::nn::Module& module() = 0;

  // Requires: batch on the training device. Ensures: returns the scalar loss to minimise.
  virtual at::Tensor training_step(const Batch& batch, IStepContext& ctx) = 0;
  // Evaluation steps log what they measure through ctx (run under no-grad, module in eval mode).
  virtual void validation_step(const Batch& batch, IStepContext& ctx) = 0;
  virtual void test_step(const Batch& batch, IStepContext& ctx) = 0;

  // Optional: build the optimizer yourself (Lightning's configure_optimizers). Return nullptr to
  // let the engine build the one described by the [optimizer] table.
  virtual std::shared_ptr<torch::optim::Optimizer> configure_optimizers() { return nullptr; }

  // Optional: the model sees every hook after the callbacks (Lightning's order).
  virtual void on_hook(Hook /*hook*/, ITrainer& /*trainer*/) {}
};

}  // namespace ember
