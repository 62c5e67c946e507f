// The model's and optimizer's state of a ZeRO run, saved and restored: whole (gathered onto rank
// 0, exactly what a replicating strategy saves, so a checkpoint resumes under any strategy and
// world size) or as one part per rank (nothing gathered; re-sharded onto any mesh when it is
// loaded: other data-parallel, tensor-parallel and pipeline degrees). Every call is collective where it gathers. The loads leave the module's own
// parameters to the caller (ZeroStrategy::parameters_changed).
#pragma once
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <ember/strategy.h>
#include <ember/tensor_parallel.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "shard_table.h"
#include "zero_context.h"

namespace ember_shard {

class ShardedStateIO {
 public:
  ShardedStateIO(ShardTable& table, ZeroContext ctx) : t_(table), c_(ctx) {}

  // The whole tensors, built on the ranks where `build` (collective over the shards either way).
  c10::Dict<std::string, at::Tensor> full_model_state(torch::nn::Module& module, bool build);
  // Throws ember::RunError naming the first tensor that is missing or has another shape.
  void load_full_model_state(torch::nn::Module& module, const c10::Dict<std::string, at::Tensor>& state);
  std::string full_optimizer_state(torch::optim::Optimizer& optimizer, bool rank0_only);
  void load_full_optimizer_state(torch::optim::Optimizer& optimizer, const std::string& bytes);
  // One optimizer state field of the shard `trained`, whole (collective over the shards and
  // tensor-parallel ranks), and this rank's part of a whole one: the pieces pipeline stages
  // build the whole optimizer state from (ember/distributed/pipeline_state.h).
  at::Tensor whole_field(const at::Tensor& trained, const at::Tensor& field);
  at::Tensor part_of_field(const at::Tensor& trained, const at::Tensor& whole);
  // This rank's part of a sharded checkpoint directory (collective over the world: world rank 0's
  // part also lists every part's layout).
  c10::IValue sharded_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer);
  // Reads the parts this rank needs, its own first (on the mesh that saved them, the only one), and
  // returns how many it read (until nothing is missing when the first part lists no layouts:
  // directories written before parts recorded them). Without `with_optimizer` the parameters and
  // buffers alone: the optimizer and its state stay as they are, and `pick` (only then) may say
  // where each tensor comes from (ember::IShardedModelStateSelective); `kept`, when given, counts
  // the tensors that kept their own values because the parts lack them (from_checkpoint_if_saved).
  using Pick = std::function<ember::InitialTensor(const std::string&)>;
  int64_t load_sharded_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer, int64_t saved_world,
                             const std::function<c10::IValue(int64_t)>& read_part, bool with_optimizer = true,
                             const Pick& pick = {}, int64_t* kept = nullptr);

  // Tensor parallelism (zero_setup.cpp): the whole tensor of a parameter (or of its optimizer
  // state) from this rank's tensor-parallel slice, collective over the tensor-parallel ranks, and
  // this rank's slice of a whole one; and how each sliced tensor is split (a sharded checkpoint
  // part records it, so it loads under another tensor-parallel degree). Unset: the shards'
  // tensors are the model's whole ones.
  using Reshape = std::function<at::Tensor(const std::string& name, const at::Tensor&)>;
  struct TensorParallelSlicing {
    Reshape to_whole, to_slice;
    std::map<std::string, ember::TensorShard> splits;
    int64_t rank = 0, size = 1;
  };
  void set_tensor_parallel(TensorParallelSlicing slicing) { tp_ = std::move(slicing); }
  // Pipeline parallelism: this rank's stage, and the optimizer's serialization over the whole
  // model's groups (PipelineState's), so that a sharded part loads on any stage of any mesh.
  struct PipelinePlace {
    int64_t rank = 0;
    std::function<std::string(torch::optim::Optimizer&)> save_optimizer;
    std::function<void(torch::optim::Optimizer&, const std::string&)> load_optimizer;
  };
  void set_pipeline(PipelinePlace place) { pp_ = std::move(place); }

 private:
  c10::impl::GenericDict part_of_this_rank(torch::nn::Module& module, torch::optim::Optimizer& optimizer);
  std::vector<c10::IValue> gather_layouts(const c10::IValue& layout);
  // Whole value of one shard-shaped tensor (a parameter's shard, or an optimizer state field).
  at::Tensor gather_whole(const ShardedParam& p, const at::Tensor& part);

  ShardTable& t_;
  ZeroContext c_;
  TensorParallelSlicing tp_;
  PipelinePlace pp_;
};

}  // namespace ember_shard
