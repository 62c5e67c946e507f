#include "gpt_net.h"

#include <ember/deferred_init.h>
#include <ember/support/tensor_parallel.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <type_traits>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>
#include <torch/nn/functional/dropout.h>
#include <torch/utils.h>

#include <ember/error.h>
#include <ember/support/activations.h>
#include <ember/support/safetensors.h>

namespace ember_gpt {
namespace {

at::Tensor maybe_dropout(const at::Tensor& x, double p, bool training) {
  return p > 0.0 && training ? at::dropout(x, p, true) : x;
}

// GPT-2's "gelu_new" through Ember::activations (ATen 2.11's CPU kernel for it is ~4x slower).
at::Tensor gelu(const at::Tensor& x, bool tanh_form) { return tanh_form ? ember::gelu_tanh(x) : at::gelu(x); }

// [.., D] -> [.., D] with the halves swapped and the first negated (transformers' rotate_half).
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

[[noreturn]] void config_error(const std::string& path, const std::string& what) {
  throw ember::RunError(c10::str(path, ": ", what));
}

}  // namespace

std::string GptShape::describe() const {
  return c10::str(flavour == Flavour::gpt2 ? "gpt2" : "llama", ", ", layers, " layers x ", heads, " heads",
                  kv_heads != heads ? c10::str(" (", kv_heads, " key/value)") : std::string(), " x ", width, " wide, context ",
                  context_length, ", vocabulary ", vocab_size, tied ? ", tied output" : "");
}

GptShape GptShape::from_hf_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) config_error(path, "cannot read the model's config.json (give model_dir a transformers model folder)");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) config_error(path, "not a JSON object");
  auto need = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key) || j[key].is_null()) config_error(path, c10::str("no \"", key, "\" (is this a transformers config.json?)"));
    return j[key];
  };
  // Each value read with its type checked, so that a wrong one names its key (nlohmann's own error
  // does not): a float, a string or a non-positive size would build a model that fails far later.
  auto get_or = [&](const char* key, auto fallback) {
    using T = decltype(fallback);
    if (!j.contains(key) || j[key].is_null()) return fallback;
    const auto& v = j[key];
    bool fits = v.is_number();
    if constexpr (std::is_same_v<T, bool>) fits = v.is_boolean();
    else if constexpr (std::is_same_v<T, std::string>) fits = v.is_string();
    else if constexpr (std::is_integral_v<T>) fits = v.is_number_integer() && v.get<int64_t>() > 0;
    if (!fits)
      config_error(path, c10::str("\"", key, "\" = ", v.dump(), " is not ",
                                  std::is_same_v<T, bool> ? "true or false" : std::is_same_v<T, std::string> ? "a string"
                                  : std::is_integral_v<T> ? "a positive integer" : "a number"));
    return v.get<T>();
  };
  auto size = [&](const char* key) {
    need(key);
    return get_or(key, int64_t{0});
  };
  const std::string type = j.value("model_type", "");
  GptShape s;
  if (type == "gpt2") {
    s.flavour = Flavour::gpt2;
    s.vocab_size = size("vocab_size");
    s.context_length = size("n_positions");
    s.width = size("n_embd");
    s.layers = size("n_layer");
    s.heads = size("n_head");
    s.kv_heads = s.heads;
    s.ff_width = get_or("n_inner", int64_t{4 * s.width});
    const std::string act = get_or("activation_function", std::string("gelu_new"));
    if (act == "gelu_new" || act == "gelu_pytorch_tanh") s.gelu_tanh = true;
    else if (act == "gelu") s.gelu_tanh = false;
    else config_error(path, c10::str("activation_function \"", act, "\" is not supported (gelu_new, gelu_pytorch_tanh or gelu)"));
    s.norm_eps = get_or("layer_norm_epsilon", 1e-5);
    s.tied = get_or("tie_word_embeddings", true);
    s.bias = true;
    if (get_or("scale_attn_by_inverse_layer_idx", false) || get_or("reorder_and_upcast_attn", false))
      config_error(path, "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported");
  } else if (type == "llama") {
    s.flavour = Flavour::llama;
    s.vocab_size = size("vocab_size");
    s.context_length = size("max_position_embeddings");
    s.width = size("hidden_size");
    s.layers = size("num_hidden_layers");
    s.heads = size("num_attention_heads");
    s.kv_heads = get_or("num_key_value_heads", s.heads);
    s.ff_width = size("intermediate_size");
    s.norm_eps = get_or("rms_norm_eps", 1e-6);
    s.tied = get_or("tie_word_embeddings", false);
    s.bias = false;
    // transformers 4 writes rope_theta at the top; 5 inside rope_parameters.
    s.rope_theta = get_or("rope_theta", 10000.0);
    const nlohmann::json* scaling = nullptr;
    if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
      scaling = &j["rope_parameters"];
      s.rope_theta = scaling->value("rope_theta", s.rope_theta);
    } else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
      scaling = &j["rope_scaling"];
    }
    if (scaling) {
      const std::string kind = scaling->value("rope_type", scaling->value("type", std::string("default")));
      if (kind != "default") config_error(path, c10::str("rope type \"", kind, "\" is not supported (only the default RoPE)"));
    }
    if (get_or("hidden_act", std::string("silu")) != "silu") config_error(path, "hidden_act must be \"silu\" (SwiGLU)");
    if (get_or("attention_bias", false) || get_or("mlp_bias", false)) config_error(path, "attention_bias / mlp_bias are not supported");
    if (const int64_t head_dim = get_or("head_dim", s.width / s.heads); head_dim != s.width / s.heads)
      config_error(path, c10::str("head_dim ", head_dim, " differs from hidden_size / num_attention_heads"));
  } else {
    config_error(path, c10::str("model_type \"", type, "\": the gpt model reads gpt2 and llama folders"));
  }
  if (s.heads <= 0 || s.width % s.heads != 0) config_error(path, "the number of heads does not divide the width");
  if (s.kv_heads <= 0 || s.heads % s.kv_heads != 0) config_error(path, "num_key_value_heads does not divide num_attention_heads");
  return s;
}

std::string GptShape::hf_config_json() const {
  nlohmann::json j;
  if (flavour == Flavour::gpt2) {
    j = {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", vocab_size}, {"n_positions", context_length},
         {"n_embd", width}, {"n_layer", layers}, {"n_head", heads}, {"n_inner", ff_width},
         {"activation_function", gelu_tanh ? "gelu_new" : "gelu"}, {"layer_norm_epsilon", norm_eps}, {"tie_word_embeddings", tied},
         {"resid_pdrop", dropout}, {"embd_pdrop", dropout}, {"attn_pdrop", dropout}, {"bos_token_id", vocab_size - 1},
         {"eos_token_id", vocab_size - 1}};
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", vocab_size},
         {"max_position_embeddings", context_length}, {"hidden_size", width}, {"intermediate_size", ff_width},
         {"num_hidden_layers", layers}, {"num_attention_heads", heads}, {"num_key_value_heads", kv_heads}, {"head_dim", head_dim()},
         {"rms_norm_eps", norm_eps}, {"rope_theta", rope_theta},
         {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", rope_theta}}}, {"hidden_act", "silu"},
         {"tie_word_embeddings", tied}, {"attention_bias", false}, {"mlp_bias", false}, {"attention_dropout", dropout}};
  }
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}

Conv1DImpl::Conv1DImpl(int64_t in, int64_t out, bool with_bias) {
  weight = register_parameter("weight", torch::empty({in, out}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({out}));
}

at::Tensor Conv1DImpl::forward(const at::Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(1);
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  return (bias.defined() ? at::addmm(bias, rows, weight) : at::mm(rows, weight)).view(sizes);
}

NormImpl::NormImpl(int64_t width, bool rms, bool with_bias, double eps) : rms_(rms), eps_(eps) {
  weight = register_parameter("weight", torch::ones({width}));
  if (with_bias && !rms) bias = register_parameter("bias", torch::zeros({width}));
}

at::Tensor NormImpl::forward(const at::Tensor& x) {
  if (!rms_) return at::layer_norm(x, {weight.size(0)}, weight, bias, eps_);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * normed.to(x.scalar_type());
}

AttentionImpl::AttentionImpl(const GptShape& shape, std::shared_ptr<const Adapters> adapters, std::string prefix)
    : shape_(shape), adapters_(std::move(adapters)), prefix_(std::move(prefix)) {
  const int64_t c = shape.width, kv = shape.kv_heads * shape.head_dim();
  if (shape.flavour == Flavour::gpt2) {
    c_attn_ = register_module("c_attn", Conv1D(c, 3 * c, shape.bias));
    c_proj_ = register_module("c_proj", Conv1D(c, c, shape.bias));
  } else {
    auto linear = [](int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); };
    q_ = register_module("q_proj", linear(c, c));
    k_ = register_module("k_proj", linear(c, kv));
    v_ = register_module("v_proj", linear(c, kv));
    o_ = register_module("o_proj", linear(c, c));
  }
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, at::Tensor* k_cache, at::Tensor* v_cache, int64_t past, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  // Under tensor parallelism this rank computes its share of the heads (tp_: parallelize_tensors).
  const int64_t parts = tp_ ? tp_->size() : 1;
  // (Under sequence parallelism x holds this rank's positions; xin all of them.)
  const at::Tensor xin = tp_ ? ember::enter_tensor_parallel(x, 1, *tp_) : x;
  const int64_t n = xin.size(0), t = xin.size(1), h = shape_.heads / parts, kvh = shape_.kv_heads / parts, d = shape_.head_dim();
  at::Tensor q, k, v;
  if (shape_.flavour == Flavour::gpt2) {
    const auto qkv = adapters_->apply(prefix_ + "c_attn", xin, c_attn_(xin)).split(h * d, -1);
    q = qkv[0].view({n, t, h, d}).transpose(1, 2);
    k = qkv[1].view({n, t, h, d}).transpose(1, 2);
    v = qkv[2].view({n, t, h, d}).transpose(1, 2);
  } else {
    q = adapters_->apply(prefix_ + "q_proj", xin, q_(xin)).view({n, t, h, d}).transpose(1, 2);
    k = adapters_->apply(prefix_ + "k_proj", xin, k_(xin)).view({n, t, kvh, d}).transpose(1, 2);
    v = adapters_->apply(prefix_ + "v_proj", xin, v_(xin)).view({n, t, kvh, d}).transpose(1, 2);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
  }
  if (k_cache != nullptr && k_cache->defined()) {
    k_cache->narrow(2, past, t).copy_(k);
    v_cache->narrow(2, past, t).copy_(v);
    k = k_cache->narrow(2, 0, past + t);
    v = v_cache->narrow(2, 0, past + t);
  }
  if (kvh != h) {  // grouped-query attention: each key/value head serves h / kvh query heads
    k = k.repeat_interleave(h / kvh, 1);
    v = v.repeat_interleave(h / kvh, 1);
  }
  // Causal: position past + i sees keys 0 .. past + i. Without earlier positions that is
  // is_causal; one new token sees everything; several new tokens after cached ones need the
  // offset mask (is_causal aligns the triangle top-left).
  std::optional<at::Tensor> mask;
  bool causal = false;
  if (past == 0) causal = t > 1;
  else if (t > 1)
    mask = at::ones({t, past + t}, x.options().dtype(at::kBool)).tril(past);
  const double p = is_training() ? shape_.dropout : 0.0;
  // Under tensor parallelism the attention dropout draws this rank's heads' own masks.
  const at::Tensor y = ember::in_split_region(tp_, x.device(), p > 0.0, [&] {
                         return at::scaled_dot_product_attention(q, k, v, mask, p, causal);
                       }).transpose(1, 2).reshape({n, t, h * d});
  if (tp_) {  // row-parallel output projection: the ranks' partial sums (an adapter's too), then the whole bias once
    if (shape_.flavour == Flavour::llama)
      return ember::leave_tensor_parallel(adapters_->apply(prefix_ + "o_proj", y, at::linear(y, o_->weight)), 1, *tp_);
    const at::Tensor out = ember::leave_tensor_parallel(adapters_->apply(prefix_ + "c_proj", y, at::matmul(y, c_proj_->weight)), 1, *tp_);
    return c_proj_->bias.defined() ? out + c_proj_->bias : out;
  }
  return shape_.flavour == Flavour::gpt2 ? adapters_->apply(prefix_ + "c_proj", y, c_proj_(y)) : adapters_->apply(prefix_ + "o_proj", y, o_(y));
}

MlpImpl::MlpImpl(const GptShape& shape, std::shared_ptr<const Adapters> adapters, std::string prefix)
    : shape_(shape), adapters_(std::move(adapters)), prefix_(std::move(prefix)) {
  if (shape.flavour == Flavour::gpt2) {
    c_fc_ = register_module("c_fc", Conv1D(shape.width, shape.ff_width, shape.bias));
    c_proj_ = register_module("c_proj", Conv1D(shape.ff_width, shape.width, shape.bias));
  } else {
    auto linear = [](int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); };
    gate_ = register_module("gate_proj", linear(shape.width, shape.ff_width));
    up_ = register_module("up_proj", linear(shape.width, shape.ff_width));
    down_ = register_module("down_proj", linear(shape.ff_width, shape.width));
  }
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  const Adapters& a = *adapters_;
  if (tp_) {  // column-parallel in, row-parallel out; adapters on this rank's slices (parallelize_tensors)
    const at::Tensor xin = ember::enter_tensor_parallel(x, 1, *tp_);
    if (shape_.flavour == Flavour::gpt2) {
      const at::Tensor h = gelu(a.apply(prefix_ + "c_fc", xin, c_fc_(xin)), shape_.gelu_tanh);
      const at::Tensor out = ember::leave_tensor_parallel(a.apply(prefix_ + "c_proj", h, at::matmul(h, c_proj_->weight)), 1, *tp_);
      return c_proj_->bias.defined() ? out + c_proj_->bias : out;
    }
    const at::Tensor h = at::silu(a.apply(prefix_ + "gate_proj", xin, gate_(xin))) * a.apply(prefix_ + "up_proj", xin, up_(xin));
    return ember::leave_tensor_parallel(a.apply(prefix_ + "down_proj", h, at::linear(h, down_->weight)), 1, *tp_);
  }
  if (shape_.flavour == Flavour::gpt2) {
    const at::Tensor h = gelu(a.apply(prefix_ + "c_fc", x, c_fc_(x)), shape_.gelu_tanh);
    return a.apply(prefix_ + "c_proj", h, c_proj_(h));
  }
  const at::Tensor h = at::silu(a.apply(prefix_ + "gate_proj", x, gate_(x))) * a.apply(prefix_ + "up_proj", x, up_(x));
  return a.apply(prefix_ + "down_proj", h, down_(h));
}

BlockImpl::BlockImpl(const GptShape& shape, const std::shared_ptr<const Adapters>& adapters, const std::string& prefix)
    : dropout_(shape.dropout) {
  const bool llama = shape.flavour == Flavour::llama;
  norm1_ = register_module(llama ? "input_layernorm" : "ln_1", Norm(shape.width, llama, shape.bias, shape.norm_eps));
  attn_ = register_module(llama ? "self_attn" : "attn", Attention(shape, adapters, prefix + (llama ? "self_attn." : "attn.")));
  norm2_ = register_module(llama ? "post_attention_layernorm" : "ln_2", Norm(shape.width, llama, shape.bias, shape.norm_eps));
  mlp_ = register_module("mlp", Mlp(shape, adapters, prefix + "mlp."));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, at::Tensor* k_cache, at::Tensor* v_cache, int64_t past, const at::Tensor& cos,
                              const at::Tensor& sin) {
  // Under sequence parallelism the residual branches hold this rank's positions: their dropout
  // draws the rank's own masks.
  const bool draws = dropout_ > 0.0 && is_training();
  const at::Tensor attended = attn_(norm1_(x), k_cache, v_cache, past, cos, sin);
  const at::Tensor h = x + ember::in_split_region(by_sequence_, x.device(), draws, [&] { return maybe_dropout(attended, dropout_, draws); });
  auto mlp = [norm = norm2_.ptr(), mlp = mlp_.ptr(), p = dropout_, draws, group = by_sequence_](const at::Tensor& in) {
    const at::Tensor out = mlp->forward(norm->forward(in));
    return ember::in_split_region(group, in.device(), draws, [&] { return maybe_dropout(out, p, draws); });
  };
  // Selective checkpointing: the MLP's activations (two [N, T, ff_width] tensors, the largest of
  // a block) are recomputed in backward; attention's are kept (recomputing it costs the most).
  return h + (recompute_mlp_ ? ember::recompute_in_backward(h, mlp) : mlp(h));
}

GptNet::GptNet(const GptShape& shape, ember::IHost* host) : shape_(shape) {
  const bool llama = shape.flavour == Flavour::llama;
  // Each piece gets its initial values as soon as it is built, and is then handed to deferred
  // initialisation (under a sharding strategy this rank keeps its part and the rest is freed).
  auto built = [&](torch::nn::Module& piece) {
    initialise(piece);
    if (host) ember::parameters_initialised(*host, piece);
  };
  body_ = register_module(llama ? "model" : "transformer", std::make_shared<torch::nn::Module>());
  embed_ = body_->register_module(llama ? "embed_tokens" : "wte", torch::nn::Embedding(shape.vocab_size, shape.width));
  built(*embed_);
  if (!llama) {
    positions_ = body_->register_module("wpe", torch::nn::Embedding(shape.context_length, shape.width));
    built(*positions_);
  }
  block_list_ = body_->register_module(llama ? "layers" : "h", torch::nn::ModuleList());
  for (int64_t i = 0; i < shape.layers; ++i) {
    blocks_.emplace_back(shape, adapters_, c10::str(llama ? "model.layers." : "transformer.h.", i, "."));
    block_list_->push_back(blocks_.back());
    built(*blocks_.back());
  }
  final_norm_ = body_->register_module(llama ? "norm" : "ln_f", Norm(shape.width, llama, shape.bias, shape.norm_eps));
  built(*final_norm_);
  if (!shape.tied) {
    lm_head_ = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(shape.width, shape.vocab_size).bias(false)));
    built(*lm_head_);
  }
  if (llama) {
    const int64_t d = shape.head_dim();
    inv_freq_ = 1.0 / at::pow(shape.rope_theta, at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d));
  }
  held_.assign(static_cast<size_t>(shape.layers), true);
  for (const auto& item : named_parameters())
    if (item.value().dim() == 2 && item.key().find("wte") == std::string::npos && item.key().find("wpe") == std::string::npos &&
        item.key().find("embed_tokens") == std::string::npos)
      matmul_parameters_ += item.value().numel();
  if (shape_.tied) matmul_parameters_ += shape_.vocab_size * shape_.width;  // the output layer reuses the embedding
}

void GptNet::initialise(torch::nn::Module& piece) {
  torch::NoGradGuard no_grad;
  const double residual_std = shape_.init_std / std::sqrt(2.0 * static_cast<double>(std::max<int64_t>(shape_.layers, 1)));
  for (auto& item : piece.named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    const bool residual_projection = name.find("attn.c_proj.weight") != std::string::npos ||
                                     name.find("mlp.c_proj.weight") != std::string::npos ||
                                     name.find("o_proj.weight") != std::string::npos || name.find("down_proj.weight") != std::string::npos;
    if (p.dim() >= 2) p.normal_(0.0, residual_projection ? residual_std : shape_.init_std);
    else if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) p.zero_();
    else p.fill_(1.0);  // norm weights
  }
}

std::pair<at::Tensor, at::Tensor> GptNet::rope(int64_t past, int64_t length, const at::Tensor& like) {
  // In float32 on the device of the activations, then cast (transformers' LlamaRotaryEmbedding).
  const at::Tensor pos = at::arange(past, past + length, like.options().dtype(at::kFloat));
  const at::Tensor freqs = at::outer(pos, inv_freq_.to(like.device()));
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(like.scalar_type()), emb.sin().to(like.scalar_type())};
}

at::Tensor GptNet::forward(const at::Tensor& ids, GenerationCache* cache) { return head(run_whole(ids, cache)); }

at::Tensor GptNet::forward_hidden(const at::Tensor& ids) { return final_hidden(run_whole(ids, nullptr)); }

at::Tensor GptNet::run_whole(const at::Tensor& ids, GenerationCache* cache) {
  if (!whole_)
    throw ember::RunError("gpt: this rank holds pipeline stages, not the whole network: logits and generation need pipeline_parallel = 1");
  const int64_t t = ids.size(1);
  const int64_t past = cache != nullptr ? cache->length : 0;
  if (past + t > shape_.context_length)
    throw ember::RunError(c10::str("gpt: a sequence of ", past + t, " tokens is longer than the model's context of ", shape_.context_length,
                                   " positions: shorten it (data.block_size, the prompt) or raise model.context_length"));
  if (cache != nullptr && past + t > cache->capacity)
    throw ember::RunError(c10::str("gpt: the generation cache holds ", cache->capacity, " positions, ", past + t, " asked"));
  at::Tensor x = run_blocks(embed(ids, past), 0, static_cast<int64_t>(blocks_.size()), past, t, cache);
  if (cache != nullptr) cache->length += t;
  return x;
}

at::Tensor GptNet::embed(const at::Tensor& ids, int64_t past) {
  const int64_t t = ids.size(1);
  if (past + t > shape_.context_length)
    throw ember::RunError(c10::str("gpt: a sequence of ", past + t, " tokens is longer than the model's context of ", shape_.context_length,
                                   " positions: shorten it (data.block_size, the prompt) or raise model.context_length"));
  // Under sequence parallelism `x` holds this rank's positions from here to the final norm.
  ember::ITensorParallelGroup* by_sequence = tp_ && tp_->sequence_parallel() ? tp_ : nullptr;
  at::Tensor x;
  if (vocab_parallel_) {
    x = ember::vocab_parallel_embedding(ids, embed_->weight, *tp_, 1);
  } else {
    x = embed_(ids);
    if (by_sequence) x = ember::scatter_to_sequence_parallel(x, 1, *by_sequence);
  }
  if (shape_.flavour == Flavour::gpt2) {
    at::Tensor where = positions_(at::arange(past, past + t, ids.options().dtype(at::kLong)));
    x = x + (by_sequence ? ember::scatter_to_sequence_parallel(where, 0, *by_sequence) : where);
  }
  return ember::in_split_region(by_sequence, x.device(), shape_.dropout > 0.0 && is_training(),
                                [&] { return maybe_dropout(x, shape_.dropout, is_training()); });
}

at::Tensor GptNet::run_blocks(at::Tensor x, int64_t begin, int64_t end, int64_t past, int64_t length, GenerationCache* cache) {
  at::Tensor cos, sin;
  if (shape_.flavour == Flavour::llama) std::tie(cos, sin) = rope(past, length, x);
  for (int64_t i = begin; i < end; ++i) {
    at::Tensor* kc = cache != nullptr ? &cache->k[static_cast<size_t>(i)] : nullptr;
    at::Tensor* vc = cache != nullptr ? &cache->v[static_cast<size_t>(i)] : nullptr;
    // By value: under activation checkpointing the block runs again during backward (the cache
    // is only used without gradients, where nothing is recomputed).
    auto run = [block = blocks_[static_cast<size_t>(i)].ptr(), kc, vc, past, cos, sin](const at::Tensor& in) {
      return block->forward(in, kc, vc, past, cos, sin);
    };
    x = units_ != nullptr ? units_->run(i, x, run) : run(x);
  }
  return x;
}

at::Tensor GptNet::head(at::Tensor x) {
  if (vocab_parallel_)  // column-parallel over the vocabulary: this rank's logits
    return at::linear(ember::enter_tensor_parallel(final_norm_(x), 1, *tp_), output_weight());
  return at::linear(final_hidden(x), output_weight());
}

at::Tensor GptNet::final_hidden(at::Tensor x) {
  x = final_norm_(x);
  if (tp_ && tp_->sequence_parallel()) x = ember::gather_from_sequence_parallel(x, 1, *tp_, /*into_split_layer=*/false);
  return x;
}

const at::Tensor& GptNet::output_weight() const { return shape_.tied ? embed_->weight : lm_head_->weight; }

std::string GptNet::embedding_name() const {
  return shape_.flavour == Flavour::llama ? "model.embed_tokens.weight" : "transformer.wte.weight";
}

void GptNet::keep_blocks(const std::vector<ember::UnitRange>& stages) {
  const int64_t n = static_cast<int64_t>(blocks_.size());
  auto held = [&](int64_t i) {
    for (const auto& s : stages)
      if (i >= s.begin && i < s.end) return true;
    return false;
  };
  auto drop = [](torch::nn::Module& parent, const std::string& name, torch::nn::Module& m) {
    at::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.set_data(at::empty({0}, p.options()));
    parent.unregister_module(name);
  };
  for (int64_t i = 0; i < n; ++i)
    if (!held(i)) {
      drop(*block_list_, std::to_string(i), *blocks_[static_cast<size_t>(i)]);
      held_[static_cast<size_t>(i)] = false;
      whole_ = false;
    }
  const bool llama = shape_.flavour == Flavour::llama;
  const bool first = held(0), last = held(n - 1);
  if (!first && !(last && shape_.tied)) drop(*body_, llama ? "embed_tokens" : "wte", *embed_);
  if (!first && positions_) drop(*body_, "wpe", *positions_);
  if (!last) {
    drop(*body_, llama ? "norm" : "ln_f", *final_norm_);
    if (lm_head_) drop(*this, "lm_head", *lm_head_);
  }
}

void GptNet::set_selective_checkpointing(bool on) {
  for (auto& b : blocks_) b->recompute_mlp(on);
}

void GptNet::declare_units(ember::ModelUnits& units) {
  units_ = &units;
  const std::string prefix = shape_.flavour == Flavour::llama ? "layers." : "h.";
  for (size_t i = 0; i < blocks_.size(); ++i) units.add(prefix + std::to_string(i), blocks_[i].ptr());
}

GenerationCache GptNet::new_cache(int64_t batch, int64_t capacity) const {
  GenerationCache c;
  c.capacity = capacity;
  const at::Tensor& like = embed_->weight;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    c.k.push_back(at::zeros({batch, shape_.kv_heads, capacity, shape_.head_dim()}, like.options().requires_grad(false)));
    c.v.push_back(at::zeros_like(c.k.back()));
  }
  return c;
}

std::vector<std::string> GptNet::load_safetensors(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  if (fs::path(path).extension() == ".json") {  // model.safetensors.index.json: {"weight_map": {name: file}}
    std::ifstream in(path);
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw ember::RunError(path + ": not a safetensors index (no \"weight_map\" object)");
    std::set<std::string> unique;
    for (const auto& [name, file] : j["weight_map"].items()) unique.insert((fs::path(path).parent_path() / file.get<std::string>()).string());
    files.assign(unique.begin(), unique.end());
  } else {
    files.push_back(path);
  }
  std::vector<std::unique_ptr<ember::support::SafetensorsFile>> opened;
  std::map<std::string, size_t> where;
  for (const auto& f : files) {
    opened.push_back(std::make_unique<ember::support::SafetensorsFile>(f));
    for (const auto& n : opened.back()->names()) where.emplace(n, opened.size() - 1);
  }
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    std::string name = item.key();
    if (!where.count(name) && name.rfind("transformer.", 0) == 0 && where.count(name.substr(12))) name = name.substr(12);
    if (!where.count(name))
      throw ember::RunError(c10::str(files.front(), ": no tensor \"", item.key(), "\" (is this a ", shape_.flavour == Flavour::gpt2 ? "GPT-2" : "Llama",
                                     " checkpoint of the shape in config.json?)"));
    const at::Tensor t = opened[where.at(name)]->tensor(name);
    if (t.sizes() != item.value().sizes())
      throw ember::RunError(c10::str(opened[where.at(name)]->path(), ": tensor \"", name, "\" has shape ", t.sizes(), ", the model expects ",
                                     item.value().sizes()));
    item.value().copy_(t);
    used.insert(name);
  }
  std::vector<std::string> unused;
  for (const auto& [name, file] : where) {
    (void)file;
    if (used.count(name)) continue;
    // Buffers transformers recomputes (GPT-2's causal mask, Llama's inverse frequencies) and the
    // tied output layer, which is the token embedding here.
    if (name.find(".attn.bias") != std::string::npos || name.find(".attn.masked_bias") != std::string::npos ||
        name.find("rotary_emb.inv_freq") != std::string::npos || (shape_.tied && name == "lm_head.weight"))
      continue;
    unused.push_back(name);
  }
  return unused;
}

std::vector<ember::LinearLayer> GptNet::linear_layers() {
  std::vector<ember::LinearLayer> out;
  for (auto& item : named_modules()) {
    ember::LinearLayer l;
    l.name = item.key();
    if (l.name.rfind(shape_.flavour == Flavour::llama ? "model.layers." : "transformer.h.", 0) != 0) continue;
    if (auto* conv = dynamic_cast<Conv1DImpl*>(item.value().get())) {
      l.in_features = conv->weight.size(0);
      l.out_features = conv->weight.size(1);
      l.weight_in_out = true;
    } else if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get())) {
      l.in_features = linear->weight.size(1);
      l.out_features = linear->weight.size(0);
    } else {
      continue;
    }
    l.module = item.value().get();
    out.push_back(std::move(l));
  }
  return out;
}

void GptNet::set_linear_adapter(const std::string& name, std::shared_ptr<ember::ILinearAdapter> adapter) {
  const auto layers = linear_layers();
  if (std::none_of(layers.begin(), layers.end(), [&](const ember::LinearLayer& l) { return l.name == name; }))
    throw ember::RunError("gpt: no linear layer named '" + name + "' (e.g. " + (layers.empty() ? std::string("none") : layers.front().name) + ")");
  if (adapter) adapters_->by_name[name] = std::move(adapter);
  else adapters_->by_name.erase(name);
}

int64_t GptNet::matmul_parameters() const { return matmul_parameters_; }

}  // namespace ember_gpt
