// Fused optimizers: torch::optim::Adam, AdamW and SGD whose step() runs ATen's fused kernels
// (at::_fused_adam_, at::_fused_adamw_, at::_fused_sgd_; CPU and CUDA) over each parameter
// group's tensors, grouped by device and dtype as PyTorch's `fused=True` path does.
//
// They stay the LibTorch classes they derive from: the same options, the same per-parameter
// state objects (AdamParamState / AdamWParamState with the step count as int64, SGDParamState's
// momentum_buffer), the same serialization. So a checkpoint written by a fused optimizer loads
// into the plain one and continues identically, and vice versa, and code that walks
// param_groups() / state() (schedulers, sharding strategies) sees no difference.
//
// A step falls back to the base class (the plain per-tensor path, same results) when any tensor
// the kernels would see is outside what they take: a device other than CPU or CUDA, a dtype
// other than fp32/fp64, a sparse or non-contiguous tensor, a gradient or state tensor
// of another dtype or device than its parameter.
//
// Header-only, so the engine and plugins (which depend on the SDK only) can use it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <map>
#include <tuple>
#include <utility>
#include <vector>

namespace ember::optim {
namespace detail {

// Whether the fused kernels take this tensor as a parameter-shaped operand for `param`.
inline bool fusable_like(const at::Tensor& t, const at::Tensor& param) {
  return t.defined() && t.layout() == at::kStrided && t.device() == param.device() &&
         t.scalar_type() == param.scalar_type() && t.is_contiguous() && t.sizes() == param.sizes();
}

// fp32 and fp64 only: with fp16/bf16 parameters (16-true, bf16-true) the CPU kernels' updates
// did not train the test CNN where the plain path did, so those keep the plain path.
inline bool fusable_param(const at::Tensor& p) {
  return (p.is_cpu() || p.is_cuda()) && p.layout() == at::kStrided &&
         (p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble) && p.is_contiguous();
}

using BucketKey = std::tuple<int, int, int>;  // device type, device index, dtype
inline BucketKey bucket_key(const at::Tensor& p) {
  return {static_cast<int>(p.device().type()), static_cast<int>(p.device().index()), static_cast<int>(p.scalar_type())};
}

// One float step tensor per (count, device), shared by every parameter at that count: the kernels
// only read it (PyTorch increments its step tensors before the call, as the counts are here).
class StepTensors {
 public:
  const at::Tensor& at_count(int64_t count, const at::Device& device) {
    auto key = std::make_pair(count, device.str());
    auto it = cache_.find(key);
    if (it == cache_.end())
      it = cache_.emplace(key, at::full({}, static_cast<double>(count), at::TensorOptions().dtype(at::kFloat).device(device)))
               .first;
    return it->second;
  }

 private:
  std::map<std::pair<int64_t, std::string>, at::Tensor> cache_;
};

// Adam and AdamW share everything but the kernel (L2 vs decoupled weight decay).
template <class Base, class Options, class State, bool kDecoupled>
class FusedAdamBase : public Base {
 public:
  using Base::Base;

  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    if (!all_fusable()) return Base::step(std::move(closure));
    at::NoGradGuard no_grad;
    at::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    StepTensors steps;
    for (auto& group : this->param_groups_) {
      auto& o = static_cast<Options&>(group.options());
      struct Bucket {
        std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
      };
      std::map<BucketKey, Bucket> buckets;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = this->state_[p.unsafeGetTensorImpl()];
        if (!slot) {  // what the base class creates on a parameter's first step
          auto s = std::make_unique<State>();
          s->step(0);
          s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
          s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          slot = std::move(s);
        }
        auto& s = static_cast<State&>(*slot);
        s.step(s.step() + 1);
        auto& b = buckets[bucket_key(p)];
        b.params.push_back(p);
        b.grads.push_back(p.grad());
        b.exp_avgs.push_back(s.exp_avg());
        b.exp_avg_sqs.push_back(s.exp_avg_sq());
        if (o.amsgrad()) b.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
        b.steps.push_back(steps.at_count(s.step(), p.device()));
      }
      const auto [beta1, beta2] = o.betas();
      for (auto& [key, b] : buckets) {
        if constexpr (kDecoupled)
          at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps, o.lr(), beta1, beta2,
                            o.weight_decay(), o.eps(), o.amsgrad(), /*maximize=*/false);
        else
          at::_fused_adam_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps, o.lr(), beta1, beta2,
                           o.weight_decay(), o.eps(), o.amsgrad(), /*maximize=*/false);
      }
    }
    return loss;
  }

 private:
  bool all_fusable() {
    for (auto& group : this->param_groups_) {
      const bool amsgrad = static_cast<Options&>(group.options()).amsgrad();
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        if (!fusable_param(p) || !fusable_like(p.grad(), p)) return false;
        auto it = this->state_.find(p.unsafeGetTensorImpl());
        if (it == this->state_.end()) continue;
        auto* s = dynamic_cast<State*>(it->second.get());
        if (!s || !fusable_like(s->exp_avg(), p) || !fusable_like(s->exp_avg_sq(), p)) return false;
        if (amsgrad && !fusable_like(s->max_exp_avg_sq(), p)) return false;
      }
    }
    return true;
  }
};

}  // namespace detail

// torch::optim::Adam (L2 weight decay) stepping with at::_fused_adam_.
class FusedAdam : public detail::FusedAdamBase<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState, false> {
 public:
  using FusedAdamBase::FusedAdamBase;
};

// torch::optim::AdamW (decoupled weight decay) stepping with at::_fused_adamw_.
class FusedAdamW
    : public detail::FusedAdamBase<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState, true> {
 public:
  using FusedAdamBase::FusedAdamBase;
};

// torch::optim::SGD stepping with at::_fused_sgd_. A parameter's momentum buffer is made on its
// first step as LibTorch's SGD makes it (a copy of the weight-decayed gradient); parameters that
// already have one and those that do not go to separate kernel calls (is_first_step).
class FusedSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;

  at::Tensor step(LossClosure closure = nullptr) override {
    if (!all_fusable()) return torch::optim::SGD::step(std::move(closure));
    at::NoGradGuard no_grad;
    at::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : param_groups_) {
      auto& o = static_cast<torch::optim::SGDOptions&>(group.options());
      const bool has_momentum = o.momentum() != 0;
      struct Bucket {
        std::vector<at::Tensor> params, grads, bufs;
      };
      // [key][first step?]
      std::map<std::pair<detail::BucketKey, bool>, Bucket> buckets;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        bool first = false;
        at::Tensor buf;
        if (has_momentum) {
          auto& slot = state_[p.unsafeGetTensorImpl()];
          if (!slot) {
            auto s = std::make_unique<torch::optim::SGDParamState>();
            s->momentum_buffer(at::empty_like(p, at::MemoryFormat::Preserve));  // the kernel fills it on the first step
            slot = std::move(s);
            first = true;
          }
          buf = static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer();
        }
        auto& b = buckets[{detail::bucket_key(p), first}];
        b.params.push_back(p);
        b.grads.push_back(p.grad());
        if (has_momentum) b.bufs.push_back(buf);
      }
      for (auto& [key, b] : buckets)
        at::_fused_sgd_(b.params, b.grads, b.bufs, o.weight_decay(), o.momentum(), o.lr(), o.dampening(), o.nesterov(),
                        /*maximize=*/false, /*is_first_step=*/key.second);
    }
    return loss;
  }

 private:
  bool all_fusable() {
    for (auto& group : param_groups_) {
      const bool has_momentum = static_cast<torch::optim::SGDOptions&>(group.options()).momentum() != 0;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        if (!detail::fusable_param(p) || !detail::fusable_like(p.grad(), p)) return false;
        if (!has_momentum) continue;
        auto it = state_.find(p.unsafeGetTensorImpl());
        if (it == state_.end()) continue;
        auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get());
        if (!s || !detail::fusable_like(s->momentum_buffer(), p)) return false;
      }
    }
    return true;
  }
};

}  // namespace ember::optim
