// ember::ReplicatingStrategy: the base of a strategy whose every rank holds the whole module
// (single_device, ddp, the local-SGD example). It implements the model-state half of IStrategy
// (optimizer, zero_grad, full state in and out), clipping over whole gradients, and no sharded
// checkpoints; a strategy adds processes, placement and collectives. ReplicatedModelState is that
// model-state half on its own, for a strategy with another base. Header-only.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>

#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "ember/error.h"
#include "ember/model.h"
#include "ember/strategy.h"
#include "ember/support/grad_util.h"

namespace ember {

class ReplicatedModelState {
 public:
  // Requires: called once, with the module the strategy has placed.
  void set_module(torch::nn::Module& module) { module_ = &module; }
  torch::nn::Module& module() const { return *module_; }

  std::shared_ptr<torch::optim::Optimizer> build_optimizer(IOptimizerFactory& factory) {
    optimizer_ = factory.build(trained_parameters());
    return optimizer_;
  }
  const std::shared_ptr<torch::optim::Optimizer>& optimizer() const { return optimizer_; }

  void zero_grad() {
    if (optimizer_) optimizer_->zero_grad(/*set_to_none=*/true);
  }

  std::vector<NamedTensor> trained_parameters() const {
    std::vector<NamedTensor> out;
    for (const auto& p : module_->named_parameters()) out.push_back({p.key(), p.value()});
    return out;
  }

  c10::Dict<std::string, at::Tensor> full_model_state(bool build) const {
    c10::Dict<std::string, at::Tensor> out;
    if (!build) return out;
    for (const auto& p : module_->named_parameters()) out.insert(p.key(), detached_host_copy(p.value()));
    for (const auto& b : module_->named_buffers()) out.insert(b.key(), detached_host_copy(b.value()));
    return out;
  }
  // The live tensors, detached, where they are (IDeviceModelState).
  c10::Dict<std::string, at::Tensor> device_model_state() const {
    c10::Dict<std::string, at::Tensor> out;
    for (const auto& p : module_->named_parameters()) out.insert(p.key(), p.value().detach());
    for (const auto& b : module_->named_buffers()) out.insert(b.key(), b.value().detach());
    return out;
  }

  void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) {
    at::NoGradGuard no_grad;
    std::vector<std::pair<at::Tensor, at::Tensor>> copies;
    std::vector<std::string> missing;
    auto check = [&](const std::string& name, const at::Tensor& target) {
      auto it = state.find(name);
      if (it == state.end()) {
        missing.push_back(name);
        return;
      }
      if (it->value().sizes() != target.sizes())
        throw RunError("'" + name + "' has shape " + c10::str(it->value().sizes()) + " but the model's is " +
                       c10::str(target.sizes()) + " (was it saved from a model with other settings?)");
      copies.emplace_back(target, it->value());
    };
    for (const auto& p : module_->named_parameters()) check(p.key(), p.value());
    for (const auto& b : module_->named_buffers()) check(b.key(), b.value());
    if (!missing.empty())
      throw RunError("lacks " + std::to_string(missing.size()) + " of the model's tensors, e.g. '" + missing.front() +
                     "' (was it saved from another model?)");
    for (auto& [target, source] : copies) target.detach().copy_(source);
  }

  std::string full_optimizer_state(bool build) const {
    if (!build || !optimizer_) return {};
    std::ostringstream out;
    torch::save(*optimizer_, out);
    return out.str();
  }

  void load_full_optimizer_state(const std::string& bytes) {
    std::istringstream in(bytes);
    // torch::load only adds the saved per-parameter states: without this, moments built up after
    // the checkpoint (a tuner's trial steps) would survive restoring one saved before any step.
    optimizer_->state().clear();
    // The moments load onto the parameters' device, as PyTorch's Optimizer.load_state_dict puts
    // them: a checkpoint written on the CPU (or by offload, whose moments live on the host) must
    // resume on a GPU.
    std::optional<c10::Device> device;
    for (const auto& group : optimizer_->param_groups())
      for (const auto& p : group.params())
        if (!device && p.defined()) device = p.device();
    torch::load(*optimizer_, in, device);
  }

 private:
  torch::nn::Module* module_ = nullptr;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
};

}  // namespace ember

namespace ember {

// Requires: the derived strategy implements launch, root_device, rank, world_size, local_rank,
// place_module, batch_to_device, backward, optimizer_step, reduce, barrier, broadcast_flag,
// teardown, and broadcast when it runs more than one process.
// It implements IDeviceModelState; a strategy answers kDeviceModelStateIid with it when its rank 0
// holds the whole model (single_device always, ddp without tensor or pipeline parallelism).
class ReplicatingStrategy : public IStrategy, public IDeviceModelState {
 public:
  c10::Dict<std::string, at::Tensor> device_model_state() override { return state_.device_model_state(); }
  void setup_module(IModel& model) override {
    place_module(model.module());
    state_.set_module(model.module());
  }
  std::shared_ptr<torch::optim::Optimizer> setup_optimizer(IOptimizerFactory& factory) override {
    return state_.build_optimizer(factory);
  }
  void forward_begin(bool /*grad_enabled*/) override {}
  void forward_end() override {}
  void zero_grad() override { state_.zero_grad(); }
  std::vector<NamedTensor> trained_parameters() override { return state_.trained_parameters(); }
  void parameters_changed() override {}
  c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only) override {
    return state_.full_model_state(!rank0_only || rank() == 0);
  }
  void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) override { state_.load_full_model_state(state); }
  std::string full_optimizer_state(bool rank0_only) override { return state_.full_optimizer_state(!rank0_only || rank() == 0); }
  void load_full_optimizer_state(const std::string& bytes) override { state_.load_full_optimizer_state(bytes); }

  // Every rank holds whole gradients (synchronised ones, for a data-parallel strategy), so the
  // local norm is the total and local clipping agrees on every rank.
  at::Tensor clip_gradients(torch::optim::Optimizer& optimizer, double max, ClipAlgorithm algorithm) override {
    return clip_gradients_in_place(grads_of(optimizer), max, algorithm);
  }

  // Checkpoints are one file gathered on rank 0; no sharded_state (kShardedCheckpointsIid unset).
  bool sharded_checkpoints() const override { return false; }
  c10::IValue sharded_state() override { throw RunError("this strategy writes no sharded checkpoints"); }
  void load_sharded_state(int64_t /*saved_world*/, const std::function<c10::IValue(int64_t)>& /*read_part*/) override {
    throw RunError("this strategy cannot read sharded checkpoint directories");
  }

  // One process: the value itself. A multi-process strategy overrides it with its communicator's.
  at::Tensor broadcast(const at::Tensor& value, int64_t src) override {
    if (world_size() != 1)
      throw RunError("this strategy runs " + std::to_string(world_size()) + " processes but has no tensor broadcast (a plugin bug)");
    if (src != 0) throw RunError("broadcast from rank " + std::to_string(src) + " of a single-process run");
    if (!value.defined()) throw RunError("the tensor to broadcast is undefined");
    return value;
  }

 protected:
  // Moves the module to the strategy's device(s) and does its own setup (broadcasts, hooks).
  virtual void place_module(torch::nn::Module& module) = 0;
  ReplicatedModelState state_;
};

}  // namespace ember
