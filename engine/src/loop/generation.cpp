#include "loop/generation.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <ember/error.h>

#include <limits>

namespace ember::engine {

LanguageModelPair language_model_pair(IModel& model, const std::string& model_name, IDataModule& data, const std::string& data_name) {
  LanguageModelPair p;
  p.model = static_cast<ICausalLanguageModel*>(model.query_interface(kCausalLanguageModelIid));
  p.tokenizer = static_cast<ITokenizer*>(data.query_interface(kTokenizerIid));
  if (p.model == nullptr)
    throw RunError("model '" + model_name + "' cannot generate text: it does not implement ember::ICausalLanguageModel "
                   "(sdk/include/ember/language_model.h); use a language model such as gpt");
  if (p.tokenizer == nullptr)
    throw RunError("data '" + data_name + "' has no tokenizer (ember::ITokenizer, sdk/include/ember/language_model.h) to turn the prompt "
                   "into tokens and back: use a text data module such as text_lm");
  check_vocabularies(model, model_name, data, data_name);
  return p;
}

void check_vocabularies(IModel& model, const std::string& model_name, IDataModule& data, const std::string& data_name) {
  auto* lm = static_cast<ICausalLanguageModel*>(model.query_interface(kCausalLanguageModelIid));
  auto* tokenizer = static_cast<ITokenizer*>(data.query_interface(kTokenizerIid));
  if (lm == nullptr || tokenizer == nullptr) return;
  if (tokenizer->vocab_size() > lm->vocab_size())
    throw RunError(c10::str("data '", data_name, "' makes token ids up to ", tokenizer->vocab_size() - 1, " (", tokenizer->describe(),
                            ") but model '", model_name, "' knows ", lm->vocab_size(), " tokens: set model.vocab_size = ", tokenizer->vocab_size(),
                            " or more (a checkpoint must be trained again with it)"));
}

int64_t sample_next_token(const at::Tensor& logits, const GenerationOptions& o, at::Generator& generator) {
  if (o.temperature == 0.0) return logits.argmax().item<int64_t>();
  at::Tensor l = logits.to(at::kFloat) / o.temperature;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  if (o.top_k > 0 && o.top_k < l.size(0)) {
    const at::Tensor kth = std::get<0>(l.topk(o.top_k)).min();
    l = l.masked_fill(l < kth, minus_inf);
  }
  if (o.top_p < 1.0) {
    auto [sorted, order] = l.sort(/*dim=*/0, /*descending=*/true);
    const at::Tensor probs = sorted.softmax(0);
    // Drop a token when the tokens before it already hold top_p (the most likely always stays).
    const at::Tensor drop = (probs.cumsum(0) - probs) >= o.top_p;
    l = l.index_fill(0, order.masked_select(drop), minus_inf);
  }
  return at::multinomial(l.softmax(0), 1, /*replacement=*/false, generator).item<int64_t>();
}

size_t complete_utf8_prefix(const std::string& text) {
  size_t n = text.size();
  // Walk back over at most 3 continuation bytes to the last lead byte.
  size_t i = n;
  int back = 0;
  while (i > 0 && back < 4 && (static_cast<unsigned char>(text[i - 1]) & 0xC0) == 0x80) --i, ++back;
  if (i == 0) return n;
  const auto lead = static_cast<unsigned char>(text[i - 1]);
  const size_t need = lead < 0x80 ? 1 : (lead & 0xE0) == 0xC0 ? 2 : (lead & 0xF0) == 0xE0 ? 3 : (lead & 0xF8) == 0xF0 ? 4 : 1;
  return n - (i - 1) >= need ? n : i - 1;
}

}  // namespace ember::engine
