#include "loop/rank_states.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstring>
#include <string_view>

#include "checkpoint/checkpoint_document.h"
#include "checkpoint/crc32c.h"

namespace ember::engine {

namespace {

// What tells two states apart without moving them: the size, a CRC32C and a 64-bit hash of their
// pickled bytes, as four numbers below 2^32 (so they and their negations fit an int64).
constexpr int64_t kDigest = 4;
void digest(const std::vector<char>& bytes, int64_t* out) {
  const uint64_t hash = std::hash<std::string_view>{}(std::string_view(bytes.data(), bytes.size()));
  out[0] = static_cast<int64_t>(bytes.size());
  out[1] = static_cast<int64_t>(crc32c(bytes.data(), bytes.size()));
  out[2] = static_cast<int64_t>(hash & 0xffffffffu);
  out[3] = static_cast<int64_t>(hash >> 32);
}

}  // namespace

RankStates gather_differing_states(const std::vector<std::pair<std::string, c10::IValue>>& states, bool trains_shards, StatesGo go,
                                   const RankCollectives& c) {
  RankStates out{checkpoint_dict(), checkpoint_dict()};
  if (c.world <= 1 || states.empty()) return out;
  const int64_t n = static_cast<int64_t>(states.size());
  std::vector<std::vector<char>> bytes;
  // Row 0: each state's digest; row 1: its negation. One MAX over the ranks gives the largest and
  // (negated) the smallest of each number: a state is the same everywhere when they agree.
  at::Tensor digests = at::empty({2, n * kDigest}, at::kLong);
  auto d = digests.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n; ++i) {
    bytes.push_back(states[static_cast<size_t>(i)].second.isNone() ? std::vector<char>{}
                                                                   : torch::jit::pickle_save(states[static_cast<size_t>(i)].second));
    int64_t g[kDigest];
    digest(bytes.back(), g);
    for (int64_t j = 0; j < kDigest; ++j) {
      d[0][i * kDigest + j] = g[j];
      d[1][i * kDigest + j] = -g[j];
    }
  }
  const at::Tensor extremes = c.reduce(digests.to(c.device), ReduceOp::max).to(at::kCPU);
  auto e = extremes.accessor<int64_t, 2>();
  auto per_rank = checkpoint_dict();
  c10::List<std::string> with_tensors, in_parts;
  bool any = false;  // known alike on every rank: the extremes are the same everywhere
  for (int64_t i = 0; i < n; ++i) {
    const auto& [name, state] = states[static_cast<size_t>(i)];
    bool differs = false;
    for (int64_t j = 0; j < kDigest; ++j) differs = differs || e[0][i * kDigest + j] != -e[1][i * kDigest + j];
    if (!differs) continue;
    any = true;
    bool tensors = false;
    state.visit([&](const c10::IValue& v) {
      tensors = tensors || v.isTensor();
      return tensors;
    });
    if (tensors) with_tensors.push_back(name);
    if (go == StatesGo::into_own_part) {  // each rank writes its own; nothing travels
      in_parts.push_back(name);
      out.own.insert(name, state);
      continue;
    }
    // Every rank's bytes reach rank 0, one broadcast per rank: its length (8 bytes), then the bytes,
    // in a buffer of the largest length.
    const int64_t longest = e[0][i * kDigest];
    at::Tensor buffer = at::zeros({8 + longest}, at::kByte);
    const int64_t own = static_cast<int64_t>(bytes[static_cast<size_t>(i)].size());
    std::memcpy(buffer.data_ptr(), &own, 8);
    if (own > 0) std::memcpy(static_cast<char*>(buffer.data_ptr()) + 8, bytes[static_cast<size_t>(i)].data(), static_cast<size_t>(own));
    c10::impl::GenericList list(c10::AnyType::get());
    for (int64_t src = 0; src < c.world; ++src) {
      at::Tensor got = src == 0 ? buffer : c.broadcast(src == c.rank ? buffer.to(c.device) : at::zeros({8 + longest}, at::kByte).to(c.device), src)
                                               .to(at::kCPU);
      if (c.rank != 0) continue;
      int64_t size = 0;
      std::memcpy(&size, got.data_ptr(), 8);
      const char* data = static_cast<const char*>(got.data_ptr()) + 8;
      list.push_back(size == 0 ? c10::IValue() : torch::jit::pickle_load(std::vector<char>(data, data + size)));
    }
    if (c.rank == 0) per_rank.insert(name, list);
  }
  // When a state differs, every rank's layout goes into the record (one all-reduce; each rank fills
  // its own slot, the others 0; a MAX, which spans every rank where a SUM under a mesh spans the
  // data-parallel ones).
  if (!any) return out;
  at::Tensor layouts = at::zeros({c.world}, at::kLong);
  layouts[c.rank] = c.layout;
  layouts = c.reduce(layouts.to(c.device), ReduceOp::max).to(at::kCPU);
  if (c.rank != 0) return out;
  out.record.insert("world_size", c.world);
  out.record.insert("trains_shards", trains_shards);
  out.record.insert("with_tensors", with_tensors);
  out.record.insert("layouts", c10::List<int64_t>(std::vector<int64_t>(layouts.data_ptr<int64_t>(), layouts.data_ptr<int64_t>() + c.world)));
  if (go == StatesGo::into_own_part)
    out.record.insert("in_parts", in_parts);
  else
    out.record.insert("states", per_rank);
  return out;
}

bool states_in_parts(const c10::impl::GenericDict& by_rank) { return by_rank.contains("in_parts"); }

bool shards_cut_otherwise(const c10::impl::GenericDict& by_rank, int64_t rank, int64_t world, int64_t layout,
                          const std::function<bool(bool)>& any_rank) {
  if (!by_rank.contains("layouts") || !by_rank.contains("world_size") || by_rank.at("world_size").toInt() != world) return false;
  const auto layouts = by_rank.at("layouts").toIntVector();
  const bool mine = rank >= static_cast<int64_t>(layouts.size()) || layouts[static_cast<size_t>(rank)] != layout;
  return any_rank(mine);
}

c10::IValue state_for_rank(const std::string& name, const c10::IValue& shared, const c10::impl::GenericDict& by_rank,
                           const c10::IValue& own_part, int64_t rank, int64_t world, bool other_cut, const std::string& where) {
  auto listed = [](const c10::impl::GenericDict& d, const char* key, const std::string& n) {
    if (!d.contains(key)) return false;
    const auto list = d.at(key).toList();
    for (size_t j = 0; j < list.size(); ++j)
      if (list.get(j).toStringRef() == n) return true;
    return false;
  };
  const bool in_parts = listed(by_rank, "in_parts", name);
  if (!in_parts && !(by_rank.contains("states") && by_rank.at("states").toGenericDict().contains(name))) return shared;
  const int64_t saved = by_rank.at("world_size").toInt();
  if (saved != world || other_cut) {
    // Tensors in a state that differs per rank under a sharding strategy are that rank's shards
    // (weight averaging, pruning masks): they fit no other cut. A clock or a loss window is not
    // shaped by the ranks: every rank takes rank 0's, as before.
    const bool shards = by_rank.contains("trains_shards") && by_rank.at("trains_shards").toBool();
    if (!(shards && listed(by_rank, "with_tensors", name))) return shared;
    if (saved == world)
      throw RunError(where + ": callback '" + name + "' saved a state of its own on each of the " + std::to_string(saved) +
                     " ranks that wrote it (its part of the strategy's shards), cut for another mesh than this run's (its "
                     "tensor-parallel degree or pipeline stages): resume with the [parallelism] that wrote it, or without '" + name + "'");
    throw RunError(where + ": callback '" + name + "' saved a state of its own on each of the " + std::to_string(saved) +
                   " ranks that wrote it (its part of the strategy's shards), and this run has " + std::to_string(world) +
                   ": resume with " + std::to_string(saved) + " ranks, or without '" + name + "'");
  }
  if (in_parts) {
    if (!own_part.isGenericDict() || !own_part.toGenericDict().contains(name))
      throw RunError(where + ": rank " + std::to_string(rank) + "'s part holds no state of callback '" + name +
                     "' though meta.ckpt says each part does (parts of another save mixed in?): resume from a whole directory");
    return own_part.toGenericDict().at(name);
  }
  const auto list = by_rank.at("states").toGenericDict().at(name).toList();
  if (static_cast<int64_t>(list.size()) != saved) throw RunError(where + ": callback '" + name + "': the states per rank are incomplete");
  return list.get(static_cast<size_t>(rank));
}

}  // namespace ember::engine
