// Reading what a run left behind in a checkpoint, for tests that compare weights.
#pragma once
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <limits>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/sharded_checkpoint.h"
#include "support.h"

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
      if (!part.contains("params")) continue;  // a later replica's part under hybrid sharding: no tensors
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

// last.ckpt of a run started from <dir>/run.toml (the run is named after the file).
inline std::filesystem::path last_checkpoint(const TempDir& dir, int version = 0) {
  return dir / ("runs/run/version_" + std::to_string(version) + "/checkpoints/last.ckpt");
}

// The largest element difference between the weights of two checkpoints, with the name of the
// tensor where it is (printed when a comparison fails); compares as a number:
// EXPECT_LE(max_weight_difference(a, b), 1e-5). Both must hold the same, non-empty set of
// tensors with the same shapes (a test failure otherwise).
struct WeightDifference {
  double value = 0;
  std::string name;
  operator double() const { return value; }  // NOLINT: compared directly in EXPECT_LE
};
inline std::ostream& operator<<(std::ostream& os, const WeightDifference& d) {
  return os << d.value << " ('" << d.name << "')";
}

inline WeightDifference max_weight_difference(const std::filesystem::path& a, const std::filesystem::path& b) {
  for (const auto& p : {a, b})
    if (!std::filesystem::exists(p)) {
      ADD_FAILURE() << "no checkpoint at " << p;
      return {std::numeric_limits<double>::infinity(), "(missing checkpoint)"};
    }
  auto wa = weights(a), wb = weights(b);
  EXPECT_EQ(wa.size(), wb.size());
  EXPECT_FALSE(wa.empty());
  WeightDifference worst;
  for (const auto& [name, t] : wa) {
    if (!wb.count(name)) {
      ADD_FAILURE() << name << " is in " << a << " but not in " << b;
      continue;
    }
    if (t.sizes() != wb.at(name).sizes()) {
      ADD_FAILURE() << name << ": shape " << t.sizes() << " vs " << wb.at(name).sizes();
      continue;
    }
    const double d = (t.to(at::kDouble) - wb.at(name).to(at::kDouble)).abs().max().item<double>();
    if (d > worst.value) worst = {d, name};
  }
  return worst;
}

// Every tensor of two checkpoints bit for bit equal (the exact-resume tests).
inline void expect_identical_weights(const std::filesystem::path& a, const std::filesystem::path& b) {
  auto wa = weights(a), wb = weights(b);
  ASSERT_EQ(wa.size(), wb.size()) << a << " vs " << b;
  for (const auto& [name, t] : wa) EXPECT_TRUE(at::equal(t, wb.at(name))) << name << " differs: " << a << " vs " << b;
}

}  // namespace ember::test
