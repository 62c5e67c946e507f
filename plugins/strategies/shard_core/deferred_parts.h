// Deferred initialisation for the ZeRO strategies (ember/deferred_init.h, docs/parallelism.md):
// while the model is built, this rank's chunk of each floating-point parameter (FSDP2's layout,
// shard_layout.h), in the precision's dtype; the parameter keeps its shape, dtype and identity but
// no storage. At set-up each chunk is handed over once (it becomes the shard or offload's master)
// and the ranks compare a fingerprint of every piece they built. Under pipeline stages the model is
// built twice (IDeferredInitPlan): the first build only frees each piece and records the order
// its parameters came in; the strategy then marks which of them this rank's stages hold, and the
// second build keeps parts of those only, freeing the others whole.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ember/distributed/communicator.h>

#include "shard_layout.h"

namespace torch::nn { class Module; }

namespace ember_shard {

class DeferredParts {
 public:
  // From now on take() keeps rank `rank` of `world`'s chunks, converted to `dtype`.
  void begin(c10::ScalarType dtype, int64_t rank, int64_t world);
  bool active() const { return active_; }
  // The shapes build (IDeferredInitPlan): take() frees each new parameter's storage and records
  // the order they came in; nothing is kept.
  void begin_shapes_pass() { shapes_pass_ = true; }
  bool in_shapes_pass() const { return shapes_pass_; }
  // The parameters of the shapes build, in the order they came (their TensorImpl).
  const std::vector<const void*>& arrival_order() const { return arrivals_; }
  // After the shapes build: the second build keeps parts of the parameters whose arrival index
  // `keep` holds, and frees the others (another stage's) whole.
  void keep_only(std::vector<bool> keep);
  // Whether the parameter was handed over while the model was built (kept or freed): set-up must
  // not read its values except through hand_over.
  bool taken(const at::Tensor& param) const { return seen_.count(param.unsafeGetTensorImpl()) != 0; }
  // `module`'s parameters have their initial values: keep this rank's chunk of each one not taken
  // yet and free its storage.
  void take(torch::nn::Module& module);
  bool holds(const ShardedParam& p) const { return parts_.count(p.param.unsafeGetTensorImpl()) != 0; }
  // The chunk of p taken while the model was built (holds(p)), handed over once: the copy kept
  // since then is released.
  at::Tensor hand_over(const ShardedParam& p);
  // At set-up, before any part is handed over. With nothing taken (a model that does not call
  // ember::parameters_initialised) it ends deferral and says so; otherwise the ranks' fingerprints
  // must agree (one collective over `comm`; RunError naming `name`.deferred_init otherwise).
  // Returns the line to log.
  std::string check(const std::vector<ShardedParam>& params, ember_dist::Communicator& comm, const std::string& name);
  // After set-up: nothing is kept any more.
  void clear() { parts_.clear(); }

 private:
  bool active_ = false;
  c10::ScalarType dtype_ = at::kFloat;
  int64_t rank_ = 0, world_ = 1;
  std::unordered_map<const void*, at::Tensor> parts_;  // by the parameter's TensorImpl
  bool shapes_pass_ = false;
  std::vector<const void*> arrivals_;  // the shapes build's parameters, in order
  std::vector<bool> keep_;             // by arrival index; empty: keep every one
  std::unordered_set<const void*> seen_;  // every parameter taken this build
  int64_t arrived_ = 0;
  std::vector<double> fingerprints_;                   // one per piece's parameter, in build order
  int64_t whole_elements_ = 0, kept_elements_ = 0;
};

}  // namespace ember_shard
