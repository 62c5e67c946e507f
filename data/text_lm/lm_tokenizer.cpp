#include "lm_tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include <c10/util/StringUtil.h>

#include <ember/error.h>

#include "char_vocabulary.h"

namespace fs = std::filesystem;

namespace ember_text_lm {
namespace {

class CharTokenizer final : public LmTokenizer {
 public:
  explicit CharTokenizer(CharVocabulary vocab) : vocab_(std::move(vocab)) {}
  int64_t vocab_size() const override { return vocab_.size(); }
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<uint32_t> cps;
    size_t bad = 0;
    if (!decode_utf8(text, cps, bad)) throw ember::RunError(c10::str("text_lm: the text is not UTF-8 (byte ", bad, ")"));
    std::vector<int64_t> ids;
    ids.reserve(cps.size());
    for (uint32_t cp : cps) {
      const int64_t id = vocab_.id(cp);
      if (id < 0)
        throw ember::RunError(c10::str("text_lm: the character ", describe_code_point(cp), " is not in the vocabulary of the corpus (",
                                       vocab_.size(), " characters): leave it out of the text"));
      ids.push_back(id);
    }
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_.size())
        throw ember::RunError(c10::str("text_lm: token id ", id, " is outside the vocabulary of ", vocab_.size(),
                                       " characters (the model's vocab_size is larger than the data's: its extra ids mean nothing here)"));
      append_utf8(out, vocab_.symbol(id));
    }
    return out;
  }
  std::string describe() const override { return c10::str("characters of the corpus (vocabulary ", vocab_.size(), ")"); }
  void save(const fs::path& folder) const override {
    std::ofstream v(folder / "vocab.txt");
    for (uint32_t cp : vocab_.symbols()) v << std::hex << cp << "\n";
    if (!v) throw ember::RunError(c10::str((folder / "vocab.txt").string(), ": writing failed (disk full?)"));
  }

 private:
  CharVocabulary vocab_;
};

// Feeds the corpus's lines to SentencePiece's trainer (no temporary input file).
class Lines final : public sentencepiece::SentenceIterator {
 public:
  explicit Lines(const std::vector<std::string>& texts) : texts_(texts) { advance(); }
  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    while (text_ < texts_.size()) {
      const std::string& t = texts_[text_];
      if (pos_ >= t.size()) {
        ++text_;
        pos_ = 0;
        continue;
      }
      const size_t end = std::min(t.find('\n', pos_), t.size());
      line_.assign(t, pos_, end - pos_);
      pos_ = end + 1;
      if (!line_.empty()) return;
    }
    done_ = true;
  }
  const std::vector<std::string>& texts_;
  size_t text_ = 0, pos_ = 0;
  std::string line_;
  bool done_ = false;
};

// SentencePiece sees lines (a newline is never inside a piece): a text is encoded line by line
// with the newline's own token between lines (the byte piece <0x0A> of byte fallback, which
// Llama-family models have too), and decoded the same way.
class SentencePieceTokenizer final : public LmTokenizer {
 public:
  SentencePieceTokenizer(const std::string& serialized, std::string origin) : serialized_(serialized), origin_(std::move(origin)) {
    const auto status = processor_.LoadFromSerializedProto(serialized_);
    if (!status.ok()) {
      // The library's message names its own source line ("./src/sentencepiece_processor.cc(232)
      // [model_proto->ParseFromArray(...)]"): say what it means instead.
      std::string why = status.message();
      if (why.find("ParseFromArray") != std::string::npos) why = "it does not parse as one (a tokenizer.model file is a serialized ModelProto)";
      while (!why.empty() && std::isspace(static_cast<unsigned char>(why.back()))) why.pop_back();
      throw ember::RunError(c10::str("text_lm: ", origin_, " is not a SentencePiece model: ", why));
    }
    newline_ = processor_.PieceToId("<0x0A>");
    if (newline_ == processor_.unk_id())
      throw ember::RunError(c10::str("text_lm: the SentencePiece model ", origin_,
                                     " has no newline token (<0x0A>: byte fallback): train one with byte_fallback, or let text_lm train it"));
  }
  int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int64_t> out;
    std::vector<int> ids;
    size_t pos = 0;
    while (pos <= text.size()) {
      const size_t end = std::min(text.find('\n', pos), text.size());
      if (end > pos) {
        const auto status = processor_.Encode(std::string_view(text).substr(pos, end - pos), &ids);
        if (!status.ok()) throw ember::RunError(c10::str("text_lm: SentencePiece cannot encode the text: ", status.ToString()));
        out.insert(out.end(), ids.begin(), ids.end());
      }
      if (end == text.size()) break;
      out.push_back(newline_);
      pos = end + 1;
    }
    return out;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out, piece;
    std::vector<int> line;
    auto flush = [&] {
      if (line.empty()) return;
      const auto status = processor_.Decode(line, &piece);
      if (!status.ok()) throw ember::RunError(c10::str("text_lm: SentencePiece cannot decode: ", status.ToString()));
      out += piece;
      line.clear();
    };
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size())
        throw ember::RunError(c10::str("text_lm: token id ", id, " is outside the SentencePiece vocabulary of ", vocab_size(),
                                       " (the model's vocab_size is larger than the data's: its extra ids mean nothing here)"));
      if (id == newline_) {
        flush();
        out += '\n';
      } else {
        line.push_back(static_cast<int>(id));
      }
    }
    flush();
    return out;
  }
  std::string describe() const override { return c10::str("SentencePiece ", origin_, " (vocabulary ", vocab_size(), ")"); }
  void save(const fs::path& folder) const override {
    std::ofstream f(folder / "tokenizer.model", std::ios::binary);
    f.write(serialized_.data(), static_cast<std::streamsize>(serialized_.size()));
    std::ofstream(folder / "tokenizer.origin") << origin_;
    if (!f) throw ember::RunError(c10::str((folder / "tokenizer.model").string(), ": writing failed (disk full?)"));
  }

 private:
  std::string serialized_, origin_;
  sentencepiece::SentencePieceProcessor processor_;
  int newline_ = 0;
};

std::string read_binary(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ember::RunError(c10::str(path.string(), ": cannot read"));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::unique_ptr<LmTokenizer> train_char_tokenizer(const std::vector<std::string>& texts, const std::vector<fs::path>& files) {
  std::vector<uint32_t> all, cps;
  for (size_t f = 0; f < texts.size(); ++f) {
    size_t bad = 0;
    if (!decode_utf8(texts[f], cps, bad)) {
      const int64_t line = 1 + std::count(texts[f].begin(), texts[f].begin() + static_cast<std::ptrdiff_t>(bad), '\n');
      throw ember::RunError(c10::str(files[f].string(), ":", line, ": not UTF-8 (byte ", bad, "): convert the corpus to UTF-8 (iconv) or leave the file out"));
    }
    all.insert(all.end(), cps.begin(), cps.end());
  }
  return std::make_unique<CharTokenizer>(CharVocabulary(all));
}

std::unique_ptr<LmTokenizer> load_char_tokenizer(const fs::path& folder) {
  std::ifstream v(folder / "vocab.txt");
  std::vector<uint32_t> symbols;
  for (std::string line; std::getline(v, line);)
    if (!line.empty()) symbols.push_back(static_cast<uint32_t>(std::stoul(line, nullptr, 16)));
  return std::make_unique<CharTokenizer>(CharVocabulary(symbols));
}

std::unique_ptr<LmTokenizer> make_sentencepiece(const SentencePieceSettings& s, const std::vector<std::string>& texts) {
  if (!s.model_file.empty()) return std::make_unique<SentencePieceTokenizer>(read_binary(s.model_file), s.model_file);
  // Identity normalization and kept whitespace: the text decodes back exactly. Byte fallback:
  // any character encodes (as UTF-8 bytes) and the newline has its token <0x0A>.
  const std::string args = c10::str("--model_type=", s.model_type, " --vocab_size=", s.vocab_size,
                                    " --normalization_rule_name=identity --remove_extra_whitespaces=false --byte_fallback=true",
                                    " --character_coverage=1.0 --split_digits=true --allow_whitespace_only_pieces=true",
                                    " --bos_id=-1 --eos_id=-1 --pad_id=-1 --unk_id=0 --num_threads=2 --minloglevel=2",
                                    " --train_extremely_large_corpus=false --input_sentence_size=0 --shuffle_input_sentence=false");
  Lines lines(texts);
  std::string serialized;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &lines, &serialized);
  if (!status.ok())
    throw ember::RunError(c10::str("text_lm: training the SentencePiece ", s.model_type, " tokenizer (vocab_size ", s.vocab_size,
                                   ") failed: ", status.ToString(), " (data.sentencepiece_vocab_size must fit the corpus: 256 byte tokens, its characters, then merges)"));
  return std::make_unique<SentencePieceTokenizer>(serialized, c10::str(s.model_type, " trained on the corpus"));
}

std::unique_ptr<LmTokenizer> load_sentencepiece(const fs::path& folder) {
  std::ifstream origin(folder / "tokenizer.origin");
  std::string text((std::istreambuf_iterator<char>(origin)), std::istreambuf_iterator<char>());
  return std::make_unique<SentencePieceTokenizer>(read_binary(folder / "tokenizer.model"), text);
}

}  // namespace ember_text_lm
