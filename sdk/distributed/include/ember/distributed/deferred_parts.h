// Deferred initialisation (ember/deferred_init.h, docs/parallelism.md), for the strategies that
// take the model piece by piece (sharded and offload: this rank's ZeRO chunk of each parameter;
// ddp under pipeline stages or tensor parallelism: its stages' parameters whole, its slices of split ones): while the model is built, this rank's
// chunk (FSDP2's layout: ceil(numel / world) elements, the last ranks' padded) of each
// floating-point parameter, in the precision's dtype; the parameter keeps its shape, dtype and
// identity but no storage. At set-up each chunk is handed over once (the whole value with one
// rank, a ZeRO shard or offload's master) and the ranks compare a fingerprint of every piece they built. Under pipeline stages the model is
// built twice (IDeferredInitPlan): the first build only frees each piece and records the order
// its parameters came in; the strategy then marks which of them this rank's stages hold, and the
// second build keeps parts of those only, freeing the others whole.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ember/tensor_parallel.h>

#include "ember/distributed/communicator.h"

namespace torch::nn { class Module; }
namespace ember { class IModel; }

namespace ember_dist {

// A parameter's storage taken away (or given back), the tensor object, its shape and every view
// autograd saved of it staying valid (they share the StorageImpl).
inline void free_storage(const at::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}
inline void allocate_storage(const at::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  const size_t need = static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
  if (s->nbytes() >= need && s->data_ptr().get() != nullptr) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(need));
  s->set_nbytes(need);
}

class DeferredParts {
 public:
  // From now on take() keeps rank `rank` of `world`'s chunks, converted to `dtype`. `in_place`
  // (world 1): a kept parameter keeps its own storage (no copy while the model is built), and
  // hand_over copies it out; for a strategy that reads it before it frees any parameter (ddp). A
  // tensor-parallel slice (end_shapes_pass) is kept apart even so, its parameter left without
  // storage until the plan gives it the slice's shape.
  void begin(c10::ScalarType dtype, int64_t rank, int64_t world, bool in_place = false);
  bool active() const { return active_; }
  // The shapes build (IDeferredInitPlan): take() frees each new parameter's storage and records
  // the order they came in; nothing is kept. (A tensor-parallel plan slices such parameters with
  // ember::keep_shard, which keeps them without storage.)
  void begin_shapes_pass() { shapes_pass_ = true; }
  bool in_shapes_pass() const { return shapes_pass_; }
  // After the shapes build, parallelised as the real model will be: its parameters still in
  // `shapes` are the ones the second build keeps parts of (another pipeline stage's are freed
  // whole); `slices` (by name: a tensor-parallel plan's split parameters) are kept as this
  // rank's slice, `slice_rank` of `slice_size`, before the chunk is cut.
  void end_shapes_pass(ember::IModel& shapes, const std::vector<ember::TensorShard>& slices = {}, int64_t slice_rank = 0,
                       int64_t slice_size = 1);
  // Whether the parameter was handed over while the model was built (kept or freed): set-up must
  // not read its values except through hand_over.
  bool taken(const at::Tensor& param) const { return seen_.count(param.unsafeGetTensorImpl()) != 0; }
  // `module`'s parameters have their initial values: keep this rank's chunk of each one not taken
  // yet and free its storage.
  void take(torch::nn::Module& module);
  bool holds(const at::Tensor& param) const { return parts_.count(param.unsafeGetTensorImpl()) != 0; }
  // The chunk of `param` (flat) taken while the model was built (holds(param)), handed over once:
  // the copy kept since then is released. `name` is for the error of a strategy bug.
  at::Tensor hand_over(const at::Tensor& param, const std::string& name);
  // At set-up, before any part is handed over. With nothing taken (a model that does not call
  // ember::parameters_initialised) it ends deferral and says so; otherwise the ranks' fingerprints
  // must agree (one collective over `comm`; RunError naming `name`.deferred_init otherwise).
  // Returns the line to log.
  std::string check(const std::vector<at::Tensor>& params, Communicator& comm, const std::string& name);
  // After set-up: nothing is kept any more.
  void clear() { parts_.clear(); }

 private:
  bool active_ = false;
  c10::ScalarType dtype_ = at::kFloat;
  int64_t rank_ = 0, world_ = 1;
  std::unordered_map<const void*, at::Tensor> parts_;  // by the parameter's TensorImpl
  bool shapes_pass_ = false, in_place_ = false;
  std::vector<const void*> arrivals_;  // the shapes build's parameters, in order
  std::vector<bool> keep_;             // by arrival index; empty: keep every one
  std::unordered_map<int64_t, ember::TensorShard> slices_;  // by arrival index: kept as a tensor-parallel slice
  int64_t slice_rank_ = 0, slice_size_ = 1;
  std::unordered_set<const void*> seen_;  // every parameter taken this build
  int64_t arrived_ = 0;
  std::vector<double> fingerprints_;                   // one per piece's parameter, in build order
  int64_t whole_elements_ = 0, kept_elements_ = 0;
};

}  // namespace ember_dist
