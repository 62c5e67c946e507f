// Units: the blocks of a model (transformer layers, say) that a sharding or offloading strategy
// materialises one at a time.
//
// LibTorch modules have no forward hooks, so a model declares its units and runs each one's
// forward through ember::ModelUnits::run; a strategy installs IUnitHooks to act around them.
// Without a strategy that installs hooks, run() is a plain call. A model that declares no units
// is one unit as a whole (the strategy's forward_begin/forward_end cover it).
//
//   class MyModel : public ember::IModel, public ember::UnitModel {
//     MyModel() { for (size_t i = 0; i < net_->layers.size(); ++i) units_.add("layer" + ..., net_->layers[i]); }
//     void* query_interface(const char* iid) override { return unit_model_interface(iid); }
//     // in the network's forward:
//     for (size_t i = 0; i < layers.size(); ++i) x = units_.run(i, [&] { return layers[i]->forward(x); });
//   };
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ember/export.h"

namespace torch::nn { class Module; }

namespace ember {

// Implemented by strategies. Calls arrive in the order the model runs its units, the same on
// every rank (the strategy's collectives rely on it).
class EMBER_SDK_API IUnitHooks {
 public:
  virtual ~IUnitHooks() = default;
  // Ensures: the unit's parameters are whole and current until after_unit_forward.
  virtual void before_unit_forward(int64_t unit) = 0;
  // The unit's forward returned (or threw); its parameters may be freed.
  virtual void after_unit_forward(int64_t unit) = 0;
  // Autograd reached the unit's output: its backward runs next, so its parameters must be whole
  // again. Called on the thread that runs backward.
  virtual void before_unit_backward(int64_t unit) = 0;
};

// Extension interface of IModel (IModel::query_interface(kUnitModelIid)).
inline constexpr const char* kUnitModelIid = "ember.IUnitModel/1";
class EMBER_SDK_API IUnitModel {
 public:
  virtual ~IUnitModel() = default;
  virtual int64_t num_units() const = 0;
  // The unit's name and its module, a submodule of the model's module() (its parameters keep
  // the names they have there).
  virtual std::string unit_name(int64_t unit) const = 0;
  virtual torch::nn::Module& unit_module(int64_t unit) = 0;
  // nullptr removes them.
  virtual void set_unit_hooks(IUnitHooks* hooks) = 0;
};

// The bookkeeping a model keeps for its units (header-only; lives inside the model plugin).
class ModelUnits {
 public:
  void add(std::string name, std::shared_ptr<torch::nn::Module> module) {
    if (!module) throw std::invalid_argument("ModelUnits::add: unit '" + name + "' has no module");
    units_.emplace_back(std::move(name), std::move(module));
  }
  int64_t size() const { return static_cast<int64_t>(units_.size()); }
  const std::string& name(int64_t i) const { return units_.at(static_cast<size_t>(i)).first; }
  torch::nn::Module& module(int64_t i) { return *units_.at(static_cast<size_t>(i)).second; }
  void set_hooks(IUnitHooks* hooks) { hooks_ = hooks; }
  IUnitHooks* hooks() const { return hooks_; }

  // Runs unit i's forward `fn` (returning its output tensor) with the strategy's hooks around it.
  // The output gets a gradient hook that announces the unit's backward.
  template <class Fn>
  at::Tensor run(int64_t unit, Fn&& fn) {
    if (hooks_ == nullptr) return fn();
    struct After {
      IUnitHooks* h;
      int64_t u;
      ~After() { h->after_unit_forward(u); }
    };
    at::Tensor out;
    {
      hooks_->before_unit_forward(unit);
      After after{hooks_, unit};
      out = fn();
    }
    if (out.defined() && out.requires_grad()) {
      IUnitHooks* h = hooks_;
      out.register_hook([h, unit](const at::Tensor& grad) {
        h->before_unit_backward(unit);
        return grad;
      });
    }
    return out;
  }

 private:
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> units_;
  IUnitHooks* hooks_ = nullptr;
};

// Mixin for a model that declares units: implements IUnitModel over a ModelUnits member. The
// model's query_interface returns unit_model_interface(iid) for the iids it does not know.
class UnitModel : public IUnitModel {
 public:
  int64_t num_units() const override { return units_.size(); }
  std::string unit_name(int64_t unit) const override { return units_.name(unit); }
  torch::nn::Module& unit_module(int64_t unit) override { return units_.module(unit); }
  void set_unit_hooks(IUnitHooks* hooks) override { units_.set_hooks(hooks); }

 protected:
  void* unit_model_interface(const char* iid) {
    return std::strcmp(iid, kUnitModelIid) == 0 ? static_cast<IUnitModel*>(this) : nullptr;
  }
  ModelUnits units_;
};

}  // namespace ember
