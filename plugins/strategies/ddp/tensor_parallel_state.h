// ddp's model state when the model is split over tensor-parallel ranks (ember/tensor_parallel.h):
// which parameters are slices, and the whole tensors made from them for checkpoints (so a
// checkpoint written under one mesh loads under any other strategy and mesh) and for the total
// gradient norm. Replicated parameters are the same on every rank of the group and are handled
// as ddp handles every parameter.
#pragma once
#include <ember/strategy.h>
#include <ember/tensor_parallel.h>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace torch::nn { class Module; }
namespace torch::optim { class Optimizer; }
namespace ember_dist { class MeshGroup; }

namespace ember_ddp {

class TensorParallelState {
 public:
  // `shards` is what the model's plan returned; every name must be a parameter of `module`.
  TensorParallelState(ember_dist::MeshGroup& group, torch::nn::Module& module, std::vector<ember::TensorShard> shards);

  size_t sliced() const { return by_name_.size(); }
  size_t summed() const { return summed_.size(); }
  // Sums over the group the gradients the plan marked kSummedGradient (sequence parallelism), in
  // one collective per dtype. Collective over the group.
  void sum_partial_gradients();
  // All of these are collective over the tensor-parallel group (every rank of it calls them).
  // Whole parameters and buffers, on this rank when `build`.
  c10::Dict<std::string, at::Tensor> full_model_state(bool build);
  // `state` holds whole tensors; each rank keeps its slices. Throws ember::RunError naming the
  // first tensor that is missing or has another shape.
  void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state);
  // The optimizer state as an optimizer over the whole parameters would save it.
  std::string full_optimizer_state(torch::optim::Optimizer& optimizer, bool build);
  void load_full_optimizer_state(torch::optim::Optimizer& optimizer, const std::string& bytes);
  // torch's clip_grad_norm_ / clip_grad_value_ over the whole model: a slice's squared norm is
  // summed over the group, a replicated parameter's counted once.
  // `across` (pipeline stages): sums the squared norm over the ranks that hold the model's other
  // parts; `counted` leaves out a parameter another stage counts.
  at::Tensor clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm,
                            const std::function<at::Tensor(const at::Tensor&)>& across = nullptr,
                            const std::function<bool(const at::Tensor&)>& counted = nullptr);
  // An optimizer state field of `param`: whole (gathered over the group when `param` is a slice;
  // collective), and this rank's slice of a whole one (a copy).
  at::Tensor whole_state(const at::Tensor& param, const at::Tensor& field);
  at::Tensor part_of_state(const at::Tensor& param, const at::Tensor& field);

 private:
  const ember::TensorShard* shard_of(const at::Tensor& parameter) const;
  at::Tensor whole(const at::Tensor& slice, const ember::TensorShard& shard);

  ember_dist::MeshGroup& group_;
  torch::nn::Module& module_;
  std::map<std::string, ember::TensorShard> by_name_;
  std::map<const c10::TensorImpl*, ember::TensorShard> by_tensor_;
  std::vector<at::Tensor> summed_;  // parameters whose gradients are partial sums
};

}  // namespace ember_ddp
