// transformer: a sequence classifier built from torch::nn::TransformerEncoderLayer (self-attention
// plus a feed-forward block, post-norm as in "Attention Is All You Need"), mean-pooled over the
// sequence, then a linear head. Inputs are float sequences [N, seq_len, d_model] (e.g. embeddings;
// the synthetic data module with shape = [seq_len, d_model]); targets are class labels. It is the
// attention-heavy counterpart of the cnn model in the precision benchmarks.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/StringUtil.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/transformer.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/deferred_init.h>
#include <ember/error.h>
#include <ember/model.h>
#include <ember/model_flops.h>
#include <ember/model_units.h>
#include <ember/pipeline.h>
#include <ember/plugin.h>
#include <ember/predict.h>

#include <ember/model_support/classification.h>
#include <ember/support/tensor_parallel.h>
#include <ember/tensor_parallel.h>

#include "tensor_parallel_plan.h"

namespace {

using ember_models::Phase;

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("d_model", "128", "Width of every sequence element (the data's last dimension).").at_least(1),
    ember::key::Int("nhead", "4", "Attention heads; must divide d_model.").at_least(1),
    ember::key::Int("dim_feedforward", "512", "Width of the feed-forward block inside each layer.").at_least(1),
    ember::key::Int("num_layers", "1", "Encoder layers (blocks) stacked.").at_least(1),
    ember::key::Float("dropout", "0.1", "Dropout inside the encoder layers, in [0, 1).").at_least(0.0).below(1.0),
    ember::key::Int("num_classes", "10", "Classes: the width of the output layer.").at_least(2),
};

// Cloneable: clone() gives a deep copy with the same parameter names (it copy-constructs the net,
// calls reset() to rebuild its layers, then copies the values in).
class TransformerNet : public torch::nn::Cloneable<TransformerNet> {
 public:
  // `host`: each layer and the head handed to ember::parameters_initialised as soon as it is built
  // (deferred initialisation under a sharding strategy); none for a clone.
  TransformerNet(int64_t d_model, int64_t nhead, int64_t ff, int64_t layers, double dropout, int64_t classes,
                 ember::IHost* host = nullptr)
      : d_model_(d_model), nhead_(nhead), ff_(ff), layers_(layers), dropout_(dropout), classes_(classes), host_(host) {
    reset();
    host_ = nullptr;
  }
  // Names layer1.*, ..., head.*; the order of construction is the order of the initial draws.
  void reset() override {
    blocks_.clear();  // a copy-constructed clone still holds the original's blocks
    for (int64_t i = 0; i < layers_; ++i) {
      blocks_.push_back(register_module(
          "layer" + std::to_string(i + 1),
          torch::nn::TransformerEncoderLayer(
              torch::nn::TransformerEncoderLayerOptions(d_model_, nhead_).dim_feedforward(ff_).dropout(dropout_))));
      if (host_) ember::parameters_initialised(*host_, *blocks_.back());
    }
    head_ = register_module("head", torch::nn::Linear(d_model_, classes_));
    if (host_) ember::parameters_initialised(*host_, *head_);
    held_.assign(static_cast<size_t>(layers_), true);
  }
  // x: [N, S, E]. LibTorch's encoder layer takes [S, N, E] (it has no batch_first option).
  at::Tensor forward(at::Tensor x) { return head(layers(enter(x), 0, layers_)); }
  // The pieces a pipeline stage runs (ember/pipeline.h): the input made [S, N, E] (split by
  // sequence under sequence parallelism), layers [begin, end), then the pooled head.
  at::Tensor enter(const at::Tensor& x) {
    at::Tensor h = x.transpose(0, 1);
    if (by_sequence()) h = ember::scatter_to_sequence_parallel(h, 0, *tensor_parallel_);
    return h;
  }
  at::Tensor layers(at::Tensor h, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      auto block = [this, layer = blocks_[static_cast<size_t>(i)].ptr()](const at::Tensor& in) {
        return tensor_parallel_ ? ember_transformer::encoder_layer_forward(*layer, in, nhead_, *tensor_parallel_) : layer->forward(in);
      };
      h = units_ ? units_->run(i, h, block) : block(h);
    }
    return h;
  }
  at::Tensor head(at::Tensor h) {
    if (by_sequence()) h = ember::gather_from_sequence_parallel(h, 0, *tensor_parallel_, /*into_split_layer=*/false);
    return head_(h.mean(0));
  }
  // Keeps the layers of `stages` (and the head when the last layer is among them): the others
  // leave the module and their storage is freed.
  void keep_layers(const std::vector<ember::UnitRange>& stages) {
    auto kept = [&](int64_t i) {
      for (const auto& s : stages)
        if (i >= s.begin && i < s.end) return true;
      return false;
    };
    auto drop = [this](const std::string& name, torch::nn::Module& m) {
      at::NoGradGuard no_grad;
      for (auto& p : m.parameters()) p.set_data(at::empty({0}, p.options()));
      unregister_module(name);
    };
    for (int64_t i = 0; i < layers_; ++i)
      if (!kept(i)) {
        drop("layer" + std::to_string(i + 1), *blocks_[static_cast<size_t>(i)]);
        held_[static_cast<size_t>(i)] = false;
      }
    if (!kept(layers_ - 1)) {
      drop("head", *head_);
      has_head_ = false;
    }
  }
  bool has_head() const { return has_head_; }
  // The plan (tensor_parallel_plan.h): every encoder layer split over the group; the head stays whole.
  std::vector<ember::TensorShard> parallelize(ember::ITensorParallelGroup& group, const std::string& section,
                                              const std::string& where_nhead, const std::string& where_ff) {
    if (nhead_ % group.size() != 0)
      throw ember::ConfigError(c10::str(where_nhead, ": [", section, "] nhead = ", nhead_, " cannot be split over tensor_parallel = ",
                                        group.size(), " ranks (each rank takes whole attention heads): choose a degree that divides ",
                                        nhead_));
    if (ff_ % group.size() != 0)
      throw ember::ConfigError(c10::str(where_ff, ": [", section, "] dim_feedforward = ", ff_, " cannot be split over tensor_parallel = ",
                                        group.size(), " ranks: choose a degree that divides it"));
    std::vector<ember::TensorShard> shards;
    auto params = named_parameters();
    for (size_t i = 0; i < blocks_.size(); ++i) {
      if (!held_[i]) continue;  // another pipeline stage's
      for (auto& s : ember_transformer::encoder_layer_shards("layer" + std::to_string(i + 1), group.sequence_parallel())) {
        if (s.dim != ember::kSummedGradient) ember::keep_shard(params[s.name], s, group.rank(), group.size());
        shards.push_back(std::move(s));
      }
    }
    tensor_parallel_ = &group;
    return shards;
  }
  // The dtype the model computes in (the precision handler may have converted it).
  c10::ScalarType dtype() const {
    for (const auto& p : parameters())
      if (p.numel() > 0) return p.scalar_type();
    return c10::kFloat;
  }
  // Each encoder layer is a unit (ember/model_units.h): sharding strategies gather its
  // parameters just before it runs.
  void declare_units(ember::ModelUnits& units) {
    units_ = &units;
    for (size_t i = 0; i < blocks_.size(); ++i) units.add("layer" + std::to_string(i + 1), blocks_[i].ptr());
  }

 private:
  int64_t d_model_, nhead_, ff_, layers_;
  double dropout_;
  int64_t classes_;
  ember::ModelUnits* units_ = nullptr;
  bool by_sequence() const { return tensor_parallel_ && tensor_parallel_->sequence_parallel(); }
  ember::ITensorParallelGroup* tensor_parallel_ = nullptr;  // set by the plan
  bool has_head_ = true;
  std::vector<bool> held_;  // the layers this rank holds (all but under pipeline parallelism)
  std::vector<torch::nn::TransformerEncoderLayer> blocks_;
  torch::nn::Linear head_{nullptr};
  ember::IHost* host_ = nullptr;  // while the constructor builds the layers
};

class Transformer final : public ember::IModel, public ember::IModelFlops, public ember::UnitModel,
                          public ember::IPredictingModel, public ember::ITensorParallelModel, public ember::IPipelineModel {
 public:
  Transformer(ember::IHost& host, const ember::IConfig& cfg)
      : d_model_(cfg.get_int("d_model")), section_(cfg.section()), where_nhead_(cfg.where("nhead")),
        where_ff_(cfg.where("dim_feedforward")) {
    const int64_t nhead = cfg.get_int("nhead");
    if (d_model_ % nhead != 0)
      throw ember::ConfigError(c10::str("[", section_, "] nhead = ", nhead, " (", cfg.where("nhead"), ") does not divide d_model = ",
                                        d_model_, ": choose heads that split the width evenly, e.g. ", d_model_ % 4 == 0 ? 4 : 1));
    ff_ = cfg.get_int("dim_feedforward");
    layers_ = cfg.get_int("num_layers");
    classes_ = cfg.get_int("num_classes");
    net_ = std::make_shared<TransformerNet>(d_model_, nhead, ff_, layers_, ember_models::read_dropout(cfg, "dropout"), classes_, &host);
    net_->declare_units(units_);
  }
  torch::nn::Module& module() override { return *net_; }
  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kModelFlopsIid) == 0) return static_cast<ember::IModelFlops*>(this);
    if (std::strcmp(iid, ember::kPredictingModelIid) == 0) return static_cast<ember::IPredictingModel*>(this);
    if (std::strcmp(iid, ember::kTensorParallelModelIid) == 0) return static_cast<ember::ITensorParallelModel*>(this);
    if (std::strcmp(iid, ember::kPipelineModelIid) == 0) return static_cast<ember::IPipelineModel*>(this);
    return unit_model_interface(iid);
  }
  // Pipeline stages (ember/pipeline.h): the units are the encoder layers; the first stage takes the
  // data, the last pools, applies the head and computes the loss.
  void keep_pipeline_stages(const std::vector<ember::UnitRange>& stages) override { net_->keep_layers(stages); }
  at::Tensor pipeline_forward(const ember::UnitRange& stage, const ember::Batch& batch, const at::Tensor& input,
                              ember::IStepContext& ctx) override {
    at::Tensor h = stage.begin == 0 ? net_->enter(checked_inputs(batch)) : input;
    h = net_->layers(h, stage.begin, stage.end);
    if (stage.end < layers_) return h;
    ember_models::require_inputs_and_targets(batch, "transformer");
    const Phase phase = ctx.stage() == ember::Stage::fit ? Phase::train : ctx.stage() == ember::Stage::test ? Phase::test : Phase::val;
    return ember_models::classification_step(net_->head(h), batch[1], phase, ctx, "transformer");
  }
  std::vector<ember::TensorShard> parallelize_tensors(ember::ITensorParallelGroup& group) override {
    return net_->parallelize(group, section_, where_nhead_, where_ff_);
  }
  at::Tensor predict_step(const ember::Batch& batch) override { return logits(batch).to(at::kFloat).softmax(1); }
  bool predicts_classes() const override { return true; }
  // Per layer and sequence of length L (width d, feed-forward f): q/k/v projections 6Ld^2,
  // scores and weighted values 2L^2d each, output projection 2Ld^2, feed-forward 4Ldf; then the
  // head on the pooled vector, 2dC. Backward doubles every product except the first layer's
  // input gradient of its q/k/v projection (the data needs none).
  double training_flops(const ember::Batch& batch) const override {
    if (batch.tensors.empty() || batch[0].dim() != 3) return 0.0;
    const double n = static_cast<double>(batch[0].size(0)), L = static_cast<double>(batch[0].size(1));
    const double d = static_cast<double>(d_model_), f = static_cast<double>(ff_), c = static_cast<double>(classes_);
    const double layer = 8.0 * L * d * d + 4.0 * L * L * d + 4.0 * L * d * f;
    const double forward = static_cast<double>(layers_) * layer + 2.0 * d * c;
    return n * (3.0 * forward - 6.0 * L * d * d);
  }
  at::Tensor training_step(const ember::Batch& batch, ember::IStepContext& ctx) override { return step(batch, ctx, Phase::train); }
  void validation_step(const ember::Batch& batch, ember::IStepContext& ctx) override { step(batch, ctx, Phase::val); }
  void test_step(const ember::Batch& batch, ember::IStepContext& ctx) override { step(batch, ctx, Phase::test); }

 private:
  at::Tensor step(const ember::Batch& batch, ember::IStepContext& ctx, Phase phase) {
    ember_models::require_inputs_and_targets(batch, "transformer");
    return ember_models::classification_step(logits(batch), batch[1], phase, ctx, "transformer");
  }
  at::Tensor checked_inputs(const ember::Batch& batch) {
    if (batch.tensors.empty()) throw ember::RunError("transformer: got a batch without inputs");
    const at::Tensor& x = batch[0];
    if (x.dim() != 3 || x.size(2) != d_model_)
      throw ember::RunError(c10::str("transformer: got inputs of shape ", x.sizes(), ", expected [N, seq_len, ", d_model_,
                                     "]: set [", section_, "] d_model to the data's last dimension"));
    return x.to(net_->dtype());
  }
  at::Tensor logits(const ember::Batch& batch) {
    if (!net_->has_head())
      throw ember::RunError("transformer: this rank holds pipeline stages without the head; the strategy runs the model's pipeline_forward");
    return net_->forward(checked_inputs(batch));
  }
  int64_t d_model_, ff_ = 0, layers_ = 0, classes_ = 0;
  std::string section_, where_nhead_, where_ff_;
  std::shared_ptr<TransformerNet> net_;
};

ember::IModel* make(ember::IHost& host, const ember::IConfig& cfg) { return new Transformer(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "transformer", "0.1.0", "Apache-2.0",
             "Sequence classifier: transformer encoder block(s), mean pooling, linear head.", EMBER_CONFIG_KEYS(kKeys), make)
