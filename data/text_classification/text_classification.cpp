// text_classification: labelled texts from CSV or JSONL files, tokenized once at setup with the
// model's WordPiece vocabulary (models/text/wordpiece.h) and cut to max_length.
//
// Files: CSV with a header row (RFC 4180 quoting, read by libcsv) or JSONL (one JSON object a
// line), picked by the file's extension. Label names map to ids in the order of `labels`; when it
// is not given, dense integer labels are their own ids ("0" .. the largest), sparse ones and
// names are sorted (ember::support::label_classes, as image_folder's lists). Splits: train; val
// from val_file, else val_split of train (a permutation seeded with trainer.seed); test from
// test_file (optional).
// Batch: tensors[0] = input_ids int64 [N, L], tensors[1] = labels int64 [N],
// tensors[2] = attention_mask int64 [N, L], where L is the longest sequence of the batch.
// Reports each text's token count (ember::ISampleLengths) for data.group_by_length.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/StringUtil.h>
#include <ember/support/held_out_split.h>
#include <ember/support/table_file.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/data.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/predict.h>
#include <ember/sample_lengths.h>

#include "asset_path.h"
#include "wordpiece.h"

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("train_file", nullptr, "Training texts: a .csv (header row) or .jsonl file. A relative path not found from the working folder is looked up in the Ember cache ($EMBER_CACHE, default ~/.cache/ember)."),
    ember::key::String("val_file", "\"\"", "Validation texts; empty: hold out val_split of train_file."),
    ember::key::String("test_file", "\"\"", "Test texts; empty: no test split."),
    ember::key::String("text_column", "\"text\"", "Column (CSV) or field (JSONL) holding the text."),
    ember::key::String("label_column", "\"label\"", "Column or field holding the label (a name, or an integer)."),
    ember::key::StringList("labels", "[]", "Label names in id order; empty: the training file's, as ids 0 .. the largest when every label is an integer and they are dense, else the names sorted (integers in numeric order)."),
    ember::key::Bool("multilabel", "false", "Each text has any number of labels (none included), separated by label_separator in its label field (JSONL: or a list, [\"sports\", \"politics\"]): the targets are 0/1 per label [N, labels] (bert: problem_type = \"multi_label_classification\")."),
    ember::key::String("label_separator", "\";\"", "What separates a multilabel text's labels (\"sports;politics\"); spaces around each label are dropped."),
    ember::key::Float("val_split", "0.1", "Fraction of train_file held out for validation when val_file is empty, in [0, 1).").at_least(0.0).below(1.0),
    ember::key::String("tokenizer_dir", "\"all-minilm-l6-v2\"", "Folder with the model's vocab.txt (and tokenizer_config.json); a bare name is a folder in the Ember cache."),
    ember::key::Int("max_length", "128", "Most tokens per text, [CLS] and [SEP] included; longer texts are cut.").at_least(2),
    ember::key::Int("limit_train_samples", "0", "Keep at most this many training texts (after the validation split); 0 keeps all.").at_least(0),
};

struct Row {
  std::string text, label;
  int64_t line = 0;
};

// `separator`: a multilabel label column, where a JSONL array of labels is read as one field.
std::vector<Row> read_table_rows(const std::string& path, const std::string& text_col, const std::string& label_col, const std::string& separator) {
  std::vector<Row> rows;
  for (auto& r : ember::support::read_table(path, {{text_col, "text_column"}, {label_col, "label_column", separator}}))
    rows.push_back({std::move(r.values[0]), std::move(r.values[1]), r.line});
  return rows;
}

// Checks the setting (the file exists, its extension is known) before anything heavy starts.
std::string data_file(const std::string& key, const ember::IConfig& cfg) {
  const std::string given = cfg.get_string(key);
  const std::filesystem::path path = ember_text::resolve_asset(given);
  if (!std::filesystem::is_regular_file(path))
    throw ember::ConfigError(c10::str("[", cfg.section(), "] ", key, " = \"", given, "\" (", cfg.where(key), "): file not found (also looked in ",
                                      ember_text::cache_dir().string(), "): give a .csv or .jsonl file; run scripts/setup.sh for small_fine_foods"));
  const std::string ext = path.extension().string();
  if (ext != ".jsonl" && ext != ".ndjson" && ext != ".csv")
    throw ember::ConfigError(c10::str("[", cfg.section(), "] ", key, " = \"", given, "\" (", cfg.where(key),
                                      "): unknown extension '", ext, "': use a .csv or .jsonl file"));
  return path.string();
}

std::vector<Row> read_rows(const std::string& path, const std::string& text_col, const std::string& label_col, const std::string& separator) {
  std::vector<Row> rows = read_table_rows(path, text_col, label_col, separator);
  if (rows.empty()) throw ember::RunError(c10::str(path, ": holds no texts"));
  return rows;
}

struct Samples {
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::string> origins;  // "<file>:<line>" of each text: its id in predictions
  at::Tensor labels;  // int64 [N], or 0/1 int64 [N, labels] (multilabel)
};

class TextClassification final : public ember::IDataModule, public ember::IPredictionNames, public ember::ISampleLengths {
 public:
  TextClassification(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        section_(cfg.section()),
        val_split_(cfg.get_float("val_split")),
        max_length_(cfg.get_int("max_length")),
        limit_train_(cfg.get_int("limit_train_samples")) {
    if (val_split_ >= 1.0)
      throw ember::ConfigError(c10::str("[", section_, "] val_split = ", val_split_, " (", cfg.where("val_split"),
                                        ") leaves no training texts: use a fraction in [0, 1), e.g. 0.1"));
    // Paths and the vocabulary are checked here, before anything heavy starts; the files'
    // contents are read by setup().
    train_file_ = data_file("train_file", cfg);
    if (!cfg.get_string("val_file").empty()) val_file_ = data_file("val_file", cfg);
    if (!cfg.get_string("test_file").empty()) test_file_ = data_file("test_file", cfg);
    text_column_ = cfg.get_string("text_column");
    label_column_ = cfg.get_string("label_column");
    const auto tok_dir = ember_text::resolve_asset(cfg.get_string("tokenizer_dir"));
    tokenizer_.emplace(ember_text::WordPieceTokenizer::from_folder(tok_dir.string()));
    labels_ = cfg.get_string_list("labels");
    multilabel_ = cfg.get_bool("multilabel");
    separator_ = cfg.get_string("label_separator");
    if (multilabel_ && separator_.empty())
      throw ember::ConfigError(c10::str("[", cfg.section(), "] label_separator (", cfg.where("label_separator"),
                                        ") is empty: a multilabel field needs a separator between its labels, e.g. \";\""));
    for (size_t i = 0; i < labels_.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (labels_[i] == labels_[j])
          throw ember::ConfigError(c10::str("[", cfg.section(), "] labels (", cfg.where("labels"), ") names \"", labels_[i],
                                            "\" twice (ids ", j, " and ", i, "): list each label once, in id order"));
  }

  void setup(const ember::DataSetup& setup) override {
    const std::vector<Row> train_rows = read_rows(train_file_, text_column_, label_column_, list_separator());
    if (labels_.empty()) {
      std::vector<std::string> names;
      for (const auto& r : train_rows) {
        if (!multilabel_) names.push_back(r.label);
        else
          for (auto& l : ember::support::split_list(r.label, separator_)) names.push_back(std::move(l));
      }
      labels_ = ember::support::label_classes(names);
    }
    for (size_t i = 0; i < labels_.size(); ++i) label_ids_[labels_[i]] = static_cast<int64_t>(i);
    if (labels_.size() < 2)
      throw ember::RunError(c10::str(train_file_, ": holds ", labels_.size(), " label(s) in column \"", label_column_,
                                     "\": classification needs at least two (check label_column", multilabel_ ? " and label_separator" : "", ")"));
    Samples train = encode(train_rows, train_file_);
    if (!val_file_.empty()) {
      slot(ember::Split::val) = encode(read_rows(val_file_, text_column_, label_column_, list_separator()), val_file_);
    } else {
      const auto n = static_cast<int64_t>(train.ids.size());
      const auto split = ember::held_out_split(n, val_split_, setup.seed);
      const auto* p = split.perm.data_ptr<int64_t>();
      slot(ember::Split::val) = subset(train, p, split.n_val);
      train = subset(train, p + split.n_val, n - split.n_val);
    }
    if (limit_train_ > 0 && limit_train_ < static_cast<int64_t>(train.ids.size())) {
      std::vector<int64_t> first(static_cast<size_t>(limit_train_));
      std::iota(first.begin(), first.end(), 0);
      train = subset(train, first.data(), limit_train_);
    }
    slot(ember::Split::train) = std::move(train);
    if (!test_file_.empty()) slot(ember::Split::test) = encode(read_rows(test_file_, text_column_, label_column_, list_separator()), test_file_);
    std::string names;
    for (size_t i = 0; i < labels_.size(); ++i) names += c10::str(i ? ", " : "", labels_[i], "=", i);
    host_.log(ember::LogLevel::info,
              c10::str("text_classification: ", size(ember::Split::train), " train, ", size(ember::Split::val), " val, ",
                       size(ember::Split::test), " test texts; labels ", names, multilabel_ ? " (multilabel)" : "", "; ", truncated_,
                       " text(s) cut to ", max_length_, " tokens"));
  }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kPredictionNamesIid) == 0) return static_cast<ember::IPredictionNames*>(this);
    if (std::strcmp(iid, ember::kSampleLengthsIid) == 0) return static_cast<ember::ISampleLengths*>(this);
    return nullptr;
  }
  // Tokens after truncation, [CLS] and [SEP] included: what a batch is padded to.
  int64_t sample_length(ember::Split split, int64_t index) const override {
    return static_cast<int64_t>(splits_.at(static_cast<size_t>(split)).ids.at(static_cast<size_t>(index)).size());
  }
  std::vector<std::string> class_names() const override { return labels_; }
  std::string sample_id(ember::Split split, int64_t index) const override {
    return splits_.at(static_cast<size_t>(split)).origins.at(static_cast<size_t>(index));
  }

  int64_t size(ember::Split split) const override {
    const Samples& s = splits_.at(static_cast<size_t>(split));
    return static_cast<int64_t>(s.ids.size());
  }

  // Pads to the longest text of this batch. Reads only what setup() built: thread-safe.
  ember::Batch get_batch(ember::Split split, const int64_t* indices, int64_t count) const override {
    const Samples& s = splits_.at(static_cast<size_t>(split));
    size_t longest = 0;
    for (int64_t i = 0; i < count; ++i) longest = std::max(longest, s.ids.at(static_cast<size_t>(indices[i])).size());
    at::Tensor ids = torch::full({count, static_cast<int64_t>(longest)}, tokenizer_->pad_id(), torch::kLong);
    at::Tensor mask = torch::zeros({count, static_cast<int64_t>(longest)}, torch::kLong);
    auto* id_p = ids.data_ptr<int64_t>();
    auto* mask_p = mask.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) {
      const auto& t = s.ids[static_cast<size_t>(indices[i])];
      std::copy(t.begin(), t.end(), id_p + i * static_cast<int64_t>(longest));
      std::fill_n(mask_p + i * static_cast<int64_t>(longest), t.size(), 1);
    }
    const at::Tensor idx = torch::from_blob(const_cast<int64_t*>(indices), {count}, torch::kLong);
    ember::Batch batch;
    batch.tensors = {std::move(ids), s.labels.index_select(0, idx), std::move(mask)};
    batch.size = count;
    return batch;
  }

 private:
  Samples encode(const std::vector<Row>& rows, const std::string& path) {
    Samples s;
    std::vector<int64_t> labels;
    auto id_of = [&](const std::string& label, const Row& r) {
      const auto it = label_ids_.find(label);
      if (it == label_ids_.end())
        throw ember::RunError(c10::str(path, ":", r.line, ": label \"", label,
                                       "\" is not among the labels (", c10::Join(", ", labels_), "): add it to [", section_, "] labels"));
      return it->second;
    };
    for (const auto& r : rows) {
      if (multilabel_) {
        // One 0/1 row per text: its labels' columns set.
        const size_t row = labels.size();
        labels.resize(row + labels_.size(), 0);
        for (const auto& l : ember::support::split_list(r.label, separator_)) labels[row + static_cast<size_t>(id_of(l, r))] = 1;
      } else {
        labels.push_back(id_of(r.label, r));
      }
      std::vector<int64_t> full = tokenizer_->encode(r.text);
      if (static_cast<int64_t>(full.size()) > max_length_) {
        ++truncated_;
        full = tokenizer_->encode(r.text, max_length_);
      }
      s.ids.push_back(std::move(full));
      s.origins.push_back(c10::str(std::filesystem::path(path).filename().string(), ":", r.line));
    }
    s.labels = torch::tensor(labels, torch::kLong);
    if (multilabel_) s.labels = s.labels.reshape({-1, static_cast<int64_t>(labels_.size())});
    return s;
  }
  static Samples subset(const Samples& from, const int64_t* idx, int64_t n) {
    Samples s;
    for (int64_t i = 0; i < n; ++i) {
      s.ids.push_back(from.ids[static_cast<size_t>(idx[i])]);
      s.origins.push_back(from.origins[static_cast<size_t>(idx[i])]);
    }
    s.labels = from.labels.index_select(0, torch::from_blob(const_cast<int64_t*>(idx), {n}, torch::kLong)).clone();
    return s;
  }
  Samples& slot(ember::Split split) { return splits_.at(static_cast<size_t>(split)); }
  std::string list_separator() const { return multilabel_ ? separator_ : std::string(); }

  ember::IHost& host_;
  std::string section_;
  double val_split_;
  int64_t max_length_, limit_train_;
  std::string train_file_, val_file_, test_file_, text_column_, label_column_;
  std::optional<ember_text::WordPieceTokenizer> tokenizer_;
  std::vector<std::string> labels_;
  std::map<std::string, int64_t> label_ids_;
  bool multilabel_ = false;
  std::string separator_;
  int64_t truncated_ = 0;
  std::array<Samples, 3> splits_;  // indexed by ember::Split
};

ember::IDataModule* make(ember::IHost& host, const ember::IConfig& cfg) { return new TextClassification(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IDataModule, "text_classification", "0.1.0", "Apache-2.0",
             "Labelled texts from CSV/JSONL, WordPiece-tokenized, padded per batch to the longest text.",
             EMBER_CONFIG_KEYS(kKeys), make)
