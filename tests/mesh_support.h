// What the device-mesh tests share (tensor_parallel_test.cpp, pipeline_parallel_test.cpp): the
// transformer run they train under single_device and on meshes, and reading a metric's column.
#pragma once
#include <string>
#include <vector>

#include "support.h"

namespace ember::test {

// `layers` encoder layers of 4 heads, no dropout (a rank's dropout masks cannot be
// single_device's). 96 samples, global batch 12, 2 batches accumulated: 4 optimizer steps per
// epoch, 8 in all. AdamW's eps is 1e-4, not 1e-8: the key projection's bias has an exactly zero
// gradient (softmax ignores a shift of a row of scores), so its float gradient is rounding noise
// that eps = 1e-8 turns into full-size steps, and any two implementations of attention (LibTorch's
// MultiheadAttention and a split forward) then differ there by ~1e-3.
inline std::string transformer_mesh_toml(int layers) {
  return R"([trainer]
accelerator = "cpu"
max_epochs = 2
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
log_every_n_steps = 1
gradient_clip_val = 0.5
accumulate_grad_batches = 2
[model]
name = "transformer"
d_model = 16
nhead = 4
dim_feedforward = 24
num_layers = )" + std::to_string(layers) + R"(
dropout = 0.0
num_classes = 4
[data]
name = "synthetic"
shape = [6, 16]
num_classes = 4
num_train = 96
num_val = 24
num_test = 0
batch_size = 12
shuffle = true
[optimizer]
name = "adamw"
lr = 0.01
weight_decay = 0.1
eps = 1e-4
)";
}

// A small gpt run on a few lines of prose repeated (the text_lm data module, tokens cached in the
// folder): `layers` blocks of 4 heads, 32 wide, `extra` [model] lines (flavour's keys); 12
// optimizer steps of 2 accumulated batches, validation every 6 batches.
inline void write_gpt_mesh_run(const TempDir& dir, const std::string& flavour, int layers, const std::string& extra) {
  const std::string corpus =
      "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.\n"
      "The sun was shining on the sea, shining with all his might.\n"
      "Happy families are all alike; every unhappy family is unhappy in its own way.\n";
  std::string text;
  for (int i = 0; i < 8; ++i) text += corpus;
  write_file(dir / "corpus.txt", text);
  write_file(dir / "run.toml",
             "[trainer]\naccelerator = \"cpu\"\nmax_steps = 12\nmax_epochs = -1\nval_check_interval = 6\nlimit_val_batches = 4\n"
             "num_sanity_val_steps = 0\nenable_progress_bar = false\nenable_model_summary = false\nlog_every_n_steps = 1\n"
             "gradient_clip_val = 1.0\naccumulate_grad_batches = 2\n"
             "[model]\nname = \"gpt\"\nflavour = \"" + flavour + "\"\ncontext_length = 32\nlayers = " + std::to_string(layers) +
             "\nheads = 4\nwidth = 32\n" + extra + "[data]\nname = \"text_lm\"\ncorpus = \"" + (dir / "corpus.txt").string() +
             "\"\ncache_dir = \"" + (dir / "tokens").string() + "\"\nblock_size = 16\nbatch_size = 8\n"
             "[optimizer]\nname = \"adamw\"\nlr = 0.003\neps = 1e-4\n");
}

// The non-empty values of column `name` in a run's metrics.csv.
inline std::vector<std::string> metric_column(const TempDir& dir, const std::string& name, int version = 0) {
  std::vector<std::string> out;
  for (const auto& row : read_csv(dir / ("runs/run/version_" + std::to_string(version) + "/metrics.csv")))
    if (row.count(name) && !row.at(name).empty()) out.push_back(row.at(name));
  return out;
}

}  // namespace ember::test
