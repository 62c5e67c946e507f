// (<ember/support/...>: shared by the sharding and tensor-parallel strategies.) The per-element tensors of a LibTorch optimizer's per-parameter state (Adam's exp_avg, SGD's
// momentum_buffer, ...), so a sharding strategy can gather them into whole tensors for a full
// checkpoint and cut whole ones back into shards. LibTorch's state classes expose their fields
// only by type, so the optimizers Ember builds are listed here; another one is refused with a
// clear line rather than saved wrong.
#pragma once
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <typeinfo>

namespace ember {

// Calls fn(field name, field) for every tensor field of `state` in a fixed order (the same on
// every rank), skipping undefined ones (max_exp_avg_sq without amsgrad, a momentum buffer not yet
// made). fn may assign the field.
inline void for_each_state_tensor(torch::optim::OptimizerParamState& state,
                                  const std::function<void(const char*, at::Tensor&)>& fn) {
  auto visit = [&](const char* name, at::Tensor& t) {
    if (t.defined()) fn(name, t);
  };
  if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    visit("exp_avg", s->exp_avg());
    visit("exp_avg_sq", s->exp_avg_sq());
    visit("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    visit("exp_avg", w->exp_avg());
    visit("exp_avg_sq", w->exp_avg_sq());
    visit("max_exp_avg_sq", w->max_exp_avg_sq());
  } else if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    visit("momentum_buffer", g->momentum_buffer());
  } else if (auto* r = dynamic_cast<torch::optim::RMSpropParamState*>(&state)) {
    visit("square_avg", r->square_avg());
    visit("momentum_buffer", r->momentum_buffer());
    visit("grad_avg", r->grad_avg());
  } else if (auto* a = dynamic_cast<torch::optim::AdagradParamState*>(&state)) {
    visit("sum", a->sum());
  } else {
    throw std::runtime_error(std::string("cannot shard or offload the state of this optimizer (state type ") + typeid(state).name() +
                             "); use sgd, adam, adamw, rmsprop or adagrad");
  }
}

// Tensors of the parameter's size the optimizer keeps per parameter of `group` once it stepped
// (for the host-memory check before the first step, which creates them); 0 for an optimizer not
// listed above (its state is refused later, by for_each_state_tensor).
inline int64_t state_tensors_per_element(const torch::optim::OptimizerParamGroup& group) {
  const auto& o = group.options();
  if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) return a->amsgrad() ? 3 : 2;
  if (auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) return w->amsgrad() ? 3 : 2;
  if (auto* g = dynamic_cast<const torch::optim::SGDOptions*>(&o)) return g->momentum() != 0 ? 1 : 0;
  if (auto* r = dynamic_cast<const torch::optim::RMSpropOptions*>(&o)) return 1 + (r->momentum() != 0 ? 1 : 0) + (r->centered() ? 1 : 0);
  if (dynamic_cast<const torch::optim::AdagradOptions*>(&o)) return 1;
  return 0;
}

}  // namespace ember
