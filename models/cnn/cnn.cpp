// cnn: the classic MNIST-tutorial convolutional network (PyTorch's examples/mnist), with
// configurable widths, for small square images such as MNIST or Fashion-MNIST.
//
//   conv3x3(in, c1) -> relu -> maxpool2 -> conv3x3(c1, c2) -> relu -> maxpool2 -> dropout
//   -> flatten -> linear(c2 * (size/4)^2, hidden) -> relu -> dropout -> linear(hidden, classes)
//
// architecture = "speedrun" is another, faster-to-accuracy network for the same inputs (the
// Fashion-MNIST speed-run, configs/fashion_mnist_speedrun.toml): five 3x3 conv -> batch-norm ->
// relu layers of widths w, 2w, 2w, 4w, 4w with a 2x2 max-pool after the 2nd and 4th, a global
// max-pool and one linear layer (bench/speedrun.py builds the same network in PyTorch).
//
// Batch: tensors[0] = images float [N, C, H, W], tensors[1] = labels int64 [N], or with
// task = "multilabel" 0/1 targets [N, num_classes] (image_folder's multilabel lists).
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
#include <ember/host.h>
#include <ember/model.h>
#include <ember/model_flops.h>
#include <ember/plugin.h>
#include <ember/predict.h>
#include <ember/support/sync_batch_norm.h>
#include <ember/trainer.h>

#include <ember/model_support/classification.h>

namespace {

using ember_models::Phase;

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("in_channels", "1", "Channels of the input images (1 for grayscale, 3 for RGB).").at_least(1),
    ember::key::Int("image_size", "28", "Height and width of the square input images, in pixels.").at_least(4),
    ember::key::Int("conv1_channels", "32", "Output channels of the first 3x3 convolution.").at_least(1),
    ember::key::Int("conv2_channels", "64", "Output channels of the second 3x3 convolution.").at_least(1),
    ember::key::Int("hidden", "128", "Width of the fully connected hidden layer.").at_least(1),
    ember::key::Float("dropout_conv", "0.25", "Dropout probability after the convolutions, in [0, 1).").at_least(0.0).below(1.0),
    ember::key::Float("dropout_fc", "0.5", "Dropout probability after the hidden layer, in [0, 1).").at_least(0.0).below(1.0),
    ember::key::Int("num_classes", "10", "Number of classes: the width of the output layer.").at_least(2),
    ember::key::String("architecture", "\"classic\"", "classic: the MNIST-tutorial network (conv1_channels, conv2_channels, hidden, dropout_*); speedrun: five conv + batch-norm layers of width `width` (no dropout).").choices("classic|speedrun"),
    ember::key::Int("width", "16", "Base width of the speedrun architecture (its layers have width, 2x, 2x, 4x, 4x channels).").at_least(1),
    ember::key::Bool("sync_batchnorm", "false", "Batch norms (speedrun architecture) normalise over every data-parallel rank's batch, not each rank's own (Lightning's sync_batchnorm)."),
    ember::key::Float("label_smoothing", "0.0", "Label smoothing of the training cross-entropy (PyTorch's label_smoothing), in [0, 1).").at_least(0.0).below(1.0),
    ember::key::String("task", "\"classification\"", "One class per image (cross-entropy on class indices), or any number (multilabel: binary cross-entropy on 0/1 targets [N, num_classes]; image_folder's multilabel = true).").choices("classification|multilabel"),
};

struct CnnOptions {
  int64_t in_channels, image_size, conv1_channels, conv2_channels, hidden, num_classes, width;
  double dropout_conv, dropout_fc, label_smoothing;
  bool speedrun, sync_batchnorm, multilabel;
};

// Cloneable: clone() gives a deep copy with the same parameter names (it copy-constructs the net,
// calls reset() to rebuild its layers, then copies the values in).
class CnnNet : public torch::nn::Cloneable<CnnNet> {
 public:
  explicit CnnNet(const CnnOptions& o) : o_(o) { reset(); }

  // Submodules are registered in forward order under fixed names, so named_parameters() reads
  // conv1.weight, conv1.bias, conv2.*, fc1.*, fc2.* and checkpoints stay loadable. The order of
  // construction is also the order of the initial random draws: keep it.
  void reset() override {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(o_.in_channels, o_.conv1_channels, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(o_.conv1_channels, o_.conv2_channels, 3).padding(1)));
    dropout_conv = register_module("dropout_conv", torch::nn::Dropout(o_.dropout_conv));
    // Padded 3x3 convolutions keep the size; each 2x2 max-pool halves it (rounding down).
    fc1 = register_module("fc1", torch::nn::Linear(o_.conv2_channels * (o_.image_size / 4) * (o_.image_size / 4), o_.hidden));
    dropout_fc = register_module("dropout_fc", torch::nn::Dropout(o_.dropout_fc));
    fc2 = register_module("fc2", torch::nn::Linear(o_.hidden, o_.num_classes));
  }

  at::Tensor forward(at::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = dropout_conv(x).flatten(1);
    x = dropout_fc(torch::relu(fc1(x)));
    return fc2(x);
  }

  CnnOptions o_;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Dropout dropout_conv{nullptr};
  torch::nn::Linear fc1{nullptr};
  torch::nn::Dropout dropout_fc{nullptr};
  torch::nn::Linear fc2{nullptr};
};

// architecture = "speedrun". Parameters: conv1..conv5 (no bias: batch-norm follows), bn1..bn5, fc.
class SpeedrunNet : public torch::nn::Cloneable<SpeedrunNet> {
 public:
  explicit SpeedrunNet(const CnnOptions& o) : o_(o) { reset(); }

  void reset() override {
    const int64_t w = o_.width;
    const int64_t widths[] = {o_.in_channels, w, 2 * w, 2 * w, 4 * w, 4 * w};
    convs.clear();
    bns.clear();
    for (int i = 0; i < 5; ++i) {
      convs.push_back(register_module("conv" + std::to_string(i + 1),
                                      torch::nn::Conv2d(torch::nn::Conv2dOptions(widths[i], widths[i + 1], 3).padding(1).bias(false))));
      bns.push_back(register_module("bn" + std::to_string(i + 1), ember::SyncBatchNorm2d(widths[i + 1])));
    }
    fc = register_module("fc", torch::nn::Linear(4 * w, o_.num_classes));
  }

  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < convs.size(); ++i) {
      x = torch::relu(bns[i](convs[i](x)));
      if (i == 1 || i == 3) x = torch::max_pool2d(x, 2);
    }
    return fc(torch::amax(x, {2, 3}));
  }

  CnnOptions o_;
  std::vector<torch::nn::Conv2d> convs;
  std::vector<ember::SyncBatchNorm2d> bns;  // plain batch norms unless model.sync_batchnorm
  torch::nn::Linear fc{nullptr};
};

CnnOptions read_options(const ember::IConfig& cfg) {
  CnnOptions o{};
  o.in_channels = cfg.get_int("in_channels");
  o.image_size = cfg.get_int("image_size");
  o.conv1_channels = cfg.get_int("conv1_channels");
  o.conv2_channels = cfg.get_int("conv2_channels");
  o.hidden = cfg.get_int("hidden");
  o.num_classes = cfg.get_int("num_classes");
  o.dropout_conv = ember_models::read_dropout(cfg, "dropout_conv");
  o.dropout_fc = ember_models::read_dropout(cfg, "dropout_fc");
  o.speedrun = cfg.get_string("architecture") == "speedrun";
  o.width = cfg.get_int("width");
  o.label_smoothing = cfg.get_float("label_smoothing");
  o.sync_batchnorm = cfg.get_bool("sync_batchnorm");
  o.multilabel = cfg.get_string("task") == "multilabel";
  if (o.sync_batchnorm && !o.speedrun)
    throw ember::ConfigError(cfg.where("sync_batchnorm") + ": " + cfg.section() +
                             ".sync_batchnorm = true, and the classic architecture has no batch norm; use architecture = \"speedrun\" "
                             "or remove the key");
  if (o.label_smoothing >= 1.0)
    throw ember::ConfigError(c10::str("[", cfg.section(), "] label_smoothing = ", o.label_smoothing, " (",
                                      cfg.where("label_smoothing"), ") must be below 1: use a value in [0, 1), e.g. 0.1"));
  // Label smoothing is cross-entropy's; binary cross-entropy on 0/1 targets has none in PyTorch.
  if (o.multilabel && o.label_smoothing > 0.0)
    throw ember::ConfigError(cfg.where("label_smoothing") + ": " + cfg.section() + ".label_smoothing = " + c10::str(o.label_smoothing) +
                             " smooths the single-label cross-entropy, and task = \"multilabel\" trains with binary cross-entropy: remove the key");
  return o;
}

class Cnn final : public ember::IModel, public ember::IPredictingModel, public ember::IModelFlops, public ember::ITrainerAware {
 public:
  explicit Cnn(const ember::IConfig& cfg)
      : opts_(read_options(cfg)), section_(cfg.section()), sync_batchnorm_(opts_.sync_batchnorm, "cnn") {
    if (opts_.speedrun) speedrun_ = std::make_shared<SpeedrunNet>(opts_);
    else net_ = std::make_shared<CnnNet>(opts_);
  }

  torch::nn::Module& module() override {
    if (speedrun_) return *speedrun_;
    return *net_;
  }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kPredictingModelIid) == 0) return static_cast<ember::IPredictingModel*>(this);
    if (std::strcmp(iid, ember::kModelFlopsIid) == 0) return static_cast<ember::IModelFlops*>(this);
    if (std::strcmp(iid, ember::kTrainerAwareIid) == 0) return static_cast<ember::ITrainerAware*>(this);
    return nullptr;
  }

  void attach_trainer(ember::ITrainer* trainer) override {
    if (speedrun_) sync_batchnorm_.attach(*speedrun_, trainer);
  }

  // ember/model_flops.h's count: per 3x3 convolution (padding 1: the output is as large as its
  // input) 2*n*h*w*out*in*9 forward, the same for the weight's gradient and again for the input's
  // gradient except in the first layer; linear layers likewise; pools, norms, activations left out.
  double training_flops(const ember::Batch& batch) const override {
    if (batch.tensors.empty() || batch[0].dim() != 4) return 0.0;
    const double n = static_cast<double>(batch[0].size(0));
    int64_t h = batch[0].size(2), w = batch[0].size(3);
    double flops = 0.0;
    bool first = true;
    auto add = [&](double forward) {
      flops += (first ? 2.0 : 3.0) * forward;
      first = false;
    };
    auto conv = [&](int64_t in, int64_t out) { add(2.0 * n * static_cast<double>(h * w) * static_cast<double>(out * in) * 9.0); };
    auto linear = [&](int64_t in, int64_t out) { add(2.0 * n * static_cast<double>(in) * static_cast<double>(out)); };
    auto pool = [&] { h /= 2; w /= 2; };
    if (speedrun_) {
      const int64_t c = opts_.width;
      const int64_t widths[] = {opts_.in_channels, c, 2 * c, 2 * c, 4 * c, 4 * c};
      for (int i = 0; i < 5; ++i) {
        conv(widths[i], widths[i + 1]);
        if (i == 1 || i == 3) pool();
      }
      linear(4 * c, opts_.num_classes);
    } else {
      conv(opts_.in_channels, opts_.conv1_channels);
      pool();
      conv(opts_.conv1_channels, opts_.conv2_channels);
      pool();
      linear(opts_.conv2_channels * h * w, opts_.hidden);
      linear(opts_.hidden, opts_.num_classes);
    }
    return flops;
  }
  // Class probabilities, or each class's own (multilabel).
  at::Tensor predict_step(const ember::Batch& batch) override {
    const at::Tensor out = logits(batch).to(at::kFloat);
    return opts_.multilabel ? out.sigmoid() : out.softmax(1);
  }
  bool predicts_classes() const override { return !opts_.multilabel; }

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
    ember_models::require_inputs_and_targets(batch, "cnn");
    return ember_models::image_classes_step(logits(batch), batch[1], opts_.multilabel, phase, ctx, "cnn", section_,
                                            phase == Phase::train ? opts_.label_smoothing : 0.0);
  }

  at::Tensor logits(const ember::Batch& batch) {
    if (batch.tensors.empty()) throw ember::RunError("cnn: got a batch without images");
    const at::Tensor& images = batch[0];
    check_images(images);
    // Follow the parameters' dtype, so a module converted to reduced precision accepts the
    // float32 images a data module produces (a no-op otherwise).
    return speedrun_ ? speedrun_->forward(images.to(speedrun_->convs[0]->weight.scalar_type()))
                     : net_->forward(images.to(net_->conv1->weight.scalar_type()));
  }

  // The first linear layer's width is fixed by in_channels and image_size; a mismatch would
  // otherwise surface as an opaque matmul shape error deep inside the forward.
  void check_images(const at::Tensor& images) const {
    if (images.dim() != 4 || images.size(1) != opts_.in_channels || images.size(2) != opts_.image_size ||
        images.size(3) != opts_.image_size) {
      throw ember::RunError(c10::str("cnn: got images of shape ", images.sizes(), ", expected [N, ",
                                     opts_.in_channels, ", ", opts_.image_size, ", ", opts_.image_size,
                                     "]: set [", section_, "] in_channels and image_size to match the data"));
    }
  }

  CnnOptions opts_;
  std::string section_;
  ember::SyncBatchNormSetting sync_batchnorm_;
  std::shared_ptr<CnnNet> net_;             // architecture = "classic"
  std::shared_ptr<SpeedrunNet> speedrun_;   // architecture = "speedrun"
};

ember::IModel* make(ember::IHost& /*host*/, const ember::IConfig& cfg) { return new Cnn(cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "cnn", "0.1.0", "Apache-2.0",
             "The MNIST-tutorial CNN (two 3x3 convolutions, two linear layers) for small square images.",
             EMBER_CONFIG_KEYS(kKeys), make)
