// Reading and writing the learning rate, momentum and weight decay of an optimizer's param
// groups, whatever the concrete torch::optim optimizer. Shared (header-only) by the scheduler
// plugins, swa and lr_monitor; each .so compiles its own copy.
//
// Momentum is what Lightning and PyTorch cycle: SGDOptions/RMSpropOptions::momentum, and beta1 of
// AdamOptions/AdamWOptions::betas. Adagrad and LBFGS have none.
#pragma once
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace ember::support {

// The optimizer's class name as Lightning's LearningRateMonitor spells it ("SGD", "Adam", ...).
inline std::string optimizer_name(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return "SGD";
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return "AdamW";
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return "Adam";
  if (dynamic_cast<const torch::optim::RMSprop*>(&o)) return "RMSprop";
  if (dynamic_cast<const torch::optim::Adagrad*>(&o)) return "Adagrad";
  if (dynamic_cast<const torch::optim::LBFGS*>(&o)) return "LBFGS";
  return "Optimizer";
}

inline size_t num_groups(const torch::optim::Optimizer& o) { return o.param_groups().size(); }

inline double get_lr(const torch::optim::Optimizer& o, size_t g) { return o.param_groups().at(g).options().get_lr(); }
inline void set_lr(torch::optim::Optimizer& o, size_t g, double lr) { o.param_groups().at(g).options().set_lr(lr); }

inline std::vector<double> get_lrs(const torch::optim::Optimizer& o) {
  std::vector<double> out;
  for (size_t g = 0; g < num_groups(o); ++g) out.push_back(get_lr(o, g));
  return out;
}

// `rate` for group 0 and, for each other group, `rate` times the ratio its rate has to group 0's
// now: a rate a plugin is configured with (a scheduler's base_lr or max_lr, lr_find's sweep) is
// the first group's, and groups that train at another rate (optimizer.backbone at
// lr x backbone_lr_scale, a model's own groups) keep that ratio.
inline std::vector<double> rates_keeping_ratios(const torch::optim::Optimizer& o, double rate) {
  std::vector<double> out;
  const double first = num_groups(o) > 0 ? get_lr(o, 0) : 0.0;
  for (size_t g = 0; g < num_groups(o); ++g) out.push_back(first > 0 ? rate * (get_lr(o, g) / first) : rate);
  return out;
}

// Momentum of group g (beta1 for Adam/AdamW), or nullopt when the optimizer has none.
inline std::optional<double> get_momentum(const torch::optim::Optimizer& o, size_t g) {
  const auto& opts = o.param_groups().at(g).options();
  if (auto* s = dynamic_cast<const torch::optim::SGDOptions*>(&opts)) return s->momentum();
  if (auto* r = dynamic_cast<const torch::optim::RMSpropOptions*>(&opts)) return r->momentum();
  if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&opts)) return std::get<0>(a->betas());
  if (auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&opts)) return std::get<0>(w->betas());
  return std::nullopt;
}

// Returns false (and changes nothing) when the optimizer has no momentum.
inline bool set_momentum(torch::optim::Optimizer& o, size_t g, double m) {
  auto& opts = o.param_groups().at(g).options();
  if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&opts)) {
    s->momentum(m);
    return true;
  }
  if (auto* r = dynamic_cast<torch::optim::RMSpropOptions*>(&opts)) {
    r->momentum(m);
    return true;
  }
  if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&opts)) {
    a->betas(std::make_tuple(m, std::get<1>(a->betas())));
    return true;
  }
  if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&opts)) {
    w->betas(std::make_tuple(m, std::get<1>(w->betas())));
    return true;
  }
  return false;
}

inline std::optional<double> get_weight_decay(const torch::optim::Optimizer& o, size_t g) {
  const auto& opts = o.param_groups().at(g).options();
  if (auto* s = dynamic_cast<const torch::optim::SGDOptions*>(&opts)) return s->weight_decay();
  if (auto* r = dynamic_cast<const torch::optim::RMSpropOptions*>(&opts)) return r->weight_decay();
  if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&opts)) return a->weight_decay();
  if (auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&opts)) return w->weight_decay();
  if (auto* d = dynamic_cast<const torch::optim::AdagradOptions*>(&opts)) return d->weight_decay();
  return std::nullopt;
}

}  // namespace ember::support
