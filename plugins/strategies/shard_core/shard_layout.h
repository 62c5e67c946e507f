// How the sharded and offload strategies cut parameters (FSDP2's layout, docs/strategy.md): every parameter is
// flattened and cut into world_size equal chunks (the last ones padded; a rank may hold no real
// element of a small parameter). Parameters are grouped; a group is one all-gather and one
// reduce-scatter: rank r's row of a group is the concatenation of its chunk of every parameter.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <ember/distributed/deferred_parts.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ember_shard {

struct ShardedParam {
  std::string name;
  at::Tensor param;  // the module's own parameter, whole shape (storage freed under stage 3)
  at::Tensor shard;  // what the optimizer trains: this rank's real elements, 1-D leaf tensor
                     // (offload: the fp32 master, in host memory)
  at::Tensor host_grad;  // offload: the shard's gradient buffer in host memory (reused every step)
  at::Tensor staging;    // offload on a GPU: pinned, compute dtype; the gradient part lands here first
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t chunk = 0;   // ceil(numel / world)
  int64_t valid = 0;   // real elements in this rank's chunk (<= chunk)
  int64_t offset = 0;  // where the chunk sits in its group's row
  bool trainable = true;
  size_t group = 0;
};

struct ShardGroup {
  std::string name;
  std::vector<size_t> params;
  int64_t row = 0;     // elements of one rank's row
  int64_t unit = -1;   // the model's unit it belongs to; -1: no unit (gathered for the whole step)
  size_t max_index = 0;  // last parameter (named_parameters order): sets the reduce-scatter order
  // Whether the module's parameters hold the current whole values.
  bool materialized = true;
  // A gather under way (prefetch): an all-gather, or with one rank a copy (from the host under
  // offload: `copied` is its event on a GPU); and the reduce-scatter of this backward.
  bool gather_pending = false;
  at::Tensor gather_in, gather_out;
  c10::intrusive_ptr<c10d::Work> gather_work;
  std::shared_ptr<c10::Event> copied;
  size_t pending = 0;
  bool ready = false, launched = false;
  at::Tensor scatter_in, scatter_out;
  c10::intrusive_ptr<c10d::Work> scatter_work;
};

// A tensor over `t`'s memory that does not share its autograd version counter: writing the
// gathered values into a parameter that autograd saved in forward must not look like an in-place
// change of it (FSDP2 refills the same storage for the same reason).
inline at::Tensor unversioned_view(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().requires_grad(false));
}

// Stage 3 gives a parameter's storage its memory back, or takes it away (Ember::distributed's,
// which deferred initialisation uses too).
using ember_dist::allocate_storage;
using ember_dist::free_storage;

}  // namespace ember_shard
