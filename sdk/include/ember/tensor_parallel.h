// Beyond data parallel (SDK 2.5): a device mesh and tensor parallelism (Megatron-LM's split of
// attention heads and of the feed-forward block). The run's [parallelism] table gives the mesh's
// degrees; the engine passes them to the strategy in LaunchRequest. A strategy that builds the mesh
// answers kDeviceMeshIid; a model that can be split answers kTensorParallelModelIid and holds its
// own plan (torchtitan's parallelize_fn), apart from its forward where it can. docs/parallelism.md.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ember/export.h"

namespace ember {

// The tensor-parallel ranks a model's plan splits itself over (Megatron's tensor-model-parallel
// group): consecutive global ranks, which see the same batch. The collectives are not
// differentiable; <ember/support/tensor_parallel.h> has the autograd-aware ones built on them.
class EMBER_SDK_API ITensorParallelGroup {
 public:
  virtual ~ITensorParallelGroup() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t size() const = 0;
  // In place: `t` becomes the sum of every rank's `t` (same shape and dtype on every rank).
  // Collective over the group.
  virtual void all_reduce_sum(at::Tensor& t) = 0;
  // Every rank's `t` (same shape and dtype on every rank) stacked along a new dimension 0:
  // result[r] is rank r's. Collective over the group.
  virtual at::Tensor all_gather(const at::Tensor& t) = 0;
  // The sum of every rank's `t` (same shape and dtype everywhere; dimension 0 divisible by
  // size()), of which this rank keeps the rank()-th of size() equal parts of dimension 0.
  // Collective over the group.
  virtual at::Tensor reduce_scatter_sum(const at::Tensor& t) = 0;
  // [parallelism] sequence_parallel: outside the split layers (norms, dropout, residuals) the
  // model keeps its activations split along the sequence over the group's ranks (Megatron's
  // sequence parallelism), each rank holding 1 / size() of the positions.
  virtual bool sequence_parallel() const = 0;
};

// How a parameter (or buffer) is split over the group's ranks: dimension `dim` of the whole tensor
// is `blocks` equal consecutive parts (3 for a fused q/k/v projection, 2 for a fused gate/up one,
// else 1), and rank r holds the r-th of size() equal slices of each part, concatenated. A tensor
// not listed is replicated: every rank holds the whole of it and updates it identically.
struct TensorShard {
  std::string name;  // as in module().named_parameters()
  int64_t dim = 0;   // or kSummedGradient
  int64_t blocks = 1;
};
// TensorShard::dim of a parameter that is not split (every rank holds and updates the whole of
// it) but whose gradient is a partial sum on each rank, to be summed over the group before the
// step: under sequence parallelism, a norm or a bias applied to this rank's positions only.
inline constexpr int64_t kSummedGradient = -1;

// A model that can be split over tensor-parallel ranks (found through query_interface).
class EMBER_SDK_API ITensorParallelModel {
 public:
  virtual ~ITensorParallelModel() = default;
  // Requires: module() holds its whole, initialised parameters (equal on every rank of the
  // group), already on the rank's device; called once, before the optimizer is built.
  // Ensures: every parameter listed in the result holds only this rank's slice (same name, same
  // Variable, smaller shape), and the forward computes with the slices, reaching the other ranks
  // through `group` (which outlives the model's use of it); the model's outputs (loss, logits,
  // logged values) are the same on every rank of the group.
  // Throws ember::ConfigError (one line, naming the model key and the numbers) when the model
  // cannot be split group.size() ways, e.g. heads not divisible by it, or when
  // group.sequence_parallel() asks for what the model does not do.
  virtual std::vector<TensorShard> parallelize_tensors(ITensorParallelGroup& group) = 0;
};
inline constexpr const char* kTensorParallelModelIid = "ember.ITensorParallelModel/1";

// A strategy's answer to query_interface(kDeviceMeshIid): it reads LaunchRequest's mesh degrees
// (ember/strategy.h) and splits its ranks accordingly. The engine refuses a mesh with tensor
// parallelism for a strategy that does not answer; a data-parallel-only mesh needs nothing.
// The data-parallel rank and size are what the data (sampler, DataSetup) and the metric sums use:
// tensor-parallel ranks of one data-parallel rank see the same batch.
class EMBER_SDK_API IDeviceMesh {
 public:
  virtual ~IDeviceMesh() = default;
  virtual int64_t data_parallel_rank() const = 0;
  virtual int64_t data_parallel_size() const = 0;
  virtual int64_t tensor_parallel_rank() const = 0;
  virtual int64_t tensor_parallel_size() const = 0;
};
inline constexpr const char* kDeviceMeshIid = "ember.IDeviceMesh/1";

}  // namespace ember
