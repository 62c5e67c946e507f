// lora: low-rank adaptation (Hu et al. 2021, PEFT's LoraConfig): the model's weights are frozen
// and each targeted linear layer gets a trainable branch
//     y = W x + (alpha / rank) * B A dropout(x),   A [rank, in] (Kaiming-uniform), B [out, rank] (zeros),
// so training starts from the model as it is. A and B are parameters of the layer's module
// (`<layer>.lora_A`, `<layer>.lora_B`): the precision handler converts them, strategies place,
// shard and synchronise them like any other parameter. Checkpoints hold them and leave the frozen
// weights out (ember::IFrozenParameters; save_frozen keeps them). `engine export` folds them into
// the weights (W + (alpha / rank) B A), so the export is the plain model's.
// Needs a model that lists its linear layers (ember/model_adapters.h: gpt).
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/StringUtil.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/language_model.h>
#include <ember/model.h>
#include <ember/model_adapters.h>
#include <ember/plugin.h>
#include <ember/support/callback_base.h>
#include <ember/support/name_patterns.h>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("rank", "8", "Rank r of the update B A.").at_least(1),
    ember::key::Float("alpha", "16.0", "Scale: the update is multiplied by alpha / rank (PEFT's lora_alpha).").above(0.0),
    ember::key::Float("dropout", "0.0", "Dropout on the branch's input while training, in [0, 1) (PEFT's lora_dropout).").at_least(0.0).below(1.0),
    ember::key::Bool("save_frozen", "false", "Checkpoints also hold the frozen base weights. False: they hold the adapters (and what else trains) only, a fraction of the size; the base comes from the model as it is built (model_dir or the seed), or from [model] init_checkpoint when the run started from one (recorded in the checkpoint, which must stay there), checked by a fingerprint when a checkpoint is loaded."),
    ember::key::StringList("target_modules", "[\"c_attn\", \"q_proj\", \"v_proj\"]", "Layers to adapt: a layer whose name ends with an entry (\"c_attn\", \"mlp.c_fc\", \"q_proj\") or matches it as a regular expression (\"layers\\\\.[0-3]\\\\..*_proj\"). The defaults are PEFT's for GPT-2 (c_attn) and Llama (q_proj, v_proj)."),
};

// The branch of one layer. Its parameters live in the layer's module; it keeps handles to them.
class LoraBranch final : public ember::ILinearAdapter {
 public:
  LoraBranch(at::Tensor a, at::Tensor b, double scale, double dropout, torch::nn::Module& layer)
      : a_(std::move(a)), b_(std::move(b)), scale_(scale), dropout_(dropout), layer_(layer) {}
  at::Tensor forward(const at::Tensor& x) override {
    const at::Tensor in = dropout_ > 0.0 && layer_.is_training() ? at::dropout(x, dropout_, true) : x;
    return at::matmul(at::matmul(in, a_.t()), b_.t()) * scale_;
  }

 private:
  at::Tensor a_, b_;
  double scale_, dropout_;
  torch::nn::Module& layer_;
};

class Lora final : public ember::Callback, public ember::IModelTransform, public ember::IFrozenParameters, public ember::IAdapterExport {
 public:
  Lora(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        rank_(cfg.get_int("rank")),
        alpha_(cfg.get_float("alpha")),
        dropout_(cfg.get_float("dropout")),
        save_frozen_(cfg.get_bool("save_frozen")),
        patterns_(cfg.get_string_list("target_modules")),
        where_(cfg.where("target_modules")),
        section_(cfg.section()) {
    if (patterns_.empty())
      throw ember::ConfigError(c10::str("[", section_, "] target_modules = [] (", where_, "): name the layers to adapt, e.g. [\"c_attn\"]"));
  }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kModelTransformIid) == 0) return static_cast<ember::IModelTransform*>(this);
    if (std::strcmp(iid, ember::kFrozenParametersIid) == 0) return static_cast<ember::IFrozenParameters*>(this);
    if (std::strcmp(iid, ember::kAdapterExportIid) == 0) return static_cast<ember::IAdapterExport*>(this);
    return nullptr;
  }
  bool checkpoints_keep_frozen() const override { return save_frozen_; }

  void transform_model(ember::IModel& model, const std::string& model_name) override {
    causal_lm_ = model.query_interface(ember::kCausalLanguageModelIid) != nullptr;
    auto* linears = static_cast<ember::ILinearLayers*>(model.query_interface(ember::kLinearLayersIid));
    if (linears == nullptr)
      throw ember::ConfigError(c10::str("lora: model '", model_name, "' does not list its linear layers (ember::ILinearLayers, ",
                                        "sdk/include/ember/model_adapters.h), so it cannot be adapted: use a model that does (gpt)"));
    const auto layers = linears->linear_layers();
    std::vector<ember::LinearLayer> chosen;
    for (const auto& l : layers)
      if (patterns_.matches(l.name)) chosen.push_back(l);
    if (chosen.empty())
      throw ember::ConfigError(c10::str("[", section_, "] target_modules (", where_, ") matches none of model '", model_name, "''s ", layers.size(),
                                        " linear layers (e.g. ", layers.empty() ? std::string("none") : layers.front().name, ")"));
    int64_t frozen = 0, trained = 0;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model.module().parameters()) {
        p.set_requires_grad(false);
        frozen += p.numel();
      }
      const double scale = alpha_ / static_cast<double>(rank_);
      for (const auto& l : chosen) {
        const auto options = l.module->named_parameters(false)["weight"].options().requires_grad(false);
        at::Tensor a = at::empty({rank_, l.in_features}, options);
        // PEFT's initialisation: A Kaiming-uniform (a = sqrt(5), as nn.Linear), B zero.
        torch::nn::init::kaiming_uniform_(a, std::sqrt(5.0));
        at::Tensor b = at::zeros({l.out_features, rank_}, options);
        a = l.module->register_parameter("lora_A", a);
        b = l.module->register_parameter("lora_B", b);
        trained += a.numel() + b.numel();
        linears->set_linear_adapter(l.name, std::make_shared<LoraBranch>(a, b, scale, dropout_, *l.module));
        layers_[l.name] = l;
      }
    }
    host_.log(ember::LogLevel::info,
              c10::str("lora: rank ", rank_, ", alpha ", alpha_, " on ", chosen.size(), " of ", layers.size(), " linear layers (", chosen.front().name,
                       chosen.size() > 1 ? ", ..." : "", "): ", trained, " trainable parameters, ", frozen, " frozen (",
                       100.0 * static_cast<double>(trained) / static_cast<double>(trained + frozen), "% trained)"));
  }

  // PEFT's adapter folder: adapter_model.safetensors with base_model.model.<layer>.lora_A.weight
  // ([r, in]) and .lora_B.weight ([out, r]) under the exported model's names, and
  // adapter_config.json (LoraConfig; fan_in_fan_out for GPT-2's Conv1D layout), which
  // peft.PeftModel.from_pretrained(base, folder) loads onto the base model.
  std::vector<ember::NamedTensor> export_adapters(const std::vector<ember::NamedTensor>& state,
                                                  const std::function<std::string(const std::string&)>& exported_name,
                                                  std::vector<std::pair<std::string, std::string>>& files) override {
    std::map<std::string, at::Tensor> by_name;
    for (const auto& t : state) by_name[t.name] = t.tensor;
    std::vector<ember::NamedTensor> out;
    std::vector<std::string> targets;
    size_t in_out = 0;
    for (const auto& [name, l] : layers_) {
      const auto a = by_name.find(name + ".lora_A"), b = by_name.find(name + ".lora_B");
      if (a == by_name.end() || b == by_name.end())
        throw ember::RunError(c10::str("lora: the checkpoint lacks ", name, ".lora_A or .lora_B: not a checkpoint of this LoRA configuration"));
      std::string layer = exported_name(name + ".weight");
      const std::string suffix = ".weight";
      if (layer.size() <= suffix.size() || layer.compare(layer.size() - suffix.size(), suffix.size(), suffix) != 0)
        throw ember::RunError(c10::str("lora: the model exports layer ", name, " under no weight name ('", layer, "'): its adapters have no place in PEFT's format"));
      layer.resize(layer.size() - suffix.size());
      out.push_back({"base_model.model." + layer + ".lora_A.weight", a->second.contiguous()});
      out.push_back({"base_model.model." + layer + ".lora_B.weight", b->second.contiguous()});
      targets.push_back(layer);
      in_out += l.weight_in_out ? 1 : 0;
    }
    if (in_out != 0 && in_out != layers_.size())
      throw ember::RunError("lora: the adapted layers mix [in, out] (Conv1D) and [out, in] weights; PEFT's fan_in_fan_out is one setting for all");
    std::string json = "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": " + std::string(causal_lm_ ? "\"CAUSAL_LM\"" : "null") +
                       ",\n  \"r\": " + std::to_string(rank_) + ",\n  \"lora_alpha\": " + number(alpha_) +
                       ",\n  \"lora_dropout\": " + number(dropout_) + ",\n  \"fan_in_fan_out\": " + (in_out ? "true" : "false") +
                       ",\n  \"bias\": \"none\",\n  \"use_rslora\": false,\n  \"use_dora\": false,\n  \"init_lora_weights\": true,\n"
                       "  \"inference_mode\": true,\n  \"base_model_name_or_path\": null,\n  \"modules_to_save\": null,\n  \"target_modules\": [";
    for (size_t i = 0; i < targets.size(); ++i) json += (i ? ", " : "") + quoted(targets[i]);
    json += "]\n}\n";
    files.emplace_back("adapter_config.json", json);
    host_.log(ember::LogLevel::info, c10::str("lora: ", layers_.size(), " adapted layers in PEFT's format (r ", rank_, ", lora_alpha ", alpha_,
                                              in_out ? ", fan_in_fan_out" : "", ")"));
    return out;
  }

  void fold_for_export(std::vector<ember::NamedTensor>& state) override {
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < state.size(); ++i) index[state[i].name] = i;
    const double scale = alpha_ / static_cast<double>(rank_);
    std::vector<bool> drop(state.size(), false);
    for (const auto& [name, l] : layers_) {
      const auto w = index.find(name + ".weight"), a = index.find(name + ".lora_A"), b = index.find(name + ".lora_B");
      if (w == index.end() || a == index.end() || b == index.end())
        throw ember::RunError(c10::str("lora: the checkpoint lacks ", name, ".weight, .lora_A or .lora_B: not a checkpoint of this LoRA configuration"));
      at::Tensor& weight = state[w->second].tensor;
      const at::Tensor delta = at::matmul(state[b->second].tensor.to(at::kDouble), state[a->second].tensor.to(at::kDouble)) * scale;  // [out, in]
      weight = (weight.to(at::kDouble) + (l.weight_in_out ? delta.t() : delta)).to(weight.scalar_type()).contiguous();
      drop[a->second] = drop[b->second] = true;
    }
    std::vector<ember::NamedTensor> kept;
    for (size_t i = 0; i < state.size(); ++i)
      if (!drop[i]) kept.push_back(std::move(state[i]));
    state = std::move(kept);
    host_.log(ember::LogLevel::info, c10::str("lora: folded the adapters of ", layers_.size(), " layers into their weights (W + ", scale, " B A)"));
  }

 private:
  ember::IHost& host_;
  int64_t rank_;
  double alpha_, dropout_;
  bool save_frozen_;
  ember::NamePatterns patterns_;
  std::string where_, section_;
  std::map<std::string, ember::LinearLayer> layers_;
  bool causal_lm_ = false;

  // JSON: a number that reads back as the same double, a string with its quotes escaped.
  static std::string number(double v) {
    std::ostringstream s;
    s.precision(17);
    s << v;
    return s.str();
  }
  static std::string quoted(const std::string& text) {
    std::string out = "\"";
    for (char c : text) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out + "\"";
  }
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new Lora(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "lora", "0.1.0", "Apache-2.0",
             "Low-rank adaptation: freezes the model and trains rank-r branches on the chosen linear layers; engine export folds them in.",
             EMBER_CONFIG_KEYS(kKeys), make)
