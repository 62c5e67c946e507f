// WordPiece tokenization with the semantics of Hugging Face's BertTokenizer / the `tokenizers`
// package's BertNormalizer + BertPreTokenizer + WordPiece + [CLS] A [SEP] template:
//   special tokens ([CLS], [SEP], [PAD], [UNK], [MASK]) written in the text are kept whole;
//   clean-up: NUL, U+FFFD and control characters (Unicode C*, except \t \n \r) are removed,
//     whitespace becomes a space;
//   CJK ideographs are split into words of their own;
//   accents are stripped (Unicode NFD, then nonspacing marks Mn removed) when strip_accents is
//     on (by default: when lowercasing);
//   lower-casing (Unicode full lowercase mapping);
//   words split at whitespace and at punctuation (ASCII punctuation and Unicode P*), each
//     punctuation character a word;
//   greedy longest-match-first word pieces ("##" continues a word); a word longer than
//     max_input_chars_per_word, or one that cannot be pieced, is [UNK].
// tests/text_test.cpp checks that the ids equal the `tokenizers` package's on every text of the
// small_fine_foods data set.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace ember_text {

struct WordPieceOptions {
  bool lowercase = true;
  std::optional<bool> strip_accents;  // unset: follow lowercase (BertTokenizer's rule)
  bool handle_chinese_chars = true;
  bool clean_text = true;
  int64_t max_input_chars_per_word = 100;
};

class WordPieceTokenizer {
 public:
  // Reads `vocab.txt` (one token a line; the line number is its id) and, when the folder holds a
  // tokenizer_config.json, its do_lower_case / strip_accents / tokenize_chinese_chars. Throws
  // ember::RunError naming the file when it is missing, empty or lacks a special token.
  static WordPieceTokenizer from_folder(const std::string& folder);
  WordPieceTokenizer(std::unordered_map<std::string, int64_t> vocab, WordPieceOptions options, const std::string& source);

  // [CLS] pieces [SEP]; with max_length > 0, pieces are cut so the result has at most max_length
  // ids (max_length >= 2).
  std::vector<int64_t> encode(std::string_view text, int64_t max_length = 0) const;
  // The word pieces of `text` without special tokens around them (ids).
  void append_pieces(std::string_view text, std::vector<int64_t>& out) const;

  int64_t pad_id() const { return pad_id_; }
  int64_t cls_id() const { return cls_id_; }
  int64_t sep_id() const { return sep_id_; }
  int64_t unk_id() const { return unk_id_; }
  // One past the largest id: vocab.txt's lines. A repeated line keeps its last id (as
  // transformers' load_vocab does), so this can exceed the number of distinct tokens.
  int64_t vocab_size() const { return id_count_; }
  const WordPieceOptions& options() const { return options_; }

 private:
  void normalized_words(std::string_view text, std::vector<int64_t>& out) const;
  void word_pieces(const std::string& word, std::vector<int64_t>& out) const;
  int64_t require(const std::string& token, const std::string& source) const;

  std::unordered_map<std::string, int64_t> vocab_;
  WordPieceOptions options_;
  std::vector<std::pair<std::string, int64_t>> specials_;  // matched whole in the raw text
  int64_t pad_id_ = 0, cls_id_ = 0, sep_id_ = 0, unk_id_ = 0;
  int64_t id_count_ = 0;
};

}  // namespace ember_text
