// The decoder-only transformer of the `gpt` model plugin, in the two layouts that matter:
//   gpt2:  learned positions, LayerNorm, GELU MLP, biases, tied input/output embeddings, the
//          attention and MLP weights stored as Hugging Face's Conv1D ([in, out]);
//   llama: rotary positions (RoPE), RMSNorm, SwiGLU MLP, grouped-query attention, no biases,
//          untied or tied output.
// Parameter names are transformers' own (GPT2LMHeadModel: transformer.h.0.attn.c_attn.weight;
// LlamaForCausalLM: model.layers.0.self_attn.q_proj.weight), so Hugging Face safetensors load
// and export without renaming or transposing.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ember/host.h>
#include <ember/pipeline.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <ember/model_adapters.h>
#include <ember/model_units.h>
#include <ember/tensor_parallel.h>

namespace ember_gpt {

enum class Flavour { gpt2, llama };

struct GptShape {
  Flavour flavour = Flavour::gpt2;
  int64_t vocab_size = 0;
  int64_t context_length = 0;  // gpt2: n_positions; llama: max_position_embeddings
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;        // llama: num_key_value_heads (== heads for gpt2)
  int64_t width = 0;           // n_embd / hidden_size
  int64_t ff_width = 0;        // the MLP's inner width
  bool bias = true;            // gpt2 only (llama has none)
  bool tied = true;            // output layer = the token embedding's transpose
  bool gelu_tanh = true;       // gpt2: "gelu_new" (tanh approximation), else exact GELU
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double dropout = 0.0;
  double init_std = 0.02;
  int64_t head_dim() const { return width / heads; }
  // One line for logs: "gpt2, 4 layers x 4 heads x 128 wide, context 64, vocabulary 96".
  std::string describe() const;
  // transformers' config.json for this shape (model_type gpt2 or llama), for `engine export`.
  std::string hf_config_json() const;
  // The shape a transformers config.json describes (GPT2Config or LlamaConfig). Throws
  // ember::RunError naming the file and the key when it is neither or lacks a key.
  static GptShape from_hf_config(const std::string& path);
};

// Keys and values of every layer for generation: [N, kv_heads, capacity, head_dim] each.
struct GenerationCache {
  std::vector<at::Tensor> k, v;
  int64_t length = 0;  // positions filled
  int64_t capacity = 0;
};

// The branches plugins added to the network's linear layers (ember/model_adapters.h: LoRA), by
// the layer's name in module(); shared by the blocks, empty unless a plugin adds one.
struct Adapters {
  std::map<std::string, std::shared_ptr<ember::ILinearAdapter>> by_name;
  at::Tensor apply(const std::string& name, const at::Tensor& x, const at::Tensor& y) const {
    if (by_name.empty()) return y;
    const auto it = by_name.find(name);
    return it == by_name.end() ? y : y + it->second->forward(x);
  }
};

// x [.., in] -> [.., out] with weight [in, out]: the GPT-2 checkpoint's layout.
class Conv1DImpl : public torch::nn::Module {
 public:
  Conv1DImpl(int64_t in, int64_t out, bool bias);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;
};
TORCH_MODULE(Conv1D);

// LayerNorm whose bias is optional (nanoGPT's bias = False), or RMSNorm (no mean, no bias;
// computed in float32 as transformers' LlamaRMSNorm does).
class NormImpl : public torch::nn::Module {
 public:
  NormImpl(int64_t width, bool rms, bool bias, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;

 private:
  bool rms_;
  double eps_;
};
TORCH_MODULE(Norm);

// Self-attention: gpt2's fused c_attn + c_proj, or llama's q/k/v/o projections with RoPE and
// grouped-query heads. Causal, through at::scaled_dot_product_attention.
class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const GptShape& shape, std::shared_ptr<const Adapters> adapters, std::string prefix);
  // x [N, T, C] at positions [past, past + T); k_cache/v_cache (undefined: no cache) hold the
  // earlier positions and get this call's appended. cos/sin [T, head_dim] (llama).
  at::Tensor forward(const at::Tensor& x, at::Tensor* k_cache, at::Tensor* v_cache, int64_t past, const at::Tensor& cos,
                     const at::Tensor& sin);
  // From now on the projections hold this rank's heads (GptNet::parallelize_tensors).
  void parallelize(ember::ITensorParallelGroup& group) { tp_ = &group; }

 private:
  at::Tensor project(const std::string& name, torch::nn::Module& layer, const at::Tensor& x);
  ember::ITensorParallelGroup* tp_ = nullptr;
  GptShape shape_;
  std::shared_ptr<const Adapters> adapters_;
  std::string prefix_;  // "transformer.h.3.attn." / "model.layers.3.self_attn."
  Conv1D c_attn_{nullptr}, c_proj_{nullptr};
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(const GptShape& shape, std::shared_ptr<const Adapters> adapters, std::string prefix);
  at::Tensor forward(const at::Tensor& x);
  void parallelize(ember::ITensorParallelGroup& group) { tp_ = &group; }

 private:
  ember::ITensorParallelGroup* tp_ = nullptr;
  GptShape shape_;
  std::shared_ptr<const Adapters> adapters_;
  std::string prefix_;
  Conv1D c_fc_{nullptr}, c_proj_{nullptr};
  torch::nn::Linear gate_{nullptr}, up_{nullptr}, down_{nullptr};
};
TORCH_MODULE(Mlp);

// One decoder block: pre-norm attention and MLP, each with a residual.
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GptShape& shape, const std::shared_ptr<const Adapters>& adapters, const std::string& prefix);
  at::Tensor forward(const at::Tensor& x, at::Tensor* k_cache, at::Tensor* v_cache, int64_t past, const at::Tensor& cos,
                     const at::Tensor& sin);
  void recompute_mlp(bool on) { recompute_mlp_ = on; }
  void parallelize(ember::ITensorParallelGroup& group) {
    attn_->parallelize(group);
    mlp_->parallelize(group);
    if (group.sequence_parallel()) by_sequence_ = &group;
  }

 private:
  bool recompute_mlp_ = false;
  double dropout_;
  ember::ITensorParallelGroup* by_sequence_ = nullptr;  // sequence parallelism: the residuals hold this rank's positions
  Norm norm1_{nullptr}, norm2_{nullptr};
  Attention attn_{nullptr};
  Mlp mlp_{nullptr};
};
TORCH_MODULE(Block);

class GptNet : public torch::nn::Module {
 public:
  // `host`: each piece (embeddings, blocks, final norm, output layer) handed to
  // ember::parameters_initialised once it has its initial values; none when weights are loaded.
  explicit GptNet(const GptShape& shape, ember::IHost* host = nullptr);
  const GptShape& shape() const { return shape_; }
  // Draws one piece's weights (names relative to it) from the current default generator:
  // N(0, init_std) for every matrix and embedding, GPT-2's residual projections (attn/mlp c_proj,
  // llama's o_proj/down_proj) scaled by 1/sqrt(2 * layers) as GPT-2 and nanoGPT do, zero biases,
  // unit norms.
  void initialise(torch::nn::Module& piece);
  // ids [N, T] int64 -> logits [N, T, vocab]. With a cache: the positions follow the cached ones
  // and this call's keys and values are appended.
  at::Tensor forward(const at::Tensor& ids, GenerationCache* cache = nullptr);
  // forward without the output layer: the final norm's output [N, T, width] (see final_hidden).
  at::Tensor forward_hidden(const at::Tensor& ids);
  // forward's three parts, which pipeline stages run apart (ember/pipeline.h): the embeddings
  // (ids [N, T] -> activations, this rank's positions under sequence parallelism), blocks [begin,
  // end) of a sequence of `length` tokens after `past` cached ones, and the final norm and output.
  at::Tensor embed(const at::Tensor& ids, int64_t past);
  at::Tensor run_blocks(at::Tensor x, int64_t begin, int64_t end, int64_t past, int64_t length, GenerationCache* cache);
  at::Tensor head(at::Tensor x);
  // head() in two halves, for a loss that multiplies by the output layer itself
  // (ember::linear_cross_entropy): the final norm (whole positions again under sequence
  // parallelism), and the output layer's weight [vocab, width] (the embedding when tied). Not under
  // vocabulary parallelism, where each rank holds some of the rows.
  at::Tensor final_hidden(at::Tensor x);
  const at::Tensor& output_weight() const;
  // Pipeline stages: keeps the blocks of `stages`, the embeddings when block 0 is among them, the
  // final norm and output when the last block is (and, tied, the embedding the output multiplies
  // by); the rest leave the module and their storage is freed.
  void keep_blocks(const std::vector<ember::UnitRange>& stages);
  // False once keep_blocks dropped something: forward and generation need the whole network.
  bool whole() const { return whole_; }
  // The tied embedding's name (gpt2 by default): the first and the last stage both hold it.
  std::string embedding_name() const;
  // Every block is a unit (sharding strategies gather one block at a time; full activation
  // checkpointing recomputes one block at a time).
  void declare_units(ember::ModelUnits& units);
  // Selective activation checkpointing: each block recomputes its MLP in backward.
  void set_selective_checkpointing(bool on);
  // An empty cache for `batch` sequences of up to `capacity` positions, like the parameters.
  GenerationCache new_cache(int64_t batch, int64_t capacity) const;
  // Loads transformers' safetensors (one file, or the files of model.safetensors.index.json);
  // GPT-2 files saved from GPT2Model (no "transformer." prefix) load too. Throws ember::RunError
  // naming the file and the tensor on a missing tensor or a shape mismatch. Returns the names
  // of the file's tensors this network does not use.
  std::vector<std::string> load_safetensors(const std::string& path);
  // The blocks' linear layers, and the branches plugins add to them (ember/model_adapters.h).
  std::vector<ember::LinearLayer> linear_layers();
  void set_linear_adapter(const std::string& name, std::shared_ptr<ember::ILinearAdapter> adapter);
  // Tensor parallelism (ember/tensor_parallel.h), Megatron's split: every block's attention heads
  // (q/k/v column-parallel, the output projection row-parallel) and MLP (c_fc / gate and up
  // column-parallel, c_proj / down row-parallel) over the group; embeddings, norms, the biases added
  // after a sum and the lm_head stay whole. Throws ember::ConfigError when heads, kv_heads or
  // ff_width do not divide by the group's size, or when a plugin added adapters.
  // The embedding (and an untied lm_head) are split by vocabulary when it divides: the forward then
  // returns this rank's columns of the logits, for ember::vocab_parallel_cross_entropy.
  std::vector<ember::TensorShard> parallelize_tensors(ember::ITensorParallelGroup& group, const std::string& section);
  // Set when forward returns vocabulary-parallel logits [N, T, vocab / group size].
  ember::ITensorParallelGroup* vocab_parallel_group() const { return vocab_parallel_ ? tp_ : nullptr; }
  // Matrix-multiply parameters that a token's forward runs through (the lm_head included, the
  // embedding lookups not): the 6N of the FLOPs estimate.
  int64_t matmul_parameters() const;

 private:
  // The embeddings and every block, after the checks forward and forward_hidden share.
  at::Tensor run_whole(const at::Tensor& ids, GenerationCache* cache);
  std::pair<at::Tensor, at::Tensor> rope(int64_t past, int64_t length, const at::Tensor& like);
  GptShape shape_;
  std::shared_ptr<torch::nn::Module> body_;  // "transformer" (gpt2) or "model" (llama)
  torch::nn::Embedding embed_{nullptr}, positions_{nullptr};
  torch::nn::ModuleList block_list_{nullptr};
  std::vector<Block> blocks_;
  Norm final_norm_{nullptr};
  torch::nn::Linear lm_head_{nullptr};
  ember::ModelUnits* units_ = nullptr;
  ember::ITensorParallelGroup* tp_ = nullptr;
  bool vocab_parallel_ = false;
  std::shared_ptr<Adapters> adapters_ = std::make_shared<Adapters>();
  at::Tensor inv_freq_;  // llama: [head_dim / 2] float, on the CPU
  std::vector<bool> held_;  // the blocks this rank holds (all but under pipeline parallelism)
  bool whole_ = true;
  int64_t matmul_parameters_ = 0;  // of the whole network (pipeline stages hold part of it)
};

}  // namespace ember_gpt
