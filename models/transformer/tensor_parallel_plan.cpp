#include "tensor_parallel_plan.h"

#include <ember/error.h>
#include <ember/support/tensor_parallel.h>

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/transformerlayer.h>

#include <cmath>
#include <variant>

namespace ember_transformer {

std::vector<ember::TensorShard> encoder_layer_shards(const std::string& prefix, bool sequence_parallel) {
  const std::string p = prefix + ".";
  std::vector<ember::TensorShard> shards = {
      {p + "self_attn.in_proj_weight", 0, 3},  // [q; k; v]: each keeps its heads' rows
      {p + "self_attn.in_proj_bias", 0, 3},
      {p + "self_attn.out_proj.weight", 1, 1},  // the columns that read this rank's heads
      {p + "linear1.weight", 0, 1},
      {p + "linear1.bias", 0, 1},
      {p + "linear2.weight", 1, 1},
  };
  // Applied to this rank's positions only under sequence parallelism.
  if (sequence_parallel)
    for (const char* name : {"norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "self_attn.out_proj.bias", "linear2.bias"})
      shards.push_back({p + name, ember::kSummedGradient, 1});
  return shards;
}

at::Tensor encoder_layer_forward(torch::nn::TransformerEncoderLayerImpl& layer, const at::Tensor& src, int64_t heads,
                                 ember::ITensorParallelGroup& group) {
  namespace F = torch::nn::functional;
  auto& attn = *layer.self_attn;
  const bool training = layer.is_training();
  // Under sequence parallelism src holds this rank's positions; the split layers see them all.
  at::Tensor x = ember::enter_tensor_parallel(src, 0, group);
  const int64_t S = x.size(0), N = x.size(1), E = x.size(2);
  const int64_t local_heads = heads / group.size(), head_dim = E / heads;

  // Self-attention on this rank's heads (what F::multi_head_attention_forward computes per head).
  auto qkv = at::linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1);
  auto per_head = [&](const at::Tensor& t) { return t.contiguous().view({S, N * local_heads, head_dim}).transpose(0, 1); };
  at::Tensor q = per_head(qkv[0] * (1.0 / std::sqrt(static_cast<double>(head_dim))));
  at::Tensor k = per_head(qkv[1]), v = per_head(qkv[2]);
  at::Tensor weights = at::softmax(at::bmm(q, k.transpose(1, 2)), -1);
  // Dropout in a split region (this rank's heads, its hidden columns, under sequence parallelism
  // its positions) draws the rank's own masks; on replicated activations, the group's common ones.
  const double p = layer.options.dropout(), attn_p = attn.options.dropout();
  const bool sp = group.sequence_parallel();
  weights = ember::in_split_region(&group, weights.device(), training && attn_p > 0.0,
                                   [&] { return F::dropout(weights, F::DropoutFuncOptions().p(attn_p).training(training)); });
  at::Tensor heads_out = at::bmm(weights, v).transpose(0, 1).contiguous().view({S, N, local_heads * head_dim});
  at::Tensor attended = ember::leave_tensor_parallel(at::linear(heads_out, attn.out_proj->weight), 0, group) + attn.out_proj->bias;
  at::Tensor h = layer.norm1(src + ember::in_split_region(&group, src.device(), sp && training && p > 0.0, [&] { return layer.dropout1(attended); }));

  // Feed-forward on this rank's slice of the hidden width.
  at::Tensor hidden = at::linear(ember::enter_tensor_parallel(h, 0, group), layer.linear1->weight, layer.linear1->bias);
  const auto& activation = layer.options.activation();
  if (std::holds_alternative<torch::enumtype::kReLU>(activation)) hidden = at::relu(hidden);
  else if (std::holds_alternative<torch::enumtype::kGELU>(activation)) hidden = at::gelu(hidden);
  else hidden = std::get<std::function<at::Tensor(const at::Tensor&)>>(activation)(hidden);
  hidden = ember::in_split_region(&group, hidden.device(), training && p > 0.0, [&] { return layer.dropout(hidden); });
  at::Tensor out = ember::leave_tensor_parallel(at::linear(hidden, layer.linear2->weight), 0, group) + layer.linear2->bias;
  return layer.norm2(h + ember::in_split_region(&group, h.device(), sp && training && p > 0.0, [&] { return layer.dropout2(out); }));
}

}  // namespace ember_transformer
