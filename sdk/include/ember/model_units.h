// Units: the blocks of a model (transformer layers, say) that a sharding or offloading strategy
// materialises one at a time, and that activation checkpointing recomputes.
//
// LibTorch modules have no forward hooks, so a model declares its units and runs each one's
// forward through ember::ModelUnits::run; a strategy installs IUnitHooks to act around them.
// Without a strategy that installs hooks, run() is a plain call. A model that declares no units
// is one unit as a whole (the strategy's forward_begin/forward_end cover it).
//
//   class MyModel : public ember::IModel, public ember::UnitModel {
//     MyModel() { for (size_t i = 0; i < net_->layers.size(); ++i) units_.add("layer" + ..., net_->layers[i]); }
//     void* query_interface(const char* iid) override { return unit_model_interface(iid); }
//     // in the network's forward (the input passed in, so the unit can be recomputed):
//     for (size_t i = 0; i < layers.size(); ++i)
//       x = units_.run(i, x, [layer = layers[i]](const at::Tensor& in) { return layer->forward(in); });
//   };
//
// Activation checkpointing (SDK 2.3, trainer.activation_checkpointing): with "full", run(unit,
// input, fn) keeps only the unit's input during a training forward and runs fn again during
// backward (with the same RNG and autocast state), trading compute for activation memory. fn may
// therefore run twice: it must capture by value what it uses (not references to the caller's
// locals). "selective" is the model's own choice of what to recompute inside a unit (e.g. the MLP,
// keeping the attention), offered by overriding UnitModel::set_selective_checkpointing and using
// ember::recompute_in_backward there.
#pragma once
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdint>
#include <functional>
#include <mutex>
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

// trainer.activation_checkpointing: what a training forward keeps for backward.
enum class ActivationCheckpointing : int { none = 0, full = 1, selective = 2 };

// Extension interface of IModel (IModel::query_interface(kActivationCheckpointingIid); SDK 2.3),
// implemented by UnitModel. The engine calls it once, before training.
inline constexpr const char* kActivationCheckpointingIid = "ember.IActivationCheckpointing/1";
class EMBER_SDK_API IActivationCheckpointing {
 public:
  virtual ~IActivationCheckpointing() = default;
  // Ensures: training forwards keep what `mode` says. Returns false when the model does not
  // offer `mode` (selective is the model's own choice; none and full every unit model offers).
  virtual bool set_activation_checkpointing(ActivationCheckpointing mode) = 0;
};

namespace detail {

// What a recomputed forward needs again in backward: the function, and the RNG and autocast
// state it ran under (dropout draws the same masks; autocast casts the same way).
struct Recompute : torch::CustomClassHolder {
  std::function<at::Tensor(const at::Tensor&)> fn;
  c10::Device device{c10::kCPU};
  at::Tensor cpu_rng, device_rng;
  bool autocast_cpu = false, autocast_device = false;
  c10::ScalarType autocast_cpu_dtype = c10::kBFloat16, autocast_device_dtype = c10::kHalf;
};

inline at::Tensor generator_state(const c10::Device& device) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
inline void set_generator_state(const c10::Device& device, const at::Tensor& state) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Forward without a graph, keeping the input; backward recomputes with a graph and runs its
// backward (the reentrant form of torch.utils.checkpoint): parameter gradients accumulate as
// usual, the input's gradient is returned.
struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, c10::intrusive_ptr<Recompute> state) {
    state->cpu_rng = generator_state(c10::Device(c10::kCPU));
    if (!state->device.is_cpu()) state->device_rng = generator_state(state->device);
    state->autocast_cpu = at::autocast::is_autocast_enabled(c10::kCPU);
    state->autocast_cpu_dtype = at::autocast::get_autocast_dtype(c10::kCPU);
    if (!state->device.is_cpu()) {
      state->autocast_device = at::autocast::is_autocast_enabled(state->device.type());
      state->autocast_device_dtype = at::autocast::get_autocast_dtype(state->device.type());
    }
    at::Tensor out = state->fn(input);
    ctx->save_for_backward({input});
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(state);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const at::Tensor input = ctx->get_saved_variables()[0];
    at::Tensor x = input.detach();
    x.requires_grad_(input.requires_grad());
    // The forward's RNG and autocast state for the recompute, then back to what they are now.
    const at::Tensor cpu_now = generator_state(c10::Device(c10::kCPU));
    const at::Tensor device_now = state->device.is_cpu() ? at::Tensor() : generator_state(state->device);
    const bool cpu_was = at::autocast::is_autocast_enabled(c10::kCPU);
    const c10::ScalarType cpu_dtype_was = at::autocast::get_autocast_dtype(c10::kCPU);
    const c10::DeviceType dt = state->device.type();
    const bool device_was = state->device.is_cpu() ? false : at::autocast::is_autocast_enabled(dt);
    const c10::ScalarType device_dtype_was = state->device.is_cpu() ? c10::kHalf : at::autocast::get_autocast_dtype(dt);
    set_generator_state(c10::Device(c10::kCPU), state->cpu_rng);
    if (!state->device.is_cpu()) set_generator_state(state->device, state->device_rng);
    at::autocast::set_autocast_enabled(c10::kCPU, state->autocast_cpu);
    at::autocast::set_autocast_dtype(c10::kCPU, state->autocast_cpu_dtype);
    if (!state->device.is_cpu()) {
      at::autocast::set_autocast_enabled(dt, state->autocast_device);
      at::autocast::set_autocast_dtype(dt, state->autocast_device_dtype);
    }
    at::Tensor out;
    {
      torch::autograd::AutoGradMode grad(true);
      out = state->fn(x);
    }
    at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(c10::kCPU, cpu_was);
    at::autocast::set_autocast_dtype(c10::kCPU, cpu_dtype_was);
    if (!state->device.is_cpu()) {
      at::autocast::set_autocast_enabled(dt, device_was);
      at::autocast::set_autocast_dtype(dt, device_dtype_was);
    }
    set_generator_state(c10::Device(c10::kCPU), cpu_now);
    if (!state->device.is_cpu()) set_generator_state(state->device, device_now);
    if (out.requires_grad()) torch::autograd::backward({out}, {grads[0]});
    return {x.requires_grad() ? x.grad() : at::Tensor(), at::Tensor()};
  }
};

}  // namespace detail

// fn(input), keeping only `input` for backward and running fn again there (see above). Outside a
// training forward (no grad mode) it is a plain call.
template <class Fn>
at::Tensor recompute_in_backward(const at::Tensor& input, Fn&& fn) {
  if (!torch::autograd::GradMode::is_enabled()) return fn(input);
  auto state = c10::make_intrusive<detail::Recompute>();
  state->fn = std::forward<Fn>(fn);
  state->device = input.device();
  // A unit whose input needs no gradient (the first one, taking the data) still has parameters
  // that do: its output must stay in the graph, so the input becomes a leaf that asks for one
  // (torch.utils.checkpoint's reentrant form has this hole: "None of the inputs have
  // requires_grad=True", and the unit silently stops training).
  if (!input.requires_grad() && input.is_floating_point())
    return detail::RecomputeFunction::apply(input.detach().requires_grad_(true), state);
  return detail::RecomputeFunction::apply(input, state);
}

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
  void set_checkpointing(ActivationCheckpointing mode) { checkpointing_ = mode; }
  ActivationCheckpointing checkpointing() const { return checkpointing_; }

  // Runs unit i's forward fn(input) with the strategy's hooks around it; under "full" activation
  // checkpointing fn runs again during backward (it must capture by value).
  template <class Fn>
  at::Tensor run(int64_t unit, const at::Tensor& input, Fn&& fn) {
    if (checkpointing_ != ActivationCheckpointing::full) return hooked(unit, [&] { return fn(input); });
    return hooked(unit, [&] { return recompute_in_backward(input, fn); });
  }
  // Runs unit i's forward `fn` (returning its output tensor) with the strategy's hooks around it.
  // The output gets a gradient hook that announces the unit's backward. This form has no input
  // to recompute from: under "full" activation checkpointing it is an error.
  template <class Fn>
  at::Tensor run(int64_t unit, Fn&& fn) {
    if (checkpointing_ == ActivationCheckpointing::full && torch::autograd::GradMode::is_enabled())
      throw std::logic_error("activation checkpointing: unit '" + name(unit) +
                             "' runs through ModelUnits::run(unit, fn), which has no input to recompute from; run it with "
                             "ModelUnits::run(unit, input, fn) (ember/model_units.h)");
    return hooked(unit, std::forward<Fn>(fn));
  }

 private:
  template <class Fn>
  at::Tensor hooked(int64_t unit, Fn&& fn) {
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

  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> units_;
  IUnitHooks* hooks_ = nullptr;
  ActivationCheckpointing checkpointing_ = ActivationCheckpointing::none;
};

// Mixin for a model that declares units: implements IUnitModel (and, since 2.3,
// IActivationCheckpointing) over a ModelUnits member. The model's query_interface returns
// unit_model_interface(iid) for the iids it does not know.
class UnitModel : public IUnitModel, public IActivationCheckpointing {
 public:
  bool set_activation_checkpointing(ActivationCheckpointing mode) override {
    if (mode == ActivationCheckpointing::selective) {
      if (!set_selective_checkpointing(true)) return false;
      units_.set_checkpointing(ActivationCheckpointing::none);
      return true;
    }
    set_selective_checkpointing(false);
    units_.set_checkpointing(mode);
    return true;
  }
  int64_t num_units() const override { return units_.size(); }
  std::string unit_name(int64_t unit) const override { return units_.name(unit); }
  torch::nn::Module& unit_module(int64_t unit) override { return units_.module(unit); }
  void set_unit_hooks(IUnitHooks* hooks) override { units_.set_hooks(hooks); }

 protected:
  void* unit_model_interface(const char* iid) {
    if (std::strcmp(iid, kActivationCheckpointingIid) == 0) return static_cast<IActivationCheckpointing*>(this);
    return std::strcmp(iid, kUnitModelIid) == 0 ? static_cast<IUnitModel*>(this) : nullptr;
  }
  // A model that recomputes part of each unit (ember::recompute_in_backward inside it) overrides
  // this: true when it did turn `on` on; the default offers no selective mode.
  virtual bool set_selective_checkpointing(bool on) { return !on; }
  ModelUnits units_;
};

}  // namespace ember
