// `engine generate`: text from a causal language model (ember::ICausalLanguageModel) and the data
// module's tokenizer (ember::ITokenizer), sampled token by token with a key/value cache.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>

#include <ember/data.h>
#include <ember/language_model.h>
#include <ember/model.h>

namespace ember::engine {

struct GenerationOptions {
  std::string prompt;           // may be empty when the tokenizer has an end-of-text token
  int64_t max_new_tokens = 200;
  double temperature = 0.8;     // 0 = greedy (argmax)
  int64_t top_k = 0;            // 0 = all tokens
  double top_p = 1.0;           // nucleus sampling: the smallest set of tokens holding top_p of the probability
  uint64_t seed = 1337;
  bool use_cache = true;        // false: every step runs the whole sequence again (a check of the cache)
};

// The language-model interfaces of `model` and `data`, checked against each other: throws
// ember::RunError naming the plugins and the fix when either is missing or the tokenizer's
// vocabulary is larger than the model's.
struct LanguageModelPair {
  ICausalLanguageModel* model = nullptr;
  ITokenizer* tokenizer = nullptr;
};
LanguageModelPair language_model_pair(IModel& model, const std::string& model_name, IDataModule& data, const std::string& data_name);

// The same check where the pair is optional (training): only a model and a data module that
// both speak the language-model interfaces are compared.
void check_vocabularies(IModel& model, const std::string& model_name, IDataModule& data, const std::string& data_name);

// Picks the next token from `logits` [vocab] (float, CPU) by the options; `generator` draws.
int64_t sample_next_token(const at::Tensor& logits, const GenerationOptions& options, at::Generator& generator);

// Longest prefix of `text` that ends on a whole UTF-8 character (a byte-level tokenizer may stop
// inside one).
size_t complete_utf8_prefix(const std::string& text);

}  // namespace ember::engine
