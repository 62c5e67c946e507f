#include "wordpiece.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <ember/error.h>

namespace ember_text {
namespace {

// Rust's char::is_whitespace (Unicode White_Space), which `tokenizers` uses.
bool is_whitespace(char32_t c) {
  switch (c) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0: case 0x1680:
    case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool is_control(char32_t c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_CC: case UTF8PROC_CATEGORY_CF: case UTF8PROC_CATEGORY_CS: case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
      return true;
    default:
      return false;
  }
}

bool is_punctuation(char32_t c) {
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126)) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_PC: case UTF8PROC_CATEGORY_PD: case UTF8PROC_CATEGORY_PS: case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI: case UTF8PROC_CATEGORY_PF: case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

bool is_chinese_char(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// Invalid UTF-8 bytes decode to U+FFFD, which clean-up then removes.
std::u32string decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(s.size());
  while (left > 0) {
    utf8proc_int32_t c = 0;
    utf8proc_ssize_t n = utf8proc_iterate(p, left, &c);
    if (n <= 0) { c = 0xFFFD; n = 1; }
    out.push_back(static_cast<char32_t>(c));
    p += n;
    left -= n;
  }
  return out;
}

void encode_to(char32_t c, std::string& out) {
  utf8proc_uint8_t buf[4];
  const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(c), buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

// Canonical decomposition (NFD) of a whole string: decomposed and canonically reordered.
std::u32string nfd(const std::u32string& s) {
  std::string utf8;
  for (char32_t c : s) encode_to(c, utf8);
  utf8proc_uint8_t* mapped = nullptr;
  const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(utf8.data()),
                              static_cast<utf8proc_ssize_t>(utf8.size()), &mapped,
                              static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE));
  if (n < 0) return s;  // cannot happen on the valid code points decode() produced
  std::u32string out = decode(std::string_view(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n)));
  std::free(mapped);
  return out;
}

}  // namespace

WordPieceTokenizer::WordPieceTokenizer(std::unordered_map<std::string, int64_t> vocab, WordPieceOptions options,
                                       const std::string& source)
    : vocab_(std::move(vocab)), options_(options) {
  for (const auto& [token, id] : vocab_) {
    if (id < 0) throw ember::RunError(c10::str(source, ": token \"", token, "\" has the negative id ", id));
    id_count_ = std::max(id_count_, id + 1);
  }
  if (options_.max_input_chars_per_word < 1)
    throw ember::RunError(c10::str(source, ": max_input_chars_per_word must be at least 1"));
  pad_id_ = require("[PAD]", source);
  unk_id_ = require("[UNK]", source);
  cls_id_ = require("[CLS]", source);
  sep_id_ = require("[SEP]", source);
  for (const char* t : {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}) {
    const auto it = vocab_.find(t);
    if (it != vocab_.end()) specials_.emplace_back(t, it->second);
  }
}

int64_t WordPieceTokenizer::require(const std::string& token, const std::string& source) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end())
    throw ember::RunError(c10::str(source, ": the vocabulary has no ", token,
                                   " token: not a BERT WordPiece vocabulary (use the model's own vocab.txt)"));
  return it->second;
}

WordPieceTokenizer WordPieceTokenizer::from_folder(const std::string& folder) {
  const std::filesystem::path dir(folder);
  const std::filesystem::path vocab_path = dir / "vocab.txt";
  std::ifstream in(vocab_path, std::ios::binary);
  if (!in)
    throw ember::RunError(c10::str(vocab_path.string(), " not found: a BERT model folder needs its WordPiece vocab.txt ",
                                   "(scripts/setup.sh installs all-MiniLM-L6-v2's)"));
  std::unordered_map<std::string, int64_t> vocab;
  std::string line;
  int64_t id = 0;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    vocab[line] = id++;  // a repeated token keeps its last id, as transformers' load_vocab does
  }
  if (id == 0) throw ember::RunError(c10::str(vocab_path.string(), ": empty vocabulary: use the model's own vocab.txt"));

  WordPieceOptions options;
  const std::filesystem::path cfg_path = dir / "tokenizer_config.json";
  if (std::filesystem::exists(cfg_path)) {
    std::ifstream cf(cfg_path);
    nlohmann::json cfg;
    try {
      cfg = nlohmann::json::parse(cf);
    } catch (const nlohmann::json::exception& e) {
      throw ember::RunError(c10::str(cfg_path.string(), ": not valid JSON (", e.what(), ")"));
    }
    auto flag = [&](const char* key, bool& out) {
      if (cfg.contains(key) && cfg[key].is_boolean()) out = cfg[key].get<bool>();
    };
    flag("do_lower_case", options.lowercase);
    flag("tokenize_chinese_chars", options.handle_chinese_chars);
    if (cfg.contains("strip_accents") && cfg["strip_accents"].is_boolean()) options.strip_accents = cfg["strip_accents"].get<bool>();
  }
  return WordPieceTokenizer(std::move(vocab), options, vocab_path.string());
}

std::vector<int64_t> WordPieceTokenizer::encode(std::string_view text, int64_t max_length) const {
  std::vector<int64_t> ids{cls_id_};
  append_pieces(text, ids);
  if (max_length > 0 && static_cast<int64_t>(ids.size()) + 1 > max_length)
    ids.resize(static_cast<size_t>(std::max<int64_t>(max_length - 1, 1)));
  ids.push_back(sep_id_);
  return ids;
}

void WordPieceTokenizer::append_pieces(std::string_view text, std::vector<int64_t>& out) const {
  // Special tokens written in the text are matched on the raw text, before any normalization.
  size_t start = 0;
  while (start < text.size()) {
    size_t best = std::string_view::npos;
    const std::pair<std::string, int64_t>* found = nullptr;
    for (const auto& s : specials_) {
      const size_t at = text.find(s.first, start);
      if (at < best) { best = at; found = &s; }
    }
    if (found == nullptr) {
      normalized_words(text.substr(start), out);
      return;
    }
    normalized_words(text.substr(start, best - start), out);
    out.push_back(found->second);
    start = best + found->first.size();
  }
}

void WordPieceTokenizer::normalized_words(std::string_view text, std::vector<int64_t>& out) const {
  if (text.empty()) return;
  std::u32string s = decode(text);
  std::u32string t;
  t.reserve(s.size());
  for (char32_t c : s) {
    if (options_.clean_text) {
      if (c == 0 || c == 0xFFFD || is_control(c)) continue;
      if (is_whitespace(c)) c = ' ';
    }
    if (options_.handle_chinese_chars && is_chinese_char(c)) {
      t.push_back(' ');
      t.push_back(c);
      t.push_back(' ');
    } else {
      t.push_back(c);
    }
  }
  if (options_.strip_accents.value_or(options_.lowercase)) {
    s = nfd(t);
    t.clear();
    for (char32_t c : s)
      if (utf8proc_category(static_cast<utf8proc_int32_t>(c)) != UTF8PROC_CATEGORY_MN) t.push_back(c);
  }
  if (options_.lowercase) {
    s.clear();
    for (char32_t c : t) {
      if (c == 0x130) {  // the one unconditional multi-character lowercase mapping (SpecialCasing)
        s.push_back('i');
        s.push_back(0x307);
      } else {
        s.push_back(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
      }
    }
    t.swap(s);
  }
  // Words: split at whitespace (dropped) and punctuation (kept, one character a word).
  std::string word;
  auto flush = [&] {
    if (!word.empty()) word_pieces(word, out);
    word.clear();
  };
  for (char32_t c : t) {
    if (is_whitespace(c)) {
      flush();
    } else if (is_punctuation(c)) {
      flush();
      encode_to(c, word);
      flush();
    } else {
      encode_to(c, word);
    }
  }
  flush();
}

void WordPieceTokenizer::word_pieces(const std::string& word, std::vector<int64_t>& out) const {
  // Character boundaries (byte offsets) of the word.
  std::vector<size_t> bounds;
  for (size_t i = 0; i < word.size(); ++i)
    if ((static_cast<unsigned char>(word[i]) & 0xC0) != 0x80) bounds.push_back(i);
  bounds.push_back(word.size());
  const int64_t chars = static_cast<int64_t>(bounds.size()) - 1;
  if (chars > options_.max_input_chars_per_word) {
    out.push_back(unk_id_);
    return;
  }
  const size_t mark = out.size();
  size_t b = 0;  // index into bounds of the current start
  std::string piece;
  while (b + 1 < bounds.size()) {
    size_t e = bounds.size() - 1;
    int64_t id = -1;
    for (; e > b; --e) {
      piece.assign(b > 0 ? "##" : "");
      piece.append(word, bounds[b], bounds[e] - bounds[b]);
      const auto it = vocab_.find(piece);
      if (it != vocab_.end()) {
        id = it->second;
        break;
      }
    }
    if (id < 0) {
      out.resize(mark);
      out.push_back(unk_id_);
      return;
    }
    out.push_back(id);
    b = e;
  }
}

}  // namespace ember_text
