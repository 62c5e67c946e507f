// mlp: a multi-layer perceptron on flattened inputs, for classification (cross-entropy on class
// indices), regression (mean squared error on float targets) or multilabel classification (binary
// cross-entropy on 0/1 targets, one independent label per output).
//
//   flatten -> [linear -> activation -> dropout] per hidden width -> linear(num_classes)
//
// Batch: tensors[0] = inputs [N, ...] (flattened to [N, input_size]); tensors[1] = labels int64
// [N] for classification, float targets [N, num_classes] for regression, 0/1 targets [N, num_classes]
// (any dtype) for multilabel.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/StringUtil.h>
#include <torch/nn.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/error.h>
#include <ember/deferred_init.h>
#include <ember/host.h>
#include <ember/model.h>
#include <ember/model_flops.h>
#include <ember/model_units.h>
#include <ember/plugin.h>
#include <ember/predict.h>

#include <ember/model_support/classification.h>

namespace {

using ember_models::Phase;

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("input_size", "784", "Features per sample after flattening (784 for 28x28 images).").at_least(1),
    ember::key::IntList("hidden", "[256, 128]", "Widths of the hidden layers in order; [] makes a linear model.").at_least(1),
    ember::key::String("activation", "\"relu\"", "Nonlinearity after each hidden layer.").choices("relu|gelu|tanh"),
    ember::key::Float("dropout", "0.0", "Dropout probability after each hidden activation, in [0, 1); 0 adds no dropout.").at_least(0.0).below(1.0),
    ember::key::Int("num_classes", "10", "Output width: the number of classes, or of regression targets.").at_least(1),
    ember::key::String("task", "\"classification\"", "Cross-entropy on class labels, mean squared error on float targets (regression), or binary cross-entropy on 0/1 targets [N, num_classes] (multilabel: each output an independent label).").choices("classification|regression|multilabel"),
};

enum class Activation { relu, gelu, tanh };
enum class Task { classification, regression, multilabel };

struct MlpOptions {
  int64_t input_size = 0;
  std::vector<int64_t> hidden;
  Activation activation = Activation::relu;
  double dropout = 0.0;
  int64_t num_classes = 0;
  Task task = Task::classification;
};

// Cloneable: clone() gives a deep copy with the same parameter names (it copy-constructs the net,
// calls reset() to rebuild its layers, then copies the values in).
class MlpNet : public torch::nn::Cloneable<MlpNet> {
 public:
  // `host`: each layer handed to ember::parameters_initialised as soon as it is built (deferred
  // initialisation under a sharding strategy); none for a clone.
  explicit MlpNet(const MlpOptions& o, ember::IHost* host = nullptr) : o_(o), host_(host) {
    reset();
    host_ = nullptr;
  }

  // Fixed names (fc1, fc2, ..., head) keep named_parameters() and checkpoints stable; the order
  // of construction is also the order of the initial random draws.
  void reset() override {
    layers_.clear();  // a copy-constructed clone still holds the original's layers
    dropout_ = nullptr;
    int64_t width = o_.input_size;
    for (size_t i = 0; i < o_.hidden.size(); ++i) {
      layers_.push_back(register_module("fc" + std::to_string(i + 1), torch::nn::Linear(width, o_.hidden[i])));
      if (host_) ember::parameters_initialised(*host_, *layers_.back());
      width = o_.hidden[i];
    }
    head_ = register_module("head", torch::nn::Linear(width, o_.num_classes));
    if (host_) ember::parameters_initialised(*host_, *head_);
    // No module at all for dropout 0: the forward is then exactly deterministic, which the
    // gradient-accumulation tests rely on. One module serves every layer (it holds no state).
    if (o_.dropout > 0.0) dropout_ = register_module("dropout", torch::nn::Dropout(o_.dropout));
  }

  at::Tensor forward(at::Tensor x) {
    x = x.flatten(1);
    for (size_t i = 0; i < layers_.size(); ++i) {
      // By value (the net outlives every backward): under activation checkpointing the block runs
      // again during backward.
      auto block = [this, layer = layers_[i].ptr()](const at::Tensor& in) {
        at::Tensor y = activate(layer->forward(in));
        return dropout_ ? dropout_(y) : y;
      };
      x = units_ ? units_->run(static_cast<int64_t>(i), x, block) : block(x);
    }
    return head_(x);
  }

  const at::Tensor& head_weight() const { return head_->weight; }
  // Each hidden layer is a unit (ember/model_units.h): sharding strategies gather its
  // parameters just before it runs. The head is gathered with the rest of the step.
  void declare_units(ember::ModelUnits& units) {
    units_ = &units;
    for (size_t i = 0; i < layers_.size(); ++i) units.add("fc" + std::to_string(i + 1), layers_[i].ptr());
  }

 private:
  at::Tensor activate(const at::Tensor& x) const {
    switch (o_.activation) {
      case Activation::gelu: return torch::gelu(x);
      case Activation::tanh: return torch::tanh(x);
      case Activation::relu: break;
    }
    return torch::relu(x);
  }

  MlpOptions o_;
  ember::IHost* host_ = nullptr;  // while the constructor builds the layers
  ember::ModelUnits* units_ = nullptr;
  std::vector<torch::nn::Linear> layers_;
  torch::nn::Linear head_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
};

MlpOptions read_options(const ember::IConfig& cfg) {
  MlpOptions o;
  o.input_size = cfg.get_int("input_size");
  o.hidden = cfg.get_int_list("hidden");
  const std::string activation = cfg.get_string("activation");
  o.activation = activation == "gelu" ? Activation::gelu : activation == "tanh" ? Activation::tanh : Activation::relu;
  o.dropout = ember_models::read_dropout(cfg, "dropout");
  o.num_classes = cfg.get_int("num_classes");
  const std::string task = cfg.get_string("task");
  o.task = task == "regression" ? Task::regression : task == "multilabel" ? Task::multilabel : Task::classification;

  // Constraints between keys, which the schema cannot express.
  const std::string s = c10::str("[", cfg.section(), "] ");
  if (o.dropout > 0.0 && o.hidden.empty()) {
    throw ember::ConfigError(c10::str(s, "dropout = ", o.dropout, " (", cfg.where("dropout"),
                                      ") has nothing to act on with hidden = [] (", cfg.where("hidden"),
                                      "): add hidden layers or set dropout = 0"));
  }
  if (o.task == Task::classification && o.num_classes < 2) {
    throw ember::ConfigError(c10::str(s, "num_classes = ", o.num_classes, " (", cfg.where("num_classes"),
                                      ") is too few for task = \"classification\": use at least 2 classes, "
                                      "or task = \"regression\" for a single output"));
  }
  return o;
}

class Mlp final : public ember::IModel, public ember::IModelFlops, public ember::UnitModel,
                  public ember::IPredictingModel {
 public:
  Mlp(ember::IHost& host, const ember::IConfig& cfg)
      : opts_(read_options(cfg)), section_(cfg.section()), net_(std::make_shared<MlpNet>(opts_, &host)) {
    net_->declare_units(units_);
  }

  torch::nn::Module& module() override { return *net_; }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kModelFlopsIid) == 0) return static_cast<ember::IModelFlops*>(this);
    if (std::strcmp(iid, ember::kPredictingModelIid) == 0) return static_cast<ember::IPredictingModel*>(this);
    return unit_model_interface(iid);
  }
  // Classification: class probabilities; multilabel: each label's probability; regression: the outputs.
  at::Tensor predict_step(const ember::Batch& batch) override {
    at::Tensor out = outputs(batch);
    if (opts_.task == Task::classification) return out.to(at::kFloat).softmax(1);
    return opts_.task == Task::multilabel ? out.to(at::kFloat).sigmoid() : out;
  }
  bool predicts_classes() const override { return opts_.task == Task::classification; }
  // Per linear layer: forward and weight gradient 2*n*in*out each, the input gradient again
  // for every layer but the first (the data needs none).
  double training_flops(const ember::Batch& batch) const override {
    if (batch.tensors.empty() || batch[0].dim() < 1) return 0.0;
    const double n = static_cast<double>(batch[0].size(0));
    double flops = 0.0;
    int64_t in = opts_.input_size;
    std::vector<int64_t> widths = opts_.hidden;
    widths.push_back(opts_.num_classes);
    for (size_t i = 0; i < widths.size(); ++i) {
      const double mm = 2.0 * n * static_cast<double>(in) * static_cast<double>(widths[i]);
      flops += (i == 0 ? 2.0 : 3.0) * mm;
      in = widths[i];
    }
    return flops;
  }

  at::Tensor training_step(const ember::Batch& batch, ember::IStepContext& ctx) override {
    return step(batch, ctx, Phase::train);
  }
  void validation_step(const ember::Batch& batch, ember::IStepContext& ctx) override {
    step(batch, ctx, Phase::val);
  }
  void test_step(const ember::Batch& batch, ember::IStepContext& ctx) override {
    step(batch, ctx, Phase::test);
  }

 private:
  at::Tensor step(const ember::Batch& batch, ember::IStepContext& ctx, Phase phase) {
    ember_models::require_inputs_and_targets(batch, "mlp");
    at::Tensor out = outputs(batch);
    if (opts_.task == Task::classification) {
      return ember_models::classification_step(out, batch[1], phase, ctx, "mlp");
    }
    if (opts_.task == Task::multilabel)
      return ember_models::multilabel_step(out, batch[1], phase, ctx, "mlp",
                                           c10::str("set [", section_, "] num_classes to the number of labels, or task = \"classification\" for one class index per sample"));
    return regression_step(out, batch[1], phase, ctx);
  }

  at::Tensor outputs(const ember::Batch& batch) {
    if (batch.tensors.empty()) throw ember::RunError("mlp: got a batch without inputs");
    const at::Tensor& inputs = batch[0];
    // Compare the flattened width with input_size here: the mismatch would otherwise be an
    // opaque matmul shape error.
    const int64_t features = inputs.dim() > 0 && inputs.size(0) > 0 ? inputs.numel() / inputs.size(0) : 0;
    if (inputs.dim() < 2 || features != opts_.input_size) {
      throw ember::RunError(c10::str("mlp: got inputs of shape ", inputs.sizes(), " (", features,
                                     " features per sample), expected ", opts_.input_size,
                                     ": set [", section_, "] input_size = ", features));
    }
    // Follow the parameters' dtype, so a module converted to reduced precision accepts float32
    // inputs (a no-op otherwise).
    return net_->forward(inputs.to(net_->head_weight().scalar_type()));
  }

  // Mean squared error against float targets [N, num_classes]; logs only <phase>_loss (there is
  // no accuracy for a regression).
  at::Tensor regression_step(const at::Tensor& out, const at::Tensor& targets, Phase phase,
                             ember::IStepContext& ctx) const {
    if (!targets.is_floating_point() || targets.dim() != 2 || targets.size(0) != out.size(0) ||
        targets.size(1) != opts_.num_classes) {
      throw ember::RunError(c10::str("mlp: regression needs float targets of shape [", out.size(0), ", ",
                                     opts_.num_classes, "], got ", targets.scalar_type(), " ", targets.sizes(),
                                     ": set [", section_, "] num_classes to the target width, or task = \"classification\" for class labels"));
    }
    // In float32 even after a reduced-precision forward, so small errors do not round to zero.
    at::Tensor loss = torch::mse_loss(out.to(torch::kFloat), targets.to(torch::kFloat));
    ctx.log(std::string(ember_models::phase_name(phase)) + "_loss", loss.detach(),
            ember_models::loss_log_options(phase));
    // Outputs and targets for the run's [metrics] table (mae, rmse, r2).
    ctx.update_metrics(out.detach(), targets);
    return loss;
  }

  MlpOptions opts_;
  std::string section_;
  std::shared_ptr<MlpNet> net_;
};

ember::IModel* make(ember::IHost& host, const ember::IConfig& cfg) { return new Mlp(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "mlp", "0.1.0", "Apache-2.0",
             "A multi-layer perceptron on flattened inputs, for classification, multilabel classification or regression.",
             EMBER_CONFIG_KEYS(kKeys), make)
