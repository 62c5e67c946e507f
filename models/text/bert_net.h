// A BERT-family encoder with a classification head, built from a Hugging Face config.json.
// Layouts: BERT (model_type "bert": BERT, MiniLM, ...) and DistilBERT ("distilbert": no token
// types, its own weight names, ReLU pre-classifier). Module names are BERT's (embeddings.*,
// encoder.layer.N.*, pooler.dense, classifier), so a state dict of this module is a
// BertModel's (plus the head) and exports load in transformers with a "bert." prefix.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <ember/model_units.h>

namespace ember_text {

enum class Pooling { mean, cls, pooler };
enum class Activation { gelu, gelu_tanh, relu };

struct BertConfig {
  std::string model_type = "bert";  // "bert" or "distilbert"
  int64_t vocab_size = 0, hidden = 0, layers = 0, heads = 0, intermediate = 0;
  int64_t max_positions = 512, type_vocab_size = 2, pad_token_id = 0;
  double hidden_dropout = 0.1, attention_dropout = 0.1, layer_norm_eps = 1e-12, initializer_range = 0.02;
  Activation activation = Activation::gelu;
  // Reads config.json; throws ember::RunError naming the file and the key on anything unsupported.
  static BertConfig from_json_file(const std::string& path);
};

struct BertHead {
  Pooling pooling = Pooling::mean;
  int64_t num_classes = 2;
  double dropout = 0.1;
};

// When the encoder leaves a batch's padding out: auto = when at least 5% of its [N, S] token
// slots are padding, always, or never.
enum class Unpad { auto_, always, never };

// Where a batch's real tokens sit in its padded [N, S] layout. On the unpadded path the encoder's
// per-token work (projections, feed-forward, LayerNorm, dropout, residuals) runs on the T real
// tokens only, [T, H]; the attention product alone is computed padded, with the padding masked.
struct TokenLayout {
  at::Tensor index;  // int64 [T]: the real tokens' positions in the flattened [N * S]; undefined = padded path
  int64_t n = 0, s = 0;
  bool unpadded() const { return index.defined(); }
  // [T, ...] -> [N * S, ...] with zero rows at the padding.
  at::Tensor pad(const at::Tensor& t) const;
};

class BertLayerImpl : public torch::nn::Module {
 public:
  BertLayerImpl(const BertConfig& c);
  // x: [N, S, H] (padded path) or [T, H] (unpadded: `layout` says where the tokens sit).
  // keep_mask: bool [N, 1, 1, S], the keys each query may attend to.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& keep_mask, const TokenLayout& layout = {});

 private:
  int64_t heads_;
  double attention_dropout_;
  Activation act_;
  torch::nn::Linear query_{nullptr}, key_{nullptr}, value_{nullptr}, attn_out_{nullptr}, inter_{nullptr}, out_{nullptr};
  torch::nn::LayerNorm attn_norm_{nullptr}, out_norm_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
};
TORCH_MODULE(BertLayer);

class BertClassifierNet : public torch::nn::Module {
 public:
  BertClassifierNet(const BertConfig& config, const BertHead& head, Unpad unpad = Unpad::auto_);
  // input_ids int64 [N, S]; attention_mask [N, S] (1 = token, 0 = padding). Returns logits [N, C].
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask);
  // The pooled sentence vector [N, H] (before the head's dropout and classifier).
  at::Tensor pooled(const at::Tensor& input_ids, const at::Tensor& attention_mask);

  // HF's initialisation: normal(0, initializer_range) weights, zero biases, unit LayerNorms,
  // zero padding embedding.
  void init_weights();
  // Copies the encoder (and pooler / classifier when the file has them) from a safetensors file,
  // mapping the layout's names. Throws ember::RunError naming the first missing or mis-shaped
  // tensor. Returns the names in the file that were not used.
  std::vector<std::string> load_safetensors(const std::string& path);
  // The name Hugging Face's *ForSequenceClassification model of this layout gives the tensor this
  // module calls `name` (BertForSequenceClassification: "bert." + name, the head as is;
  // DistilBertForSequenceClassification: its own layer names, pre_classifier for the pooler).
  std::string transformers_name(const std::string& name) const;
  // Only the classifier (and nothing of the encoder) trains.
  void freeze_encoder();
  // Each encoder layer runs through `units` (sharding strategies gather its parameters first).
  void declare_units(ember::ModelUnits& units);

  const BertConfig& config() const { return config_; }
  const BertHead& head() const { return head_; }
  const at::Tensor& classifier_weight() const { return classifier_->weight; }

 private:
  BertConfig config_;
  BertHead head_;
  Unpad unpad_;
  ember::ModelUnits* units_ = nullptr;
  torch::nn::Embedding word_{nullptr}, position_{nullptr}, token_type_{nullptr};
  torch::nn::LayerNorm emb_norm_{nullptr};
  torch::nn::Dropout dropout_{nullptr}, head_dropout_{nullptr};
  std::vector<BertLayer> layers_;
  torch::nn::Linear pooler_{nullptr}, classifier_{nullptr};
};

}  // namespace ember_text
