// The engine's commands, callable from main() and from tests. Exported from libember.so (EMBER_API)
// for the `engine` binary only; they are not part of the library's public API.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <ember/library.h>
#include <ember/types.h>

#include "config/run_request.h"
#include "loop/generation.h"

namespace ember::engine {


// `engine run.toml`: fit, then test when the config asks. Returns the exit code.
EMBER_API int run_training(const RunRequest& request);
// `engine validate|test|predict [--ckpt best|last|PATH] run.toml`: one validation or test pass
// over the checkpoint's weights ("" = the freshly set-up model), results printed; or (predict)
// the predictions for data.predict_split in <run folder>/predictions.csv. Returns the exit code.
EMBER_API int evaluate_checkpoint(const RunRequest& request, Split split, const std::string& checkpoint, bool predict = false);
// `engine generate [--ckpt best|last|PATH] [--prompt TEXT] run.toml`: text from a language model
// (the prompt, then the sampled tokens streamed to stdout). Returns the exit code.
EMBER_API int generate_text(const RunRequest& request, const std::string& checkpoint, const GenerationOptions& options);
// `engine checkpoint consolidate DIR OUT.ckpt [--weights-only]`: the single-file checkpoint of a
// sharded checkpoint directory (what single_device and Python read), made by restoring DIR into the
// run's own configuration on one process; `weights_only`: the model's weights alone.
EMBER_API int consolidate_checkpoint(const RunRequest& request, const std::string& dir, const std::string& out, bool weights_only = false);
// `engine checkpoint info CKPT` (checkpoint_info.cpp): what a checkpoint file or sharded directory
// holds, read from its pickle alone (no tensor data).
EMBER_API int checkpoint_info(const std::string& checkpoint, std::ostream& out);
// `engine checkpoint verify CKPT` (checkpoint_verify.cpp): every record of a checkpoint file (or of
// each file of a sharded directory) against its manifest's CRC32C, read in chunks, and its pickle
// read; exit 1 with one line naming what is damaged.
EMBER_API int checkpoint_verify(const std::string& checkpoint, std::ostream& out);
// "25.7 kB", "403.2 MB", "90.12 GB": a file's size in the checkpoint commands' output.
std::string size_text(uintmax_t bytes);
// `engine export CKPT --format safetensors OUT` (weights_export.cpp): the checkpoint's model
// weights as OUT (a .safetensors file) or OUT/model.safetensors plus the files the model exports
// (ember::IExportableModel: e.g. config.json and the tokenizer for transformers); `--format peft`:
// the adapters a transform added (ember::IAdapterExport: lora) as OUT/adapter_model.safetensors
// and adapter_config.json. CKPT may be a sharded checkpoint folder (consolidated first).
EMBER_API int export_weights(const RunRequest& request, const std::string& checkpoint, const std::string& format,
                             const std::string& out);
// `engine config run.toml`: prints the resolved configuration.
EMBER_API int print_config(const RunRequest& request, std::ostream& out);
// `engine plugins list` / `engine plugins info NAME`.
EMBER_API int list_plugins(const std::vector<std::string>& plugin_paths, std::ostream& out);
EMBER_API int plugin_info(const std::string& name, const std::vector<std::string>& plugin_paths, std::ostream& out);

}  // namespace ember::engine
