// A strategy's device mesh (ember/tensor_parallel.h, ember/pipeline.h): the run's ranks split into
// a pipeline, a data-parallel and a tensor-parallel dimension, one process group per dimension.
// Tensor-parallel ranks are consecutive global ranks (on one node, where the fastest links are:
// torchtitan's and Megatron's order), pipeline stages the outermost dimension:
// rank = (pipeline_rank * data_parallel + data_parallel_rank) * tensor_parallel + tensor_parallel_rank.
// Hybrid sharding (data_parallel_replicate > 1 with data_parallel_shard): the data-parallel ranks
// are replicas of a sharded group, data_parallel_rank = replica * data_parallel_shard + shard rank
// (torchtitan's dp_replicate outside dp_shard), each with a group of its own.
#pragma once
#include <ember/strategy.h>
#include <ember/tensor_parallel.h>

#include <array>
#include <string>
#include <vector>

#include "ember/distributed/communicator.h"

namespace ember_dist {

// One dimension's group as a model's tensor-parallel plan sees it.
class MeshGroup final : public ember::ITensorParallelGroup {
 public:
  MeshGroup(Communicator& comm, Subgroup group, std::string what) : comm_(&comm), group_(std::move(group)), what_(std::move(what)) {}
  int64_t rank() const override { return group_.rank; }
  int64_t size() const override { return group_.size; }
  void all_reduce_sum(at::Tensor& t) override;
  at::Tensor all_gather(const at::Tensor& t) override;
  at::Tensor reduce_scatter_sum(const at::Tensor& t) override;
  bool sequence_parallel() const override { return sequence_parallel_; }
  void set_sequence_parallel(bool on) { sequence_parallel_ = on; }
  // In place, over the group: ReduceOp::mean averages. Identity on a group of one.
  void all_reduce(at::Tensor& t, ember::ReduceOp op, const std::string& what);
  // Point to point within the group (pipeline stages; group ranks). A send returns once posted
  // (the backend keeps the tensor until it is delivered; complete_sends waits for all of them);
  // a receive fills `t` (contiguous, the sender's shape and dtype) and returns when it arrived.
  // Open MPI only: on another backend they throw ember::RunError.
  void send(const at::Tensor& t, int64_t to, int tag);
  void recv(at::Tensor& t, int64_t from, int tag);
  void complete_sends();
  // Every rank's bytes, in group rank order (an all-gather of the lengths, then of the bytes).
  std::vector<std::string> all_gather_bytes(const std::string& bytes);
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return group_.backend; }
  void shutdown();

 private:
  Communicator* comm_;
  Subgroup group_;
  std::string what_;
  bool sequence_parallel_ = false;
};

class DeviceMesh final : public ember::IDeviceMesh {
 public:
  // Builds the groups of `comm` (launched) for the mesh of `request` (ember::LaunchRequest's
  // degrees; a request of an older engine means no tensor or pipeline parallelism). Throws
  // ember::ConfigError when the degrees do not divide comm's world size. Collective.
  DeviceMesh(Communicator& comm, const ember::LaunchRequest& request);
  ~DeviceMesh() override { shutdown(); }

  int64_t data_parallel_rank() const override { return data_.rank(); }
  int64_t data_parallel_size() const override { return data_.size(); }
  int64_t tensor_parallel_rank() const override { return tensor_.rank(); }
  int64_t tensor_parallel_size() const override { return tensor_.size(); }
  int64_t pipeline_rank() const { return pipeline_.rank(); }
  int64_t pipeline_size() const { return pipeline_.size(); }
  MeshGroup& data_parallel() { return data_; }
  // Hybrid sharding: the ranks that shard one copy of the model (the data-parallel group without
  // it), and the ranks that hold the same shard in the other copies (a group of one without it).
  MeshGroup& data_parallel_shard() { return replicas_ > 1 ? shard_ : data_; }
  MeshGroup& data_parallel_replicate() { return replicate_; }
  MeshGroup& tensor_parallel() { return tensor_; }
  // The ranks of this rank's data- and tensor-parallel coordinates, one per pipeline stage.
  MeshGroup& pipeline() { return pipeline_; }
  // "2 (pipeline) x 2 (data parallel) x 2 (tensor parallel)" (the pipeline only when it has stages)
  std::string describe() const;
  // Ends the groups (before the communicator's teardown). Idempotent.
  void shutdown();

 private:
  static int64_t tensor_degree(const ember::LaunchRequest& request);
  MeshGroup data_, tensor_, pipeline_, shard_, replicate_;
  int64_t replicas_ = 1;
  std::array<bool, 5> owns_{};  // which groups are splits (not the world's backend)
};

// In place: each tensor becomes its sum over the group's ranks, with one all-reduce per dtype over
// the tensors flattened together (every rank passes the same list). Identity on a group of one.
void sum_over_group(MeshGroup& group, const std::vector<at::Tensor>& tensors, const std::string& what);

// Elements of a module's parameters, and the line a strategy logs after a tensor-parallel plan
// split `split` of them: "ddp: the model's tensor-parallel plan split 14 of 28 parameters; this
// rank holds 1,234 of its 5,678 elements".
int64_t parameter_elements(torch::nn::Module& module);
// `summed`: the parameters whose gradients are summed over the group (sequence parallelism).
std::string describe_split(const std::string& strategy, size_t split, size_t summed, int64_t whole_elements, torch::nn::Module& module);

}  // namespace ember_dist
