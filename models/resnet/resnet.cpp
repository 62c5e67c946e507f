// resnet: ResNet-18 and ResNet-50 (He et al. 2015) in torchvision's layout and parameter names
// (conv1, bn1, layer1.0.conv1, ..., layer1.0.downsample.0, fc), so a torchvision state_dict saved
// as safetensors (safetensors.torch.save_file(model.state_dict(), "resnet18.safetensors")) loads with
// `weights`. torchvision's initialisation (Kaiming normal, fan_out, for the convolutions; batch norm
// at 1 and 0; zero_init_residual optional). `small_input` swaps the stem for a 3x3 stride-1
// convolution without max pooling, for 28-32 pixel images (CIFAR's and Fashion-MNIST's usual
// variant). Works with the precisions and trainer.channels_last.
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/model.h>
#include <ember/plugin.h>
#include <ember/predict.h>
#include <ember/support/safetensors.h>
#include <ember/support/sync_batch_norm.h>
#include <ember/trainer.h>

#include <torch/nn.h>

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ember/model_support/classification.h>

namespace {

using ember_models::Phase;
namespace nn = torch::nn;

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("depth", "18", "18 (BasicBlock x [2, 2, 2, 2]) or 50 (Bottleneck x [3, 4, 6, 3])."),
    ember::key::Int("num_classes", "1000", "Classes: the width of fc.").at_least(2),
    ember::key::String("task", "\"classification\"", "One class per image (cross-entropy on class indices), or any number (multilabel: binary cross-entropy on 0/1 targets [N, num_classes]; image_folder's multilabel = true).").choices("classification|multilabel"),
    ember::key::Int("in_channels", "3", "Channels of the input images.").at_least(1),
    ember::key::Bool("small_input", "false", "A 3x3 stride-1 first convolution and no max pooling, for 28-32 pixel images (weights of conv1 then do not come from an ImageNet checkpoint)."),
    ember::key::Bool("zero_init_residual", "false", "Start each block's last batch norm at 0, so every residual block starts as the identity (torchvision's zero_init_residual)."),
    ember::key::Bool("sync_batchnorm", "false", "Batch norms normalise over every data-parallel rank's batch, not each rank's own (Lightning's sync_batchnorm)."),
    ember::key::String("weights", "\"\"", "A safetensors file of torchvision's state_dict names to start from (e.g. resnet18 exported with safetensors.torch.save_file); fc is skipped when num_classes differs."),
};

nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t pad) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).bias(false));
}

struct BlockImpl : nn::Module {
  BlockImpl(int64_t in, int64_t planes, int64_t stride, bool bottleneck) : bottleneck_(bottleneck) {
    const int64_t out = bottleneck ? planes * 4 : planes;
    if (bottleneck) {
      conv1 = register_module("conv1", conv(in, planes, 1, 1, 0));
      bn1 = register_module("bn1", ember::SyncBatchNorm2d(planes));
      conv2 = register_module("conv2", conv(planes, planes, 3, stride, 1));
      bn2 = register_module("bn2", ember::SyncBatchNorm2d(planes));
      conv3 = register_module("conv3", conv(planes, out, 1, 1, 0));
      bn3 = register_module("bn3", ember::SyncBatchNorm2d(out));
    } else {
      conv1 = register_module("conv1", conv(in, planes, 3, stride, 1));
      bn1 = register_module("bn1", ember::SyncBatchNorm2d(planes));
      conv2 = register_module("conv2", conv(planes, planes, 3, 1, 1));
      bn2 = register_module("bn2", ember::SyncBatchNorm2d(planes));
    }
    if (stride != 1 || in != out) {
      downsample = register_module("downsample", nn::Sequential(conv(in, out, 1, stride, 0), ember::SyncBatchNorm2d(out)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = torch::relu(bn1(conv1(x)));
    y = bn2(conv2(y));
    if (bottleneck_) y = bn3(conv3(torch::relu(y)));
    return torch::relu(y + (downsample ? downsample->forward(x) : x));
  }
  ember::SyncBatchNorm2d last_norm() { return bottleneck_ ? bn3 : bn2; }
  bool bottleneck_;
  nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  ember::SyncBatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};  // plain unless model.sync_batchnorm
  nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Block);

struct ResNetImpl : nn::Module {
  ResNetImpl(int64_t depth, int64_t num_classes, int64_t in_channels, bool small_input, bool zero_init_residual) : small_(small_input) {
    const bool bottleneck = depth == 50;
    const std::vector<int64_t> counts = bottleneck ? std::vector<int64_t>{3, 4, 6, 3} : std::vector<int64_t>{2, 2, 2, 2};
    conv1 = register_module("conv1", small_input ? conv(in_channels, 64, 3, 1, 1) : conv(in_channels, 64, 7, 2, 3));
    bn1 = register_module("bn1", ember::SyncBatchNorm2d(64));
    int64_t in = 64;
    const int64_t planes[] = {64, 128, 256, 512};
    for (int i = 0; i < 4; ++i) {
      nn::Sequential layer;
      for (int64_t b = 0; b < counts[static_cast<size_t>(i)]; ++b) {
        layer->push_back(Block(in, planes[i], b == 0 && i > 0 ? 2 : 1, bottleneck));
        in = bottleneck ? planes[i] * 4 : planes[i];
      }
      layers.push_back(register_module("layer" + std::to_string(i + 1), layer));
    }
    fc = register_module("fc", nn::Linear(in, num_classes));
    // torchvision's initialisation.
    for (auto& m : modules(/*include_self=*/false)) {
      if (auto* c = m->as<nn::Conv2d>()) nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
      if (auto* bn = m->as<nn::BatchNorm2d>()) {
        nn::init::ones_(bn->weight);
        nn::init::zeros_(bn->bias);
      }
    }
    if (zero_init_residual)
      for (auto& layer : layers)
        for (auto& block : *layer) nn::init::zeros_(block.get<Block>()->last_norm()->weight);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(bn1(conv1(x)));
    if (!small_) x = torch::max_pool2d(x, 3, 2, 1);
    for (auto& layer : layers) x = layer->forward(x);
    return fc(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1));
  }
  bool small_;
  nn::Conv2d conv1{nullptr};
  ember::SyncBatchNorm2d bn1{nullptr};
  std::vector<nn::Sequential> layers;
  nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

int64_t checked_depth(const ember::IConfig& cfg) {
  const int64_t d = cfg.get_int("depth");
  if (d != 18 && d != 50) throw ember::ConfigError(cfg.where("depth") + ": model.depth = " + std::to_string(d) + ": resnet builds depth 18 or 50");
  return d;
}

class ResNetModel final : public ember::IModel, public ember::IPredictingModel, public ember::ITrainerAware {
 public:
  ResNetModel(ember::IHost& host, const ember::IConfig& cfg)
      : in_channels_(cfg.get_int("in_channels")),
        sync_batchnorm_(cfg.get_bool("sync_batchnorm"), "resnet"),
        net_(checked_depth(cfg), cfg.get_int("num_classes"), in_channels_, cfg.get_bool("small_input"), cfg.get_bool("zero_init_residual")),
        multilabel_(cfg.get_string("task") == "multilabel"),
        section_(cfg.section()) {
    const std::string weights = cfg.get_string("weights");
    if (!weights.empty()) load(host, cfg, weights);
  }
  torch::nn::Module& module() override { return *net_; }
  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kPredictingModelIid) == 0) return static_cast<ember::IPredictingModel*>(this);
    if (std::strcmp(iid, ember::kTrainerAwareIid) == 0) return static_cast<ember::ITrainerAware*>(this);
    return nullptr;
  }
  void attach_trainer(ember::ITrainer* trainer) override {
    sync_batchnorm_.attach(*net_, trainer);
  }
  at::Tensor training_step(const ember::Batch& batch, ember::IStepContext& ctx) override { return step(batch, ctx, Phase::train); }
  void validation_step(const ember::Batch& batch, ember::IStepContext& ctx) override { step(batch, ctx, Phase::val); }
  void test_step(const ember::Batch& batch, ember::IStepContext& ctx) override { step(batch, ctx, Phase::test); }
  // Class probabilities, or each class's own (multilabel).
  at::Tensor predict_step(const ember::Batch& batch) override {
    const at::Tensor out = logits(batch).to(at::kFloat);
    return multilabel_ ? out.sigmoid() : out.softmax(1);
  }
  bool predicts_classes() const override { return !multilabel_; }

 private:
  at::Tensor step(const ember::Batch& batch, ember::IStepContext& ctx, Phase phase) {
    ember_models::require_inputs_and_targets(batch, "resnet");
    return ember_models::image_classes_step(logits(batch), batch[1], multilabel_, phase, ctx, "resnet", section_);
  }
  at::Tensor logits(const ember::Batch& batch) {
    if (batch.tensors.empty()) throw ember::RunError("resnet: got a batch without images");
    const at::Tensor& images = batch[0];
    if (images.dim() != 4 || images.size(1) != in_channels_)
      throw ember::RunError(c10::str("resnet: got images of shape ", images.sizes(), ", expected [N, ", in_channels_,
                                     ", H, W]: set [model] in_channels to the data's channels"));
    // Follow the parameters' dtype (a module converted to reduced precision takes float32 data).
    return net_->forward(images.to(net_->fc->weight.scalar_type()));
  }
  // torchvision's names; fc is left at its initialisation when its shape differs (a new head).
  void load(ember::IHost& host, const ember::IConfig& cfg, const std::string& path) {
    ember::support::SafetensorsFile file(path);
    torch::NoGradGuard no_grad;
    std::vector<std::string> missing;
    int64_t loaded = 0;
    auto take = [&](const std::string& name, at::Tensor& target) {
      if (!file.contains(name)) return missing.push_back(name);
      const at::Tensor t = file.tensor(name);
      if (t.sizes() != target.sizes()) {
        if (name.rfind("fc.", 0) == 0) return;  // another number of classes: a fresh head
        throw ember::RunError(c10::str(cfg.where("weights"), ": resnet: ", path, " holds ", name, " of shape ", t.sizes(), ", this model's is ",
                                       target.sizes(), ": set [model] depth / in_channels / small_input to the checkpoint's"));
      }
      target.copy_(t.to(target.scalar_type()));
      ++loaded;
    };
    for (auto& p : net_->named_parameters()) take(p.key(), p.value());
    for (auto& b : net_->named_buffers()) take(b.key(), b.value());
    if (!missing.empty())
      throw ember::RunError(cfg.where("weights") + ": resnet: " + path + " lacks " + std::to_string(missing.size()) + " of this model's tensors (first: " +
                            missing.front() + "): is it a torchvision resnet state_dict of the same depth?");
    host.log(ember::LogLevel::info, "resnet: " + std::to_string(loaded) + " tensors from " + path);
  }
  int64_t in_channels_;
  ember::SyncBatchNormSetting sync_batchnorm_;
  ResNet net_;
  bool multilabel_;
  std::string section_;
};

ember::IModel* make(ember::IHost& host, const ember::IConfig& cfg) { return new ResNetModel(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "resnet", "0.1.0", "Apache-2.0",
             "ResNet-18 / ResNet-50 in torchvision's layout and names (torchvision weights load from safetensors).",
             EMBER_CONFIG_KEYS(kKeys), make)
