// The predict loop (Lightning's trainer.predict): the model's outputs for every sample of a split,
// written as one CSV row per sample (docs/predict in README's "Using the engine").
#include <ember/language_model.h>
#include <ember/predict.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include <sstream>

#include "checkpoint/checkpoint_io.h"
#include "data/data_loader.h"
#include "data/device_feed.h"
#include "common/log.h"
#include "loop/training_loop.h"

namespace ember::engine {
namespace {

// A CSV field (RFC 4180): quoted when it holds a comma, quote or line break.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

const char* split_name(Split s) { return s == Split::train ? "train" : s == Split::val ? "val" : "test"; }

}  // namespace

int64_t TrainingLoop::predict(Split split, const std::filesystem::path& csv) {
  auto& model = *plugins_.model.object;
  auto& data = *plugins_.data.object;
  if (world_size() > 1)
    throw UsageError("engine predict runs on one process, so that every sample is written once and in order: set "
                     "trainer.devices = 1 and trainer.num_nodes = 1");
  auto* predicting = static_cast<IPredictingModel*>(model.query_interface(kPredictingModelIid));
  if (!predicting) {
    // A language model writes text instead: say which command does.
    const bool lm = model.query_interface(kCausalLanguageModelIid) != nullptr;
    throw UsageError("model '" + plugins_.model.name + "' cannot predict: it does not implement ember::IPredictingModel "
                     "(sdk/include/ember/predict.h)" +
                     (lm ? std::string("; it is a language model: engine generate --ckpt CKPT --prompt TEXT run.toml writes its text") : ""));
  }
  const auto* names = static_cast<IPredictionNames*>(data.query_interface(kPredictionNamesIid));
  if (data.size(split) == 0)
    throw RunError("data '" + plugins_.data.name + "' has no " + split_name(split) + " samples to predict (data.predict_split)");
  DataLoader loader(data, split, plan_->eval_options());  // in order: no shuffling for evaluation
  const int64_t batches = plan_->predict_batches(loader.num_batches());
  const std::vector<std::string> classes = names ? names->class_names() : std::vector<std::string>{};

  const bool was_training = module().is_training();
  if (runtime_->pipeline())
    throw ConfigError("predict: parallelism.pipeline_parallel = " + std::to_string(runtime_->pipeline()->pipeline_size()) +
                      ": predictions through pipeline stages are not built; predict with pipeline_parallel = 1 from the checkpoint "
                      "(it loads under any mesh)");
  module().eval();
  std::ostringstream out;
  int64_t rows = 0, width = -1;
  {
    torch::NoGradGuard no_grad;
    auto pass = loader.pass(0, 0, batches);
    DeviceFeed feed(*pass, *runtime_, feed_options_);
    Batch batch;
    while (feed.next(batch)) {
      at::Tensor y;
      {
        auto region = runtime_->forward(/*grad_enabled=*/false);
        y = predicting->predict_step(batch);
      }
      if (!y.defined() || y.dim() == 0 || y.size(0) != batch.size)
        throw RunError("model '" + plugins_.model.name + "': predict_step returned " +
                       (y.defined() ? "a tensor of shape " + c10::str(y.sizes()) : std::string("nothing")) + " for a batch of " +
                       std::to_string(batch.size) + " samples (expected one row per sample)");
      y = y.reshape({y.size(0), -1}).to(at::kCPU, at::kDouble);
      if (width < 0) {  // the header, from the first batch's width
        width = y.size(1);
        if (predicting->predicts_classes() && !classes.empty() && static_cast<int64_t>(classes.size()) != width)
          throw RunError("model '" + plugins_.model.name + "' predicts " + std::to_string(width) + " classes, data '" +
                         plugins_.data.name + "' names " + std::to_string(classes.size()));
        out << "id";
        if (predicting->predicts_classes()) out << ",prediction";
        for (int64_t k = 0; k < width; ++k)
          out << "," << csv_field((predicting->predicts_classes() ? "prob_" : "out_") +
                                  (classes.empty() ? std::to_string(k) : classes[static_cast<size_t>(k)]));
        out << "\n";
      }
      const auto acc = y.accessor<double, 2>();
      for (int64_t i = 0; i < y.size(0); ++i, ++rows) {
        std::string id = names ? names->sample_id(split, rows) : "";
        out << csv_field(id.empty() ? std::to_string(rows) : id);
        if (predicting->predicts_classes()) {
          int64_t best = 0;
          for (int64_t k = 1; k < width; ++k)
            if (acc[i][k] > acc[i][best]) best = k;
          out << "," << csv_field(classes.empty() ? std::to_string(best) : classes[static_cast<size_t>(best)]);
        }
        for (int64_t k = 0; k < width; ++k) out << "," << c10::str(acc[i][k]);
        out << "\n";
      }
    }
  }
  if (was_training) module().train();
  const std::string text = out.str();
  atomic_write(csv, text.data(), text.size());
  log::info("wrote " + std::to_string(rows) + " predictions of the " + split_name(split) + " split to " + csv.string());
  return rows;
}

}  // namespace ember::engine
