// The tokenizers of text_lm behind one small interface: characters of the corpus (CharTokenizer),
// SentencePiece (BPE or unigram, trained on the corpus once, or a given tokenizer.model such as a
// Llama-family model's) and byte-level BPE from a Hugging Face tokenizer.json (GPT-2's). All keep
// text exactly: decode(encode(text)) == text.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace ember_text_lm {

class LmTokenizer {
 public:
  virtual ~LmTokenizer() = default;
  virtual int64_t vocab_size() const = 0;
  // Throws ember::RunError naming what cannot be encoded and the fix.
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual std::string describe() const = 0;
  // Writes what load() needs into `folder` (the token cache).
  virtual void save(const std::filesystem::path& folder) const = 0;
  // The id that ends a document, -1 when the vocabulary has none.
  virtual int64_t end_of_text() const { return -1; }
};

// Characters of `texts` (Unicode code points, ids in code point order).
std::unique_ptr<LmTokenizer> train_char_tokenizer(const std::vector<std::string>& texts, const std::vector<std::filesystem::path>& files);
std::unique_ptr<LmTokenizer> load_char_tokenizer(const std::filesystem::path& folder);

struct SentencePieceSettings {
  std::string model_file;     // a given tokenizer.model; empty: train one on the corpus
  int64_t vocab_size = 2048;  // when training
  std::string model_type = "bpe";  // bpe | unigram
};
// Trains SentencePiece on `texts` (a line a sentence, byte fallback so that every text encodes,
// identity normalization so that nothing is rewritten), or loads settings.model_file.
std::unique_ptr<LmTokenizer> make_sentencepiece(const SentencePieceSettings& settings, const std::vector<std::string>& texts);
std::unique_ptr<LmTokenizer> load_sentencepiece(const std::filesystem::path& folder);

// A Hugging Face tokenizer.json of a byte-level BPE (GPT-2's tokenizer and its kin: the ByteLevel
// pre-tokenizer with GPT-2's split pattern, bytes mapped to printable characters, ranked merges).
// Throws ember::RunError naming the file and what it does not support.
std::unique_ptr<LmTokenizer> load_bytelevel_bpe(const std::filesystem::path& tokenizer_json);


}  // namespace ember_text_lm
