#include "ember/distributed/device_mesh.h"

#include <ember/error.h>

#include "flattened.h"
#ifdef EMBER_WITH_MPI
#include "mpi_backend.h"
#endif

#include <array>
#include <cstring>

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

#ifdef EMBER_WITH_MPI
namespace {
MpiBackend& mpi_of(const c10::intrusive_ptr<c10d::Backend>& backend, const std::string& what) {
  auto* mpi = dynamic_cast<MpiBackend*>(backend.get());
  if (!mpi) throw ember::RunError(what + ": pipeline stages exchange activations over Open MPI only so far (CPU ranks)");
  return *mpi;
}
}  // namespace
#endif

void MeshGroup::send(const at::Tensor& t, int64_t to, int tag) {
#ifdef EMBER_WITH_MPI
  std::vector<at::Tensor> v{t.contiguous()};
  comm_->label(what_ + ": send to stage " + std::to_string(to));
  mpi_of(group_.backend, what_).send(v, static_cast<int>(to), tag);
#else
  (void)t, (void)to, (void)tag;
  throw ember::RunError(what_ + ": pipeline stages need Open MPI, which this build lacks");
#endif
}

void MeshGroup::recv(at::Tensor& t, int64_t from, int tag) {
#ifdef EMBER_WITH_MPI
  std::vector<at::Tensor> v{t};
  comm_->label(what_ + ": receive from stage " + std::to_string(from));
  mpi_of(group_.backend, what_).recv(v, static_cast<int>(from), tag)->wait();
#else
  (void)t, (void)from, (void)tag;
  throw ember::RunError(what_ + ": pipeline stages need Open MPI, which this build lacks");
#endif
}

void MeshGroup::complete_sends() {
#ifdef EMBER_WITH_MPI
  if (group_.size > 1) mpi_of(group_.backend, what_).complete_sends()->wait();
#endif
}

std::vector<std::string> MeshGroup::all_gather_bytes(const std::string& bytes) {
  if (group_.size == 1) return {bytes};
  at::Tensor length = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
  at::Tensor lengths = all_gather(length).reshape({-1});
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::memcpy(mine.data_ptr(), bytes.data(), bytes.size());
  at::Tensor all = all_gather(mine);
  std::vector<std::string> out;
  for (int64_t r = 0; r < group_.size; ++r)
    out.emplace_back(static_cast<const char*>(all[r].data_ptr()), static_cast<size_t>(lengths[r].item<int64_t>()));
  return out;
}

void MeshGroup::shutdown() {
  if (group_.backend) group_.backend->shutdown();
  group_.backend.reset();
}

int64_t DeviceMesh::tensor_degree(const ember::LaunchRequest& request) {
  return ember::has_field(request, &ember::LaunchRequest::tensor_parallel) ? request.tensor_parallel : 1;
}

DeviceMesh::DeviceMesh(Communicator& comm, const ember::LaunchRequest& request)
    : data_(comm, Subgroup{}, "data-parallel group"), tensor_(comm, Subgroup{}, "tensor-parallel group"),
      pipeline_(comm, Subgroup{}, "pipeline group"), shard_(comm, Subgroup{}, "data-parallel shard group"),
      replicate_(comm, Subgroup{}, "data-parallel replica group") {
  const int64_t tp = tensor_degree(request);
  const int64_t pp = ember::has_field(request, &ember::LaunchRequest::pipeline_parallel) ? request.pipeline_parallel : 1;
  const int64_t world = comm.world();
  if (tp < 1 || pp < 1 || world % (tp * pp) != 0)
    throw ember::ConfigError("parallelism.tensor_parallel = " + std::to_string(tp) + " x pipeline_parallel = " + std::to_string(pp) +
                             " does not divide the " + std::to_string(world) + " ranks of this run");
  const int64_t dp = world / (tp * pp);
  const int64_t rank = comm.rank();
  const int64_t t = rank % tp, d = (rank / tp) % dp, p = rank / (tp * dp);
  // A dimension as wide as the world is the world's own backend; the splits are collective over
  // every rank, in the same order everywhere (also those whose group has one rank).
  auto group = [&](int64_t size, int64_t color, int64_t key, const char* name) {
    if (size == world) return Subgroup{comm.backend_ptr(), static_cast<int>(rank), static_cast<int>(world)};
    if (size == 1) return Subgroup{};  // the same degree on every rank: all skip this split
    return comm.split(static_cast<int>(color), static_cast<int>(key), static_cast<int>(size), name);
  };
  data_ = MeshGroup(comm, group(dp, p * tp + t, d, "data_parallel"), "data-parallel group");
  tensor_ = MeshGroup(comm, group(tp, p * dp + d, t, "tensor_parallel"), "tensor-parallel group");
  pipeline_ = MeshGroup(comm, group(pp, d * tp + t, p, "pipeline_parallel"), "pipeline group");
  // Hybrid sharding: replicas of a group that shards; data-parallel rank d is replica d / shard,
  // shard rank d % shard. Both splits happen on every rank (the request is the same everywhere).
  if (ember::has_field(request, &ember::LaunchRequest::data_parallel_shard) && request.data_parallel_replicate > 1) {
    replicas_ = request.data_parallel_replicate;
    if (dp % replicas_ != 0)
      throw ember::ConfigError("parallelism.data_parallel_replicate = " + std::to_string(replicas_) + " does not divide the " +
                               std::to_string(dp) + " data-parallel ranks of this run");
    const int64_t shard = dp / replicas_, r = d / shard, s = d % shard;
    shard_ = MeshGroup(comm, group(shard, (p * tp + t) * replicas_ + r, s, "data_parallel_shard"), "data-parallel shard group");
    replicate_ = MeshGroup(comm, group(replicas_, (p * tp + t) * shard + s, r, "data_parallel_replicate"), "data-parallel replica group");
  }
  tensor_.set_sequence_parallel(ember::has_field(request, &ember::LaunchRequest::sequence_parallel) && request.sequence_parallel);
  owns_ = {dp < world, tp < world, pp < world, replicas_ > 1 && dp / replicas_ < world, replicas_ > 1 && replicas_ < world};
}

std::string DeviceMesh::describe() const {
  std::string line = replicas_ > 1 ? std::to_string(replicas_) + " (data parallel, replicas) x " + std::to_string(shard_.size()) +
                                         " (data parallel, shards) x " + std::to_string(tensor_.size()) + " (tensor parallel)"
                                   : std::to_string(data_.size()) + " (data parallel) x " + std::to_string(tensor_.size()) + " (tensor parallel)";
  return pipeline_.size() > 1 ? std::to_string(pipeline_.size()) + " (pipeline) x " + line : line;
}

void DeviceMesh::shutdown() {
  // The world backend is the communicator's: only split groups are ended here.
  if (owns_[0]) data_.shutdown();
  if (owns_[1]) tensor_.shutdown();
  if (owns_[2]) pipeline_.shutdown();
  if (owns_[3]) shard_.shutdown();
  if (owns_[4]) replicate_.shutdown();
  owns_ = {false, false, false, false, false};
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
