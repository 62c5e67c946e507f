#include "ember/distributed/deferred_parts.h"

#include <ember/error.h>
#include <ember/model.h>
#include <ember/support/tensor_parallel.h>
#include <ember/types.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>


namespace ember_dist {

void DeferredParts::begin(c10::ScalarType dtype, int64_t rank, int64_t world, bool in_place) {
  in_place_ = in_place && world == 1;
  dtype_ = dtype;
  rank_ = rank;
  world_ = world;
  active_ = true;
}

void DeferredParts::end_shapes_pass(ember::IModel& shapes, const std::vector<ember::TensorShard>& slices, int64_t slice_rank,
                                    int64_t slice_size) {
  std::unordered_map<const void*, std::string> held;
  for (const auto& p : shapes.module().named_parameters()) held.emplace(p.value().unsafeGetTensorImpl(), p.key());
  std::unordered_map<std::string, const ember::TensorShard*> by_name;
  for (const auto& s : slices)
    if (s.dim != ember::kSummedGradient) by_name.emplace(s.name, &s);
  keep_.clear();
  slices_.clear();
  for (size_t i = 0; i < arrivals_.size(); ++i) {
    auto it = held.find(arrivals_[i]);
    keep_.push_back(it != held.end());
    if (it == held.end()) continue;
    auto s = by_name.find(it->second);
    if (s != by_name.end()) slices_.emplace(static_cast<int64_t>(i), *s->second);
  }
  slice_rank_ = slice_rank;
  slice_size_ = slice_size;
  shapes_pass_ = false;
  arrived_ = 0;
  seen_.clear();
}

void DeferredParts::take(torch::nn::Module& module) {
  if (!active_) return;
  at::NoGradGuard no_grad;
  for (auto& t : module.parameters()) {
    const void* impl = t.unsafeGetTensorImpl();
    if (seen_.count(impl) || !at::isFloatingType(t.scalar_type()) || !t.is_contiguous() || t.numel() == 0) continue;
    seen_.insert(impl);
    const int64_t index = arrived_++;
    if (shapes_pass_) {
      arrivals_.push_back(impl);
    } else {
      const at::Tensor whole = t.detach().to(dtype_);
      // Every rank must have built the same values: a fingerprint of each, compared at set-up
      // (another stage's too: every rank builds every piece).
      fingerprints_.push_back(whole.sum(at::kDouble).item<double>());
      whole_elements_ += t.numel();
      if (keep_.empty() || (index < static_cast<int64_t>(keep_.size()) && keep_[static_cast<size_t>(index)])) {
        // A tensor-parallel plan's split parameter: this rank's slice, then its chunk of that.
        auto slice = slices_.find(index);
        const at::Tensor mine =
            slice == slices_.end() ? whole : ember::shard_of(whole, slice->second, slice_rank_, slice_size_).contiguous();
        const int64_t numel = mine.numel(), chunk = (numel + world_ - 1) / world_;
        const int64_t valid = std::clamp<int64_t>(numel - rank_ * chunk, 0, chunk);
        kept_elements_ += valid;
        if (in_place_ && slice == slices_.end()) {
          // Kept whole: the parameter keeps its storage (in `dtype_`), and no second copy is made
          // while the piece is alive; hand_over copies it out. (A slice is kept apart, as below:
          // the parameter takes the slice's shape only when the plan runs at set-up.)
          if (!whole.is_same(t)) t.set_data(whole);
          parts_.emplace(impl, at::Tensor());
          continue;
        }
        parts_.emplace(impl, mine.reshape({-1}).narrow(0, std::min(rank_ * chunk, numel), valid).clone());
      }
    }
    // The parameter keeps its shape, dtype and identity; its storage goes until set-up (or for
    // good: the shapes build, another stage's piece).
    t.set_data(at::empty(t.sizes(), t.options().dtype(dtype_)));
    free_storage(t);
  }
}

at::Tensor DeferredParts::hand_over(const at::Tensor& param, const std::string& name) {
  auto it = parts_.find(param.unsafeGetTensorImpl());
  if (it == parts_.end()) throw ember::RunError("deferred initialisation: no part was taken of parameter '" + name + "' (a strategy bug)");
  if (!it->second.defined()) return param.detach().reshape({-1}).clone();  // kept whole, in place
  at::Tensor part = std::move(it->second);
  it->second = at::Tensor();  // still held: holds(p) stays true for the rest of the set-up
  return part;
}

std::string DeferredParts::check(const std::vector<at::Tensor>& params, Communicator& comm, const std::string& name) {
  if (!keep_.empty() && arrived_ != static_cast<int64_t>(keep_.size()))
    throw ember::RunError(name + ": deferred initialisation: the model handed over " + std::to_string(arrived_) +
                          " parameters in its second build and " + std::to_string(keep_.size()) +
                          " in the first (its shapes); a model's build must depend on its configuration and the seed only. Set " + name +
                          ".deferred_init = false to build it whole");
  int64_t taken = 0;
  for (const auto& p : params) taken += holds(p) ? 1 : 0;
  if (taken == 0) {
    active_ = false;
    return name + ": deferred initialisation: the model was built whole (it does not call ember::parameters_initialised; "
                  "ember/deferred_init.h)";
  }
  if (comm.world() > 1) {
    // The fingerprints' minimum and maximum over the ranks (as min = -max(-x)): equal, or the
    // model's initial values depend on something other than the seed.
    const auto n = static_cast<int64_t>(fingerprints_.size());
    at::Tensor both = at::empty({2 * n}, at::kDouble);
    for (int64_t i = 0; i < n; ++i) {
      both[i] = fingerprints_[static_cast<size_t>(i)];
      both[n + i] = -fingerprints_[static_cast<size_t>(i)];
    }
    const at::Tensor reduced = comm.reduce(both, ember::ReduceOp::max).cpu();
    for (int64_t i = 0; i < n; ++i)
      if (reduced[i].item<double>() != -reduced[n + i].item<double>())
        throw ember::RunError(name + ": deferred initialisation: the ranks built different initial values (parameter " + std::to_string(i) +
                              " taken while the model was built); the model's initialisation must depend on the seed only. Set " + name +
                              ".deferred_init = false to build it whole and take rank 0's values");
  }
  return name + ": deferred initialisation: " + std::to_string(taken) + " of " + std::to_string(params.size()) +
         " parameters taken as the model was built; this rank kept " + std::to_string(kept_elements_) + " of their " +
         std::to_string(whole_elements_) + " elements";
}

}  // namespace ember_dist
