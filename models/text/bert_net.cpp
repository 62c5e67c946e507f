#include "bert_net.h"

#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>
#include <torch/nn/functional/activation.h>

#include <ember/error.h>

#include <ember/support/activations.h>
#include <ember/support/safetensors.h>

namespace ember_text {
namespace {

using nlohmann::json;

int64_t get_int(const json& j, const std::string& path, const char* key, int64_t fallback, bool required) {
  if (!j.contains(key)) {
    if (required) throw ember::RunError(c10::str(path, ": lacks \"", key, "\": not a ", "BERT-family config.json"));
    return fallback;
  }
  if (!j[key].is_number_integer() || j[key].get<int64_t>() < 0)
    throw ember::RunError(c10::str(path, ": \"", key, "\" must be a non-negative integer, got ", j[key].dump()));
  return j[key].get<int64_t>();
}

double get_float(const json& j, const std::string& path, const char* key, double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number()) throw ember::RunError(c10::str(path, ": \"", key, "\" must be a number, got ", j[key].dump()));
  return j[key].get<double>();
}

Activation parse_activation(const json& j, const std::string& path, const char* key) {
  const std::string a = j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : "gelu";
  if (a == "gelu") return Activation::gelu;
  if (a == "gelu_new" || a == "gelu_pytorch_tanh" || a == "gelu_fast") return Activation::gelu_tanh;
  if (a == "relu") return Activation::relu;
  throw ember::RunError(c10::str(path, ": \"", key, "\" = \"", a, "\" is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu)"));
}

at::Tensor activate(const at::Tensor& x, Activation a) {
  switch (a) {
    case Activation::gelu: return at::gelu(x);
    case Activation::gelu_tanh: return ember::gelu_tanh(x);
    case Activation::relu: return at::relu(x);
  }
  return x;
}

// The file names under which a tensor of this module may be stored, most likely first.
std::vector<std::string> stored_names(const std::string& model_type, const std::string& name) {
  if (model_type == "bert") {
    std::vector<std::string> out;
    const bool head = name.rfind("classifier.", 0) == 0;
    for (const std::string& prefix : head ? std::vector<std::string>{""} : std::vector<std::string>{"", "bert."}) {
      out.push_back(prefix + name);
      // Checkpoints from the TensorFlow era name LayerNorm parameters gamma and beta.
      const auto ln = name.rfind("LayerNorm.");
      if (ln != std::string::npos) {
        const std::string tail = name.substr(ln + 10);
        out.push_back(prefix + name.substr(0, ln + 10) + (tail == "weight" ? "gamma" : "beta"));
      }
    }
    return out;
  }
  // DistilBERT's names for the same tensors.
  static const std::vector<std::pair<std::string, std::string>> layer_map = {
      {"attention.self.query.", "attention.q_lin."},   {"attention.self.key.", "attention.k_lin."},
      {"attention.self.value.", "attention.v_lin."},   {"attention.output.dense.", "attention.out_lin."},
      {"attention.output.LayerNorm.", "sa_layer_norm."}, {"intermediate.dense.", "ffn.lin1."},
      {"output.dense.", "ffn.lin2."},                  {"output.LayerNorm.", "output_layer_norm."}};
  std::string mapped = name;
  if (name.rfind("encoder.layer.", 0) == 0) {
    const size_t dot = name.find('.', 14);
    const std::string index = name.substr(14, dot - 14), rest = name.substr(dot + 1);
    for (const auto& [ours, theirs] : layer_map)
      if (rest.rfind(ours, 0) == 0) mapped = "transformer.layer." + index + "." + theirs + rest.substr(ours.size());
  } else if (name.rfind("pooler.dense.", 0) == 0) {
    return {"pre_classifier." + name.substr(13)};
  } else if (name.rfind("classifier.", 0) == 0) {
    return {name};
  }
  return {mapped, "distilbert." + mapped};
}

}  // namespace

BertConfig BertConfig::from_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ember::RunError(c10::str(path, " not found: a BERT model folder needs its config.json (scripts/setup.sh installs all-MiniLM-L6-v2's)"));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw ember::RunError(c10::str(path, ": not valid JSON (", e.what(), ")"));
  }
  BertConfig c;
  c.model_type = j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "bert";
  if (c.model_type == "bert") {
    c.vocab_size = get_int(j, path, "vocab_size", 0, true);
    c.hidden = get_int(j, path, "hidden_size", 0, true);
    c.layers = get_int(j, path, "num_hidden_layers", 0, true);
    c.heads = get_int(j, path, "num_attention_heads", 0, true);
    c.intermediate = get_int(j, path, "intermediate_size", 0, true);
    c.max_positions = get_int(j, path, "max_position_embeddings", 512, false);
    c.type_vocab_size = get_int(j, path, "type_vocab_size", 2, false);
    c.pad_token_id = get_int(j, path, "pad_token_id", 0, false);
    c.hidden_dropout = get_float(j, path, "hidden_dropout_prob", 0.1);
    c.attention_dropout = get_float(j, path, "attention_probs_dropout_prob", 0.1);
    c.layer_norm_eps = get_float(j, path, "layer_norm_eps", 1e-12);
    c.initializer_range = get_float(j, path, "initializer_range", 0.02);
    c.activation = parse_activation(j, path, "hidden_act");
    if (j.contains("position_embedding_type") && j["position_embedding_type"] != "absolute")
      throw ember::RunError(c10::str(path, ": position_embedding_type ", j["position_embedding_type"].dump(),
                                     " is not supported (only \"absolute\")"));
  } else if (c.model_type == "distilbert") {
    c.vocab_size = get_int(j, path, "vocab_size", 0, true);
    c.hidden = get_int(j, path, "dim", 0, true);
    c.layers = get_int(j, path, "n_layers", 0, true);
    c.heads = get_int(j, path, "n_heads", 0, true);
    c.intermediate = get_int(j, path, "hidden_dim", 0, true);
    c.max_positions = get_int(j, path, "max_position_embeddings", 512, false);
    c.type_vocab_size = 0;
    c.pad_token_id = get_int(j, path, "pad_token_id", 0, false);
    c.hidden_dropout = get_float(j, path, "dropout", 0.1);
    c.attention_dropout = get_float(j, path, "attention_dropout", 0.1);
    c.layer_norm_eps = 1e-12;
    c.initializer_range = get_float(j, path, "initializer_range", 0.02);
    c.activation = parse_activation(j, path, "activation");
  } else {
    throw ember::RunError(c10::str(path, ": model_type \"", c.model_type, "\" is not supported: the bert model reads bert (BERT, MiniLM) and distilbert"));
  }
  if (c.vocab_size < 1 || c.hidden < 1 || c.layers < 1 || c.heads < 1 || c.intermediate < 1)
    throw ember::RunError(c10::str(path, ": vocabulary, width, layers, heads and feed-forward width must all be at least 1"));
  if (c.hidden % c.heads != 0)
    throw ember::RunError(c10::str(path, ": ", c.heads, " attention heads do not divide the width ", c.hidden));
  if (c.pad_token_id >= c.vocab_size)
    throw ember::RunError(c10::str(path, ": pad_token_id ", c.pad_token_id, " is outside the vocabulary of ", c.vocab_size));
  return c;
}

BertLayerImpl::BertLayerImpl(const BertConfig& c)
    : heads_(c.heads), attention_dropout_(c.attention_dropout), act_(c.activation) {
  auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden}).eps(c.layer_norm_eps)); };
  auto attention = register_module("attention", std::make_shared<torch::nn::Module>());
  auto self = attention->register_module("self", std::make_shared<torch::nn::Module>());
  query_ = self->register_module("query", torch::nn::Linear(c.hidden, c.hidden));
  key_ = self->register_module("key", torch::nn::Linear(c.hidden, c.hidden));
  value_ = self->register_module("value", torch::nn::Linear(c.hidden, c.hidden));
  auto attn_output = attention->register_module("output", std::make_shared<torch::nn::Module>());
  attn_out_ = attn_output->register_module("dense", torch::nn::Linear(c.hidden, c.hidden));
  attn_norm_ = attn_output->register_module("LayerNorm", ln());
  auto intermediate = register_module("intermediate", std::make_shared<torch::nn::Module>());
  inter_ = intermediate->register_module("dense", torch::nn::Linear(c.hidden, c.intermediate));
  auto output = register_module("output", std::make_shared<torch::nn::Module>());
  out_ = output->register_module("dense", torch::nn::Linear(c.intermediate, c.hidden));
  out_norm_ = output->register_module("LayerNorm", ln());
  dropout_ = register_module("dropout", torch::nn::Dropout(c.hidden_dropout));
}

at::Tensor TokenLayout::pad(const at::Tensor& t) const {
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = n * s;
  return at::zeros(shape, t.options()).index_copy(0, index, t);
}

at::Tensor BertLayerImpl::forward(const at::Tensor& x, const at::Tensor& keep_mask, const TokenLayout& layout) {
  const int64_t h = x.size(-1), d = h / heads_;
  const int64_t n = layout.unpadded() ? layout.n : x.size(0), s = layout.unpadded() ? layout.s : x.size(1);
  // Query, key and value in one matrix product (one pass over x, one scatter on the unpadded path);
  // the three Linear modules keep their own parameters and names.
  at::Tensor qkv = at::linear(x, at::cat({query_->weight, key_->weight, value_->weight}),
                              at::cat({query_->bias, key_->bias, value_->bias}));
  if (layout.unpadded()) qkv = layout.pad(qkv);
  const auto parts = qkv.view({n, s, 3, heads_, d}).permute({2, 0, 3, 1, 4}).unbind(0);  // 3 x [N, heads, S, d]
  at::Tensor ctx = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], keep_mask,
                                                    is_training() ? attention_dropout_ : 0.0);
  ctx = ctx.transpose(1, 2).reshape({n * s, h});
  ctx = layout.unpadded() ? ctx.index_select(0, layout.index) : ctx.view({n, s, h});
  at::Tensor a = attn_norm_(dropout_(attn_out_(ctx)) + x);
  return out_norm_(dropout_(out_(activate(inter_(a), act_))) + a);
}

BertClassifierNet::BertClassifierNet(const BertConfig& c, const BertHead& head, Unpad unpad)
    : config_(c), head_(head), unpad_(unpad) {
  auto embeddings = register_module("embeddings", std::make_shared<torch::nn::Module>());
  word_ = embeddings->register_module(
      "word_embeddings", torch::nn::Embedding(torch::nn::EmbeddingOptions(c.vocab_size, c.hidden).padding_idx(c.pad_token_id)));
  position_ = embeddings->register_module("position_embeddings", torch::nn::Embedding(c.max_positions, c.hidden));
  if (c.type_vocab_size > 0)
    token_type_ = embeddings->register_module("token_type_embeddings", torch::nn::Embedding(c.type_vocab_size, c.hidden));
  emb_norm_ = embeddings->register_module(
      "LayerNorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden}).eps(c.layer_norm_eps)));
  dropout_ = register_module("dropout", torch::nn::Dropout(c.hidden_dropout));
  auto encoder = register_module("encoder", std::make_shared<torch::nn::Module>());
  auto list = encoder->register_module("layer", std::make_shared<torch::nn::Module>());
  for (int64_t i = 0; i < c.layers; ++i) layers_.push_back(list->register_module(std::to_string(i), BertLayer(c)));
  if (head.pooling == Pooling::pooler) {
    auto pooler = register_module("pooler", std::make_shared<torch::nn::Module>());
    pooler_ = pooler->register_module("dense", torch::nn::Linear(c.hidden, c.hidden));
  }
  head_dropout_ = register_module("head_dropout", torch::nn::Dropout(head.dropout));
  classifier_ = register_module("classifier", torch::nn::Linear(c.hidden, head.num_classes));
  init_weights();
}

void BertClassifierNet::init_weights() {
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    const bool norm = name.find("LayerNorm") != std::string::npos;
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) p.zero_();
    else if (norm) p.fill_(1.0);
    else p.normal_(0.0, config_.initializer_range);
  }
  word_->weight[config_.pad_token_id].zero_();
}

std::vector<std::string> BertClassifierNet::load_safetensors(const std::string& path) {
  ember::support::SafetensorsFile file(path);
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    const bool optional = name.rfind("classifier.", 0) == 0 || name.rfind("pooler.", 0) == 0;
    const std::vector<std::string> candidates = stored_names(config_.model_type, name);
    const std::string* found = nullptr;
    for (const auto& c : candidates)
      if (file.contains(c)) { found = &c; break; }
    if (found == nullptr) {
      if (optional) continue;  // a pretrained encoder without this head: it keeps its fresh initialisation
      throw ember::RunError(c10::str(path, ": missing tensor '", candidates.front(), "' (", config_.model_type,
                                     " layout, for ", name, "): the file does not hold the model its config.json describes"));
    }
    const at::Tensor t = file.tensor(*found);
    if (t.sizes() != p.sizes())
      throw ember::RunError(c10::str(path, ": tensor '", *found, "' has shape ", t.sizes(), ", the model needs ", p.sizes(),
                                     *found == "classifier.weight" || *found == "classifier.bias"
                                         ? ": set num_classes to the file's classes or use a file without a classifier"
                                         : ": the file does not match config.json"));
    if (!at::isFloatingType(t.scalar_type()))
      throw ember::RunError(c10::str(path, ": tensor '", *found, "' has dtype ", t.scalar_type(), ", expected floating point"));
    p.copy_(t);
    used.insert(*found);
  }
  std::vector<std::string> unused;
  for (const auto& n : file.names())
    if (!used.count(n) && n.find("position_ids") == std::string::npos) unused.push_back(n);
  return unused;
}

std::string BertClassifierNet::transformers_name(const std::string& name) const {
  if (name.rfind("classifier.", 0) == 0) return name;
  if (config_.model_type == "bert") return "bert." + name;
  // stored_names lists DistilBERT's bare name first, then the one with the model's prefix.
  const auto names = stored_names(config_.model_type, name);
  return names.size() > 1 ? names.back() : names.front();
}

void BertClassifierNet::freeze_encoder() {
  for (auto& item : named_parameters())
    if (item.key().rfind("classifier.", 0) != 0) item.value().requires_grad_(false);
}

void BertClassifierNet::declare_units(ember::ModelUnits& units) {
  units_ = &units;
  for (size_t i = 0; i < layers_.size(); ++i) units.add("layer" + std::to_string(i), layers_[i].ptr());
}

at::Tensor BertClassifierNet::pooled(const at::Tensor& input_ids, const at::Tensor& attention_mask) {
  const int64_t s = input_ids.size(1);
  if (s > config_.max_positions)
    throw ember::RunError(c10::str("bert: sequences of ", s, " tokens exceed the model's ", config_.max_positions,
                                   " positions: set [data] max_length to at most ", config_.max_positions));
  const int64_t n = input_ids.size(0);
  const at::Tensor keep = attention_mask.to(at::kBool);
  // [N, 1, 1, S]: every query attends to the sequence's tokens, never to its padding.
  const at::Tensor keep4 = keep.view({n, 1, 1, s});
  // Ids outside the embedding table would fail inside LibTorch ("index out of range in self"; on
  // a GPU a device-side assert that ends the process); the usual cause is a data tokenizer that
  // is not this model's. Checked where it costs no extra synchronisation: always on the CPU, and
  // on a device together with the token count that unpadding reads anyway.
  TokenLayout layout;
  if (input_ids.numel() > 0 && (unpad_ != Unpad::never || input_ids.is_cpu())) {
    const at::Tensor stats = at::stack({keep.sum().to(at::kLong), input_ids.max().to(at::kLong), input_ids.min().to(at::kLong)}).cpu();
    const int64_t tokens = stats[0].item<int64_t>(), largest = stats[1].item<int64_t>(), smallest = stats[2].item<int64_t>();
    if (largest >= config_.vocab_size || smallest < 0)
      throw ember::RunError(c10::str("bert: token id ", largest >= config_.vocab_size ? largest : smallest, " is outside the model's vocabulary of ",
                                     config_.vocab_size, " (its config.json): the data's tokenizer is not this model's; set [data] "
                                     "tokenizer_dir to the model's folder (model_dir)"));
    if (unpad_ != Unpad::never && tokens < n * s && (unpad_ == Unpad::always || (n * s - tokens) * 20 >= n * s))
      layout = TokenLayout{keep.flatten().nonzero().squeeze(1), n, s};
  }
  at::Tensor positions = at::arange(s, input_ids.options()).unsqueeze(0);
  at::Tensor ids = input_ids;
  if (layout.unpadded()) {  // embed only the real tokens: [T] ids and positions
    ids = input_ids.flatten().index_select(0, layout.index);
    positions = positions.expand({n, s}).flatten().index_select(0, layout.index);
  }
  at::Tensor x = word_(ids) + position_(positions);
  if (token_type_) x = x + token_type_->weight[0];  // single sequences: every token is of type 0
  x = dropout_(emb_norm_(x));
  for (size_t i = 0; i < layers_.size(); ++i) {
    // By value: under activation checkpointing the layer runs again during backward.
    auto run = [layer = layers_[i].ptr(), keep4, layout](const at::Tensor& in) { return layer->forward(in, keep4, layout); };
    x = units_ != nullptr ? units_->run(static_cast<int64_t>(i), x, run) : run(x);
  }
  // Pooling reads the padded layout (zeros at the padding, which it leaves out or never reads).
  if (layout.unpadded()) x = layout.pad(x).view({n, s, x.size(-1)});
  switch (head_.pooling) {
    case Pooling::mean: {
      const at::Tensor m = keep.unsqueeze(-1).to(x.scalar_type());
      return (x * m).sum(1) / m.sum(1).clamp_min(1e-9);
    }
    case Pooling::cls: return x.select(1, 0);
    case Pooling::pooler: {
      const at::Tensor p = pooler_(x.select(1, 0));
      return config_.model_type == "distilbert" ? at::relu(p) : at::tanh(p);
    }
  }
  return x.select(1, 0);
}

at::Tensor BertClassifierNet::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask) {
  return classifier_(head_dropout_(pooled(input_ids, attention_mask)));
}

}  // namespace ember_text
