// The transformer's tensor-parallel plan (ember/tensor_parallel.h), apart from the model: each
// encoder layer split Megatron-style over T ranks. Attention heads are split (q/k/v
// column-parallel, out_proj row-parallel), and so is the feed-forward block (linear1
// column-parallel, linear2 row-parallel); norms, the biases added after a sum and the head are
// replicated. One all-reduce per block forward and one per block backward (with sequence
// parallelism: an all-gather and a reduce-scatter, and the norms run on 1 / size of the positions).
#pragma once
#include <ember/tensor_parallel.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch::nn { class TransformerEncoderLayerImpl; }

namespace ember_transformer {

// The split parameters of the encoder layer registered as `prefix` ("layer1"); with sequence
// parallelism also its norms and the biases added after a sum (kSummedGradient).
std::vector<ember::TensorShard> encoder_layer_shards(const std::string& prefix, bool sequence_parallel);

// The encoder layer's forward (post-norm, LibTorch's TransformerEncoderLayer) on this rank's
// slices: `heads` is the layer's whole head count; src [S, N, E] is the same on every rank, and
// so is the result; under sequence parallelism both hold this rank's S / size positions.
at::Tensor encoder_layer_forward(torch::nn::TransformerEncoderLayerImpl& layer, const at::Tensor& src, int64_t heads,
                                 ember::ITensorParallelGroup& group);

}  // namespace ember_transformer
