// gpt's tensor-parallel plan (docs/parallelism.md), apart from the network: which parameters each
// rank keeps a slice of (Megatron's column- and row-parallel split of attention and the MLP, the
// vocabulary-parallel embedding and head, adapters with their layer) and which gradients are
// partial sums over the group.
#include "gpt_net.h"

#include <algorithm>
#include <string>
#include <vector>

#include <c10/util/StringUtil.h>

#include <ember/error.h>
#include <ember/support/tensor_parallel.h>

namespace ember_gpt {

std::vector<ember::TensorShard> GptNet::parallelize_tensors(ember::ITensorParallelGroup& group, const std::string& section) {
  const int64_t tp = group.size();
  auto refuse = [&](const char* what, int64_t value) {
    throw ember::ConfigError(c10::str("[", section, "] ", what, " = ", value, " cannot be split over tensor_parallel = ", tp,
                                      " ranks (each rank takes whole heads and an equal part of the MLP): choose a degree that divides it"));
  };
  if (shape_.heads % tp != 0) refuse("heads", shape_.heads);
  if (shape_.kv_heads % tp != 0) refuse("kv_heads", shape_.kv_heads);
  if (shape_.ff_width % tp != 0) refuse("ff_width", shape_.ff_width);
  const bool llama = shape_.flavour == Flavour::llama;
  std::vector<ember::TensorShard> shards;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const std::string b = (llama ? "model.layers." : "transformer.h.") + std::to_string(i) + ".";
    if (llama) {
      for (const char* name : {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
                               "mlp.up_proj.weight"})
        shards.push_back({b + name, 0, 1});
      shards.push_back({b + "self_attn.o_proj.weight", 1, 1});
      shards.push_back({b + "mlp.down_proj.weight", 1, 1});
    } else {  // Conv1D weights are [in, out]: column-parallel splits dimension 1, row-parallel 0
      shards.push_back({b + "attn.c_attn.weight", 1, 3});
      if (shape_.bias) shards.push_back({b + "attn.c_attn.bias", 0, 3});
      shards.push_back({b + "attn.c_proj.weight", 0, 1});
      shards.push_back({b + "mlp.c_fc.weight", 1, 1});
      if (shape_.bias) shards.push_back({b + "mlp.c_fc.bias", 0, 1});
      shards.push_back({b + "mlp.c_proj.weight", 0, 1});
    }
  }
  // Vocabulary-parallel embedding and output (Megatron's): when the vocabulary divides (GPT-2's
  // 50257 does not; nanoGPT's padded 50304 does), else both stay whole.
  if (shape_.vocab_size % tp == 0) {
    shards.push_back({llama ? "model.embed_tokens.weight" : "transformer.wte.weight", 0, 1});
    if (!shape_.tied) shards.push_back({"lm_head.weight", 0, 1});
    vocab_parallel_ = true;
  }
  // Adapters (lora: y += B A x, A [rank, in], B [out, rank]) follow their layer's split. On a
  // column-parallel layer B takes this rank's outputs (in the layer's blocks) and A stays whole;
  // on a row-parallel one A takes this rank's inputs and B stays whole, the branch's output joining
  // the layer's partial sum. The whole factor's gradient is then a partial sum on each rank.
  std::vector<std::string> adapter_summed;
  for (const auto& [layer, adapter] : adapters_->by_name) {
    const std::string leaf = layer.substr(layer.rfind('.') + 1);
    const bool row = leaf == "o_proj" || leaf == "down_proj" || leaf == "c_proj";
    const int64_t blocks = leaf == "c_attn" ? 3 : 1;
    shards.push_back({layer + (row ? ".lora_A" : ".lora_B"), row ? int64_t{1} : int64_t{0}, blocks});
    adapter_summed.push_back(layer + (row ? ".lora_B" : ".lora_A"));
  }
  auto params = named_parameters();
  // Pipeline stages: only what this rank holds.
  shards.erase(std::remove_if(shards.begin(), shards.end(), [&](const ember::TensorShard& s) { return !params.contains(s.name); }),
               shards.end());
  for (const auto& s : shards) ember::keep_shard(params[s.name], s, group.rank(), tp);
  for (auto& name : adapter_summed)
    if (params.contains(name)) shards.push_back({std::move(name), ember::kSummedGradient, 1});
  // Sequence parallelism: the norms and the biases added after a sum see this rank's positions
  // only, so their gradients are partial sums.
  if (group.sequence_parallel()) {
    std::vector<std::string> summed;
    for (size_t i = 0; i < blocks_.size(); ++i) {
      const std::string b = (llama ? "model.layers." : "transformer.h.") + std::to_string(i) + ".";
      if (llama) {
        summed.insert(summed.end(), {b + "input_layernorm.weight", b + "post_attention_layernorm.weight"});
      } else {
        summed.insert(summed.end(), {b + "ln_1.weight", b + "ln_2.weight"});
        if (shape_.bias) summed.insert(summed.end(), {b + "ln_1.bias", b + "ln_2.bias", b + "attn.c_proj.bias", b + "mlp.c_proj.bias"});
      }
    }
    summed.push_back(llama ? "model.norm.weight" : "transformer.ln_f.weight");
    if (!llama && shape_.bias) summed.push_back("transformer.ln_f.bias");
    for (auto& name : summed)
      if (params.contains(name)) shards.push_back({std::move(name), ember::kSummedGradient, 1});
  }
  for (auto& block : blocks_) block->parallelize(group);
  tp_ = &group;
  return shards;
}

}  // namespace ember_gpt
