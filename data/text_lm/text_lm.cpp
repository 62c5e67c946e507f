// text_lm: a text corpus as windows of token ids for next-token prediction (nanoGPT's data).
//
// The corpus (a UTF-8 file, or every file of a folder in path order) is tokenized once into a
// token file in the Ember cache, named by a hash of the corpus and the tokenizer, and memory-
// mapped: later runs (and the other ranks) read it without tokenizing again. The last
// val_fraction of the tokens (and test_fraction after it) are held out, as nanoGPT's 90/10 split.
// A sample is a window of block_size + 1 tokens: every train_stride-th offset of the training
// tokens starts one (stride 1 with the engine's shuffling = nanoGPT's random windows, drawn
// without replacement, so an epoch sees every window once and a resumed run continues exactly
// where it stopped); evaluation windows do not overlap.
// Batch: tensors[0] = ids int64 [N, block_size], tensors[1] = the next ids int64 [N, block_size].
// Implements ember::ITokenizer (ember/language_model.h) for `engine generate`.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/StringUtil.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/data.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/language_model.h>
#include <ember/plugin.h>

#include "asset_path.h"
#include "lm_tokenizer.h"

namespace fs = std::filesystem;

namespace {


constexpr EmberConfigKey kKeys[] = {
    ember::key::String("corpus", "\"austen\"", "A UTF-8 text file, or a folder whose files are read in path order. A bare name is looked up in the Ember cache ($EMBER_CACHE, default ~/.cache/ember), where scripts/setup.sh installs austen (Jane Austen's six novels, Debian's r-cran-janeaustenr)."),
    ember::key::String("tokenizer", "\"char\"", "char: one token per Unicode character of the corpus (nanoGPT's shakespeare_char); sentencepiece: SentencePiece trained on the corpus once (or sentencepiece_model).").choices("char|sentencepiece|bytelevel_bpe"),
    ember::key::String("tokenizer_json", "\"\"", "tokenizer = bytelevel_bpe: a Hugging Face tokenizer.json of a byte-level BPE (GPT-2's tokenizer, or one trained with the tokenizers library)."),
    ember::key::Int("sentencepiece_vocab_size", "2048", "tokenizer = sentencepiece: the vocabulary to train (256 byte tokens for characters it does not know, the corpus's characters, then merges).").at_least(300),
    ember::key::String("sentencepiece_model_type", "\"bpe\"", "tokenizer = sentencepiece: the algorithm to train.").choices("bpe|unigram"),
    ember::key::String("sentencepiece_model", "\"\"", "tokenizer = sentencepiece: a trained tokenizer.model (e.g. a Llama-family model's) instead of training one; it needs byte fallback (<0x0A> for the newline)."),
    ember::key::Int("block_size", "64", "Tokens per window (the context a model trains on).").at_least(1),
    ember::key::Float("val_fraction", "0.1", "The last fraction of the tokens held out for validation, in [0, 1).").at_least(0.0).below(1.0),
    ember::key::Float("test_fraction", "0.0", "The fraction after the validation part held out for testing, in [0, 1).").at_least(0.0).below(1.0),
    ember::key::Int("train_stride", "1", "Training windows start every train_stride tokens: 1 = every offset (shuffled: nanoGPT's random windows), block_size = disjoint windows.").at_least(1),
    ember::key::Int("eval_stride", "0", "Validation/test windows start every eval_stride tokens; 0 = block_size (disjoint).").at_least(0),
    ember::key::String("cache_dir", "\"\"", "Where token files are kept; empty = <Ember cache>/text_lm."),
};

// FNV-1a, 64 bits: names a corpus's token file (not a security boundary).
struct Fnv1a {
  uint64_t h = 1469598103934665603ull;
  void add(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  void add(const std::string& s) { add(s.data(), s.size() + 1); }  // with the terminator, so "ab"+"c" != "a"+"bc"
};

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ember::RunError(c10::str(path.string(), ": cannot read the corpus file"));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The corpus's files: `path` itself, or a folder's regular files (not hidden) in path order.
std::vector<fs::path> corpus_files(const fs::path& path) {
  if (fs::is_regular_file(path)) return {path};
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(path))
    if (e.is_regular_file() && e.path().filename().string().front() != '.') files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

// LibTorch's wheel exports std::filesystem symbols of its own, and its remove_all crashes with
// this libstdc++ (seen in the tests' support code): a temporary folder is removed by hand.
void remove_folder(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) fs::remove(e.path(), ec);
  fs::remove(dir, ec);
}

// A read-only memory mapping of a token file.
class Mapping {
 public:
  Mapping() = default;
  explicit Mapping(const fs::path& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw ember::RunError(c10::str(path.string(), ": cannot open the token file: ", std::strerror(errno)));
    struct stat st {};
    ::fstat(fd, &st);
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      data_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (data_ == MAP_FAILED) {
        ::close(fd);
        throw ember::RunError(c10::str(path.string(), ": cannot map the token file: ", std::strerror(errno)));
      }
    }
    ::close(fd);
  }
  ~Mapping() {
    if (data_ != nullptr && data_ != MAP_FAILED) ::munmap(data_, size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

class TextLm final : public ember::IDataModule, public ember::ITokenizer {
 public:
  TextLm(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        corpus_key_(cfg.get_string("corpus")),
        corpus_where_(cfg.where("corpus")),
        block_(cfg.get_int("block_size")),
        val_fraction_(cfg.get_float("val_fraction")),
        test_fraction_(cfg.get_float("test_fraction")),
        train_stride_(cfg.get_int("train_stride")),
        eval_stride_(cfg.get_int("eval_stride") == 0 ? cfg.get_int("block_size") : cfg.get_int("eval_stride")),
        section_(cfg.section()) {
    sentencepiece_ = cfg.get_string("tokenizer") == "sentencepiece";
    bytelevel_ = cfg.get_string("tokenizer") == "bytelevel_bpe";
    if (bytelevel_) {
      const std::string j = cfg.get_string("tokenizer_json");
      tokenizer_json_ = ember_text::resolve_asset(j);
      if (j.empty() || !fs::is_regular_file(tokenizer_json_))
        throw ember::ConfigError(c10::str("[", section_, "] tokenizer = \"bytelevel_bpe\" needs tokenizer_json, a Hugging Face tokenizer.json (",
                                          cfg.where("tokenizer_json"), j.empty() ? ": not set)" : c10::str(": no file ", tokenizer_json_.string(), ")")));
    }
    sp_.vocab_size = cfg.get_int("sentencepiece_vocab_size");
    sp_.model_type = cfg.get_string("sentencepiece_model_type");
    sp_.model_file = cfg.get_string("sentencepiece_model");
    if (!sp_.model_file.empty()) {
      if (!sentencepiece_)
        throw ember::ConfigError(c10::str("[", section_, "] sentencepiece_model = \"", sp_.model_file, "\" (", cfg.where("sentencepiece_model"),
                                          ") needs tokenizer = \"sentencepiece\""));
      const fs::path model = ember_text::resolve_asset(sp_.model_file);
      if (!fs::is_regular_file(model))
        throw ember::ConfigError(c10::str("[", section_, "] sentencepiece_model = \"", sp_.model_file, "\" (", cfg.where("sentencepiece_model"),
                                          "): no such file (give a SentencePiece tokenizer.model)"));
      sp_.model_file = model.string();
    }
    if (val_fraction_ + test_fraction_ >= 1.0)
      throw ember::ConfigError(c10::str("[", section_, "] val_fraction + test_fraction = ", val_fraction_ + test_fraction_, " (",
                                        cfg.where("val_fraction"), ", ", cfg.where("test_fraction"), ") leaves no training text: keep their sum below 1"));
    const std::string dir = cfg.get_string("cache_dir");
    cache_dir_ = dir.empty() ? ember_text::cache_dir() / "text_lm" : fs::path(dir);
  }

  void setup(const ember::DataSetup&) override {
    corpus_ = ember_text::resolve_asset(corpus_key_);
    if (!fs::exists(corpus_))
      throw ember::ConfigError(c10::str("[", section_, "] corpus = \"", corpus_key_, "\" (", corpus_where_, "): no file or folder ", corpus_.string(),
                                        corpus_key_ == "austen" ? ": run scripts/setup.sh (it installs Jane Austen's novels there)" : ": give a UTF-8 text file or a folder of them"));
    const auto files = corpus_files(corpus_);
    if (files.empty()) throw ember::ConfigError(c10::str("[", section_, "] corpus = \"", corpus_key_, "\" (", corpus_where_, "): the folder ", corpus_.string(), " holds no files"));
    // The token file's name: the corpus's bytes and file names, and the tokenizer.
    Fnv1a hash;
    hash.add(std::string("text_lm/2"));
    if (bytelevel_) {
      hash.add(std::string("bytelevel_bpe"));
      hash.add(read_file(tokenizer_json_));
    } else if (sentencepiece_) {
      hash.add(c10::str("sentencepiece/", sp_.model_type, "/", sp_.vocab_size));
      if (!sp_.model_file.empty()) hash.add(read_file(sp_.model_file));
    } else {
      hash.add(std::string("char"));
    }
    std::vector<std::string> texts;
    for (const auto& f : files) {
      texts.push_back(read_file(f));
      hash.add(fs::relative(f, fs::is_directory(corpus_) ? corpus_ : corpus_.parent_path()).string());
      hash.add(texts.back());
    }
    char name[32];
    std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(hash.h));
    const fs::path folder = cache_dir_ / name;
    const bool cached = fs::exists(folder / "tokens.u16") || fs::exists(folder / "tokens.u32");
    if (!cached) build_token_file(files, texts, folder);
    load(folder);
    const int64_t n = num_tokens_;
    const int64_t n_test = static_cast<int64_t>(static_cast<double>(n) * test_fraction_);
    const int64_t n_val = static_cast<int64_t>(static_cast<double>(n) * val_fraction_);
    ranges_ = {{{0, n - n_val - n_test}, {n - n_val - n_test, n - n_test}, {n - n_test, n}}};
    auto windows = [&](const std::array<int64_t, 2>& r, int64_t stride) {
      const int64_t len = r[1] - r[0];
      return len < block_ + 1 ? 0 : (len - block_ - 1) / stride + 1;
    };
    counts_ = {windows(ranges_[0], train_stride_), windows(ranges_[1], eval_stride_), windows(ranges_[2], eval_stride_)};
    const std::array<const char*, 3> names{"training", "validation", "test"};
    const std::array<double, 3> wanted{1.0, val_fraction_, test_fraction_};
    for (size_t s = 0; s < 3; ++s)
      if (wanted[s] > 0.0 && counts_[s] == 0)
        throw ember::ConfigError(c10::str("[", section_, "] the ", names[s], " part of ", corpus_.string(), " has ", ranges_[s][1] - ranges_[s][0],
                                          " tokens, fewer than one window of block_size + 1 = ", block_ + 1, ": lower block_size or give a longer corpus"));
    host_.log(ember::LogLevel::info,
              c10::str("text_lm: ", corpus_.string(), ": ", n, " tokens, ", describe(), (cached ? "; token file " : "; tokenized into "),
                       folder.string(), "; windows of ", block_, ": ", counts_[0], " train (stride ", train_stride_, "), ", counts_[1], " val",
                       counts_[2] > 0 ? c10::str(", ", counts_[2], " test") : std::string()));
  }

  int64_t size(ember::Split split) const override { return counts_[static_cast<size_t>(split)]; }

  ember::Batch get_batch(ember::Split split, const int64_t* indices, int64_t count) const override {
    const auto s = static_cast<size_t>(split);
    if (counts_[s] == 0) throw ember::RunError("text_lm: get_batch on an empty split or before setup()");
    const int64_t stride = split == ember::Split::train ? train_stride_ : eval_stride_;
    at::Tensor x = at::empty({count, block_}, at::kLong), y = at::empty({count, block_}, at::kLong);
    int64_t* xp = x.data_ptr<int64_t>();
    int64_t* yp = y.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) {
      if (indices[i] < 0 || indices[i] >= counts_[s]) throw ember::RunError(c10::str("text_lm: sample ", indices[i], " outside [0, ", counts_[s], ")"));
      const int64_t start = ranges_[s][0] + indices[i] * stride;
      for (int64_t t = 0; t < block_; ++t) {
        xp[i * block_ + t] = token(start + t);
        yp[i * block_ + t] = token(start + t + 1);
      }
    }
    ember::Batch batch;
    batch.tensors = {x, y};
    batch.size = count;
    return batch;
  }

  void* query_interface(const char* iid) override {
    return std::strcmp(iid, ember::kTokenizerIid) == 0 ? static_cast<ember::ITokenizer*>(this) : nullptr;
  }

  // ITokenizer
  int64_t vocab_size() const override { return tokenizer_->vocab_size(); }
  std::vector<int64_t> encode(const std::string& text) const override { return tokenizer_->encode(text); }
  std::string decode(const std::vector<int64_t>& ids) const override { return tokenizer_->decode(ids); }
  int64_t end_of_text_id() const override { return tokenizer_->end_of_text(); }
  std::string describe() const override { return tokenizer_->describe(); }

 private:
  int64_t token(int64_t i) const {
    return wide_ ? static_cast<const uint32_t*>(tokens_->data())[i] : static_cast<const uint16_t*>(tokens_->data())[i];
  }

  // Tokenizes the corpus into `folder` (the tokenizer's files, and tokens.u16 or tokens.u32: the
  // ids, little-endian). Written into a temporary folder and renamed, so a concurrent rank or an
  // interrupted run never leaves a half-written cache behind.
  void build_token_file(const std::vector<fs::path>& files, const std::vector<std::string>& texts, const fs::path& folder) {
    const auto tokenizer = bytelevel_       ? ember_text_lm::load_bytelevel_bpe(tokenizer_json_)
                           : sentencepiece_ ? ember_text_lm::make_sentencepiece(sp_, texts)
                                            : ember_text_lm::train_char_tokenizer(texts, files);
    std::vector<int64_t> all;
    for (const auto& text : texts) {
      const auto ids = tokenizer->encode(text);
      all.insert(all.end(), ids.begin(), ids.end());
    }
    if (all.empty()) throw ember::RunError(c10::str(corpus_.string(), ": the corpus is empty"));
    const bool wide = tokenizer->vocab_size() > 65535;
    std::error_code ec;
    fs::create_directories(cache_dir_, ec);
    const fs::path tmp = cache_dir_ / c10::str(folder.filename().string(), ".tmp-", ::getpid());
    remove_folder(tmp);
    if (!fs::create_directories(tmp, ec))
      throw ember::RunError(c10::str(tmp.string(), ": cannot create the token cache (", ec.message(), "): set data.cache_dir to a writable folder"));
    tokenizer->save(tmp);
    {
      std::ofstream t(tmp / (wide ? "tokens.u32" : "tokens.u16"), std::ios::binary);
      std::vector<char> buf;
      buf.reserve(all.size() * (wide ? 4 : 2));
      for (int64_t v : all) {
        const auto id = static_cast<uint32_t>(v);
        buf.push_back(static_cast<char>(id & 0xFF));
        buf.push_back(static_cast<char>((id >> 8) & 0xFF));
        if (wide) {
          buf.push_back(static_cast<char>((id >> 16) & 0xFF));
          buf.push_back(static_cast<char>((id >> 24) & 0xFF));
        }
      }
      t.write(buf.data(), static_cast<std::streamsize>(buf.size()));
      if (!t) throw ember::RunError(c10::str(tmp.string(), ": writing the token cache failed (disk full?)"));
    }
    fs::rename(tmp, folder, ec);
    if (ec) remove_folder(tmp);  // another process made the same folder first: theirs is identical
  }

  void load(const fs::path& folder) {
    tokenizer_ = bytelevel_       ? ember_text_lm::load_bytelevel_bpe(folder / "tokenizer.json")
                 : sentencepiece_ ? ember_text_lm::load_sentencepiece(folder)
                                  : ember_text_lm::load_char_tokenizer(folder);
    wide_ = fs::exists(folder / "tokens.u32");
    tokens_ = std::make_unique<Mapping>(folder / (wide_ ? "tokens.u32" : "tokens.u16"));
    num_tokens_ = static_cast<int64_t>(tokens_->size() / (wide_ ? 4 : 2));
    if (tokenizer_->vocab_size() == 0 || num_tokens_ == 0)
      throw ember::RunError(c10::str(folder.string(), ": the token cache is empty or damaged: delete the folder to tokenize again"));
  }

  ember::IHost& host_;
  std::string corpus_key_, corpus_where_;
  int64_t block_;
  double val_fraction_, test_fraction_;
  int64_t train_stride_, eval_stride_;
  std::string section_;
  fs::path cache_dir_, corpus_;
  bool sentencepiece_ = false, bytelevel_ = false;
  fs::path tokenizer_json_;
  ember_text_lm::SentencePieceSettings sp_;
  std::unique_ptr<ember_text_lm::LmTokenizer> tokenizer_;
  std::unique_ptr<Mapping> tokens_;
  bool wide_ = false;
  int64_t num_tokens_ = 0;
  std::array<std::array<int64_t, 2>, 3> ranges_{};
  std::array<int64_t, 3> counts_{};
};

ember::IDataModule* make(ember::IHost& host, const ember::IConfig& cfg) { return new TextLm(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IDataModule, "text_lm", "0.1.0", "Apache-2.0",
             "A text corpus as windows of token ids for language models (character tokenizer), tokenized once into a cached, memory-mapped token file.",
             EMBER_CONFIG_KEYS(kKeys), make)
