// The run the batch-norm tests share: the test plugin bn_mlp (linear -> batch norm -> relu ->
// linear) on 64 synthetic samples, batch 8, SGD, two epochs, on the CPU (so CPU ranks (Open MPI)
// and single_device compare on the same device also where a GPU is present). Give
// `--plugin-path test_plugin_dir("good")`.
#pragma once

namespace ember::test {

inline constexpr const char* kBnMlpRun = R"(
[trainer]
accelerator = "cpu"
max_epochs = 2
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "bn_mlp"
input_size = 16
hidden = 8
num_classes = 4
[data]
name = "synthetic"
shape = [16]
num_classes = 4
num_train = 64
num_val = 16
num_test = 0
batch_size = 8
[optimizer]
name = "sgd"
lr = 0.1
)";

}  // namespace ember::test
