// Byte-level BPE from a Hugging Face tokenizer.json (GPT-2's tokenizer): what `tokenizers` does
// for {"pre_tokenizer": ByteLevel(add_prefix_space=false, use_regex=true), "model": BPE}:
//  1. split the text with GPT-2's pattern
//     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//     (a scanner over code points here; letters and numbers by utf8proc's Unicode categories),
//  2. map each piece's UTF-8 bytes to printable characters (GPT-2's bytes_to_unicode),
//  3. merge adjacent symbols by rank (lowest first) until no ranked pair is left,
//  4. look the symbols up in the vocabulary.
// Added tokens ("<|endoftext|>") are matched in the text first, as `tokenizers` does.
#include <algorithm>
#include <array>
#include <fstream>
#include <map>
#include <mutex>
#include <unordered_map>

#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <ember/error.h>

#include "char_vocabulary.h"
#include "lm_tokenizer.h"

namespace fs = std::filesystem;

namespace ember_text_lm {
namespace {

bool is_space(uint32_t c) {  // Unicode White_Space, what \s matches
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
bool is_letter(uint32_t c) {
  const auto k = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO;
}
bool is_number(uint32_t c) {
  const auto k = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

// Pieces of `cps` [begin, end) by GPT-2's pattern, as [start, stop) code point ranges.
void split_gpt2(const std::vector<uint32_t>& cps, size_t begin, size_t end, std::vector<std::pair<size_t, size_t>>& out) {
  size_t i = begin;
  auto run = [&](size_t from, auto pred) {
    size_t j = from;
    while (j < end && pred(cps[j])) ++j;
    return j;
  };
  while (i < end) {
    const uint32_t c = cps[i];
    // 's 't 're 've 'm 'll 'd
    if (c == '\'' && i + 1 < end) {
      const uint32_t a = cps[i + 1], b = i + 2 < end ? cps[i + 2] : 0;
      size_t len = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') len = 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) len = 3;
      if (len > 0) {
        out.emplace_back(i, i + len);
        i += len;
        continue;
      }
    }
    const size_t j = c == ' ' ? i + 1 : i;  // the optional leading space of the next three
    if (j < end) {
      const uint32_t d = cps[j];
      size_t k = 0;
      if (is_letter(d)) k = run(j, is_letter);
      else if (is_number(d)) k = run(j, is_number);
      else if (!is_space(d)) k = run(j, [](uint32_t x) { return !is_space(x) && !is_letter(x) && !is_number(x); });
      if (k > j) {
        out.emplace_back(i, k);
        i = k;
        continue;
      }
    }
    // Whitespace: \s+(?!\S) leaves the last space before a non-space for the next piece; \s+.
    const size_t k = run(i, is_space);
    if (k < end && k - i >= 2) {
      out.emplace_back(i, k - 1);
      i = k - 1;
    } else {
      out.emplace_back(i, k);
      i = k;
    }
  }
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to 256, 257, ...
std::array<uint32_t, 256> byte_to_unicode() {
  std::array<uint32_t, 256> table{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    table[b] = printable ? b : next++;
  }
  return table;
}

class ByteLevelBpe final : public LmTokenizer {
 public:
  ByteLevelBpe(const std::string& json_text, std::string origin) : json_(json_text), origin_(std::move(origin)) {
    const nlohmann::json j = nlohmann::json::parse(json_text, nullptr, false);
    auto fail = [&](const std::string& what) { throw ember::RunError(c10::str(origin_, ": ", what)); };
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object()) fail("not a Hugging Face tokenizer.json (no \"model\")");
    const auto& model = j["model"];
    if (model.value("type", "") != "BPE") fail(c10::str("model type \"", model.value("type", ""), "\": only byte-level BPE (GPT-2's) is supported"));
    auto byte_level = [](const nlohmann::json& p) { return p.is_object() && p.value("type", "") == "ByteLevel"; };
    const auto& pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : nlohmann::json();
    bool ok = byte_level(pre) && !pre.value("add_prefix_space", false) && pre.value("use_regex", true);
    if (!ok) fail("the pre-tokenizer is not ByteLevel(add_prefix_space = false) with GPT-2's pattern: only GPT-2-style byte-level BPE is supported");
    if (j.contains("normalizer") && !j["normalizer"].is_null()) fail("a normalizer is not supported (GPT-2's tokenizer has none)");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty())
        fail(c10::str("a BPE with ", key, " is not byte-level BPE as GPT-2's"));
    ignore_merges_ = model.value("ignore_merges", false);
    for (const auto& [token, id] : model["vocab"].items()) {
      vocab_[token] = id.get<int64_t>();
      size_ = std::max(size_, id.get<int64_t>() + 1);
    }
    int64_t rank = 0;
    for (const auto& m : model["merges"]) {
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) fail(c10::str("merge \"", s, "\" is not two symbols"));
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        a = m.at(0).get<std::string>();
        b = m.at(1).get<std::string>();
      }
      ranks_[a + '\x01' + b] = rank++;
    }
    if (j.contains("added_tokens"))
      for (const auto& t : j["added_tokens"]) {
        const std::string content = t.value("content", "");
        const int64_t id = t.value("id", int64_t{-1});
        if (content.empty() || id < 0) continue;
        added_.emplace_back(content, id);
        size_ = std::max(size_, id + 1);
        if (content == "<|endoftext|>" || content == "</s>" || content == "<|end_of_text|>") end_ = id;
      }
    id_to_token_.resize(static_cast<size_t>(size_));
    for (const auto& [token, id] : vocab_) id_to_token_[static_cast<size_t>(id)] = token;
    for (const auto& [token, id] : added_) id_to_token_[static_cast<size_t>(id)] = token;
    const auto table = byte_to_unicode();
    for (uint32_t b = 0; b < 256; ++b) {
      std::string u;
      append_utf8(u, table[b]);
      byte_symbol_[b] = u;
      symbol_byte_[table[b]] = static_cast<unsigned char>(b);
    }
  }
  int64_t vocab_size() const override { return size_; }
  int64_t end_of_text() const override { return end_; }
  std::string describe() const override { return c10::str("byte-level BPE ", origin_, " (vocabulary ", size_, ")"); }
  void save(const fs::path& folder) const override {
    std::ofstream(folder / "tokenizer.json", std::ios::binary) << json_;
    std::ofstream(folder / "tokenizer.origin") << origin_;
  }

  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int64_t> out;
    // Added tokens first: the text between them is tokenized as usual.
    size_t pos = 0;
    while (pos < text.size()) {
      size_t best = std::string::npos;
      const std::pair<std::string, int64_t>* found = nullptr;
      for (const auto& a : added_) {
        const size_t at = text.find(a.first, pos);
        if (at < best) best = at, found = &a;
      }
      encode_plain(text.substr(pos, (best == std::string::npos ? text.size() : best) - pos), out);
      if (found == nullptr) break;
      out.push_back(found->second);
      pos = best + found->first.size();
    }
    return out;
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (int64_t id : ids) {
      if (id < 0 || id >= size_ || id_to_token_[static_cast<size_t>(id)].empty())
        throw ember::RunError(c10::str("text_lm: token id ", id, " is not in the vocabulary of ", origin_, " (", size_, " tokens)"));
      const std::string& token = id_to_token_[static_cast<size_t>(id)];
      if (std::any_of(added_.begin(), added_.end(), [&](const auto& a) { return a.second == id; })) {
        out += token;
        continue;
      }
      std::vector<uint32_t> cps;
      size_t bad = 0;
      decode_utf8(token, cps, bad);
      for (uint32_t c : cps) {
        const auto it = symbol_byte_.find(c);
        if (it != symbol_byte_.end()) out += static_cast<char>(it->second);
      }
    }
    return out;
  }

 private:
  void encode_plain(const std::string& text, std::vector<int64_t>& out) const {
    if (text.empty()) return;
    std::vector<uint32_t> cps;
    size_t bad = 0;
    if (!decode_utf8(text, cps, bad)) throw ember::RunError(c10::str("text_lm: the text is not UTF-8 (byte ", bad, ")"));
    std::vector<std::pair<size_t, size_t>> pieces;
    split_gpt2(cps, 0, cps.size(), pieces);
    std::string piece;
    for (const auto& [a, b] : pieces) {
      piece.clear();
      for (size_t k = a; k < b; ++k) append_utf8(piece, cps[k]);
      const auto& ids = word(piece);
      out.insert(out.end(), ids.begin(), ids.end());
    }
  }

  // One pre-tokenized piece -> ids (cached: a corpus repeats its words).
  const std::vector<int64_t>& word(const std::string& piece) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (const auto it = cache_.find(piece); it != cache_.end()) return it->second;
    std::vector<std::string> symbols;
    for (unsigned char byte : piece) symbols.push_back(byte_symbol_[byte]);
    if (ignore_merges_) {  // Llama 3's rule: a piece that is a token as a whole is that token
      std::string whole;
      for (const auto& s : symbols) whole += s;
      if (const auto it = vocab_.find(whole); it != vocab_.end()) return cache_.emplace(piece, std::vector<int64_t>{it->second}).first->second;
    }
    while (symbols.size() > 1) {
      int64_t best = -1;
      size_t at = 0;
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        const auto it = ranks_.find(symbols[i] + '\x01' + symbols[i + 1]);
        if (it != ranks_.end() && (best < 0 || it->second < best)) best = it->second, at = i;
      }
      if (best < 0) break;
      // Merge every occurrence of the best pair, left to right.
      const std::string a = symbols[at], b = symbols[at + 1];
      std::vector<std::string> merged;
      for (size_t i = 0; i < symbols.size(); ++i) {
        if (i + 1 < symbols.size() && symbols[i] == a && symbols[i + 1] == b) {
          merged.push_back(a + b);
          ++i;
        } else {
          merged.push_back(symbols[i]);
        }
      }
      symbols.swap(merged);
    }
    std::vector<int64_t> ids;
    for (const auto& s : symbols) {
      const auto it = vocab_.find(s);
      if (it == vocab_.end()) throw ember::RunError(c10::str("text_lm: ", origin_, " has no token for \"", s, "\" (a byte-level BPE without all 256 bytes?)"));
      ids.push_back(it->second);
    }
    return cache_.emplace(piece, std::move(ids)).first->second;
  }

  std::string json_, origin_;
  std::unordered_map<std::string, int64_t> vocab_, ranks_;
  std::vector<std::pair<std::string, int64_t>> added_;
  std::vector<std::string> id_to_token_;
  std::array<std::string, 256> byte_symbol_;
  std::unordered_map<uint32_t, unsigned char> symbol_byte_;
  int64_t size_ = 0, end_ = -1;
  bool ignore_merges_ = false;
  mutable std::mutex mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ember::RunError(c10::str(path.string(), ": cannot read the tokenizer"));
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

std::unique_ptr<LmTokenizer> load_bytelevel_bpe(const fs::path& tokenizer_json) {
  // A cached copy keeps the name of the file it came from.
  const fs::path origin_file = tokenizer_json.parent_path() / "tokenizer.origin";
  std::string origin = tokenizer_json.string();
  if (tokenizer_json.filename() == "tokenizer.json" && fs::exists(origin_file)) origin = read_text(origin_file);
  return std::make_unique<ByteLevelBpe>(read_text(tokenizer_json), origin);
}

}  // namespace ember_text_lm
