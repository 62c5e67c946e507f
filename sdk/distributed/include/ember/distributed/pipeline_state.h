// A strategy's model state when the model is cut into pipeline stages (ember/pipeline.h), shared
// by ddp and the ZeRO strategies (sharded, offload): which units this rank holds, the schedule
// that runs a batch through them (PipelineRunner), the parameters several stages hold, and the
// whole model and optimizer state made of the stages' parts for checkpoints (so a checkpoint
// written with pipeline_parallel = 2 resumes under any other strategy and mesh) and the total
// gradient norm. What the optimizer trains is the strategy's: the parameters themselves (ddp) or
// this rank's shards of them (ZeRO), named as in the whole model (set_optimizer).
#pragma once
#include <ember/host.h>
#include <ember/model.h>
#include <ember/pipeline.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/Dict.h>

#include <functional>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/strategy.h>

#include "ember/distributed/device_mesh.h"
#include "ember/distributed/pipeline_runner.h"

namespace torch::nn { class Module; }
namespace torch::optim { class Optimizer; class OptimizerParamState; }

namespace ember_dist {

class PipelineState {
 public:
  // Checks the settings against the mesh (ember::ConfigError naming the key).
  PipelineState(DeviceMesh& mesh, const ember::PipelineOptions& options);

  // Cuts `model` (its whole parameters placed, equal on every rank): stages balanced by the units'
  // parameter counts (or parallelism.stage_units), this rank's kept. Throws ember::ConfigError
  // when the model cannot be cut so (no units, fewer units than stages). `strategy` prefixes the log line.
  void cut(ember::IModel& model, const std::string& strategy, ember::IHost& host);
  // The stages this rank would hold, without cutting (the same answer cut() acts on; the same
  // ConfigErrors): a strategy that builds the model piece by piece decides what to keep from a
  // first, shapes-only build (ember/deferred_init.h's IDeferredInitPlan).
  std::vector<ember::UnitRange> stages_of_this_rank(ember::IModel& model);
  // The shapes build of deferred initialisation, cut to this rank's stages (the model's
  // keep_pipeline_stages): what remains in it is what the real build keeps.
  void cut_shapes(ember::IModel& model);
  // This rank's stages (after cut).
  std::vector<ember::UnitRange> my_stages() const { return runner_->my_stages(); }
  ember::IPipelineModel& model() { return *model_; }
  PipelineRunner& runner() { return *runner_; }
  // (p - 1) / (m + p - 1), or interleaved (p - 1) / (v m + p - 1).
  double theoretical_bubble() const;
  // "; pipeline: 16 training batches, 27.0% of their time waiting for other stages (the
  // schedule's bubble in theory: 20.0%)" for a strategy's closing line; empty before any batch.
  std::string describe_stats() const;
  // Records which optimizer group each stage's parameters are in (collective over the pipeline
  // group; once, after the optimizer is built). `trained`: the tensors the optimizer holds, by
  // their names in the whole model (ddp: the module's parameters; ZeRO: this rank's shards).
  void set_optimizer(torch::optim::Optimizer& optimizer, const std::vector<ember::NamedTensor>& trained);

  // Sums the gradients of the parameters several stages hold (IPipelineModel's shared ones, a
  // tied embedding) over the stages, so their copies step alike: the module's whole gradients,
  // before they are reduced over the data-parallel ranks. Collective over the pipeline group.
  void sum_shared_gradients();
  // Whether the gradient of `trained` (a tensor the optimizer holds) counts in this rank's share
  // of the norm (a shared parameter's counts on the first stage only).
  bool counted_in_norm(const at::Tensor& trained) const;
  // The squared gradient norm of this rank's stages summed over the stages. Collective.
  at::Tensor sum_over_stages(const at::Tensor& squared);
  // The whole model from every stage's part (`part`: this stage's whole tensors, built on the
  // ranks that take part), in the whole model's order, on the ranks where `build`. Collective
  // over every rank (only the pipeline group of `rank 0` exchanges when !all).
  c10::Dict<std::string, at::Tensor> merge_model_state(const c10::Dict<std::string, at::Tensor>& part, bool build, bool all);
  // The optimizer state as an optimizer over the whole model saves it, from every stage's state
  // (`whole_field(trained, field)` gives a field's whole tensor: the tensor-parallel gather and the
  // data-parallel shards' gather, or the field itself; collective over those groups). On the ranks
  // where `build`.
  std::string full_optimizer_state(torch::optim::Optimizer& optimizer, bool build, bool all,
                                   const std::function<at::Tensor(const at::Tensor& param, const at::Tensor& field)>& whole_field);
  // Loads such a state: each stage takes its own parameters' entries (then `to_part(trained, field)`
  // cuts this rank's part: a tensor-parallel slice, a ZeRO shard).
  void load_full_optimizer_state(torch::optim::Optimizer& optimizer, const std::string& bytes,
                                 const std::function<at::Tensor(const at::Tensor& param, const at::Tensor& field)>& to_part);
  // The optimizer's serialization over the whole model's groups, as a sharded checkpoint part keeps
  // it (the caller empties the per-element fields; each rank saves those apart): this stage's state
  // objects, and for every other stage's parameter that has state there a copy of one of this
  // stage's (the same optimizer at the same step), so a part loads on any stage of any mesh
  // (load_full_optimizer_state with `to_part` returning the field). Collective over the pipeline group.
  std::string optimizer_over_whole_model(torch::optim::Optimizer& optimizer);

 private:
  // Every stage's units, checked against the model (model_ and the checks of cut()).
  std::vector<ember::UnitRange> plan(ember::IModel& model);
  // Whether this rank's pipeline group is the one of global rank 0 (data- and tensor-parallel
  // coordinates 0).
  bool in_rank0_group() const { return mesh_.data_parallel_rank() == 0 && mesh_.tensor_parallel_rank() == 0; }
  // Sets the optimizer's groups to the whole model's parameters (this rank's own, and a stand-in
  // for each other stage's) for torch::save / torch::load; the caller puts them back (pipeline_state.cpp's WidenedGroups).
  std::vector<std::vector<at::Tensor>> widen_groups(torch::optim::Optimizer& optimizer, std::vector<at::Tensor>* stand_ins);
  // torch::save over the whole model's groups; `stand_in_state(name)` gives another stage's
  // parameter its state object (null: none). The optimizer is left as it was.
  std::string save_over_whole_model(
      torch::optim::Optimizer& optimizer,
      const std::function<std::unique_ptr<torch::optim::OptimizerParamState>(const std::string& name)>& stand_in_state);

  DeviceMesh& mesh_;
  ember::PipelineOptions options_;
  PipelineScheduleKind kind_;
  int64_t virtual_stages_ = 1, microbatches_ = 0;
  ember::IPipelineModel* model_ = nullptr;
  torch::nn::Module* module_ = nullptr;
  std::unique_ptr<PipelineRunner> runner_;
  std::map<const void*, std::string> trained_;  // the optimizer's tensors, by their names in the whole model
  std::optional<c10::Device> device_;            // where they live
  std::map<std::string, int64_t> order_;  // the whole model's parameter and buffer names, in its order
  // The whole model's optimizer groups: names in the whole model's order.
  std::vector<std::vector<std::string>> groups_;
  // The shared parameters: name, shape and dtype of this rank's copy (a stage without one adds zeros).
  struct Shared {
    std::string name;
    std::vector<int64_t> shape;
    at::ScalarType dtype = at::kFloat;
  };
  std::vector<Shared> shared_;
  std::set<const void*> not_in_norm_;  // this rank's copies of shared parameters another stage counts
};

}  // namespace ember_dist
