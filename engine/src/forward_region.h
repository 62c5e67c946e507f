// The forward region of a step (training, evaluation, prediction): the strategy's (parameters
// gathered) around the precision handler's (autocast). Both ends run even when the step throws.
#pragma once
#include <ember/precision.h>
#include <ember/strategy.h>

namespace ember::engine {

struct ForwardRegion {
  IModelStateStrategy& s;
  IPrecision& p;
  ForwardRegion(IModelStateStrategy& state, IPrecision& precision, bool grad_enabled) : s(state), p(precision) {
    s.forward_begin(grad_enabled);
    try {
      p.forward_begin();
    } catch (...) {
      s.forward_end();
      throw;
    }
  }
  ~ForwardRegion() {
    p.forward_end();
    s.forward_end();
  }
};

}  // namespace ember::engine
