#include "ember/distributed/device_mesh.h"

#include <ember/error.h>

#include "flattened.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <c10/util/StringUtil.h>

namespace ember_dist {

void MeshGroup::all_reduce(at::Tensor& t, ember::ReduceOp op, const std::string& what) {
  if (group_.size == 1) return;
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  comm_->label(what_ + ": " + what);
  group_.backend->allreduce(v, opts)->wait();
}

void MeshGroup::all_reduce_sum(at::Tensor& t) {
  if (group_.size == 1) return;
  if (!t.is_contiguous()) throw ember::RunError(what_ + ": all_reduce_sum needs a contiguous tensor (a plan bug)");
  all_reduce(t, ember::ReduceOp::sum, "activation sum");
}

at::Tensor MeshGroup::all_gather(const at::Tensor& t) {
  if (group_.size == 1) return t.unsqueeze(0);
  at::Tensor in = t.contiguous();
  std::vector<int64_t> sizes{group_.size};
  sizes.insert(sizes.end(), in.sizes().begin(), in.sizes().end());
  at::Tensor out = at::empty(sizes, in.options());
  comm_->label(what_ + ": all-gather");
  group_.backend->_allgather_base(out, in)->wait();
  return out;
}

at::Tensor MeshGroup::reduce_scatter_sum(const at::Tensor& t) {
  if (group_.size == 1) return t;
  if (t.dim() == 0 || t.size(0) % group_.size != 0)
    throw ember::RunError(what_ + ": reduce-scatter of a tensor of shape " + c10::str(t.sizes()) + " over " + std::to_string(group_.size) +
                          " ranks: dimension 0 must divide (a plan bug)");
  at::Tensor in = t.contiguous();
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes[0] /= group_.size;
  at::Tensor out = at::empty(sizes, in.options());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  comm_->label(what_ + ": reduce-scatter");
  group_.backend->_reduce_scatter_base(out, in, opts)->wait();
  return out;
}

void MeshGroup::shutdown() {
  if (group_.backend) group_.backend->shutdown();
  group_.backend.reset();
}

int64_t DeviceMesh::tensor_degree(const ember::LaunchRequest& request) {
  return ember::has_field(request, &ember::LaunchRequest::tensor_parallel) ? request.tensor_parallel : 1;
}

namespace {
Subgroup split_or_world(Communicator& comm, int64_t tp, bool tensor_dim) {
  const int rank = comm.rank(), world = comm.world();
  if (tp == 1) {  // no split: the data-parallel group is the world, the tensor group one rank
    if (tensor_dim) return Subgroup{};
    return Subgroup{comm.backend_ptr(), rank, world};
  }
  const int t = static_cast<int>(tp);
  if (tensor_dim) return comm.split(rank / t, rank % t, t, "tensor_parallel");
  return comm.split(rank % t, rank / t, world / t, "data_parallel");
}
}  // namespace

DeviceMesh::DeviceMesh(Communicator& comm, const ember::LaunchRequest& request)
    : data_(comm, Subgroup{}, "data-parallel group"), tensor_(comm, Subgroup{}, "tensor-parallel group") {
  const int64_t tp = tensor_degree(request);
  const int64_t pp = ember::has_field(request, &ember::LaunchRequest::pipeline_parallel) ? request.pipeline_parallel : 1;
  if (pp != 1)
    throw ember::ConfigError("parallelism.pipeline_parallel = " + std::to_string(pp) + ": " + strategy_name() +
                             " builds no pipeline stages yet (set it to 1; docs/parallelism.md)");
  if (tp < 1 || comm.world() % tp != 0)
    throw ember::ConfigError("parallelism.tensor_parallel = " + std::to_string(tp) + " does not divide the " + std::to_string(comm.world()) +
                             " ranks of this run");
  // Both splits are collective over every rank, in the same order everywhere.
  data_ = MeshGroup(comm, split_or_world(comm, tp, false), "data-parallel group");
  tensor_ = MeshGroup(comm, split_or_world(comm, tp, true), "tensor-parallel group");
  tensor_.set_sequence_parallel(ember::has_field(request, &ember::LaunchRequest::sequence_parallel) && request.sequence_parallel);
}

std::string DeviceMesh::describe() const {
  return std::to_string(data_.size()) + " (data parallel) x " + std::to_string(tensor_.size()) + " (tensor parallel)";
}

void DeviceMesh::shutdown() {
  // The world backend is the communicator's: only split groups are ended here.
  if (tensor_.size() > 1) {
    tensor_.shutdown();
    data_.shutdown();
  }
}

void sum_over_group(MeshGroup& group, const std::vector<at::Tensor>& tensors, const std::string& what) {
  if (group.size() == 1 || tensors.empty()) return;
  for_each_dtype_flattened(tensors, [&](at::Tensor& flat, at::ScalarType) { group.all_reduce(flat, ember::ReduceOp::sum, what); });
}

int64_t parameter_elements(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

std::string describe_split(const std::string& strategy, size_t split, size_t summed, int64_t whole_elements, torch::nn::Module& module) {
  std::string line = strategy + ": the model's tensor-parallel plan split " + std::to_string(split) + " of " +
                     std::to_string(module.parameters().size()) + " parameters; this rank holds " +
                     std::to_string(parameter_elements(module)) + " of their " + std::to_string(whole_elements) + " elements";
  if (summed > 0)
    line += "; sequence parallel: the gradients of " + std::to_string(summed) + " norms and biases are summed over the group";
  return line;
}

}  // namespace ember_dist
