// gpt: a decoder-only language model (models/gpt/gpt_net.h) in GPT-2's or Llama's layout, trained
// on next-token prediction. Built from the [model] keys, or from a transformers model folder
// (model_dir: config.json and safetensors) to fine-tune it. Every block is a unit, so sharded
// strategies gather one block at a time. `engine generate` runs it through ICausalLanguageModel
// (a key/value cache), `engine export` writes a folder transformers loads.
// Batch (the text_lm data module): tensors[0] = input ids int64 [N, T], tensors[1] = the next
// ids int64 [N, T].
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include <c10/util/StringUtil.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/language_model.h>
#include <ember/model.h>
#include <ember/model_adapters.h>
#include <ember/model_export.h>
#include <ember/model_flops.h>
#include <ember/model_units.h>
#include <ember/pipeline.h>
#include <ember/plugin.h>

#include "gpt_net.h"

#include <ember/support/cross_entropy.h>
#include <ember/support/linear_cross_entropy.h>
#include <ember/support/tensor_parallel.h>

namespace {

using ember_gpt::Flavour;
using ember_gpt::GptShape;

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("flavour", "\"gpt2\"", "gpt2: learned positions, LayerNorm, GELU MLP, tied embeddings; llama: RoPE, RMSNorm, SwiGLU, grouped-query attention.").choices("gpt2|llama"),
    ember::key::String("model_dir", "\"\"", "A transformers model folder (config.json + model.safetensors or its index) of a GPT2LMHeadModel or LlamaForCausalLM: its config.json gives the shape (the shape keys below are then ignored). Empty: the shape keys."),
    ember::key::Bool("pretrained", "true", "With model_dir: load its weights; false starts from a random initialisation of its shape."),
    ember::key::Int("vocab_size", "0", "Tokens the model knows: at least the data's tokenizer's vocabulary (text_lm logs it). Required without model_dir.").at_least(0),
    ember::key::Int("context_length", "1024", "Positions the model attends over (GPT-2's n_positions): the longest sequence it trains on or generates.").at_least(1),
    ember::key::Int("layers", "12", "Decoder blocks.").at_least(1),
    ember::key::Int("heads", "12", "Attention heads; must divide width.").at_least(1),
    ember::key::Int("kv_heads", "0", "llama: key/value heads (grouped-query attention), dividing heads; 0 = heads.").at_least(0),
    ember::key::Int("width", "768", "Model width (n_embd / hidden_size).").at_least(1),
    ember::key::Int("ff_width", "0", "The MLP's inner width; 0 = 4 x width (gpt2) or 8/3 x width rounded up to a multiple of 64 (llama).").at_least(0),
    ember::key::Bool("bias", "true", "gpt2: biases in the linear layers and LayerNorms (nanoGPT's bias; false is faster, and engine export writes zeros for them, which transformers' GPT-2 always has)."),
    ember::key::Bool("tied", "true", "The output layer is the token embedding (GPT-2's tie_word_embeddings)."),
    ember::key::Float("dropout", "0.0", "Dropout on embeddings, attention and residual branches, in [0, 1).").at_least(0.0).below(1.0),
    ember::key::Float("norm_eps", "1e-5", "Epsilon of LayerNorm (gpt2) or RMSNorm (llama).").above(0.0),
    ember::key::Float("rope_theta", "10000.0", "llama: the base of the rotary position frequencies.").above(0.0),
    ember::key::Bool("fused_cross_entropy", "false", "The loss's softmax and cross-entropy run as Ember's two fused passes over the logits in their own dtype (Ember::losses' cross_entropy: one read forward, one read and write backward) instead of LibTorch's float32 copy, log-softmax and one-hot gradient. Same loss and gradients to float32 rounding; its CUDA kernels have not yet been timed on a GPU (bench/lm_gpu.sh)."),
    ember::key::Bool("chunked_loss", "false", "Training computes the output layer and the cross-entropy together, a slice of tokens at a time, with their gradients: the whole [tokens, vocabulary] logits are never kept (GPT-2 on an H200: 37% less peak memory, 3.5% fewer tokens/s). Its training steps hand no logits to the [metrics] table, so train metrics need it false."),
    ember::key::Float("init_std", "0.02", "Standard deviation of the initial weights (residual projections: divided by sqrt(2 x layers)).").above(0.0),
};

GptShape shape_from_keys(const ember::IConfig& cfg) {
  const std::string s = c10::str("[", cfg.section(), "] ");
  GptShape shape;
  shape.flavour = cfg.get_string("flavour") == "llama" ? Flavour::llama : Flavour::gpt2;
  shape.vocab_size = cfg.get_int("vocab_size");
  if (shape.vocab_size == 0)
    throw ember::ConfigError(c10::str(s, "vocab_size is not set (", cfg.where("vocab_size"),
                                      "): set it to at least the tokenizer's vocabulary (text_lm logs its size at start), or give model_dir"));
  shape.context_length = cfg.get_int("context_length");
  shape.layers = cfg.get_int("layers");
  shape.heads = cfg.get_int("heads");
  shape.width = cfg.get_int("width");
  if (shape.width % shape.heads != 0)
    throw ember::ConfigError(c10::str(s, "heads = ", shape.heads, " (", cfg.where("heads"), ") does not divide width = ", shape.width, " (",
                                      cfg.where("width"), "): choose heads that split the width evenly"));
  shape.kv_heads = cfg.get_int("kv_heads") == 0 ? shape.heads : cfg.get_int("kv_heads");
  if (shape.flavour == Flavour::gpt2 && shape.kv_heads != shape.heads)
    throw ember::ConfigError(c10::str(s, "kv_heads = ", shape.kv_heads, " (", cfg.where("kv_heads"),
                                      "): grouped-query attention is llama's; use flavour = \"llama\" or kv_heads = 0"));
  if (shape.heads % shape.kv_heads != 0)
    throw ember::ConfigError(c10::str(s, "kv_heads = ", shape.kv_heads, " (", cfg.where("kv_heads"), ") does not divide heads = ", shape.heads));
  if (shape.flavour == Flavour::llama && shape.head_dim() % 2 != 0)
    throw ember::ConfigError(c10::str(s, "width / heads = ", shape.head_dim(), " is odd: rotary positions need an even head width"));
  shape.ff_width = cfg.get_int("ff_width");
  if (shape.ff_width == 0)
    shape.ff_width = shape.flavour == Flavour::gpt2 ? 4 * shape.width : (8 * shape.width / 3 + 63) / 64 * 64;
  shape.bias = shape.flavour == Flavour::gpt2 && cfg.get_bool("bias");
  shape.tied = cfg.get_bool("tied");
  shape.norm_eps = cfg.get_float("norm_eps");
  shape.rope_theta = cfg.get_float("rope_theta");
  return shape;
}

class Gpt final : public ember::IModel,
                  public ember::UnitModel,
                  public ember::IModelFlops,
                  public ember::ICausalLanguageModel,
                  public ember::ILinearLayers,
                  public ember::IExportableModel2,
                  public ember::IExportedExtraTensors,
                  public ember::ITensorParallelModel,
                  public ember::IPipelineModel {
 public:
  Gpt(ember::IHost& host, const ember::IConfig& cfg) : section_(cfg.section()) {
    GptShape shape;
    std::string origin = "initialised from the [model] keys";
    const std::string dir = cfg.get_string("model_dir");
    std::string weights;
    if (!dir.empty()) {
      if (!std::filesystem::is_directory(dir))
        throw ember::ConfigError(c10::str("[", cfg.section(), "] model_dir = \"", dir, "\" (", cfg.where("model_dir"),
                                          "): no such folder (give a transformers model folder with config.json and model.safetensors)"));
      shape = GptShape::from_hf_config((std::filesystem::path(dir) / "config.json").string());
      if (cfg.get_bool("pretrained")) {
        for (const char* name : {"model.safetensors", "model.safetensors.index.json"})
          if (std::filesystem::exists(std::filesystem::path(dir) / name)) {
            weights = (std::filesystem::path(dir) / name).string();
            break;
          }
        if (weights.empty())
          throw ember::ConfigError(c10::str("[", cfg.section(), "] model_dir = \"", dir, "\": no model.safetensors (or its index) in the folder; ",
                                            "save the model with safetensors, or set pretrained = false"));
      }
      origin = weights.empty() ? "shape of " + dir + "/config.json, random weights" : "loaded from " + weights;
    } else {
      shape = shape_from_keys(cfg);
    }
    shape.dropout = cfg.get_float("dropout");
    shape.init_std = cfg.get_float("init_std");
    net_ = std::make_shared<ember_gpt::GptNet>(shape, weights.empty() ? &host : nullptr);
    if (!weights.empty()) {
      const auto unused = net_->load_safetensors(weights);
      if (!unused.empty())
        origin += c10::str(" (", unused.size(), " tensor(s) of the file unused, e.g. ", unused.front(), ")");
    }
    chunked_loss_ = cfg.get_bool("chunked_loss");
    fused_cross_entropy_ = cfg.get_bool("fused_cross_entropy");
    net_->declare_units(units_);
    host.log(ember::LogLevel::info, c10::str("gpt: ", shape.describe(), "; ", origin));
  }

  torch::nn::Module& module() override { return *net_; }
  std::vector<ember::TensorShard> parallelize_tensors(ember::ITensorParallelGroup& group) override {
    return net_->parallelize_tensors(group, section_);
  }
  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kModelFlopsIid) == 0) return static_cast<ember::IModelFlops*>(this);
    if (std::strcmp(iid, ember::kCausalLanguageModelIid) == 0) return static_cast<ember::ICausalLanguageModel*>(this);
    if (std::strcmp(iid, ember::kExportableModel2Iid) == 0) return static_cast<ember::IExportableModel2*>(this);
    if (std::strcmp(iid, ember::kLinearLayersIid) == 0) return static_cast<ember::ILinearLayers*>(this);
    if (std::strcmp(iid, ember::kExportableModelIid) == 0) return static_cast<ember::IExportableModel*>(this);
    if (std::strcmp(iid, ember::kExportedExtraTensorsIid) == 0) return static_cast<ember::IExportedExtraTensors*>(this);
    if (std::strcmp(iid, ember::kTensorParallelModelIid) == 0) return static_cast<ember::ITensorParallelModel*>(this);
    if (std::strcmp(iid, ember::kPipelineModelIid) == 0) return static_cast<ember::IPipelineModel*>(this);
    return unit_model_interface(iid);
  }

  // Pipeline stages (ember/pipeline.h) cut at blocks: the first stage embeds the ids, the last
  // applies the final norm and the output layer and computes the loss. A tied output layer
  // multiplies by the embedding, which the first and the last stage then both hold.
  void keep_pipeline_stages(const std::vector<ember::UnitRange>& stages) override { net_->keep_blocks(stages); }
  at::Tensor pipeline_forward(const ember::UnitRange& stage, const ember::Batch& batch, const at::Tensor& input,
                              ember::IStepContext& ctx) override {
    if (batch.tensors.size() < 2)
      throw ember::RunError("gpt: a batch needs input ids and next-token targets [N, T] (use the text_lm data module)");
    const at::Tensor ids = checked_ids(batch[0]);
    at::Tensor x = stage.begin == 0 ? net_->embed(ids, 0) : input;
    x = net_->run_blocks(x, stage.begin, stage.end, 0, ids.size(1), nullptr);
    if (stage.end < net_->shape().layers) return x;
    const char* split = ctx.stage() == ember::Stage::fit ? "train" : ctx.stage() == ember::Stage::test ? "test" : "val";
    if (chunks_loss(split)) return chunked_loss_and_log(net_->final_hidden(x), batch, ctx);
    return loss_and_log(net_->head(x), batch, ctx, split);
  }
  std::vector<std::string> pipeline_shared_parameters() const override {
    if (!net_->shape().tied) return {};
    return {net_->embedding_name()};
  }

  at::Tensor training_step(const ember::Batch& batch, ember::IStepContext& ctx) override { return step(batch, ctx, "train"); }
  void validation_step(const ember::Batch& batch, ember::IStepContext& ctx) override { step(batch, ctx, "val"); }
  void test_step(const ember::Batch& batch, ember::IStepContext& ctx) override { step(batch, ctx, "test"); }

  // Perplexity = exp(the epoch's mean token loss): every window of text_lm has block_size tokens,
  // so the batch-weighted mean the engine reduces over all ranks is the mean over all tokens.
  void on_hook(ember::Hook hook, ember::ITrainer& trainer) override {
    if (trainer.sanity_checking()) return;
    const char* split = hook == ember::Hook::on_validation_end ? "val" : hook == ember::Hook::on_test_end ? "test" : nullptr;
    double loss = 0.0;
    if (split != nullptr && trainer.metric(std::string(split) + "_loss", &loss)) trainer.log_metric(std::string(split) + "_ppl", std::exp(loss));
  }

  // 6 x (matmul parameters) per token for forward and backward, plus attention's scores and
  // weighted values (2 x 2 x T x width per layer forward, x 3 with backward): nanoGPT's estimate.
  double training_flops(const ember::Batch& batch) const override {
    if (batch.tensors.empty() || batch[0].dim() != 2) return 0.0;
    const auto& s = net_->shape();
    const double tokens = static_cast<double>(batch[0].numel()), t = static_cast<double>(batch[0].size(1));
    return tokens * (6.0 * static_cast<double>(net_->matmul_parameters()) + 12.0 * static_cast<double>(s.layers) * t * static_cast<double>(s.width));
  }

  // trainer.activation_checkpointing = "selective": the MLP of every block is recomputed.
  bool set_selective_checkpointing(bool on) override {
    net_->set_selective_checkpointing(on);
    return true;
  }

  // ILinearLayers: the blocks' projections (attention and MLP), for adapters such as LoRA.
  std::vector<ember::LinearLayer> linear_layers() override { return net_->linear_layers(); }
  void set_linear_adapter(const std::string& name, std::shared_ptr<ember::ILinearAdapter> adapter) override {
    net_->set_linear_adapter(name, std::move(adapter));
  }

  // ICausalLanguageModel
  int64_t vocab_size() const override { return net_->shape().vocab_size; }
  int64_t context_length() const override { return net_->shape().context_length; }
  at::Tensor logits(const at::Tensor& ids) override { return whole_vocabulary(net_->forward(checked_ids(ids))).to(at::kFloat); }
  void begin_generation(int64_t batch_size, int64_t max_length) override {
    cache_ = net_->new_cache(batch_size, std::min(max_length, context_length()));
  }
  at::Tensor generation_step(const at::Tensor& ids) override {
    if (cache_.capacity == 0) throw ember::RunError("gpt: generation_step without begin_generation");
    return whole_vocabulary(net_->forward(checked_ids(ids), &cache_)).to(at::kFloat);
  }
  int64_t cached_length() const override { return cache_.length; }
  void end_generation() override { cache_ = {}; }

  // IExportableModel2: the parameter names are transformers' already.
  std::string exported_name(const std::string& name) const override { return name; }
  std::vector<std::pair<std::string, std::string>> exported_files() const override { return exported_files_with_classes({}); }
  std::vector<std::pair<std::string, std::string>> exported_files_with_classes(const std::vector<std::string>&) const override {
    return {{"config.json", net_->shape().hf_config_json()}};
  }
  // IExportedExtraTensors: GPT2LMHeadModel always has biases (its Conv1D layers and LayerNorms); a
  // gpt2 built without them (model.bias = false) exports zeros there, which compute the same.
  std::vector<ember::NamedTensor> exported_extra_tensors() const override {
    std::vector<ember::NamedTensor> zeros;
    if (net_->shape().flavour != Flavour::gpt2 || net_->shape().bias) return zeros;
    for (const auto& item : net_->named_modules("", /*include_self=*/false)) {
      const at::Tensor* weight = nullptr;
      int64_t size = 0;
      if (const auto* conv = dynamic_cast<const ember_gpt::Conv1DImpl*>(item.value().get()); conv && !conv->bias.defined()) {
        weight = &conv->weight;
        size = conv->weight.size(1);  // [in, out]
      } else if (const auto* norm = dynamic_cast<const ember_gpt::NormImpl*>(item.value().get()); norm && !norm->bias.defined()) {
        weight = &norm->weight;
        size = norm->weight.size(0);
      }
      if (weight != nullptr) zeros.push_back({item.key() + ".bias", at::zeros({size}, weight->options().device(at::kCPU))});
    }
    return zeros;
  }
  std::string export_note() const override {
    return c10::str("transformers: AutoModelForCausalLM.from_pretrained(folder) (",
                    net_->shape().flavour == Flavour::gpt2 ? "GPT2LMHeadModel" : "LlamaForCausalLM", ") gives Ember's logits");
  }

 private:
  at::Tensor step(const ember::Batch& batch, ember::IStepContext& ctx, const std::string& split) {
    if (batch.tensors.size() < 2)
      throw ember::RunError("gpt: a batch needs input ids and next-token targets [N, T] (use the text_lm data module)");
    if (chunks_loss(split)) return chunked_loss_and_log(net_->forward_hidden(checked_ids(batch[0])), batch, ctx);
    return loss_and_log(net_->forward(checked_ids(batch[0])), batch, ctx, split);
  }
  // model.chunked_loss: training steps (their gradients are made in the loss's forward, so only
  // where a backward follows), never under vocabulary parallelism (its own cross-entropy).
  bool chunks_loss(const std::string& split) const {
    return chunked_loss_ && split == "train" && at::GradMode::is_enabled() && net_->vocab_parallel_group() == nullptr;
  }
  at::Tensor chunked_loss_and_log(const at::Tensor& hidden, const ember::Batch& batch, ember::IStepContext& ctx) {
    const at::Tensor loss = ember::linear_cross_entropy(hidden.reshape({-1, hidden.size(-1)}), net_->output_weight(), batch[1].reshape({-1}));
    log_loss(loss, ctx, "train");
    return loss;
  }
  static void log_loss(const at::Tensor& loss, ember::IStepContext& ctx, const std::string& split) {
    ember::LogOptions o;
    o.on_step = split == "train" ? 1 : 0;
    o.on_epoch = 1;
    o.prog_bar = true;
    o.sync_dist = true;
    ctx.log(split + "_loss", loss.detach(), o);
  }
  at::Tensor loss_and_log(const at::Tensor& logits, const ember::Batch& batch, ember::IStepContext& ctx, const std::string& split) {
    const at::Tensor rows = logits.reshape({-1, logits.size(-1)}), targets = batch[1].reshape({-1}).to(at::kLong);
    auto* vocab_group = net_->vocab_parallel_group();  // tensor parallelism: this rank's vocabulary columns
    const at::Tensor loss = vocab_group           ? ember::vocab_parallel_cross_entropy(rows, targets, *vocab_group)
                            : fused_cross_entropy_ ? ember::cross_entropy(rows, targets)
                                                   : at::cross_entropy_loss(rows, targets);
    log_loss(loss, ctx, split);
    // Logits and next tokens for the run's [metrics] table (perplexity, top-k accuracy...). Under
    // vocabulary parallelism only evaluation hands them over (whole rows need an all-gather,
    // which a training step should not pay); the engine says so if train metrics are asked.
    if (!vocab_group) ctx.update_metrics(logits.detach(), batch[1]);
    else if (split != "train") ctx.update_metrics(whole_vocabulary(logits), batch[1]);
    return loss;
  }
  // Logits over the whole vocabulary: under vocabulary parallelism every rank's columns, joined.
  at::Tensor whole_vocabulary(const at::Tensor& logits) const {
    auto* group = net_->vocab_parallel_group();
    if (!group) return logits;
    at::NoGradGuard no_grad;
    return at::cat(group->all_gather(logits.detach()).unbind(0), -1);
  }
  at::Tensor checked_ids(const at::Tensor& ids) const {
    if (ids.dim() != 2 || at::isFloatingType(ids.scalar_type()))
      throw ember::RunError(c10::str("gpt: got inputs ", ids.scalar_type(), " ", ids.sizes(), ", expected token ids int64 [N, T] (the text_lm data module)"));
    return ids.scalar_type() == at::kLong ? ids : ids.to(at::kLong);
  }
  std::string section_;
  std::shared_ptr<ember_gpt::GptNet> net_;
  bool chunked_loss_ = false;
  bool fused_cross_entropy_ = false;
  ember_gpt::GenerationCache cache_;
};

ember::IModel* make(ember::IHost& host, const ember::IConfig& cfg) { return new Gpt(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "gpt", "0.1.0", "Apache-2.0",
             "Decoder-only language model (GPT-2 or Llama layout), from the config or a transformers folder; generates with a key/value cache.",
             EMBER_CONFIG_KEYS(kKeys), make)
