#include "pruning_methods.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <stdexcept>

namespace ember::pruning {

Method method_named(const std::string& name) {
  if (name == "l1_unstructured") return Method::l1_unstructured;
  if (name == "random_unstructured") return Method::random_unstructured;
  if (name == "ln_structured") return Method::ln_structured;
  if (name == "random_structured") return Method::random_structured;
  throw std::invalid_argument("unknown pruning method '" + name + "'");
}

bool is_structured(Method m) { return m == Method::ln_structured || m == Method::random_structured; }

int64_t Amount::of(int64_t available) const {
  if (is_count) {
    if (count > available)
      throw std::invalid_argument("amount = " + std::to_string(count) + " is more than the " + std::to_string(available) +
                                  " not pruned yet");
    return count;
  }
  // Python's round(): to the nearest, ties to even (the default rounding mode).
  std::fesetround(FE_TONEAREST);
  return static_cast<int64_t>(std::nearbyint(fraction * static_cast<double>(available)));
}

namespace {

// Uniform draws in [0, 1) from the plugin's CPU generator, in `dtype` (PyTorch draws in the
// tensor's dtype for unstructured methods, in float32 for structured ones).
at::Tensor draws(int64_t n, at::ScalarType dtype, at::Generator& gen) {
  return at::rand({n}, gen, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

// PyTorch's PruningContainer for unstructured methods, on flat views: the method sees only the
// entries not pruned yet (in their order), and what it picks among them is pruned.
void prune_flat(Method method, const at::Tensor& flat_values, at::Tensor& flat_mask, const Amount& amount, at::Generator& gen) {
  const at::Tensor kept = flat_mask.nonzero().squeeze(1);
  const int64_t k = amount.of(kept.numel());
  if (k == 0) return;
  at::Tensor picked;
  if (method == Method::l1_unstructured) {
    picked = std::get<1>(at::topk(flat_values.index_select(0, kept).abs(), k, -1, /*largest=*/false, /*sorted=*/true));
  } else {
    const at::Tensor prob = draws(kept.numel(), flat_values.scalar_type(), gen);
    picked = std::get<1>(at::topk(prob, k)).to(kept.device());
  }
  flat_mask.index_fill_(0, kept.index_select(0, picked), false);
}

}  // namespace

void prune_unstructured(Method method, const at::Tensor& values, at::Tensor& mask, const Amount& amount, at::Generator& gen) {
  at::NoGradGuard no_grad;
  at::Tensor flat_mask = mask.view(-1);
  prune_flat(method, values.detach().reshape(-1), flat_mask, amount, gen);
}

void prune_global_unstructured(Method method, const std::vector<at::Tensor>& values, std::vector<at::Tensor>& masks,
                               const Amount& amount, at::Generator& gen) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> flat_values, flat_masks;
  for (size_t i = 0; i < values.size(); ++i) {
    // One device for the concatenation: the first tensor's.
    flat_values.push_back(values[i].detach().reshape(-1).to(values.front().device()));
    flat_masks.push_back(masks[i].reshape(-1).to(values.front().device()));
  }
  const at::Tensor all_values = at::cat(flat_values);
  at::Tensor all_masks = at::cat(flat_masks);
  prune_flat(method, all_values, all_masks, amount, gen);
  int64_t offset = 0;
  for (auto& m : masks) {
    m.view(-1).copy_(all_masks.narrow(0, offset, m.numel()));
    offset += m.numel();
  }
}

void prune_sharded_unstructured(Method method, const std::vector<at::Tensor>& values, std::vector<at::Tensor>& masks, const Amount& amount,
                                bool global, at::Generator& gen, const ShardedRanks& ranks) {
  at::NoGradGuard no_grad;
  const size_t n = values.size();
  if (n == 0) return;
  // Scores as float32 bit patterns, which order non-negative floats as integers; a NaN counts as
  // inf; entries pruned before are out of the ranking (kOut is above every score).
  constexpr int64_t kTop = 0x7f800000;  // +inf
  constexpr int64_t kOut = 0x7fffffff;
  std::vector<at::Tensor> bits(n);
  std::vector<size_t> group_of(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor flat = values[i].detach().reshape(-1);
    const at::Tensor score = method == Method::l1_unstructured
                                 ? flat.abs().to(at::kFloat).contiguous()
                                 : draws(flat.numel(), at::kFloat, gen).to(flat.device());
    bits[i] = score.view(at::kInt).to(at::kLong).clamp_max(kTop).masked_fill(masks[i].reshape(-1).logical_not(), kOut);
    group_of[i] = global ? 0 : i;
  }
  const size_t groups = global ? 1 : n;
  const c10::Device device = values.front().device();
  // One count per tensor from every rank, summed: a vector of n numbers on the host.
  auto summed = [&](const std::function<at::Tensor(size_t)>& count) {
    std::vector<at::Tensor> c;
    for (size_t i = 0; i < n; ++i) c.push_back(count(i).to(device));
    const at::Tensor total = ranks.sum(at::stack(c)).to(at::kCPU);
    std::vector<int64_t> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = total[static_cast<int64_t>(i)].item<int64_t>();
    return out;
  };
  auto per_group = [&](const std::vector<int64_t>& per_tensor) {
    std::vector<int64_t> out(groups, 0);
    for (size_t i = 0; i < n; ++i) out[group_of[i]] += per_tensor[i];
    return out;
  };
  const auto available = per_group(summed([&](size_t i) { return bits[i].ne(kOut).sum(); }));
  std::vector<int64_t> k(groups), lo(groups, -1), hi(groups, kTop);
  for (size_t g = 0; g < groups; ++g) k[g] = amount.of(available[g]);
  // Bisection: the smallest t with at least k scores <= t (count(hi) >= k > count(lo) throughout).
  for (;;) {
    bool open = false;
    std::vector<int64_t> mid(groups);
    for (size_t g = 0; g < groups; ++g) {
      mid[g] = lo[g] + (hi[g] - lo[g]) / 2;
      open = open || (k[g] > 0 && hi[g] - lo[g] > 1);
    }
    if (!open) break;
    const auto at_most = per_group(summed([&](size_t i) { return bits[i].le(mid[group_of[i]]).sum(); }));
    for (size_t g = 0; g < groups; ++g) {
      if (k[g] == 0 || hi[g] - lo[g] <= 1) continue;
      (at_most[g] >= k[g] ? hi[g] : lo[g]) = mid[g];
    }
  }
  // Everything below t is pruned; of the scores equal to t, as many as k still needs, first by
  // tensor, then by rank, then by index. Each rank's ties per tensor, summed in its own column.
  const auto below = summed([&](size_t i) { return bits[i].lt(hi[group_of[i]]).sum(); });
  at::Tensor ties_here = at::zeros({static_cast<int64_t>(n), ranks.world}, at::kLong);
  for (size_t i = 0; i < n; ++i) ties_here[static_cast<int64_t>(i)][ranks.rank] = bits[i].eq(hi[group_of[i]]).sum().to(at::kCPU);
  const at::Tensor ties = ranks.sum(ties_here.to(device)).to(at::kCPU);
  std::vector<int64_t> needed(groups);
  const auto below_per_group = per_group(below);
  for (size_t g = 0; g < groups; ++g) needed[g] = k[g] - below_per_group[g];
  for (size_t i = 0; i < n; ++i) {
    const size_t g = group_of[i];
    if (k[g] == 0) continue;
    const int64_t ti = static_cast<int64_t>(i);
    const int64_t take = std::min(needed[g], ties[ti].sum().item<int64_t>());
    needed[g] -= take;
    const int64_t before = ties[ti].narrow(0, 0, ranks.rank).sum().item<int64_t>();
    const int64_t mine = std::clamp(take - before, int64_t{0}, ties[ti][ranks.rank].item<int64_t>());
    at::Tensor flat_mask = masks[i].view(-1);
    flat_mask.masked_fill_(bits[i].lt(hi[g]), false);
    if (mine > 0) flat_mask.index_fill_(0, bits[i].eq(hi[g]).nonzero().squeeze(1).narrow(0, 0, mine), false);
  }
}

void prune_structured(Method method, const at::Tensor& values, at::Tensor& mask, const Amount& amount, int64_t dim, double norm,
                      at::Generator& gen) {
  at::NoGradGuard no_grad;
  const int64_t ndim = values.dim();
  if (ndim < 2)
    throw std::invalid_argument("structured pruning needs tensors of at least two dimensions (this one has " + std::to_string(ndim) + ")");
  if (dim < -ndim || dim >= ndim)
    throw std::invalid_argument("pruning_dim = " + std::to_string(dim) + " is outside a tensor of " + std::to_string(ndim) + " dimensions");
  if (dim < 0) dim += ndim;
  std::vector<int64_t> others;
  for (int64_t d = 0; d < ndim; ++d)
    if (d != dim) others.push_back(d);
  // Channels that keep any entry are the ones the method chooses among (PruningContainer).
  const at::Tensor channels = mask.sum(others).ne(0).nonzero().squeeze(1);
  const int64_t available = channels.numel();
  const int64_t k = amount.of(available);
  if (k == 0) return;
  at::Tensor keep;  // bool over `channels`
  if (method == Method::ln_structured) {
    const at::Tensor sub = values.detach().index_select(dim, channels);
    const at::Tensor norms = at::linalg_vector_norm(sub, norm, others, /*keepdim=*/false, std::nullopt);
    const at::Tensor top = std::get<1>(at::topk(norms, available - k, -1, /*largest=*/true, /*sorted=*/true));
    keep = at::zeros({available}, mask.options()).index_fill_(0, top, true);
  } else {
    const at::Tensor prob = draws(available, at::kFloat, gen);
    const at::Tensor threshold = std::get<0>(at::kthvalue(prob, k));
    keep = prob.gt(threshold).to(mask.device());
  }
  const at::Tensor pruned = channels.masked_select(keep.logical_not());
  mask.index_fill_(dim, pruned, false);
}

}  // namespace ember::pruning
