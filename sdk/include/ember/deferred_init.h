// Deferred initialisation (SDK 2.10; pipeline stages 2.11): a model too large for one rank's host memory is built one
// piece at a time, each rank keeping only what it will hold once the strategy has sharded it.
//
// A model calls ember::parameters_initialised(host, piece) as soon as a piece (a unit, the
// embeddings, the head) has its initial values:
//
//   for (int64_t i = 0; i < layers; ++i) {
//     blocks_.push_back(register_module("layer" + std::to_string(i + 1), Layer(...)));
//     ember::parameters_initialised(host, *blocks_.back());  // this rank keeps its part; the rest is freed
//   }
//
// Without a strategy that defers (single_device, ddp without pipeline stages or with tensor
// parallelism, sharded stages 1-2) the call does nothing and the model is built whole, as before. With one, the
// piece's floating-point parameters keep their shape, dtype and identity but lose their storage
// until the strategy's set-up: the model must not read or write their values after the call
// (shapes, names, dtypes and requires_grad are fine; tying a parameter to another module is
// fine). Values are the ones a single-device run with the same seed gets, because the pieces are
// built, and draw from the generator, in the same order; the model's initial values must
// therefore depend on the seed only.
// So a rank's host peak while the model is built is what it keeps plus the largest piece.
#pragma once
#include <c10/core/ScalarType.h>

#include "ember/export.h"
#include "ember/host.h"

namespace torch::nn { class Module; }

namespace ember {

// Implemented by a strategy that holds part of each parameter (IStrategy::query_interface); the
// engine offers it to the model through IHost::query_interface while the model is built.
inline constexpr const char* kDeferredInitIid = "ember.IDeferredInit/1";
class EMBER_SDK_API IDeferredInit {
 public:
  virtual ~IDeferredInit() = default;
  // Before the model is built, after launch: whether this strategy, as configured, keeps only a
  // part of the parameters; they are kept in `dtype` (the precision handler's, IParameterDtype).
  // False: parameters_initialised is never called and the model is built whole.
  virtual bool begin_deferred_init(c10::ScalarType dtype) = 0;
  // `module`'s parameters hold their initial values: keep this rank's part of each floating-point
  // one and free its storage. Parameters already taken are skipped (a module may be passed twice).
  virtual void parameters_initialised(torch::nn::Module& module) = 0;
};

class IModel;

// SDK 2.11: a strategy that knows what a rank keeps only once it has seen the whole model's shapes
// (pipeline stages: the cut balances the units' parameter counts, and the model says which of its
// other parameters, embeddings or head, go with which stage; tensor parallelism: the plan says
// which parameters it splits, ember::keep_shard slicing storage-less ones) answers this too
// (IStrategy::query_interface). When wants_shapes_pass() says so after begin_deferred_init, the
// engine builds the model twice: first for its shapes (every piece handed to
// parameters_initialised loses its storage and nothing is kept), shown to plan_from_shapes and
// destroyed; then, with the random generator put back where it was before the first build, again,
// the strategy keeping its part of the pieces its plan chose and freeing the others whole. Both
// builds must hand over the same pieces in the same order (they do: the same code and seed).
inline constexpr const char* kDeferredInitPlanIid = "ember.IDeferredInitPlan/1";
class EMBER_SDK_API IDeferredInitPlan {
 public:
  virtual ~IDeferredInitPlan() = default;
  virtual bool wants_shapes_pass() = 0;
  // The first build, whole (storage-less where pieces were handed over): decide what this rank
  // keeps. The strategy may change the model (cut it); it is destroyed afterwards. Throws
  // ember::ConfigError where the model cannot be parallelised as configured.
  virtual void plan_from_shapes(IModel& model) = 0;
};

// What a model calls (a no-op when nothing defers).
inline void parameters_initialised(IHost& host, torch::nn::Module& module) {
  if (auto* d = static_cast<IDeferredInit*>(host.query_interface(kDeferredInitIid))) d->parameters_initialised(module);
}

}  // namespace ember
