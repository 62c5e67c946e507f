// The parts of the one checkpoint layout (docs/checkpoint.md) that every writer shares: the
// training loop's checkpoints, Fabric::save and `engine checkpoint consolidate` all start from
// checkpoint_header() and keep RNG state and optimizer bytes the same way, so each reads the
// others' files.
#pragma once
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <string>

namespace ember::engine {

// An empty dict with string keys, the type of every table in a checkpoint.
c10::impl::GenericDict checkpoint_dict();

// format, format_version, ember_version, torch_version, sdk_abi, epoch, global_step,
// weights_only and config (the resolved TOML).
c10::impl::GenericDict checkpoint_header(int64_t epoch, int64_t global_step, bool weights_only, const std::string& config_toml);

// The process's random generators: "cpu" and "cuda" (one state per visible CUDA device).
c10::impl::GenericDict rng_state();
// Restores what rng_state() saved; CUDA states beyond the visible devices are ignored (a GPU
// checkpoint resumes on fewer GPUs or on the CPU).
void restore_rng_state(const c10::impl::GenericDict& rng);

// Optimizer state (torch::save bytes) as a uint8 tensor, and back.
at::Tensor bytes_tensor(const std::string& bytes);
std::string tensor_bytes(const at::Tensor& t);

}  // namespace ember::engine
