// Reading what a run left behind in a checkpoint, for tests that compare weights.
#pragma once
#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "checkpoint_io.h"
#include "sharded_checkpoint.h"

namespace ember::test {

// The model's parameters and buffers in checkpoint `ckpt`, by name: a file's state_dict, or a
// sharded directory's parts joined here independently of the strategy's own loading code (each
// part holds rank k's elements [k * chunk, k * chunk + chunk) of every flattened parameter).
inline std::map<std::string, at::Tensor> weights(const std::filesystem::path& ckpt) {
  std::map<std::string, at::Tensor> out;
  if (ember::engine::is_sharded_checkpoint(ckpt)) {
    auto meta = ember::engine::read_sharded_meta(ckpt);
    const int64_t world = meta.at("sharded").toGenericDict().at("world_size").toInt();
    std::map<std::string, std::vector<at::Tensor>> pieces;
    std::map<std::string, std::vector<int64_t>> shapes;
    for (int64_t k = 0; k < world; ++k) {
      auto part = ember::engine::read_sharded_part(ckpt, k).toGenericDict();
      for (const auto& e : part.at("params").toGenericDict()) {
        auto entry = e.value().toGenericDict();
        pieces[e.key().toStringRef()].push_back(entry.at("data").toTensor());
        shapes[e.key().toStringRef()] = entry.at("shape").toIntVector();
      }
      if (k == 0)
        for (const auto& b : part.at("buffers").toGenericDict()) out[b.key().toStringRef()] = b.value().toTensor();
    }
    for (auto& [name, list] : pieces) {
      at::Tensor flat = at::cat(list);
      const auto& shape = shapes[name];
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      out[name] = flat.narrow(0, 0, numel).view(shape);
    }
    return out;
  }
  auto ck = ember::engine::load_checkpoint_file(ckpt);
  for (const auto& e : ck.at("state_dict").toGenericDict()) out[e.key().toStringRef()] = e.value().toTensor();
  return out;
}

}  // namespace ember::test
