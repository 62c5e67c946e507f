// Reading what a run left behind in a checkpoint, for tests that compare weights.
#pragma once
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>

#include "checkpoint_io.h"

namespace ember::test {

// The model's parameters and buffers in checkpoint `ckpt`, by name.
inline std::map<std::string, at::Tensor> weights(const std::filesystem::path& ckpt) {
  auto ck = ember::engine::load_checkpoint_file(ckpt);
  std::map<std::string, at::Tensor> out;
  for (const auto& e : ck.at("state_dict").toGenericDict()) out[e.key().toStringRef()] = e.value().toTensor();
  return out;
}

}  // namespace ember::test
