// What the language-model run tests share (lm_test.cpp, lora_test.cpp): a small corpus and the
// gpt + text_lm run over it, and tensors to and from the JSON the Python checks exchange.
#pragma once
#include <ATen/ATen.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "support.h"

namespace ember::test::lm_runs {

inline at::Tensor tensor_from_json(const nlohmann::json& j) {
  // Nested lists of numbers of any depth -> a double tensor of that shape.
  std::vector<int64_t> shape;
  for (const nlohmann::json* p = &j; p->is_array(); p = &(*p)[0]) shape.push_back(static_cast<int64_t>(p->size()));
  std::vector<double> flat;
  std::function<void(const nlohmann::json&)> walk = [&](const nlohmann::json& x) {
    if (x.is_array())
      for (const auto& e : x) walk(e);
    else
      flat.push_back(x.get<double>());
  };
  walk(j);
  return at::tensor(flat, at::kDouble).view(shape);
}

inline nlohmann::json json_from_tensor(const at::Tensor& t) {
  if (t.dim() == 0) return at::isFloatingType(t.scalar_type()) ? nlohmann::json(t.item<double>()) : nlohmann::json(t.item<int64_t>());
  nlohmann::json out = nlohmann::json::array();
  for (int64_t i = 0; i < t.size(0); ++i) out.push_back(json_from_tensor(t[i]));
  return out;
}

// A small corpus: a few sentences in varied order, so a tiny model learns something in 40 steps.
inline std::string corpus_text() {
  const std::vector<std::string> lines = {
      "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
      "The sun was shining on the sea, shining with all his might.",
      "Emma Woodhouse, handsome, clever, and rich, seemed to unite some of the best blessings of existence.",
      "She was the youngest of the two daughters of a most affectionate, indulgent father.",
      "Happy families are all alike; every unhappy family is unhappy in its own way."};
  std::string out;
  for (int round = 0; round < 12; ++round)
    for (size_t i = 0; i < lines.size(); ++i) out += lines[(i * 3 + static_cast<size_t>(round)) % lines.size()] + "\n";
  return out;
}

inline std::string lm_toml(const TempDir& dir) {
  return "[trainer]\nmax_steps = 40\nmax_epochs = -1\nval_check_interval = 20\nlimit_val_batches = 4\nnum_sanity_val_steps = 0\n"
         "enable_progress_bar = false\nenable_model_summary = false\nlog_every_n_steps = 5\ndeterministic = true\n"
         "[model]\nname = \"gpt\"\nvocab_size = 48\ncontext_length = 32\nlayers = 2\nheads = 2\nwidth = 32\n"
         "[data]\nname = \"text_lm\"\ncorpus = \"" + (dir / "corpus.txt").string() + "\"\ncache_dir = \"" + (dir / "tokens").string() +
         "\"\nblock_size = 16\nbatch_size = 8\n"
         "[optimizer]\nname = \"adamw\"\nlr = 0.003\n"
         "[checkpoint]\nevery_n_train_steps = 10\nsave_top_k = -1\n";
}

inline void write_lm_run(const TempDir& dir) {
  write_file(dir / "corpus.txt", corpus_text());
  write_file(dir / "run.toml", lm_toml(dir));
}

}  // namespace ember::test::lm_runs
