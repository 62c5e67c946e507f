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
    // Every value is read with its type checked, so that a damaged or foreign file is one line
    // naming the file and the value, never nlohmann's own error or an id past the table.
    auto fail = [&](const std::string& what) { throw ember::RunError(c10::str(origin_, ": ", what)); };
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(json_text);
    } catch (const nlohmann::json::exception& e) {
      fail(c10::str("not valid JSON (", without_prefix(e.what()), ")"));
    }
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object()) fail("not a Hugging Face tokenizer.json (no \"model\")");
    const nlohmann::json& model = j["model"];
    auto string_or = [&](const nlohmann::json& o, const char* key, const char* where, std::string fallback) {
      if (!o.contains(key) || o[key].is_null()) return fallback;
      if (!o[key].is_string()) fail(c10::str(where, key, " is ", o[key].type_name(), ", not a string"));
      return o[key].get<std::string>();
    };
    auto bool_or = [&](const nlohmann::json& o, const char* key, const char* where, bool fallback) {
      if (!o.contains(key) || o[key].is_null()) return fallback;
      if (!o[key].is_boolean()) fail(c10::str(where, key, " is ", o[key].type_name(), ", not true or false"));
      return o[key].get<bool>();
    };
    // Ids index the table decode reads and are stored in uint32 token files.
    auto token_id = [&](const nlohmann::json& v, const std::string& what) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxId)
        fail(c10::str(what, " has id ", v.dump(), ": an id is an integer from 0 to ", kMaxId));
      return v.get<int64_t>();
    };
    const std::string type = string_or(model, "type", "model.", "");
    if (type != "BPE") fail(c10::str("model type \"", type, "\": only byte-level BPE (GPT-2's) is supported"));
    const nlohmann::json pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : nlohmann::json();
    const bool ok = pre.is_object() && string_or(pre, "type", "pre_tokenizer.", "") == "ByteLevel" &&
                    !bool_or(pre, "add_prefix_space", "pre_tokenizer.", false) && bool_or(pre, "use_regex", "pre_tokenizer.", true);
    if (!ok) fail("the pre-tokenizer is not ByteLevel(add_prefix_space = false) with GPT-2's pattern: only GPT-2-style byte-level BPE is supported");
    if (j.contains("normalizer") && !j["normalizer"].is_null()) fail("a normalizer is not supported (GPT-2's tokenizer has none)");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (!string_or(model, key, "model.", "").empty()) fail(c10::str("a BPE with ", key, " is not byte-level BPE as GPT-2's"));
    ignore_merges_ = bool_or(model, "ignore_merges", "model.", false);

    if (!model.contains("vocab") || !model["vocab"].is_object()) fail("model.vocab is not an object of tokens and their ids");
    for (const auto& [token, id_value] : model["vocab"].items()) {
      const int64_t id = token_id(id_value, c10::str("token ", quoted(token)));
      vocab_[token] = id;
      name_id(id, token);
    }
    if (!model.contains("merges") || !model["merges"].is_array()) fail("model.merges is not a list of merges");
    int64_t rank = 0;
    for (const auto& m : model["merges"]) {
      std::string a, b;
      if (m.is_string() && std::count(m.get_ref<const std::string&>().begin(), m.get_ref<const std::string&>().end(), ' ') == 1) {
        const std::string& s = m.get_ref<const std::string&>();
        const size_t sp = s.find(' ');
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        fail(c10::str("merge ", rank, " (", m.dump().substr(0, 80), ") is not two symbols (\"a b\" or [\"a\", \"b\"])"));
      }
      // `tokenizers` refuses such a file too (MergeTokenOutOfVocabulary).
      for (const std::string& symbol : {a, b, a + b})
        if (!vocab_.count(symbol)) fail(c10::str("merge ", rank, " (", m.dump().substr(0, 80), ") makes or uses ", quoted(symbol), ", which is not in model.vocab"));
      ranks_[a + '\x01' + b] = rank++;  // a repeated merge keeps its last rank, as in `tokenizers`
    }
    if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
      if (!j["added_tokens"].is_array()) fail("added_tokens is not a list");
      for (const auto& t : j["added_tokens"]) {
        if (!t.is_object() || !t.contains("id")) fail(c10::str("an added token (", t.dump().substr(0, 80), ") has no id"));
        const std::string content = string_or(t, "content", "added token ", "");
        const int64_t id = token_id(t["id"], c10::str("added token ", quoted(content)));
        if (content.empty()) fail(c10::str("added token ", id, " has no content"));
        added_.emplace_back(content, id);
        name_id(id, content);
        if (content == "<|endoftext|>" || content == "</s>" || content == "<|end_of_text|>") end_ = id;
      }
    }
    if (id_to_token_.empty()) fail("the vocabulary is empty");
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
      const auto named = id_to_token_.find(id);
      if (named == id_to_token_.end())
        throw ember::RunError(c10::str("text_lm: token id ", id, " is not in the vocabulary of ", origin_, " (", size_, " tokens)"));
      const std::string& token = named->second;
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
  static constexpr int64_t kMaxId = 0x7FFFFFFF;

  // "[json.exception.parse_error.101] parse error at ..." -> "parse error at ...".
  static std::string without_prefix(const std::string& what) {
    return what.rfind("[json.exception.", 0) == 0 && what.find("] ") != std::string::npos ? what.substr(what.find("] ") + 2) : what;
  }

  // A token as JSON writes it: quoted, with control characters escaped (messages stay one line).
  static std::string quoted(const std::string& token) { return nlohmann::json(token).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

  // One token per id: two tokens with one id would decode one of them as the other.
  void name_id(int64_t id, const std::string& token) {
    const auto [it, inserted] = id_to_token_.emplace(id, token);
    if (!inserted && it->second != token)
      throw ember::RunError(c10::str(origin_, ": id ", id, " is given to both ", quoted(it->second), " and ", quoted(token),
                                     ": each id names one token"));
    size_ = std::max(size_, id + 1);
  }

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
      if (it == vocab_.end()) throw ember::RunError(c10::str("text_lm: ", origin_, " has no token for ", quoted(s), " (a byte-level BPE without all 256 bytes?)"));
      ids.push_back(it->second);
    }
    return cache_.emplace(piece, std::move(ids)).first->second;
  }

  std::string json_, origin_;
  std::unordered_map<std::string, int64_t> vocab_, ranks_;
  std::vector<std::pair<std::string, int64_t>> added_;
  std::unordered_map<int64_t, std::string> id_to_token_;  // a map: ids may leave gaps
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
