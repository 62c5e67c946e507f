// bert: a pretrained BERT-family encoder (BERT, MiniLM, DistilBERT: models/text/bert_net.h) with
// mean, [CLS] or pooler pooling and a linear classification head, fine-tuned on token ids.
// Batch: tensors[0] = input_ids int64 [N, S], tensors[1] = labels int64 [N] (multi-label: 0/1
// [N, num_classes], model.problem_type = "multi_label_classification"), tensors[2] (optional)
// = attention_mask [N, S] (1 = token, 0 = padding; without it, ids equal to pad_token_id are padding),
// as the text_classification data module yields them.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <memory>
#include <string>

#include <c10/util/StringUtil.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/model.h>
#include <ember/model_export.h>
#include <ember/model_units.h>
#include <ember/plugin.h>
#include <ember/predict.h>

#include <ember/model_support/classification.h>
#include <nlohmann/json.hpp>

#include "asset_path.h"
#include "bert_net.h"

namespace {

using ember_models::Phase;

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("model_dir", "\"all-minilm-l6-v2\"", "Folder with config.json and model.safetensors (Hugging Face layout); a bare name is a folder in the Ember cache ($EMBER_CACHE, default ~/.cache/ember), where scripts/setup.sh installs all-minilm-l6-v2."),
    ember::key::Bool("pretrained", "true", "Load model.safetensors; false starts from a random initialisation of config.json's architecture."),
    ember::key::String("pooling", "\"mean\"", "Sentence vector: mean of the token states (padding excluded), the [CLS] state, or the checkpoint's pooler (tanh(dense([CLS])); DistilBERT: relu(pre_classifier([CLS])))." ).choices("mean|cls|pooler"),
    ember::key::Int("num_classes", "2", "Classes (or labels, multi-label): the width of the classification head.").at_least(2),
    ember::key::String("problem_type", "\"single_label_classification\"", "transformers' problem_type: one class per text (cross-entropy on class indices), or any number of labels per text (binary cross-entropy on 0/1 targets [N, num_classes]; text_classification's multilabel = true).").choices("single_label_classification|multi_label_classification"),
    ember::key::Float("classifier_dropout", "0.1", "Dropout before the classification head, in [0, 1).").at_least(0.0).below(1.0),
    ember::key::Bool("freeze_encoder", "false", "Train only the classification head (a frozen-encoder baseline, linear probing)."),
    ember::key::String("unpad", "\"auto\"", "Leave a batch's padding out of the encoder's per-token work (projections, feed-forward, LayerNorm: only the attention product sees the padded layout, masked): auto = when at least 5% of the batch's token slots are padding, true = always, false = never. The same outputs either way (to rounding); less time and memory the more the texts of a batch differ in length.").choices("auto|true|false"),
};

ember_text::Unpad parse_unpad(const std::string& s) {
  if (s == "true") return ember_text::Unpad::always;
  if (s == "false") return ember_text::Unpad::never;
  return ember_text::Unpad::auto_;
}

ember_text::Pooling parse_pooling(const std::string& s) {
  if (s == "cls") return ember_text::Pooling::cls;
  if (s == "pooler") return ember_text::Pooling::pooler;
  return ember_text::Pooling::mean;
}

class Bert final : public ember::IModel, public ember::UnitModel, public ember::IPredictingModel, public ember::IExportableModel2 {
 public:
  Bert(ember::IHost& host, const ember::IConfig& cfg) {
    const auto dir = ember_text::resolve_asset(cfg.get_string("model_dir"));
    if (!std::filesystem::is_directory(dir))
      throw ember::ConfigError(c10::str("[", cfg.section(), "] model_dir = \"", cfg.get_string("model_dir"), "\" (", cfg.where("model_dir"),
                                        "): no folder ", dir.string(), ": run scripts/setup.sh (installs all-minilm-l6-v2) or give a model folder"));
    const auto config = ember_text::BertConfig::from_json_file((dir / "config.json").string());
    dir_ = dir;
    ember_text::BertHead head;
    head.pooling = parse_pooling(cfg.get_string("pooling"));
    head.num_classes = cfg.get_int("num_classes");
    head.dropout = ember_models::read_dropout(cfg, "classifier_dropout");
    multilabel_ = cfg.get_string("problem_type") == "multi_label_classification";
    section_ = cfg.section();
    net_ = std::make_shared<ember_text::BertClassifierNet>(config, head, parse_unpad(cfg.get_string("unpad")));
    if (cfg.get_bool("pretrained")) {
      const std::string weights = (dir / "model.safetensors").string();
      const auto unused = net_->load_safetensors(weights);
      std::string note;
      if (!unused.empty()) note = c10::str("; ", unused.size(), " tensor(s) of the file unused, e.g. ", unused.front());
      host.log(ember::LogLevel::info, c10::str("bert: ", config.model_type, " encoder (", config.layers, " layers, width ", config.hidden,
                                               ") loaded from ", weights, note));
    }
    if (cfg.get_bool("freeze_encoder")) net_->freeze_encoder();
    pad_id_ = config.pad_token_id;
    net_->declare_units(units_);
  }
  torch::nn::Module& module() override { return *net_; }
  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kPredictingModelIid) == 0) return static_cast<ember::IPredictingModel*>(this);
    if (std::strcmp(iid, ember::kExportableModel2Iid) == 0) return static_cast<ember::IExportableModel2*>(this);
    if (std::strcmp(iid, ember::kExportableModelIid) == 0) return static_cast<ember::IExportableModel*>(this);
    return unit_model_interface(iid);
  }
  // Class probabilities, or each label's (multi-label).
  at::Tensor predict_step(const ember::Batch& batch) override {
    const at::Tensor out = logits(batch).to(at::kFloat);
    return multilabel_ ? out.sigmoid() : out.softmax(1);
  }
  bool predicts_classes() const override { return !multilabel_; }

  // Export in Hugging Face's layout: the *ForSequenceClassification names, the model folder's
  // config.json saying the architecture and the classes, and its tokenizer files, so that
  // transformers' from_pretrained(folder) loads the fine-tuned model and its tokenizer.
  std::string exported_name(const std::string& name) const override { return net_->transformers_name(name); }
  std::vector<std::pair<std::string, std::string>> exported_files() const override { return exported_files_with_classes({}); }
  std::vector<std::pair<std::string, std::string>> exported_files_with_classes(const std::vector<std::string>& class_names) const override {
    const auto& c = net_->config();
    const auto& head = net_->head();
    const auto path = dir_ / "config.json";
    std::ifstream in(path);
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) throw ember::RunError(c10::str(path.string(), ": not a JSON object (the model folder changed since training?)"));
    const bool distil = c.model_type == "distilbert";
    // transformers' sequence-classification models pool with the pooler; for mean or [CLS] pooling
    // the folder is the encoder (AutoModel) plus Ember's head weights (`classifier.*`).
    const bool hf_head = head.pooling == ember_text::Pooling::pooler;
    j["architectures"] = {hf_head ? (distil ? "DistilBertForSequenceClassification" : "BertForSequenceClassification")
                                  : (distil ? "DistilBertModel" : "BertModel")};
    // The training data's names where it gave them (a pipeline then says "positive", not
    // "LABEL_1"); transformers' own LABEL_<k> for classes it did not name.
    nlohmann::json id2label = nlohmann::json::object(), label2id = nlohmann::json::object();
    for (int64_t k = 0; k < head.num_classes; ++k) {
      const std::string name = k < static_cast<int64_t>(class_names.size()) ? class_names[static_cast<size_t>(k)]
                                                                            : "LABEL_" + std::to_string(k);
      id2label[std::to_string(k)] = name;
      label2id[name] = k;
    }
    j["id2label"] = id2label;
    j["label2id"] = label2id;
    j[distil ? "seq_classif_dropout" : "classifier_dropout"] = head.dropout;
    // transformers then trains and scores the folder with the same loss (BCE for multi-label).
    j["problem_type"] = multilabel_ ? "multi_label_classification" : "single_label_classification";
    j["ember_pooling"] = head.pooling == ember_text::Pooling::mean ? "mean" : head.pooling == ember_text::Pooling::cls ? "cls" : "pooler";
    std::vector<std::pair<std::string, std::string>> files{{"config.json", j.dump(2) + "\n"}};
    for (const char* name : {"vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
      std::ifstream f(dir_ / name, std::ios::binary);
      if (!f) continue;
      std::ostringstream text;
      text << f.rdbuf();
      files.emplace_back(name, text.str());
    }
    return files;
  }
  std::string export_note() const override {
    const bool distil = net_->config().model_type == "distilbert";
    switch (net_->head().pooling) {
      case ember_text::Pooling::pooler:
        return c10::str("transformers: AutoModelForSequenceClassification.from_pretrained(folder) (",
                        distil ? "DistilBertForSequenceClassification" : "BertForSequenceClassification", ") gives Ember's logits");
      case ember_text::Pooling::mean:
        return "transformers: AutoModel.from_pretrained(folder) is the encoder; Ember's logits are classifier(mean of the "
               "unpadded token states) with the folder's classifier.weight/bias (docs/text.md)";
      case ember_text::Pooling::cls:
        return "transformers: AutoModel.from_pretrained(folder) is the encoder; Ember's logits are classifier(the [CLS] state) "
               "with the folder's classifier.weight/bias (docs/text.md)";
    }
    return "";
  }
  at::Tensor training_step(const ember::Batch& batch, ember::IStepContext& ctx) override { return step(batch, ctx, Phase::train); }
  void validation_step(const ember::Batch& batch, ember::IStepContext& ctx) override { step(batch, ctx, Phase::val); }
  void test_step(const ember::Batch& batch, ember::IStepContext& ctx) override { step(batch, ctx, Phase::test); }

 private:
  at::Tensor step(const ember::Batch& batch, ember::IStepContext& ctx, Phase phase) {
    ember_models::require_inputs_and_targets(batch, "bert");
    if (multilabel_)
      return ember_models::multilabel_step(logits(batch), batch[1], phase, ctx, "bert",
                                           c10::str("set [data] multilabel = true (labels separated in one field), and [", section_,
                                                    "] num_classes to the number of labels"));
    if (batch[1].dim() == 2)
      throw ember::RunError(c10::str("bert: the targets ", batch[1].sizes(), " are 0/1 per label (multi-label data): set [", section_,
                                     "] problem_type = \"multi_label_classification\""));
    return ember_models::classification_step(logits(batch), batch[1], phase, ctx, "bert");
  }
  at::Tensor logits(const ember::Batch& batch) {
    if (batch.tensors.empty()) throw ember::RunError("bert: got a batch without token ids");
    const at::Tensor& ids = batch[0];
    if (ids.dim() != 2 || at::isFloatingType(ids.scalar_type()))
      throw ember::RunError(c10::str("bert: got inputs ", ids.scalar_type(), " ", ids.sizes(),
                                     ", expected token ids int64 [N, seq_len]: use a text data module (text_classification)"));
    const at::Tensor mask = batch.tensors.size() > 2 ? batch[2] : ids.ne(pad_id_);
    return net_->forward(ids.to(at::kLong), mask);
  }
  std::shared_ptr<ember_text::BertClassifierNet> net_;
  std::filesystem::path dir_;
  int64_t pad_id_ = 0;
  bool multilabel_ = false;
  std::string section_;
};

ember::IModel* make(ember::IHost& host, const ember::IConfig& cfg) { return new Bert(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IModel, "bert", "0.1.0", "Apache-2.0",
             "Pretrained BERT-family encoder (BERT, MiniLM, DistilBERT) from safetensors, pooled, with a classification head.",
             EMBER_CONFIG_KEYS(kKeys), make)
