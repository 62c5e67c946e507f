#include "shard_table.h"

#include <ember/error.h>

#include <algorithm>

namespace ember_shard {

// Groups: one per unit the model declares (when it has at least auto_wrap_min_params), and the
// remaining parameters in runs of consecutive ones of about bucket_cap_mb.
void ShardTable::build(torch::nn::Module& module, ember::IModel& model, const ZeroOptions& o, const std::vector<ember::UnitRange>* held) {
  std::unordered_map<const void*, size_t> index_of;
  for (const auto& item : module.named_parameters()) {
    ShardedParam p;
    p.name = item.key();
    p.param = item.value();
    p.shape = p.param.sizes().vec();
    p.numel = p.param.numel();
    p.trainable = p.param.requires_grad();
    if (!p.param.is_contiguous())
      throw ember::RunError(o.name + ": parameter '" + p.name + "' is not contiguous; make it contiguous in the model");
    index_of[p.param.unsafeGetTensorImpl()] = params.size();
    params.push_back(std::move(p));
  }
  if (params.empty()) throw ember::RunError(o.name + ": the model has no parameters");
  std::vector<bool> placed(params.size(), false);
  units = static_cast<ember::IUnitModel*>(model.query_interface(ember::kUnitModelIid));
  const int64_t n_units = units ? units->num_units() : 0;
  unit_group.assign(static_cast<size_t>(n_units), kNone);
  auto is_held = [held](int64_t u) {
    if (!held) return true;
    for (const auto& r : *held)
      if (u >= r.begin && u < r.end) return true;
    return false;
  };
  for (int64_t u = 0; u < n_units; ++u) {
    if (!is_held(u)) continue;  // another pipeline stage's
    std::vector<size_t> members;
    int64_t count = 0;
    for (const auto& t : units->unit_module(u).parameters()) {
      auto it = index_of.find(t.unsafeGetTensorImpl());
      if (it == index_of.end())
        throw ember::RunError(o.name + ": unit '" + units->unit_name(u) + "' has a parameter that is not in the model's module()");
      if (placed[it->second]) continue;  // shared with an earlier unit: it stays there
      members.push_back(it->second);
      count += params[it->second].numel;
    }
    if (members.empty() || count < o.min_unit_params) continue;
    ShardGroup grp;
    grp.name = "unit '" + units->unit_name(u) + "'";
    grp.unit = u;
    std::sort(members.begin(), members.end());
    for (size_t k : members) placed[k] = true;
    grp.params = std::move(members);
    unit_group[static_cast<size_t>(u)] = groups.size();
    groups.push_back(std::move(grp));
  }
  // The rest: consecutive runs, cut at bucket_cap_mb and at dtype changes.
  ShardGroup current;
  int64_t bytes = 0;
  auto close = [&] {
    if (current.params.empty()) return;
    current.name = "parameters from '" + params[current.params.front()].name + "'";
    groups.push_back(std::move(current));
    current = ShardGroup{};
    bytes = 0;
  };
  size_t last = kNone;
  for (size_t k = 0; k < params.size(); ++k) {
    if (placed[k]) continue;
    const auto& p = params[k];
    if (!current.params.empty() &&
        (last + 1 != k || params[current.params.front()].param.scalar_type() != p.param.scalar_type() || bytes >= o.bucket_cap_bytes))
      close();
    current.params.push_back(k);
    bytes += p.numel * static_cast<int64_t>(p.param.element_size());
    last = k;
  }
  close();
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& grp = groups[g];
    const auto dtype = params[grp.params.front()].param.scalar_type();
    for (size_t k : grp.params) {
      if (params[k].param.scalar_type() != dtype)
        throw ember::RunError(o.name + ": " + grp.name + " mixes parameter dtypes; a unit must hold one dtype");
      params[k].group = g;
      grp.max_index = std::max(grp.max_index, k);
    }
    order.push_back(g);
  }
  // Backward produces gradients roughly from the last parameter to the first.
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return groups[a].max_index > groups[b].max_index; });
}

void ShardTable::lay_out(int64_t rank, int64_t world) {
  for (auto& p : params) {
    p.chunk = (p.numel + world - 1) / world;
    p.valid = std::clamp<int64_t>(p.numel - rank * p.chunk, 0, p.chunk);
  }
  for (auto& grp : groups) {
    grp.row = 0;
    for (size_t k : grp.params) {
      params[k].offset = grp.row;
      grp.row += params[k].chunk;
    }
  }
}

void ShardTable::index_shards() {
  param_of_shard.clear();
  for (size_t k = 0; k < params.size(); ++k) param_of_shard[params[k].shard.unsafeGetTensorImpl()] = k;
}

size_t ShardTable::group_of_unit(int64_t unit) const {
  if (unit < 0 || unit >= static_cast<int64_t>(unit_group.size())) return kNone;
  return unit_group[static_cast<size_t>(unit)];
}

bool ShardTable::has_frozen(size_t g) const {
  for (size_t k : groups.at(g).params)
    if (!params[k].trainable) return true;
  return false;
}

at::Tensor ShardTable::my_part(const ShardedParam& p, const at::Tensor& whole, int64_t rank) {
  return whole.reshape({-1}).narrow(0, std::min(rank * p.chunk, p.numel), p.valid);
}

}  // namespace ember_shard
