// Extension interfaces for language models (SDK 2.2): a data module that turns text into token ids
// and back (ITokenizer), and a model that predicts the next token, with a cache of attention keys
// and values for generation (ICausalLanguageModel). `engine generate` needs both: the tokenizer
// belongs to the data, so one model plugin serves every tokenizer whose vocabulary fits it.
// Both are optional and found through IPluginObject::query_interface.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ember/types.h"

namespace ember {

// IDataModule::query_interface(kTokenizerIid). Called after setup(), from the engine's thread.
inline constexpr const char* kTokenizerIid = "ember.ITokenizer/1";
class EMBER_SDK_API ITokenizer {
 public:
  virtual ~ITokenizer() = default;
  // Ids are in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  // Throws ember::RunError naming the first text it cannot encode (a character outside a
  // character-level vocabulary, say) and what to do.
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  // The text of `ids`. A tokenizer whose tokens are bytes may end in an incomplete UTF-8
  // character; callers that stream decode the whole sequence and print what was added.
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  // The id that ends a text (generation stops there), or -1 when the vocabulary has none.
  virtual int64_t end_of_text_id() const = 0;
  // One line for the log, e.g. "characters of the corpus (84 symbols)".
  virtual std::string describe() const = 0;
};

// IModel::query_interface(kCausalLanguageModelIid). Every call runs under no-grad with the module
// in eval mode, on the device and in the precision region the engine chose (as predict_step).
inline constexpr const char* kCausalLanguageModelIid = "ember.ICausalLanguageModel/1";
class EMBER_SDK_API ICausalLanguageModel {
 public:
  virtual ~ICausalLanguageModel() = default;
  virtual int64_t vocab_size() const = 0;
  // Positions the model can attend over: a sequence (cached tokens included) never exceeds it.
  virtual int64_t context_length() const = 0;
  // ids [N, T] int64 -> logits [N, T, vocab_size()] float, each position predicting the next
  // token from the positions before it; no cache is read or written.
  virtual at::Tensor logits(const at::Tensor& ids) = 0;
  // Starts a cached generation of `batch_size` sequences of at most `max_length` tokens:
  // forgets whatever an earlier generation cached.
  virtual void begin_generation(int64_t batch_size, int64_t max_length) = 0;
  // ids [N, T]: the next T tokens of every sequence (first the prompt, then one token per call).
  // Returns their logits [N, T, vocab_size()] as logits() would for the whole sequence so far,
  // and appends their keys and values to the cache.
  virtual at::Tensor generation_step(const at::Tensor& ids) = 0;
  // Tokens cached so far.
  virtual int64_t cached_length() const = 0;
  // Frees the cache.
  virtual void end_generation() = 0;
};

}  // namespace ember
