// The character-level tokenizer of text_lm: one id per Unicode code point of the corpus, in code
// point order (nanoGPT's shakespeare_char, for any UTF-8 text). Header-only so that the tests use
// the same code as the plugin.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace ember_text_lm {

// Decodes UTF-8 `text` into code points; on a malformed sequence returns false and sets
// `bad_offset` to its byte offset.
inline bool decode_utf8(const std::string& text, std::vector<uint32_t>& out, size_t& bad_offset) {
  out.clear();
  out.reserve(text.size());
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = s[i];
    uint32_t cp = 0;
    size_t len = 0;
    if (c < 0x80) { cp = c; len = 1; }
    else if ((c & 0xE0) == 0xC0) { cp = c & 0x1Fu; len = 2; }
    else if ((c & 0xF0) == 0xE0) { cp = c & 0x0Fu; len = 3; }
    else if ((c & 0xF8) == 0xF0) { cp = c & 0x07u; len = 4; }
    else { bad_offset = i; return false; }
    if (i + len > n) { bad_offset = i; return false; }
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) { bad_offset = i; return false; }
      cp = (cp << 6) | (s[i + k] & 0x3Fu);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      bad_offset = i;
      return false;
    }
    out.push_back(cp);
    i += len;
  }
  return true;
}

inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// "'a'", "'\n'" or "U+00E9 'é'": a symbol as an error message shows it.
inline std::string describe_code_point(uint32_t cp) {
  std::string shown;
  if (cp == '\n') shown = "\\n";
  else if (cp == '\t') shown = "\\t";
  else if (cp == '\r') shown = "\\r";
  else append_utf8(shown, cp);
  char hex[16];
  std::snprintf(hex, sizeof hex, "U+%04X", cp);
  return std::string(hex) + " '" + shown + "'";
}

class CharVocabulary {
 public:
  CharVocabulary() = default;
  // The sorted distinct code points.
  explicit CharVocabulary(std::vector<uint32_t> symbols) : symbols_(std::move(symbols)) {
    std::sort(symbols_.begin(), symbols_.end());
    symbols_.erase(std::unique(symbols_.begin(), symbols_.end()), symbols_.end());
    for (size_t i = 0; i < symbols_.size(); ++i) ids_[symbols_[i]] = static_cast<int64_t>(i);
  }
  int64_t size() const { return static_cast<int64_t>(symbols_.size()); }
  const std::vector<uint32_t>& symbols() const { return symbols_; }
  // -1 when the symbol is not in the vocabulary.
  int64_t id(uint32_t cp) const {
    const auto it = ids_.find(cp);
    return it == ids_.end() ? -1 : it->second;
  }
  // Throws std::out_of_range for an id outside [0, size()).
  uint32_t symbol(int64_t id) const {
    if (id < 0 || id >= size()) throw std::out_of_range("token id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(size()));
    return symbols_[static_cast<size_t>(id)];
  }

 private:
  std::vector<uint32_t> symbols_;
  std::map<uint32_t, int64_t> ids_;
};

}  // namespace ember_text_lm
