// ddp's model state when the model is cut into pipeline stages (ember/pipeline.h): which units
// this rank holds, the schedule that runs a batch through them (Ember::distributed's
// PipelineRunner), and the whole model made of the stages' parts for checkpoints (so a
// checkpoint written with pipeline_parallel = 2 resumes under any other strategy and mesh) and
// for the total gradient norm.
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
#include <string>
#include <vector>

#include <ember/distributed/device_mesh.h>
#include <ember/distributed/pipeline_runner.h>

namespace torch::nn { class Module; }
namespace torch::optim { class Optimizer; }

namespace ember_ddp {

class PipelineState {
 public:
  // Checks the settings against the mesh (ember::ConfigError naming the key).
  PipelineState(ember_dist::DeviceMesh& mesh, const ember::PipelineOptions& options);

  // Cuts `model` (its whole parameters placed, equal on every rank): stages balanced by the units'
  // parameter counts (or parallelism.stage_units), this rank's kept. Throws ember::ConfigError
  // when the model cannot be cut so (no units, fewer units than stages).
  void cut(ember::IModel& model, const std::string& model_name, ember::IHost& host);
  ember::IPipelineModel& model() { return *model_; }
  ember_dist::PipelineRunner& runner() { return *runner_; }
  bool runner_ready() const { return runner_ != nullptr; }
  // (p - 1) / (m + p - 1), or interleaved (p - 1) / (v m + p - 1).
  double theoretical_bubble() const;
  // Records which optimizer group each stage's parameters are in (collective over the pipeline
  // group; once, after the optimizer is built).
  void set_optimizer(torch::optim::Optimizer& optimizer);

  // Sums the gradients of the parameters several stages hold (IPipelineModel's shared ones, a
  // tied embedding) over the stages, so their copies step alike. Collective over the pipeline group.
  void sum_shared_gradients();
  // Whether `param`'s gradient counts in this rank's share of the norm (a shared parameter's
  // counts on the first stage only).
  bool counted_in_norm(const at::Tensor& param) const;
  // The squared gradient norm of this rank's stages summed over the stages. Collective.
  at::Tensor sum_over_stages(const at::Tensor& squared);
  // The whole model from every stage's part (`part`: this stage's whole tensors, built on the
  // ranks that take part), in the whole model's order, on the ranks where `build`. Collective
  // over every rank (only the pipeline group of `rank 0` exchanges when !all).
  c10::Dict<std::string, at::Tensor> merge_model_state(const c10::Dict<std::string, at::Tensor>& part, bool build, bool all);
  // The optimizer state as an optimizer over the whole model saves it, from every stage's state
  // (`whole_field(param, field)` gives a field's whole tensor: the tensor-parallel gather, or the
  // field itself; collective over the tensor-parallel group). On the ranks where `build`.
  std::string full_optimizer_state(torch::optim::Optimizer& optimizer, bool build, bool all,
                                   const std::function<at::Tensor(const at::Tensor& param, const at::Tensor& field)>& whole_field);
  // Loads such a state: each stage takes its own parameters' entries (then `to_part(param, field)`
  // cuts a tensor-parallel slice).
  void load_full_optimizer_state(torch::optim::Optimizer& optimizer, const std::string& bytes,
                                 const std::function<at::Tensor(const at::Tensor& param, const at::Tensor& field)>& to_part);

 private:
  // Whether this rank's pipeline group is the one of global rank 0 (data- and tensor-parallel
  // coordinates 0).
  bool in_rank0_group() const { return mesh_.data_parallel_rank() == 0 && mesh_.tensor_parallel_rank() == 0; }
  // Sets the optimizer's groups to the whole model's parameters (this rank's own, and a stand-in
  // for each other stage's) for torch::save / torch::load; restore() puts them back.
  std::vector<std::vector<at::Tensor>> widen_groups(torch::optim::Optimizer& optimizer, std::vector<at::Tensor>* stand_ins);

  ember_dist::DeviceMesh& mesh_;
  ember::PipelineOptions options_;
  ember_dist::PipelineScheduleKind kind_;
  int64_t virtual_stages_ = 1, microbatches_ = 0;
  ember::IPipelineModel* model_ = nullptr;
  torch::nn::Module* module_ = nullptr;
  std::unique_ptr<ember_dist::PipelineRunner> runner_;
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

}  // namespace ember_ddp
