#include "tensor_parallel_state.h"

#include <ember/error.h>
#include <ember/support/grad_util.h>
#include <ember/support/optimizer_state_tensors.h>
#include <ember/support/tensor_parallel.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>

#include <ember/distributed/device_mesh.h>

#include <sstream>

namespace ember_ddp {

TensorParallelState::TensorParallelState(ember_dist::MeshGroup& group, torch::nn::Module& module, std::vector<ember::TensorShard> shards)
    : group_(group), module_(module) {
  auto params = module.named_parameters();
  for (auto& s : shards) {
    const at::Tensor* p = params.find(s.name);
    if (!p) throw ember::RunError("the model's tensor-parallel plan names '" + s.name + "', which is not one of its parameters (a model bug)");
    if (s.dim == ember::kSummedGradient) {
      summed_.push_back(*p);
      continue;
    }
    by_tensor_.emplace(p->unsafeGetTensorImpl(), s);
    by_name_.emplace(s.name, std::move(s));
  }
}

const ember::TensorShard* TensorParallelState::shard_of(const at::Tensor& parameter) const {
  auto it = by_tensor_.find(parameter.unsafeGetTensorImpl());
  return it == by_tensor_.end() ? nullptr : &it->second;
}

at::Tensor TensorParallelState::whole(const at::Tensor& slice, const ember::TensorShard& shard) {
  at::Tensor gathered = group_.all_gather(slice.detach());
  return ember::whole_of(gathered.unbind(0), shard);
}

void TensorParallelState::sum_partial_gradients() {
  std::vector<at::Tensor> grads;
  for (const auto& p : summed_)
    if (p.grad().defined()) grads.push_back(p.grad());
  sum_over_group(group_, grads, "sequence-parallel gradients");
}

c10::Dict<std::string, at::Tensor> TensorParallelState::full_model_state(bool build) {
  c10::Dict<std::string, at::Tensor> out;
  at::NoGradGuard no_grad;
  for (const auto& p : module_.named_parameters()) {
    auto it = by_name_.find(p.key());
    at::Tensor value = it == by_name_.end() ? p.value().detach() : whole(p.value(), it->second);  // every rank gathers
    if (build) out.insert(p.key(), ember::detached_host_copy(value));
  }
  if (build)
    for (const auto& b : module_.named_buffers()) out.insert(b.key(), ember::detached_host_copy(b.value()));
  return out;
}

void TensorParallelState::load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) {
  at::NoGradGuard no_grad;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  auto check = [&](const std::string& name, const at::Tensor& target) {
    auto it = state.find(name);
    if (it == state.end())
      throw ember::RunError("lacks the model's tensor '" + name + "' (was it saved from another model?)");
    at::Tensor source = it->value();
    auto s = by_name_.find(name);
    if (s != by_name_.end()) {
      ember::check_splits(source, s->second, group_.size());
      source = ember::shard_of(source, s->second, group_.rank(), group_.size());
    }
    if (source.sizes() != target.sizes())
      throw ember::RunError("'" + name + "' has shape " + c10::str(it->value().sizes()) + " but the model's " +
                            (s != by_name_.end() ? "slice" : "tensor") + " is " + c10::str(target.sizes()) +
                            " (was it saved from a model with other settings?)");
    copies.emplace_back(target, source);
  };
  for (const auto& p : module_.named_parameters()) check(p.key(), p.value());
  for (const auto& b : module_.named_buffers()) check(b.key(), b.value());
  for (auto& [target, source] : copies) target.detach().copy_(source);
}

std::string TensorParallelState::full_optimizer_state(torch::optim::Optimizer& optimizer, bool build) {
  // The per-element state of a slice is gathered into the whole tensor for the save, then put back.
  std::vector<std::pair<at::Tensor*, at::Tensor>> saved;
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      const auto* shard = shard_of(t);
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (!shard || it == optimizer.state().end()) continue;
      ember::for_each_state_tensor(*it->second, [&](const char*, at::Tensor& field) {
        at::Tensor w = whole(field, *shard);
        saved.emplace_back(&field, field);
        field = w;
      });
    }
  std::string bytes;
  if (build) {
    std::ostringstream out;
    torch::save(optimizer, out);
    bytes = out.str();
  }
  for (auto& [field, slice] : saved) *field = slice;
  return bytes;
}

void TensorParallelState::load_full_optimizer_state(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in(bytes);
  optimizer.state().clear();
  std::optional<c10::Device> device;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (!device && p.defined()) device = p.device();
  torch::load(optimizer, in, device);
  at::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      const auto* shard = shard_of(t);
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (!shard || it == optimizer.state().end()) continue;
      ember::for_each_state_tensor(*it->second, [&](const char* name, at::Tensor& field) {
        ember::check_splits(field, *shard, group_.size());
        at::Tensor mine = ember::shard_of(field, *shard, group_.rank(), group_.size());
        if (mine.sizes() != t.sizes())
          throw ember::RunError("optimizer state '" + std::string(name) + "' of '" + shard->name + "' has shape " + c10::str(field.sizes()) +
                                ", which does not fit the parameter (saved from another model?)");
        field = mine.clone();
      });
    }
}

at::Tensor TensorParallelState::whole_state(const at::Tensor& param, const at::Tensor& field) {
  const auto* shard = shard_of(param);
  return shard ? whole(field, *shard) : field;
}

at::Tensor TensorParallelState::part_of_state(const at::Tensor& param, const at::Tensor& field) {
  const auto* shard = shard_of(param);
  if (!shard) return field;
  ember::check_splits(field, *shard, group_.size());
  at::Tensor mine = ember::shard_of(field, *shard, group_.rank(), group_.size());
  if (mine.sizes() != param.sizes())
    throw ember::RunError("optimizer state of '" + shard->name + "' has shape " + c10::str(field.sizes()) +
                          ", which does not fit the parameter (saved from another model?)");
  return mine.clone();
}

at::Tensor TensorParallelState::clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm,
                                               const std::function<at::Tensor(const at::Tensor&)>& across,
                                               const std::function<bool(const at::Tensor&)>& counted) {
  const auto grads = ember::grads_of(optimizer);
  if (algorithm == ember::ClipAlgorithm::value) return ember::clip_gradients_in_place(grads, max, algorithm);
  std::vector<at::Tensor> sliced, replicated;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params())
      if (p.grad().defined() && (!counted || counted(p))) (shard_of(p) ? sliced : replicated).push_back(p.grad());
  auto squared = [](const std::vector<at::Tensor>& g) {
    return g.empty() ? at::zeros({}, at::kFloat) : at::stack(at::_foreach_norm(g, 2)).to(at::kFloat).pow(2).sum();
  };
  at::Tensor sliced_sq = squared(sliced).reshape({1}).contiguous();
  if (!sliced.empty()) sliced_sq = sliced_sq.to(sliced.front().device());
  group_.all_reduce(sliced_sq, ember::ReduceOp::sum, "gradient norm");
  at::Tensor replicated_sq = squared(replicated);
  if (!replicated.empty()) replicated_sq = replicated_sq.to(sliced_sq.device());
  at::Tensor total_sq = sliced_sq.reshape({}) + replicated_sq.to(sliced_sq.device());
  if (across) total_sq = across(total_sq).to(total_sq.device());
  at::Tensor total = total_sq.sqrt();
  auto coef = (max / (total + 1e-6)).clamp_max(1.0);
  for (const auto& g : grads) g.mul_(coef.to(g.device()).to(g.scalar_type()));
  return total;
}

}  // namespace ember_ddp
