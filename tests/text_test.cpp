// Text fine-tuning parts: the WordPiece tokenizer (unit cases, and identical ids to Hugging Face's
// `tokenizers` on every text of small_fine_foods), the BERT-family network (identical logits to
// transformers' BERT and DistilBERT), safetensors reading/writing and its errors, and the bert +
// text_classification plugins on real engine runs.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <numeric>
#include <sstream>
#include <nlohmann/json.hpp>

#include "asset_path.h"
#include "bert_net.h"
#include <ember/support/safetensors.h>
#include "support.h"
#include "wordpiece.h"

using namespace ember::test;
namespace fs = std::filesystem;
using ember_text::WordPieceTokenizer;

namespace {

// A vocabulary small enough to reason about; ids are line numbers.
const std::vector<std::string> kVocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "!",  ",",
                                         "un",    "##aff", "##able", "cafe", "中",     "a",     "##a",   "i",  "'",
                                         "s",     "great", "bad",   "food",  "is",     "the",   "not",   "."};

int64_t id(const std::string& token) {
  return std::find(kVocab.begin(), kVocab.end(), token) - kVocab.begin();
}

void write_vocab(const fs::path& dir, const std::vector<std::string>& vocab = kVocab) {
  fs::create_directories(dir);
  std::string text;
  for (const auto& t : vocab) text += t + "\n";
  write_file(dir / "vocab.txt", text);
}

std::vector<int64_t> ids(std::initializer_list<const char*> tokens) {
  std::vector<int64_t> out;
  for (const char* t : tokens) out.push_back(id(t));
  return out;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(WordPiece, NormalizesSplitsAndPiecesLikeBertTokenizer) {
  TempDir dir("wordpiece_unit");
  write_vocab(dir.path());
  const auto tok = WordPieceTokenizer::from_folder(dir.path().string());
  EXPECT_EQ(tok.encode("Hello, World!"), ids({"[CLS]", "hello", ",", "world", "!", "[SEP]"}));
  EXPECT_EQ(tok.encode("unaffable"), ids({"[CLS]", "un", "##aff", "##able", "[SEP]"}));
  EXPECT_EQ(tok.encode("Caf\xC3\xA9"), ids({"[CLS]", "cafe", "[SEP]"}));             // NFD, accent stripped, lower-cased
  EXPECT_EQ(tok.encode("\xE4\xB8\xAD\xE6\x96\x87"), ids({"[CLS]", "中", "[UNK]", "[SEP]"}));  // CJK: one word each
  EXPECT_EQ(tok.encode("hel\x01lo\tworld\xEF\xBF\xBD"), ids({"[CLS]", "hello", "world", "[SEP]"}));  // control, U+FFFD removed
  EXPECT_EQ(tok.encode("hello [MASK] world"), ids({"[CLS]", "hello", "[MASK]", "world", "[SEP]"}));
  EXPECT_EQ(tok.encode("\xC4\xB0"), ids({"[CLS]", "i", "[SEP]"}));                   // U+0130: full lowercase mapping
  EXPECT_EQ(tok.encode("unaffablex"), ids({"[CLS]", "[UNK]", "[SEP]"}));             // one unpieceable word = one [UNK]
  EXPECT_EQ(tok.encode(std::string(100, 'a')).size(), 102u);                         // a ##a ##a ... within the limit
  EXPECT_EQ(tok.encode(std::string(101, 'a')), ids({"[CLS]", "[UNK]", "[SEP]"}));    // over max_input_chars_per_word
  EXPECT_EQ(tok.encode("hello, world! great food", 4), ids({"[CLS]", "hello", ",", "[SEP]"}));
  EXPECT_EQ(tok.encode("hello", 2), ids({"[CLS]", "[SEP]"}));
  EXPECT_EQ(tok.encode(""), ids({"[CLS]", "[SEP]"}));
  // tokenizer_config.json turns lower-casing (and so accent stripping) off.
  write_file(dir / "tokenizer_config.json", R"({"do_lower_case": false})");
  const auto cased = WordPieceTokenizer::from_folder(dir.path().string());
  EXPECT_EQ(cased.encode("Hello hello"), ids({"[CLS]", "[UNK]", "hello", "[SEP]"}));
}

TEST(WordPiece, MissingOrForeignVocabularyIsOneClearError) {
  TempDir dir("wordpiece_errors");
  std::string e = error_of([&] { WordPieceTokenizer::from_folder(dir.path().string()); });
  EXPECT_NE(e.find((dir / "vocab.txt").string() + " not found"), std::string::npos) << e;
  write_vocab(dir.path(), {"[PAD]", "[CLS]", "[SEP]", "hello"});
  e = error_of([&] { WordPieceTokenizer::from_folder(dir.path().string()); });
  EXPECT_NE(e.find("vocab.txt: the vocabulary has no [UNK] token"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

#ifdef EMBER_TEST_PYTHON
// Every review of small_fine_foods (train and test) plus hand-picked hard cases, tokenized by the
// `tokenizers` package from all-MiniLM-L6-v2's tokenizer.json and by Ember from its vocab.txt.
TEST(WordPiece, IdenticalIdsToHuggingFaceTokenizersOnSmallFineFoods) {
  const fs::path model = ember_text::cache_dir() / "all-minilm-l6-v2";
  const fs::path foods = ember_text::cache_dir() / "small_fine_foods";
  ASSERT_TRUE(fs::exists(model / "tokenizer.json") && fs::exists(foods / "train.jsonl"))
      << "run scripts/setup.sh: it installs all-MiniLM-L6-v2 and small_fine_foods into " << ember_text::cache_dir();
  TempDir dir("wordpiece_parity");
  const std::vector<std::string> hard = {
      "Caf\xC3\xA9 na\xC3\xAFve \xC3\x85ngstr\xC3\xB6m r\xC3\xA9sum\xC3\xA9 \xC4\xB0stanbul \xC3\x9F",  // accents, İ, ß
      "\xE6\x88\x91\xE5\x96\x9C\xE6\xAC\xA2\xE5\x90\x83 sushi\xE3\x81\x8C\xE5\xA5\xBD\xE3\x81\x8D",      // CJK and kana
      "tabs\tnew\nlines\r\n zero\xE2\x80\x8Bwidth nbsp\xC2\xA0space \x07" "bell",                          // whitespace, Cf, Cc
      "[CLS] inside [SEP] text [UNK][MASK]x", "$5.99!!! <br /><br />50% off... #1 (great) {ok} ~fine~ a+b=c",
      "\xE2\x80\x9Cquoted\xE2\x80\x9D \xE2\x80\x94 dash \xE2\x80\xA6 \xC2\xBFqu\xC3\xA9? \xCE\xA3\xCE\xBF\xCF\x86\xCE\xAF\xCE\xB1",
      std::string(150, 'x') + " " + std::string(99, 'b'), "emoji \xF0\x9F\x98\x80\xF0\x9F\x8D\x95 ok"};
  {
    std::ofstream f(dir / "hard.jsonl");
    for (const auto& h : hard) f << nlohmann::json{{"text", h}}.dump() << "\n";
  }
  std::vector<fs::path> inputs = {foods / "train.jsonl", foods / "test.jsonl", dir / "hard.jsonl"};
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/text/reference.py").string(), "tokenize",
                        (model / "tokenizer.json").string(), (dir / "ids.jsonl").string(), inputs[0].string(),
                        inputs[1].string(), inputs[2].string()},
                       dir.path(), {}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto tok = WordPieceTokenizer::from_folder(model.string());
  std::ifstream expected(dir / "ids.jsonl");
  int64_t compared = 0;
  for (const auto& input : inputs) {
    std::ifstream in(input);
    std::string line, want;
    int64_t n = 0;
    while (std::getline(in, line)) {
      ++n;
      const auto row = nlohmann::json::parse(line);
      const std::string text = row.contains("review") ? row["review"] : row["text"];
      ASSERT_TRUE(std::getline(expected, want)) << "python wrote fewer rows than " << input << " holds";
      const auto ref = nlohmann::json::parse(want).get<std::vector<int64_t>>();
      ASSERT_EQ(tok.encode(text), ref) << input << ":" << n << ": " << text;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 4000 + 1000 + static_cast<int64_t>(hard.size()));
}

// A random 2-layer BERT and DistilBERT from transformers, saved as safetensors: Ember's network
// gives the same logits with the checkpoint's pooler head and with mean pooling.
TEST(BertNet, SameLogitsAsTransformersForBertAndDistilBert) {
  TempDir dir("bert_parity");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/text/reference.py").string(), "tiny-bert",
                        dir.path().string()},
                       dir.path(), {}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream f(dir / "reference.json");
  const auto ref = nlohmann::json::parse(f);
  const auto to_tensor = [](const nlohmann::json& j, at::ScalarType t) {
    std::vector<std::vector<double>> rows = j.get<std::vector<std::vector<double>>>();
    at::Tensor out = at::empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())}, at::kDouble);
    for (size_t i = 0; i < rows.size(); ++i)
      for (size_t k = 0; k < rows[i].size(); ++k) out[i][k] = rows[i][k];
    return out.to(t);
  };
  const at::Tensor input_ids = to_tensor(ref["input_ids"], at::kLong);
  const at::Tensor mask = to_tensor(ref["attention_mask"], at::kLong);
  for (const std::string kind : {"bert", "distilbert"}) {
    for (const std::string pooling : {"pooler", "mean"}) {
      const auto config = ember_text::BertConfig::from_json_file((dir / kind / "config.json").string());
      ember_text::BertHead head;
      head.pooling = pooling == "mean" ? ember_text::Pooling::mean : ember_text::Pooling::pooler;
      head.num_classes = 3;
      for (const auto unpad : {ember_text::Unpad::always, ember_text::Unpad::never}) {
        ember_text::BertClassifierNet net(config, head, unpad);
        const auto unused = net.load_safetensors((dir / kind / "model.safetensors").string());
        if (pooling == "pooler") EXPECT_TRUE(unused.empty()) << kind << ": unused " << unused.front();
        net.eval();
        torch::NoGradGuard no_grad;
        const at::Tensor logits = net.forward(input_ids, mask);
        const at::Tensor want = to_tensor(ref["logits"][kind][pooling], at::kFloat);
        EXPECT_LT((logits - want).abs().max().item<double>(), 1e-5)
            << kind << " " << pooling << (unpad == ember_text::Unpad::always ? " unpadded" : " padded") << "\n" << logits << "\n" << want;
      }
    }
  }
  EXPECT_LT(mask.sum().item<int64_t>(), mask.numel()) << "the reference batch must hold padding for the unpadded path to run";
}
#endif

namespace {

void write_tiny_bert_config(const fs::path& dir, int64_t vocab) {
  fs::create_directories(dir);
  write_file(dir / "config.json", nlohmann::json{{"model_type", "bert"}, {"vocab_size", vocab}, {"hidden_size", 16},
                                                 {"num_hidden_layers", 2}, {"num_attention_heads", 2},
                                                 {"intermediate_size", 24}, {"max_position_embeddings", 64}}
                                      .dump());
}

std::vector<std::pair<std::string, at::Tensor>> state(ember_text::BertClassifierNet& net) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : net.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

}  // namespace

// The unpadded encoder (bert's unpad = auto|true) computes what the padded one computes: the same
// logits and, with dropout off, the same gradient for every parameter, for each pooling, on a batch
// whose texts differ in length (and on one without padding, where both take the padded path).
TEST(BertNet, UnpaddedEncoderGivesThePaddedLogitsAndGradients) {
  TempDir dir("bert_unpad");
  fs::create_directories(dir.path());
  write_file(dir / "config.json", nlohmann::json{{"model_type", "bert"}, {"vocab_size", 30}, {"hidden_size", 16},
                                                 {"num_hidden_layers", 2}, {"num_attention_heads", 2},
                                                 {"intermediate_size", 24}, {"max_position_embeddings", 64},
                                                 {"hidden_dropout_prob", 0.0}, {"attention_probs_dropout_prob", 0.0}}
                                      .dump());
  const auto config = ember_text::BertConfig::from_json_file((dir / "config.json").string());
  torch::manual_seed(3);
  const std::vector<int64_t> lengths = {9, 3, 6, 2, 9};
  at::Tensor ids = at::randint(5, 30, {5, 9}, at::kLong), mask = at::zeros({5, 9}, at::kLong);
  for (int64_t i = 0; i < 5; ++i) {
    mask[i].narrow(0, 0, lengths[static_cast<size_t>(i)]).fill_(1);
    ids[i].narrow(0, lengths[static_cast<size_t>(i)], 9 - lengths[static_cast<size_t>(i)]).fill_(0);
  }
  const at::Tensor labels = at::tensor({0, 1, 2, 1, 0}, at::kLong);
  for (const auto pooling : {ember_text::Pooling::mean, ember_text::Pooling::cls, ember_text::Pooling::pooler}) {
    ember_text::BertHead head;
    head.pooling = pooling;
    head.num_classes = 3;
    head.dropout = 0.0;
    ember_text::BertClassifierNet padded(config, head, ember_text::Unpad::never), unpadded(config, head, ember_text::Unpad::always);
    {
      torch::NoGradGuard no_grad;
      auto to = unpadded.named_parameters();
      for (const auto& item : padded.named_parameters()) to[item.key()].copy_(item.value());
    }
    for (const auto& [batch_ids, batch_mask] : {std::pair{ids, mask}, std::pair{ids.narrow(0, 0, 1), mask.narrow(0, 0, 1)}}) {
      padded.zero_grad();
      unpadded.zero_grad();
      const at::Tensor a = padded.forward(batch_ids, batch_mask), b = unpadded.forward(batch_ids, batch_mask);
      EXPECT_LT((a - b).abs().max().item<double>(), 1e-5) << static_cast<int>(pooling) << "\n" << a << "\n" << b;
      const at::Tensor y = labels.narrow(0, 0, batch_ids.size(0));
      at::cross_entropy_loss(a, y).backward();
      at::cross_entropy_loss(b, y).backward();
      auto grads = unpadded.named_parameters();
      for (const auto& item : padded.named_parameters()) {
        const at::Tensor& ga = item.value().grad();
        const at::Tensor& gb = grads[item.key()].grad();
        ASSERT_EQ(ga.defined(), gb.defined()) << item.key();
        if (ga.defined()) EXPECT_LT((ga - gb).abs().max().item<double>(), 1e-5) << item.key();
      }
    }
  }
}

TEST(BertNet, SafetensorsRoundTripAndBadFilesAreOneClearError) {
  TempDir dir("bert_weights");
  write_tiny_bert_config(dir.path(), 30);
  const auto config = ember_text::BertConfig::from_json_file((dir / "config.json").string());
  ember_text::BertClassifierNet a(config, {}), b(config, {});
  const auto weights = (dir / "model.safetensors").string();
  ember::support::write_safetensors(weights, state(a));
  EXPECT_TRUE(b.load_safetensors(weights).empty());
  for (const auto& [name, t] : state(a)) EXPECT_TRUE(t.equal(b.named_parameters()[name])) << name;

  // A missing tensor, a mis-shaped one, a truncated file and a file that is not safetensors.
  auto without = state(a);
  without.erase(without.begin() + 7);
  const std::string dropped = without.size() ? state(a)[7].first : "";
  ember::support::write_safetensors(weights, without);
  std::string e = error_of([&] { b.load_safetensors(weights); });
  EXPECT_NE(e.find("missing tensor '" + dropped + "'"), std::string::npos) << e;
  auto reshaped = state(a);
  reshaped[3].second = at::zeros({5});
  ember::support::write_safetensors(weights, reshaped);
  e = error_of([&] { b.load_safetensors(weights); });
  EXPECT_NE(e.find("tensor '" + reshaped[3].first + "' has shape [5]"), std::string::npos) << e;
  ember::support::write_safetensors(weights, state(a));
  fs::resize_file(weights, fs::file_size(weights) - 100);
  e = error_of([&] { b.load_safetensors(weights); });
  EXPECT_NE(e.find(weights + ": not a valid safetensors file"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  write_file(weights, "this is not a weights file at all");
  e = error_of([&] { b.load_safetensors(weights); });
  EXPECT_NE(e.find(weights + ": not a valid safetensors file"), std::string::npos) << e;
  for (const auto& msg : {e}) EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // An unsupported architecture in config.json.
  write_file(dir / "config.json", R"({"model_type": "gpt2", "vocab_size": 10})");
  e = error_of([&] { ember_text::BertConfig::from_json_file((dir / "config.json").string()); });
  EXPECT_NE(e.find("model_type \"gpt2\" is not supported"), std::string::npos) << e;
}

namespace {

// A tiny random-weight BERT folder (no Python) and texts whose label is readable from a word.
void write_tiny_task(const TempDir& dir) {
  write_vocab(dir / "model");
  write_tiny_bert_config(dir / "model", static_cast<int64_t>(kVocab.size()));
  std::string csv = "id,text,label\n";
  std::string jsonl;
  const char* texts[][2] = {{"the food is great!", "good"},  {"great, great food.", "good"}, {"the food is bad", "poor"},
                            {"bad. not great", "poor"},      {"i'd say \"great\"", "good"},   {"bad, bad, bad!", "poor"}};
  for (int rep = 0; rep < 4; ++rep)
    for (const auto& t : texts) {
      std::string quoted = t[0];
      for (size_t p = quoted.find('"'); p != std::string::npos; p = quoted.find('"', p + 2)) quoted.insert(p, "\"");
      csv += std::to_string(rep) + ",\"" + quoted + "\"," + t[1] + "\n";
      jsonl += nlohmann::json{{"sentence", t[0]}, {"y", t[1]}}.dump() + "\n";
    }
  write_file(dir / "train.csv", csv);
  write_file(dir / "test.jsonl", jsonl);
}

std::string tiny_run(const TempDir& dir, const std::string& data_keys = "") {
  return "[trainer]\nmax_epochs = 2\nenable_progress_bar = false\nenable_model_summary = false\ntest_after_fit = true\n"
         "[model]\nname = \"bert\"\nmodel_dir = \"" + (dir / "model").string() + "\"\npretrained = false\n"
         "[data]\nname = \"text_classification\"\nbatch_size = 8\ntrain_file = \"" + (dir / "train.csv").string() +
         "\"\ntest_file = \"" + (dir / "test.jsonl").string() + "\"\ntokenizer_dir = \"" + (dir / "model").string() +
         "\"\nmax_length = 8\nval_split = 0.25\n" + data_keys + "[optimizer]\nname = \"adamw\"\nlr = 0.001\n";
}

}  // namespace

// CSV train file (quoted fields with commas and quotes), JSONL test file with other column names:
// not allowed without naming the columns; the engine trains and tests a random-weight BERT.
TEST(TextClassification, TrainsAndTestsATinyBertThroughTheEngine) {
  TempDir dir("text_classification_run");
  write_tiny_task(dir);
  write_file(dir / "run.toml", tiny_run(dir));
  auto r = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("test.jsonl:1: no string or integer field \"text\": set text_column"), std::string::npos) << r.err;
  // The test file's own names: JSONL rows {"sentence", "y"}; CSV rows {"text", "label"} are the defaults.
  std::string run = tiny_run(dir);
  run.replace(run.find("test.jsonl"), 10, "train.csv");
  write_file(dir / "run.toml", run);
  r = run_engine({"run.toml"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("18 train, 6 val, 24 test texts; labels good=0, poor=1; 8 text(s) cut to 8 tokens"), std::string::npos) << r.err;
  const auto rows = read_csv(dir / "runs/run/version_0/metrics.csv");
  bool tested = false;
  for (const auto& row : rows)
    if (row.count("test_acc") && !row.at("test_acc").empty()) tested = true;
  EXPECT_TRUE(tested);
}

// Multi-label texts (data.multilabel: labels separated in one field; model.problem_type =
// "multi_label_classification": binary cross-entropy): the labels are the union of the training
// file's, the targets one 0/1 row per text (no label at all included), the [metrics] table's
// per-label confusion matrices count every test text, predictions are each label's probability,
// and the exported folder tells transformers the problem type. Mixed-up settings are one line.
TEST(TextClassification, MultiLabelTextsTrainWithBinaryCrossEntropy) {
  TempDir dir("text_multilabel");
  write_tiny_task(dir);
  std::string csv = "text,tags\n";
  const char* texts[][2] = {{"the food is great!", "food;praise"}, {"great, great food.", "praise ; food"}, {"hello world", "greet"},
                            {"hello, the food is bad", "food;greet"}, {"bad. not great", ""},                 {"hello! great", "greet;praise"}};
  for (int rep = 0; rep < 4; ++rep)
    for (const auto& t : texts) csv += "\"" + std::string(t[0]) + "\"," + t[1] + "\n";
  write_file(dir / "tags.csv", csv);
  std::string run = tiny_run(dir, "multilabel = true\nlabel_column = \"tags\"\n");
  for (const char* file : {"train.csv", "test.jsonl"}) run.replace(run.find(file), std::strlen(file), "tags.csv");
  write_file(dir / "run.toml", run + "[metrics]\nnames = [\"f1\", \"confusion_matrix\"]\ntask = \"multilabel\"\nsplits = [\"test\"]\n");
  const std::vector<std::string> multi = {"--set", "model.problem_type=\"multi_label_classification\"", "--set", "model.num_classes=3"};
  std::vector<std::string> args = {"run.toml"};
  args.insert(args.end(), multi.begin(), multi.end());
  auto r = run_engine(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("18 train, 6 val, 24 test texts; labels food=0, greet=1, praise=2 (multilabel)"), std::string::npos) << r.err;
  const auto rows = read_csv(dir / "runs/run/version_0/metrics.csv");
  bool tested = false;
  for (const auto& row : rows) tested |= row.count("test_f1") && !row.at("test_f1").empty();
  EXPECT_TRUE(tested);
  // Every test text in each label's 2 x 2, and the targets as written: food on 12 texts of 24,
  // greet on 12, praise on 12 (tn + fp = texts without the label).
  const auto counts = read_label_counts(dir / "runs/run/version_0/test_confusion_matrix.csv");
  ASSERT_EQ(counts.size(), 3u);
  for (const auto& [tn, fp, fn, tp] : counts) {
    EXPECT_EQ(fn + tp, 12);
    EXPECT_EQ(tn + fp, 12);
  }
  // Predictions: each label's probability (sigmoid), not a distribution over classes.
  std::vector<std::string> predict = {"predict", "--ckpt", "last", "run.toml", "--set", "data.predict_split=\"test\""};
  predict.insert(predict.end(), multi.begin(), multi.end());
  r = run_engine(predict, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto predictions = read_csv(dir / "runs/run/version_1/predictions.csv");
  ASSERT_EQ(predictions.size(), 24u);
  for (const auto& row : predictions) {
    double sum = 0;
    for (const char* column : {"out_food", "out_greet", "out_praise"}) {  // named by the labels
      ASSERT_TRUE(row.count(column)) << column << ": " << read_file(dir / "runs/run/version_1/predictions.csv").substr(0, 200);
      const double p = std::stod(row.at(column));
      EXPECT_TRUE(p > 0 && p < 1) << p;
      sum += p;
    }
    EXPECT_GT(std::abs(sum - 1.0), 1e-6) << "independent labels do not sum to 1";
  }
  fs::path ckpt;
  for (const auto& e : fs::directory_iterator(dir / "runs/run/version_0/checkpoints")) ckpt = e.path();
  ASSERT_FALSE(ckpt.empty());
  r = run_engine({"export", ckpt.string(), "exported"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto config = nlohmann::json::parse(read_file(dir / "exported/config.json"));
  EXPECT_EQ(config["problem_type"], "multi_label_classification");
  EXPECT_EQ(config["id2label"]["2"], "praise");
#ifdef EMBER_TEST_PYTHON
  // transformers loads the folder and gives each label's probability engine predict wrote.
  r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/text/reference.py").string(), "export-check", (dir / "exported").string(),
                   (dir / "tags.csv").string(), (dir / "runs/run/version_1/predictions.csv").string(), "mean", "8", "multilabel"},
                  dir.path(), {}, 600);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("24 texts"), std::string::npos) << r.out << r.err;
#endif
  // JSON Lines may list the labels ([] for none): the same targets as the CSV's "a;b" fields, so
  // the checkpoint tests to the same matrices.
  std::string jsonl;
  for (int rep = 0; rep < 4; ++rep)
    for (const auto& t : texts) {
      nlohmann::json tags = nlohmann::json::array();
      for (const char* tag : {"food", "greet", "praise"})
        if (std::string(t[1]).find(tag) != std::string::npos) tags.push_back(tag);
      jsonl += nlohmann::json{{"text", t[0]}, {"tags", tags}}.dump() + "\n";
    }
  write_file(dir / "tags.jsonl", jsonl);
  std::vector<std::string> test = {"test", "--ckpt", ckpt.string(), "run.toml", "--set", "data.test_file=\"tags.jsonl\""};
  test.insert(test.end(), multi.begin(), multi.end());
  r = run_engine(test, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_file(dir / "runs/run/version_2/test_confusion_matrix.csv"), read_file(dir / "runs/run/version_0/test_confusion_matrix.csv"));
  for (const auto& [line, expected] : {std::pair<std::string, std::string>{R"({"text": "great", "tags": ["food;greet"]})",
                                                                           "tags.jsonl:1: field \"tags\" lists \"food;greet\", which holds the separator \";\""},
                                       {R"({"text": "great", "tags": [["food"]]})", "tags.jsonl:1: field \"tags\" lists [\"food\"]: a list holds strings or integers"}}) {
    write_file(dir / "tags.jsonl", line + "\n");
    r = run_engine(test, dir.path());
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find(expected), std::string::npos) << r.err;
  }
  // Multi-label data without the problem type, and the problem type without multi-label data.
  r = run_engine({"run.toml", "--set", "model.num_classes=3"}, dir.path());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find(", 3] are 0/1 per label (multi-label data): set [model] problem_type = \"multi_label_classification\""),
            std::string::npos) << r.err;
  std::string single = tiny_run(dir);
  single.replace(single.find("test.jsonl"), 10, "train.csv");
  write_file(dir / "single.toml", single);
  args = {"single.toml"};
  args.insert(args.end(), multi.begin(), multi.end());
  r = run_engine(args, dir.path());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find(", 3], got Long [6]: set [data] multilabel = true (labels separated in one field), and [model] num_classes to the number of labels"),
            std::string::npos) << r.err;
}

// data.group_by_length: each epoch's first batch holds the longest text (Hugging Face's rule) and
// an epoch pads far fewer tokens than the plain shuffled order, in a real engine run.
TEST(TextClassification, GroupByLengthBatchesTextsOfSimilarLength) {
  TempDir dir("text_group_by_length");
  write_tiny_task(dir);
  // 192 texts of 1..32 words, each word one token: 3..34 tokens with [CLS] and [SEP].
  std::string csv = "text,label\n";
  const char* words[] = {"great", "bad", "food", "the", "is", "not"};
  for (int i = 0; i < 192; ++i) {
    std::string text;
    for (int w = 0; w < 1 + (i * 37) % 32; ++w) text += std::string(w ? " " : "") + words[(i + w) % 6];
    csv += text + "," + (i % 2 ? "good" : "poor") + "\n";
  }
  write_file(dir / "train.csv", csv);
  const std::string run = "[trainer]\nmax_epochs = 2\nenable_progress_bar = false\nenable_model_summary = false\n"
                          "[model]\nname = \"bert\"\nmodel_dir = \"" + (dir / "model").string() + "\"\npretrained = false\n"
                          "[data]\nname = \"text_classification\"\nbatch_size = 8\ntrain_file = \"" + (dir / "train.csv").string() +
                          "\"\ntokenizer_dir = \"" + (dir / "model").string() + "\"\nmax_length = 40\nval_split = 0.0\n"
                          "[optimizer]\nname = \"adamw\"\nlr = 0.001\n";
  write_file(dir / "run.toml", run);
  // Per epoch: the padded widths of its training batches, in order.
  auto widths = [&](const std::string& grouped) {
    const std::string out = grouped + ".txt";
    run_engine_ok(dir, {"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", "position_probe",
                        "--set", "position_probe.path=\"" + out + "\"", "--set", "position_probe.input_width=true",
                        "--set", "data.group_by_length=" + grouped, "--set", "trainer.default_root_dir=\"runs_" + grouped + "\""});
    std::vector<std::vector<int64_t>> epochs(2);
    std::ifstream in(dir / out);
    std::string hook;
    long long epoch, step, idx, size, width;
    double sum;
    while (in >> hook >> epoch >> step >> idx >> size >> sum >> width)
      if (hook == "on_train_batch_end") epochs.at(static_cast<size_t>(epoch)).push_back(width);
    return epochs;
  };
  const auto grouped = widths("true"), plain = widths("false");
  for (size_t e = 0; e < 2; ++e) {
    ASSERT_EQ(grouped[e].size(), 24u);
    ASSERT_EQ(plain[e].size(), 24u);
    EXPECT_EQ(grouped[e][0], 34) << "epoch " << e;  // the longest text first
    const int64_t g = std::accumulate(grouped[e].begin(), grouped[e].end(), int64_t{0});
    const int64_t p = std::accumulate(plain[e].begin(), plain[e].end(), int64_t{0});
    EXPECT_LT(g * 100, p * 85) << "epoch " << e << ": " << g << " padded widths grouped, " << p << " plain";
  }
  EXPECT_NE(grouped[0], grouped[1]);  // each epoch its own order
#ifdef EMBER_TEST_PYTHON
  // The same order as a transformers Trainer with group_by_length: transformers'
  // get_length_grouped_indices over the same split with the same generator gives the same widths.
  std::string lengths;
  for (int i = 0; i < 192; ++i) lengths += std::to_string(3 + (i * 37) % 32) + "\n";
  write_file(dir / "lengths.txt", lengths);
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/text/reference.py").string(),
                        "length-grouped", (dir / "lengths.txt").string(), "8", "0", "0", "2"},
                       dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream lines(r.out);
  for (size_t e = 0; e < 2; ++e) {
    std::string line;
    std::getline(lines, line);
    std::istringstream in(line);
    std::vector<int64_t> expected{std::istream_iterator<int64_t>(in), std::istream_iterator<int64_t>()};
    EXPECT_EQ(grouped[e], expected) << "epoch " << e;
  }
#endif
}

TEST(TextClassification, BadWeightsLabelsAndFilesAreOneLineErrors) {
  TempDir dir("text_classification_errors");
  write_tiny_task(dir);
  std::string run = tiny_run(dir);
  run.replace(run.find("pretrained = false"), 18, "pretrained = true");
  write_file(dir / "run.toml", run);
  write_file(dir / "test.jsonl", R"({"text": "great", "label": "good"})" "\n");
  write_file(dir / "model/model.safetensors", "garbage");
  auto r = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 2);  // the model plugin cannot be created
  EXPECT_NE(r.err.find("model.safetensors: not a valid safetensors file"), std::string::npos) << r.err;
  // A test label the training file never had.
  write_file(dir / "run.toml", tiny_run(dir, "text_column = \"sentence\"\nlabel_column = \"y\"\n"));
  write_file(dir / "train.csv", "sentence,y\ngreat,good\nbad,poor\ngreat food,good\nbad food,poor\n");
  write_file(dir / "test.jsonl", R"({"sentence": "great", "y": "good"})" "\n" R"({"sentence": "meh", "y": "neutral"})" "\n");
  r = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("test.jsonl:2: label \"neutral\" is not among the labels (good, poor)"), std::string::npos) << r.err;
  // A CSV field with a stray quote.
  write_file(dir / "train.csv", "sentence,y\n\"great\" food\",good\n");
  r = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("train.csv:2: malformed CSV"), std::string::npos) << r.err;
}

// A data tokenizer_dir that is not the model's gives ids past the model's embedding table: one line
// naming the id, the model's vocabulary and the fix, not LibTorch's "index out of range in self"
// (on a GPU, a device-side assert). Here "food" comes last in the other vocab.txt: its id is past
// the tiny model's vocabulary. A vocab.txt with a token on two lines keeps its last id.
TEST(TextClassification, ATokenizerThatIsNotTheModelsIsOneLine) {
  TempDir dir("text_classification_foreign_tokenizer");
  write_tiny_task(dir);
  std::vector<std::string> other = kVocab;
  other.push_back("food");
  write_vocab(dir / "other", other);
  const auto tokenizer = ember_text::WordPieceTokenizer::from_folder((dir / "other").string());
  EXPECT_EQ(tokenizer.vocab_size(), static_cast<int64_t>(other.size()));
  const auto food = tokenizer.encode("food");
  ASSERT_EQ(food.size(), 3u);
  EXPECT_EQ(food[1], static_cast<int64_t>(other.size()) - 1);
  std::string run = tiny_run(dir);
  run.replace(run.find("tokenizer_dir = \"" + (dir / "model").string()), 17 + (dir / "model").string().size(),
              "tokenizer_dir = \"" + (dir / "other").string());
  run.replace(run.find("test.jsonl"), 10, "train.csv");
  write_file(dir / "run.toml", run);
  const auto r = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("bert: token id " + std::to_string(other.size() - 1) + " is outside the model's vocabulary of " +
                       std::to_string(kVocab.size()) + " (its config.json): the data's tokenizer is not this model's; set [data] "
                       "tokenizer_dir to the model's folder (model_dir)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("index out of range"), std::string::npos) << r.err;
}

// One epoch of the tiny task with [data] labels = ["poor", "good"] (not the sorted order), tested on
// the training file; its checkpoint.
static fs::path train_poor_good(const TempDir& dir) {
  write_tiny_task(dir);
  std::string run = tiny_run(dir, "labels = [\"poor\", \"good\"]\n");
  run.replace(run.find("max_epochs = 2"), 14, "max_epochs = 1");
  run.replace(run.find("test.jsonl"), 10, "train.csv");
  write_file(dir / "run.toml", run);
  const auto r = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  fs::path ckpt;
  for (const auto& e : fs::directory_iterator(dir / "runs/run/version_0/checkpoints")) ckpt = e.path();
  return ckpt;
}

// The data's label names reach the exported Hugging Face config through the checkpoint
// (`class_names`): id2label/label2id say "good"/"poor", in the ids the data gave them (here the
// order [data] labels sets, not the sorted one), so transformers' pipelines print them.
TEST(TextExport, ConfigNamesTheDataLabels) {
  TempDir dir("text_export_labels");
  const fs::path ckpt = train_poor_good(dir);
  ASSERT_FALSE(ckpt.empty());
  ember::test::ProcessResult r;
  r = run_engine({"export", ckpt.string(), "--format", "safetensors", "exported"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto config = nlohmann::json::parse(read_file(dir / "exported/config.json"));
  EXPECT_EQ(config.at("id2label"), (nlohmann::json{{"0", "poor"}, {"1", "good"}})) << config.dump();
  EXPECT_EQ(config.at("label2id"), (nlohmann::json{{"poor", 0}, {"good", 1}})) << config.dump();

  // A label listed twice would map two ids to one name: refused with the place and the fix.
  write_file(dir / "run.toml", tiny_run(dir, "labels = [\"good\", \"poor\", \"good\"]\n"));
  r = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("[data] labels (run.toml:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("names \"good\" twice (ids 0 and 2): list each label once, in id order"), std::string::npos) << r.err;
}

// A checkpoint's outputs are the classes it was trained on, in their order (`class_names`):
// data that names them in another order or names others (a label added to the file, another
// `labels`) is refused in one line when predicting, testing or resuming from it, rather than
// naming the outputs wrongly. Integer labels are their own ids ("0" .. the largest), as
// image_folder's lists have them, so 10 sorts after 9 and not after 1.
TEST(TextClassification, CheckpointsRefuseDataThatNamesOtherClasses) {
  TempDir dir("text_class_names");
  const fs::path ckpt = train_poor_good(dir);
  ASSERT_FALSE(ckpt.empty());
  ember::test::ProcessResult r;
  r = run_engine({"predict", "--ckpt", ckpt.string(), "run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string swapped = "checkpoint " + ckpt.string() +
                              " was trained on 2 classes (poor, good) and the text_classification data names 2 (good, poor): output 0 is "
                              "'poor' there and 'good' here: give the data the checkpoint's classes in its order (text_classification: "
                              "[data] labels, image_folder: [data] classes; `engine checkpoint info` lists them), or train anew";
  for (const std::vector<std::string>& args : {std::vector<std::string>{"predict", "--ckpt", ckpt.string(), "run.toml"},
                                               std::vector<std::string>{"test", "--ckpt", ckpt.string(), "run.toml"},
                                               std::vector<std::string>{"run.toml", "--resume", ckpt.string(), "--set", "trainer.max_epochs=2"}}) {
    std::vector<std::string> with = args;
    with.insert(with.end(), {"--set", "data.labels=[\"good\", \"poor\"]"});
    r = run_engine(with, dir.path());
    EXPECT_EQ(r.exit_code, 1) << args[0] << ": " << r.err;
    EXPECT_NE(r.err.find(swapped), std::string::npos) << args[0] << ": " << r.err;
  }
  // `engine checkpoint info` lists them as a TOML array, ready for `labels`.
  r = run_engine({"checkpoint", "info", ckpt.string()}, dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("classes (2, in output order): [\"poor\", \"good\"]\n"), std::string::npos) << r.out;
  r = run_engine({"predict", "--ckpt", ckpt.string(), "run.toml", "--set", "data.labels=[\"poor\", \"good\", \"meh\"]"}, dir.path());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("was trained on 2 classes (poor, good) and the text_classification data names 3 (poor, good, meh): give the data"),
            std::string::npos)
      << r.err;

  // Twelve integer labels: ids are the integers.
  std::string csv = "text,label\n";
  for (int i = 0; i < 24; ++i) csv += std::string(i % 2 ? "the food is great" : "the food is bad") + "," + std::to_string(i % 12) + "\n";
  write_file(dir / "numbers.csv", csv);
  std::string numbers = tiny_run(dir);
  numbers.replace(numbers.find("max_epochs = 2"), 14, "max_epochs = 1");
  for (const char* file : {"train.csv", "test.jsonl"}) numbers.replace(numbers.find(file), std::strlen(file), "numbers.csv");
  write_file(dir / "numbers.toml", numbers);
  r = run_engine({"numbers.toml", "--set", "model.num_classes=12"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("labels 0=0, 1=1, 2=2, 3=3, 4=4, 5=5, 6=6, 7=7, 8=8, 9=9, 10=10, 11=11;"), std::string::npos) << r.err;
}

#ifdef EMBER_TEST_PYTHON
// `engine export CKPT --format safetensors FOLDER` of a fine-tuned BERT and DistilBERT: Hugging
// Face transformers loads the folder (weights, config.json, tokenizer) and gives, for every text,
// the probabilities `engine predict` wrote from the same checkpoint (pooler pooling through
// *ForSequenceClassification, mean pooling through AutoModel + the exported classifier).
TEST(TextExport, TransformersLoadsTheExportAndPredictsLikeEmber) {
  struct Case {
    std::string kind, pooling;
  };
  for (const Case& c : {Case{"bert", "pooler"}, Case{"bert", "mean"}, Case{"distilbert", "pooler"}}) {
    SCOPED_TRACE(c.kind + " " + c.pooling);
    TempDir dir("text_export_" + c.kind + "_" + c.pooling);
    write_tiny_task(dir);
    if (c.kind == "distilbert")
      write_file(dir / "model/config.json", nlohmann::json{{"model_type", "distilbert"}, {"vocab_size", kVocab.size()}, {"dim", 16},
                                                           {"n_layers", 2}, {"n_heads", 2}, {"hidden_dim", 24},
                                                           {"max_position_embeddings", 64}}
                                                .dump());
    std::string run = tiny_run(dir);
    run.replace(run.find("test.jsonl"), 10, "train.csv");
    run.replace(run.find("pretrained = false"), 18, "pretrained = false\npooling = \"" + c.pooling + "\"");
    write_file(dir / "run.toml", run);
    auto r = run_engine({"run.toml"}, dir.path());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    fs::path ckpt;
    for (const auto& e : fs::directory_iterator(dir / "runs/run/version_0/checkpoints")) ckpt = e.path();
    ASSERT_FALSE(ckpt.empty());
    r = run_engine({"predict", "--ckpt", ckpt.string(), "run.toml"}, dir.path());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    r = run_engine({"export", ckpt.string(), "--format", "safetensors", "exported"}, dir.path());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.err.find("with config.json vocab.txt"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.pooling == "pooler" ? "ForSequenceClassification" : "AutoModel.from_pretrained"), std::string::npos) << r.err;
    r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/text/reference.py").string(), "export-check",
                     (dir / "exported").string(), (dir / "train.csv").string(), (dir / "runs/run/version_1/predictions.csv").string(),
                     c.pooling, "8"},
                    dir.path(), {}, 600);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("24 texts"), std::string::npos) << r.out << r.err;
  }
}
#endif
